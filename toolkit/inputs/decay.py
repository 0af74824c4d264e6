"""Which parameters the HF Trainer decays, by its own rule, without importing the Trainer.

`Trainer.get_decay_parameter_names` (transformers/trainer.py) is two lines: its forbidden layer types and name
patterns, handed to `trainer_pt_utils.get_parameter_names`. Importing `transformers.Trainer` to call it costs about
2.9 s of CPU here (accelerate, datasets, the integrations), more than a cold plan's whole model build, so the two
lists are read from the installed trainer.py's source (ast) and the helper, a light module, is called with them.
Where the method no longer has that shape (another transformers version), the Trainer itself is asked.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import textwrap
from pathlib import Path


@functools.cache
def _trainer_rule() -> tuple[tuple[type, ...], tuple[str, ...]] | None:
    """(forbidden layer types, forbidden name patterns) as trainer.py's get_decay_parameter_names writes them; None
    where its source does not read as such."""
    import torch

    spec = importlib.util.find_spec("transformers.trainer")
    if spec is None or not spec.origin:
        return None
    source = Path(spec.origin).read_text()
    start = source.find("    def get_decay_parameter_names(")
    if start < 0:
        return None
    end = source.find("\n    def ", start + 1)
    try:
        function = ast.parse(textwrap.dedent(source[start:end if end > 0 else None])).body[0]
    except SyntaxError:
        return None
    patterns: list[str] | None = None
    layers: list[type] | None = None
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
                "forbidden_name_patterns"]:
            try:
                patterns = list(ast.literal_eval(node.value))
            except ValueError:
                return None
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "get_parameter_names":
            if len(node.args) < 2 or not isinstance(node.args[1], ast.List):
                return None
            names = [ast.unparse(e) for e in node.args[1].elts]
            if not all(n.startswith("nn.") and hasattr(torch.nn, n[3:]) for n in names):
                return None
            layers = [getattr(torch.nn, n[3:]) for n in names]
            third = node.args[2] if len(node.args) > 2 else None
            if third is not None and getattr(third, "id", None) != "forbidden_name_patterns":
                return None
    if patterns is None or layers is None or not all(isinstance(p, str) for p in patterns):
        return None
    return tuple(layers), tuple(patterns)


def decay_parameter_names(model) -> set[str]:
    """The names of `model`'s parameters the HF Trainer puts in its weight-decay group."""
    rule = _trainer_rule()
    if rule is None:
        from transformers import Trainer

        return set(Trainer.get_decay_parameter_names(None, model))
    from transformers.trainer_pt_utils import get_parameter_names

    layers, patterns = rule
    return set(get_parameter_names(model, list(layers), list(patterns)))

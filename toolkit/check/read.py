"""Reading the files `toolkit check` is given: YAML or JSON as a mapping, refusing (one clear line) what is
unreadable, hostile or not a number where the check computes with one; the --gpus grid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from toolkit.errors import UserError
from toolkit.engines.readers import _mapping, concrete_int


MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64
MAX_VALUES = 200_000
"""Limits far above any real config (the corpus in tests/real_configs nests 4 deep, holds < 200 values), so that a
hostile file is one clear line instead of a RecursionError or an exponential walk."""


STREAM_PREFIXES = ("/dev/fd/", "/proc/self/fd/", "/dev/stdin")
"""Paths that name a pipe a shell opened for us (`check <(cat x.yaml)`), read like "-" (stdin)."""


def is_stream(name: str) -> bool:
    return name == "-" or name.startswith(STREAM_PREFIXES)


def stream_to_file(name: str, folder: Path) -> Path:
    """Read stdin ("-") or a process substitution once, up to MAX_FILE_BYTES, into a file in `folder` named by its
    content (stdin.json for a JSON object, stdin.yaml otherwise): the check reads a file more than once, a pipe
    only once."""
    from toolkit.fileio import read_bytes_limited

    raw = read_bytes_limited(Path(name), "config", limit=MAX_FILE_BYTES, streams=True)
    kind = ".json" if raw.lstrip()[:1] == b"{" else ".yaml"
    copy = folder / ("stdin" + kind)
    copy.write_bytes(raw)
    return copy


def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML or JSON file as a dict; UserError for anything unreadable."""
    from toolkit.fileio import file_kind_problem

    problem = file_kind_problem(path)
    if problem not in (None, "a directory"):  # a FIFO would block the read, /dev/zero would never end
        raise UserError(f"{path} is {problem}, not a config file; give the YAML or JSON file (a shell's <(...) "
                        "and - for stdin are read too)")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory without plan.json; give a YAML, a JSON or a plan directory") from None
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"{path} is larger than {MAX_FILE_BYTES} bytes, too large for a config file")
    try:
        # JSON has no byte-order mark (DeepSpeed's json.load refuses one too); YAML may start with one.
        text = raw.decode("utf-8" if path.suffix == ".json" else "utf-8-sig")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        raise UserError(f"{path} is not UTF-8 text (binary content, or another encoding); give the YAML or JSON "
                        "config, saved as UTF-8")
    try:
        data = _parse_json(text, path) if path.suffix == ".json" else _parse_yaml(text, path)
    except RecursionError:
        raise UserError(f"{path} is nested too deeply to be a config (more than {MAX_DEPTH} levels)") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a mapping of keys to values")
    _check_shape(data, path)
    return data


def _parse_json(text: str, path: Path) -> Any:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen and seen[key] != value:  # json.loads keeps the last silently
                raise UserError(f"{path} sets '{key}' twice in one object, to {seen[key]!r} and {value!r}; keep "
                                "the one you mean")
            seen[key] = value
        return seen

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None


def _parse_yaml(text: str, path: Path) -> Any:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_nodes(node, path)  # before building: aliases are expanded into shared objects
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path} is not valid YAML ({getattr(exc, 'problem', None) or 'parse error'}{where})") from None
    finally:
        loader.dispose()


def _check_yaml_nodes(root: yaml.Node, path: Path) -> None:
    """Refuse alias bombs (a few lines that expand to billions of values) and self-referring aliases."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 0, False)]
    open_nodes: set[int] = set()
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise UserError(f"{path} is nested too deeply to be a config (more than {MAX_DEPTH} levels)")
        children = _yaml_children(node)
        if done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_VALUES:
                raise UserError(f"{path} expands to more than {MAX_VALUES} values (YAML aliases); write the values "
                                "out instead of nesting aliases")
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise UserError(f"{path} has a YAML alias that refers to itself; write the value out")
        if isinstance(node, yaml.MappingNode):
            _refuse_duplicate_keys(node, path)
        open_nodes.add(id(node))
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def _refuse_duplicate_keys(node: yaml.MappingNode, path: Path) -> None:
    """A key set twice to different values (PyYAML keeps the last silently, so accelerate would read a value the
    writer may not have meant). The same value twice (accelerate's own test configs have one) is harmless."""
    seen: dict[str, yaml.Node] = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.value == "<<":
            continue
        first = seen.setdefault(key.value, value)
        if first is not value and not (isinstance(first, yaml.ScalarNode) and isinstance(value, yaml.ScalarNode)
                                       and (first.tag, first.value) == (value.tag, value.value)):
            raise UserError(f"{path} sets '{key.value}' twice in one mapping (lines {first.start_mark.line + 1} and "
                            f"{value.start_mark.line + 1}), to different values; keep the one you mean")


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_shape(data: Any, path: Path) -> None:
    """Depth and size of parsed data, iteratively (JSON has no aliases, but can nest a few hundred deep)."""
    import math

    stack, count = [(data, 0, "")], 0
    while stack:
        value, depth, where = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise UserError(f"{path} is nested too deeply to be a config (more than {MAX_DEPTH} levels)")
        if count > MAX_VALUES:
            raise UserError(f"{path} holds more than {MAX_VALUES} values; not a config file")
        if isinstance(value, float) and not math.isfinite(value):
            # Python's json and YAML's .nan / .inf read these; no setting of an engine means them: write a number
            raise UserError(f"{path}: {where or 'the value'} is {value!r}, not a finite number; write a number")
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{where}.{k}" if where else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))


NUMBERS_READ: dict[str, tuple[str, ...]] = {
    "json": ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "zero_optimization.stage"),
    "yaml": ("num_processes", "num_machines", "machine_rank"),
}
"""Values the check itself computes with (batch identity, process grid, ZeRO stage): anything but a whole number
(or "auto" in a DeepSpeed JSON) there makes the file unreadable for the check. Other fields go to the engines."""


def require_numbers(config: dict[str, Any], path: Path) -> None:
    kind = "json" if path.suffix == ".json" else "yaml"
    for dotted in NUMBERS_READ[kind]:
        parent, _, key = dotted.rpartition(".")
        block = _mapping(config.get(parent)) if parent else config
        if key not in block or block[key] is None:
            continue
        value = block[key]
        if concrete_int(value) is None and not (kind == "json" and value == "auto"):
            shown = json.dumps(value, default=str)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            allowed = "a whole number" + (' or "auto"' if kind == "json" else "")
            raise UserError(f"{path}: {dotted} is {shown} ({type(value).__name__}); it must be {allowed}")


def read_config(path: Path) -> dict[str, Any]:
    """read_mapping, plus the numbers the check computes with (require_numbers)."""
    config = read_mapping(path)
    if not (path.suffix == ".json" and is_plan_json(config)):
        require_numbers(config, path)
    return config


def is_plan_json(data: dict[str, Any]) -> bool:
    return "strategy" in data and "version" in data and "model_config" in data


def parse_gpus(text: str) -> tuple[int, int]:
    """"8" (one node of 8), "2x8" (2 nodes of 8) or a GPU spec "2x8xH100" -> (nodes, gpus per node)."""
    parts = text.lower().split("x")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if not numbers:  # a GPU spec with a type (8xH100-80GB): the grid is its node and GPU counts
        from toolkit.inputs.hardware import parse_hardware

        try:
            hw = parse_hardware(text)
        except UserError:
            raise UserError(f"--gpus '{text}' is not understood; write GPUS (one node) or NODESxGPUS, e.g. 2x8, "
                            "or a GPU spec such as 8xH100-80GB") from None
        return hw.nodes, hw.gpus_per_node
    if len(numbers) == 1:
        numbers = [1, numbers[0]]
    if len(numbers) != 2 or min(numbers) < 1:
        raise UserError(f"--gpus '{text}' is not understood; write GPUS (one node) or NODESxGPUS, e.g. 2x8")
    from toolkit.bounds import GPUS_PER_NODE, NODES, check_number

    check_number("--gpus nodes", numbers[0], NODES)
    check_number("--gpus GPUs per node", numbers[1], GPUS_PER_NODE)
    return numbers[0], numbers[1]

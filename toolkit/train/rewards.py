"""GRPO's reward functions as toolkit.train takes them: `--reward SPEC`, repeated for several (TRL sums them, each
with weight 1 unless --reward_weights says otherwise: GRPOConfig.reward_weights).

A SPEC is one of
- `MODULE:FUNCTION`: a function in an importable module (`my_rewards:accuracy`) or in a Python file
  (`rewards.py:accuracy`, a path relative to where the run starts);
- `length`: the built-in reward, the completion's length in characters (deterministic, no dependency: the
  rehearsal's and the tests' reward; a random model's completions differ in it, so the group advantage is not 0);
- `match=REGEX`: the built-in count of the completion's non-overlapping matches of REGEX (Python's re).

A reward function is what TRL's GRPOTrainer calls (trl/trainer/grpo_trainer.py, _calculate_rewards): keyword
arguments prompts, completions, completion_ids, every other column of the dataset, trainer_state, log_extra and
log_metric; it returns one float (or None) per completion. A function without **kwargs would fail at the first step
with a TypeError, so it is refused before any process starts. TRL also takes a reward model's name (a sequence
classifier); toolkit.train does not load one (a user's TRL script does: `toolkit launch PLAN -- script.py`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any, Callable

from toolkit.errors import UserError

BUILTIN_REWARDS = ("length", "match=REGEX")
"""The built-in SPECs, as --help names them."""
REWARD_FIX = ("give --reward MODULE:FUNCTION (a function taking **kwargs that returns one float per completion), "
              "or a built-in: length, match=REGEX")


def completion_text(completion: Any) -> str:
    """A completion's text: a string (TRL's standard format), or the content of a conversational completion's turns
    (a list of {"role", "content"})."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(turn.get("content", "")) for turn in completion if isinstance(turn, dict))
    return str(completion)


def length(completions: list, **kwargs) -> list[float]:
    """The built-in reward: each completion's length in characters."""
    return [float(len(completion_text(c))) for c in completions]


class Match:
    """The built-in `match=REGEX` reward: each completion's count of non-overlapping matches of REGEX."""

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern)
        self.__name__ = f"match={pattern}"  # TRL logs each reward under its function's name (rewards/NAME/mean)

    def __call__(self, completions: list, **kwargs) -> list[float]:
        return [float(len(self.pattern.findall(completion_text(c)))) for c in completions]


def load_rewards(specs: list[str] | None) -> list[Callable]:
    """The reward functions of the --reward SPECs, each checked (importable, callable, takes TRL's keyword
    arguments); one line naming the SPEC and the fix otherwise. No SPEC is refused: GRPO has no reward of its own."""
    if not specs:
        raise UserError(f"a GRPO plan trains on rewards and none was given; {REWARD_FIX}")
    return [load_reward(spec) for spec in specs]


def load_reward(spec: str) -> Callable:
    spec = str(spec).strip()
    if spec == "length":
        return length
    if spec.startswith("match="):
        pattern = spec[len("match="):]
        if not pattern:
            raise UserError("--reward match= has no regular expression; give one, e.g. --reward 'match=[0-9]'")
        try:
            return Match(pattern)
        except re.error as exc:
            raise UserError(f"--reward {spec}: not a regular expression ({exc}); fix the pattern") from None
    module_name, colon, name = spec.rpartition(":")
    if not colon or not module_name or not name:
        raise UserError(f"--reward {spec!r} is not a built-in reward nor MODULE:FUNCTION; {REWARD_FIX}")
    module = _import(module_name, spec)
    function = getattr(module, name, None)
    if function is None:
        raise UserError(f"--reward {spec}: {module_name} has no {name!r}; name a function defined there")
    if not callable(function):
        raise UserError(f"--reward {spec}: {name} is a {type(function).__name__}, not a function; {REWARD_FIX}")
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return function  # a builtin or C callable: nothing to inspect
    if not any(p.kind == p.VAR_KEYWORD for p in parameters):
        raise UserError(f"--reward {spec}: {name} takes no **kwargs, and TRL's GRPOTrainer calls it with prompts=, "
                        "completions=, completion_ids= and every dataset column; add **kwargs to its parameters")
    return function


def _import(module_name: str, spec: str):
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise UserError(f"--reward {spec}: {path} is not a file; give the path of the Python file that defines "
                            "the reward (relative to where the run starts) or an importable module")
        loaded = sys.modules.get(f"toolkit_reward_{path.stem}")
        if loaded is not None and getattr(loaded, "__file__", None) == str(path.resolve()):
            return loaded
        module_spec = importlib.util.spec_from_file_location(f"toolkit_reward_{path.stem}", path.resolve())
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise UserError(f"--reward {spec}: importing {path} failed: {type(exc).__name__}: "
                            f"{_first_line(exc)}; fix the file") from None
        sys.modules[module_spec.name] = module
        return module
    if str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.append(str(Path.cwd()))  # `python -m` puts the working folder first; a console script does not
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise UserError(f"--reward {spec}: cannot import {module_name} ({type(exc).__name__}: {_first_line(exc)}); "
                        "make it importable (PYTHONPATH) or give the file: --reward path/to/file.py:FUNCTION") \
            from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]

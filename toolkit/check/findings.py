"""One finding of `toolkit check`: which file, how bad, what to do, and which runner it concerns; the
runner names; the exit code a list of findings gives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


Severity = Literal["error", "warning", "note"]

TRAINER = "HF Trainer"
ACCELERATE = "accelerate script"
DEEPSPEED = "deepspeed launcher"
PIPELINE = "toolkit.train pipeline"
LAUNCH = "accelerate launch"
EVERY = "every runner"
HF_RUNNERS = frozenset({TRAINER, ACCELERATE})
RUNNER_CHOICES = {"trainer": TRAINER, "accelerate": ACCELERATE, "deepspeed": DEEPSPEED}
"""--runner values."""


@dataclass(frozen=True)
class Problem:
    file: str
    severity: Severity
    message: str
    """What is wrong and how to fix it, in one line."""
    runner: str = EVERY
    """Who it concerns: HF Trainer, accelerate script, deepspeed launcher, accelerate launch, every runner."""

    def __str__(self) -> str:
        return f"{self.file}: {self.severity}: [{self.runner}] {self.message}"


def exit_code(problems: list[Problem], *, strict: bool = False) -> int:
    """0 clean (notes never count), 1 with an error, or with a warning under --strict."""
    failing = ("error", "warning") if strict else ("error",)
    return 1 if any(p.severity in failing for p in problems) else 0

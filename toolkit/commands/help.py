"""What `toolkit CMD --help` shows beyond the flags (an example per command), and the live status line.

The status line is rich's spinner (rich is a dependency of the toolkit's environment through deepspeed/accelerate's
tooling, and it is the library the CLI uses for terminal output): shown on stderr only when stderr is a terminal,
so pipes, logs and `--json` output stay clean.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator

EXAMPLES = {
    "estimate": ["toolkit estimate llama-3-8b --gpus 8xH100-80GB --strategy zero3 --seq 8192 --micro-batch 2",
                 "toolkit estimate --params 13B --gpus 4xA100-80GB --strategy zero2 --require-fit && echo fits"],
    "plan": ["toolkit plan mistral-7b --gpus 4xA100-80GB --seq 4096 --global-batch 64 --out runs/plan",
             "toolkit plan ./my-model --gpus 2x8xH100-80GB --strategies zero3,fsdp2 --json"],
    "emit": ["toolkit emit runs/plan/plan.json --out /shared/plan --force"],
    "check": ["toolkit check runs/plan", "toolkit check accelerate_config.yaml --gpus 8xH100-80GB"],
    "launch": ["toolkit launch runs/plan -- --data corpus/ --output runs/out",
               "toolkit launch runs/plan -- --data corpus/ --output runs/out --resume",
               "toolkit launch runs/plan -- my_train.py --my-flag 1",
               "toolkit launch runs/plan --processes 2 --cpu -- my_train.py --my-flag 1",
               "toolkit launch runs/plan --rehearse"],
    "profile": ["toolkit profile gpt2 --seq 1024 --micro-batch 4 --device cuda"],
    "tune": ["toolkit tune plan/ --cpu --processes 2 --candidates 3 --budget-min 10 --steps 3"],
    "demo": ["toolkit demo --steps 60"],
    "models": ["toolkit models"],
    "gpus": ["toolkit gpus"],
}


def add_examples(subparsers: argparse._SubParsersAction) -> None:
    """Put each command's examples (and its existing epilog) under its --help, keeping the line breaks."""
    for name, parser in subparsers.choices.items():
        lines = ["example" + ("s" if len(EXAMPLES.get(name, [])) > 1 else "") + ":"]
        lines += [f"  {example}" for example in EXAMPLES.get(name, [])]
        parser.epilog = "\n".join(lines) + (f"\n\n{parser.epilog}" if parser.epilog else "")
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


@contextlib.contextmanager
def status(text: str) -> Iterator[None]:
    """A spinner with `text` on stderr while the block runs (terminal only)."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield

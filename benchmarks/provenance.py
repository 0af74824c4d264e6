"""What a results file was measured with: the toolkit commit (with `+changes` when the tree had uncommitted
edits), the date, and the library versions; every script in benchmarks/ writes it into its results."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def toolkit_commit() -> str:
    """The checkout's short commit, `+changes` when toolkit/ or benchmarks/' code and data differ from it (results
    files being rewritten do not count); `unknown` outside git."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=10", "HEAD")
        dirty = git("status", "--porcelain", "--", "toolkit", "benchmarks", ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def meta() -> dict[str, str]:
    """The provenance fields of a results JSON's meta."""
    import platform

    import torch
    import transformers

    return {"toolkit_commit": toolkit_commit(), "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine()}


def measured_line(script: str) -> str:
    """The first line under a results page's title: when, at which commit, by which command."""
    return f"{time.strftime('%Y-%m-%d')}, toolkit {toolkit_commit()}, `python benchmarks/{script}`"

"""Checkpoint folders a killed run can always resume from.

Both runners (the HF Trainer's and the pipeline runner) use these. The Trainer writes `checkpoint-N/` in several steps (model, optimizer, per-rank RNG state, trainer_state.json) with
no marker of completion, and `get_last_checkpoint` takes the newest folder whatever it holds. We add the marker:
after every rank has finished writing (a barrier), rank 0 writes COMPLETE_MARKER last; resume only takes marked
folders, and old checkpoints are deleted only after a newer one is marked (the Trainer's own rotation could delete
the last good one before the new one is whole).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

COMPLETE_MARKER = "toolkit_checkpoint_complete"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_dirs(output: str | Path) -> list[Path]:
    """Every checkpoint-N folder in output, oldest first (by N)."""
    out = Path(output)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def is_complete(checkpoint: Path) -> bool:
    """The marker is written after every rank finished its part (both runners: the Trainer's CheckpointMarker
    callback, the pipeline runner's save_checkpoint)."""
    return (checkpoint / COMPLETE_MARKER).is_file()


def step_of(checkpoint: Path) -> int:
    """The optimizer step a checkpoint-N folder was written after."""
    return int(_CHECKPOINT_RE.match(checkpoint.name).group(1))


def last_complete_checkpoint(output: str | Path) -> Path | None:
    complete = [p for p in checkpoint_dirs(output) if is_complete(p)]
    return complete[-1] if complete else None


def mark_complete(checkpoint: Path) -> None:
    (checkpoint / COMPLETE_MARKER).write_text("all ranks finished writing this checkpoint\n")


def rotate(output: str | Path, keep: int | None) -> None:
    """Delete incomplete checkpoints older than the newest complete one, and complete ones beyond `keep`."""
    dirs = checkpoint_dirs(output)
    complete = [p for p in dirs if is_complete(p)]
    if not complete:
        return
    newest = complete[-1]
    doomed = [p for p in dirs if not is_complete(p) and dirs.index(p) < dirs.index(newest)]
    if keep is not None and len(complete) > keep:
        doomed += complete[: len(complete) - keep]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)

"""Atomic, non-clobbering writes: nothing on disk is half-written or silently overwritten."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from toolkit.errors import UserError


def refuse_overwrite(paths: list[Path], force: bool) -> None:
    """Raise before writing anything if any target exists and --force was not given."""
    if force:
        return
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise UserError(f"{existing[0]} already exists ({len(existing)} file(s) would be overwritten); "
                        "pass --force to overwrite or choose another --out")


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Write `text` to a temporary file beside `path`, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise

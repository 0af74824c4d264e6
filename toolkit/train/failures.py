"""How a rank tells `toolkit launch` why it failed: one line from the first failing rank, not every worker's
traceback. toolkit.train and the runner of a user's own script (toolkit.train.own_script) both report here."""

from __future__ import annotations

import json
import os


def rank() -> int:
    """The global rank from the launcher's environment (set before any process group exists)."""
    return int(os.environ.get("RANK", "0"))


def report_failure(exc: BaseException, *, user_error: bool) -> bool:
    """Write why this rank failed to TOOLKIT_ERROR_FILE, if it failed first (O_EXCL: the first rank to fail wins;
    later ranks usually fail only because the first one left the process group). torchrun reports any failing
    worker as its own exit code 1, which would hide that this was bad input. True when this rank's report was
    first."""
    error_file = os.environ.get("TOOLKIT_ERROR_FILE")
    if not error_file:
        return False
    message = " ".join(str(exc).split()) or type(exc).__name__
    if not user_error:
        message = f"{type(exc).__name__}: {message}"
    try:
        fd = os.open(error_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"rank": rank(), "user_error": user_error, "message": message[:2000]}, f)
    return True

"""`toolkit` command line: the entry point of the `toolkit` script and `python -m toolkit` / `python -m toolkit.cli`.

The subcommands live in toolkit.commands (one module each: its flags, its work, its output); this module runs one
through toolkit.commands.execute and turns what ends it into the process's exit code: 0 / 1 as the command says, 2
for bad input (one line on stderr, no traceback), 130 for Ctrl-C, 128 + N for SIGTERM / SIGHUP.
"""

from __future__ import annotations

import sys

from toolkit.commands import build_parser, execute

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = _finish_on_termination()
    try:
        return execute(argv)
    except KeyboardInterrupt:
        return 130
    except Terminated as exc:
        return 128 + exc.signum
    finally:
        import signal

        for signum, handler in previous.items():
            signal.signal(signum, handler)


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where the program is, so that every `finally` runs (staging folders and locks
    are removed) before the process exits; like KeyboardInterrupt for SIGINT."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _finish_on_termination() -> dict:
    """Install the handlers; returns the previous ones (main restores them: a caller embedding main keeps its own)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}  # signal handlers can only be set from the main thread

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    return {signum: signal.signal(signum, raise_terminated) for signum in (signal.SIGTERM, signal.SIGHUP)}


if __name__ == "__main__":
    raise SystemExit(main())

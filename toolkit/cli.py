"""`toolkit` command line: the entry point of the `toolkit` script and `python -m toolkit` / `python -m toolkit.cli`.

The subcommands live in toolkit.commands (one module each: its flags, its work, its output); this module runs one
through toolkit.commands.execute and turns what ends it into the process's exit code: 0 / 1 as the command says, 2
for bad input (one line on stderr, no traceback), 130 for Ctrl-C (one line), 128 + N for SIGTERM / SIGHUP, 141
(128 + SIGPIPE) when the reader of stdout went away (`toolkit models | head -1`), silently, as a program killed by
SIGPIPE.
"""

from __future__ import annotations

import sys

from toolkit.commands import build_parser, execute
from toolkit.processes import finish_process, pause_collector

__all__ = ["build_parser", "main", "run"]


EXIT_INTERRUPTED = 130
"""128 + SIGINT, as a shell reports a program Ctrl-C stopped."""
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a program killed by SIGPIPE exits with (`head` closed the pipe)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = _finish_on_termination()
    try:
        quiet_deepspeed_accelerator_choice()  # after the handlers: a Ctrl-C while it imports logging is one line
        code = execute(argv)
        sys.stdout.flush()  # a closed pipe shows at the last write: inside the try, not at interpreter exit
        return code
    except KeyboardInterrupt:
        print(INTERRUPTED_LINE, file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated as exc:
        return 128 + exc.signum
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    finally:
        import signal

        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run() -> int:
    """The process's entry (the `toolkit` script, `python -m toolkit`): main, then leave without tearing the
    interpreter down. Unloading the ~3,500 modules a command that imported torch and transformers holds costs about
    1.5 s of CPU after the work is done (measured: `plan gpt2 ... --out` with no cache, 9.1 s -> 7.5 s user) and
    nothing a user sees depends on it. What the interpreter's exit would still do for us is done here, in its order:
    wait for non-daemon threads (threading._shutdown, which also runs concurrent.futures' exit hooks), run the atexit
    handlers (logging's flush, multiprocessing's and weakref.finalize's clean-ups, TemporaryDirectory), flush stdout
    and stderr; every `finally` and file close of the command already ran inside main. Where one of those steps is
    not there or fails, the code is returned for the ordinary exit. A caller embedding the CLI calls main, which
    returns."""
    if sys.argv[1:2] == ["launch"]:  # its checks and rehearsal model import torch and transformers: 0.74 s of the
        pause_collector()            # 4.3 s of CPU a rehearsal's toolkit process took, until the launcher starts
    try:
        code = main()
    except SystemExit as exc:  # argparse's --help (0) and usage errors (2) leave through here
        if exc.code is not None and not isinstance(exc.code, int):
            raise
        code = exc.code or 0
    return finish_process(code)


INTERRUPTED_LINE = "interrupted (Ctrl-C): stopped; nothing half-written was left behind"


def _stdout_to_devnull() -> None:
    """After EPIPE: point stdout's descriptor at /dev/null so the interpreter's final flush of what is still
    buffered does not print a second BrokenPipeError (the Python docs' recipe, library/signal.html "Note on
    SIGPIPE")."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a descriptor (captured in-process)
        pass


def quiet_deepspeed_accelerator_choice() -> None:
    """DeepSpeed logs which accelerator it picked when first imported ("Setting accelerator to CPU. If you have GPU
    ...", deepspeed/accelerator/real_accelerator.py get_accelerator), from wherever the import happens (a tiled trace,
    an engine's config check). Nothing here runs on that accelerator: the planner models the GPUs the user names. A
    filter on DeepSpeed's logger (created before deepspeed is imported, kept when deepspeed adds its handler) drops
    that file's records for every command, so no command's output carries the line."""
    import logging

    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _AcceleratorChoice) for f in logger.filters):
        logger.addFilter(_AcceleratorChoice())


class _AcceleratorChoice:
    def filter(self, record) -> bool:
        return record.filename != "real_accelerator.py"


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
        if _inside_torch(frame):  # as for Ctrl-C (_interrupt): an exception raised there can abort the process
            _leave_now(128 + signum, None)
        raise Terminated(signum)

    previous = {signum: signal.signal(signum, raise_terminated) for signum in (signal.SIGTERM, signal.SIGHUP)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # a caller's own handler is left alone
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _interrupt)
    return previous


def _interrupt(signum, frame) -> None:
    """Ctrl-C. Where Python was called back from torch's C++ (a dispatch mode, a hook, a destructor during a trace),
    a KeyboardInterrupt raised there can cross a C++ frame that does not pass exceptions on, and the process aborts
    with `terminate called after throwing ... KeyboardInterrupt` (one Ctrl-C in eight during `plan --out`). There
    the process removes what toolkit.fileio is writing (staging folder, temporary files, lock) and exits 130 at once;
    in plain Python code the KeyboardInterrupt is raised as usual, so every `finally` runs."""
    if not _inside_torch(frame):
        raise KeyboardInterrupt
    _leave_now(EXIT_INTERRUPTED, INTERRUPTED_LINE)


def _leave_now(code: int, line: str | None) -> None:
    """Stop at once from a signal handler called inside torch (where raising would abort the interpreter with
    `terminate called after throwing an instance of 'python_error'`, no traceback: a plan killed by `timeout`'s
    SIGTERM mid-trace did): remove what toolkit.fileio is writing, flush stdout, print `line`, exit with `code`
    (the code main returns for the same signal elsewhere)."""
    import os

    from toolkit.fileio import run_interrupt_cleanups

    run_interrupt_cleanups()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    if line:
        print(line, file=sys.stderr, flush=True)
    os._exit(code)


def _inside_torch(frame) -> bool:
    """Whether any Python frame on the stack is torch's own code or a torch callback (its C++ may be below it)."""
    callbacks = ("__torch_dispatch__", "__torch_function__", "__del__")
    while frame is not None:
        code = frame.f_code
        if code.co_name in callbacks or "/torch/" in code.co_filename:
            return True
        frame = frame.f_back
    return False


if __name__ == "__main__":
    raise SystemExit(run())

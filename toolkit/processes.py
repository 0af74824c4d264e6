"""Processes a run starts, how they start and how they end: a rank or launcher imports without the garbage
collector walking what it imports, the launcher's tree is stopped as a whole and no rank outlives it.

toolkit.run.launcher runs the launcher with these; toolkit.train's ranks set die_with_parent and pause the collector
themselves. Linux facts used:
prctl PR_SET_PDEATHSIG (<linux/prctl.h>), /proc/PID/stat for the process tree (torchrun puts each worker in a
session of its own, so a process group alone does not reach them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

STOP_GRACE_S = 20.0
"""After SIGTERM, how long ranks get to exit before SIGKILL (a rank writing a checkpoint is not waited for: an
incomplete checkpoint has no completion marker and resume skips it, toolkit.train.checkpoints)."""


def die_with_parent(signum: int) -> None:
    """Ask Linux to send `signum` to this process when its parent dies (prctl PR_SET_PDEATHSIG); no-op elsewhere."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl(pr_set_pdeathsig, int(signum))


def pause_collector() -> None:
    """Process entry only (a rank of toolkit.train, a launcher, `toolkit launch`), before its heavy imports: no cyclic garbage
    collection until start_up_done. Importing torch, transformers, accelerate and DeepSpeed makes about 440,000
    objects that live until the process exits, and the collector walks them again and again while they arrive: in a
    rank of a 2-process DDP run of the tiny Llama its 7 full and ~1,000 young collections took 1.0 s of the 4.6-5.4 s
    of CPU the imports cost (measured with gc.callbacks, OMP_NUM_THREADS=1), 0.21 s of the launcher's 1.4 s."""
    import gc

    gc.disable()


def start_up_done() -> None:
    """After pause_collector, once the heavy imports are done: what start-up made goes to the collector's permanent
    generation (gc.freeze: never walked again, as modules are never unloaded) and collection resumes for what the run
    makes from here on. The ~12,000 objects of reference cycles the imports left (a few MB beside the ~450 MB a rank
    holds) stay with them: collecting them first would walk the whole heap once more (0.4 s). Without
    pause_collector (the entry called in a test's process), nothing."""
    import gc

    if gc.isenabled():
        return
    gc.freeze()
    gc.enable()


ACCELERATE_LAUNCH = [sys.executable, "-c", "from toolkit.processes import accelerate_launch; accelerate_launch()"]
"""`accelerate launch ARGS` as toolkit starts it: ACCELERATE_LAUNCH + ARGS (toolkit.run.launcher, the tests)."""


def accelerate_launch() -> None:
    """What the `accelerate` script runs for `launch`: accelerate.commands.launch's main (the arguments from
    sys.argv, the same parser and config), with the launcher's imports (torch, accelerate, torchrun's agent) made while
    the collector is paused: 0.21 s of the launcher's 1.4 s of import CPU less. A failed run raises out of main as
    from the script, with accelerate's traceback and exit code; a finished one leaves without unloading torch
(finish_process: about 0.8 s of CPU after the last rank ended, measured on a 2-rank launch at load ~8: from the last
rank's end to the launcher's 2.6-2.9 s -> 0.12-0.19 s)."""
    pause_collector()
    import torch.distributed.run  # noqa: F401  (what launch_command imports to start the ranks)
    from accelerate.commands.launch import main

    start_up_done()
    main()
    raise SystemExit(finish_process(0))


def finish_process(code: int) -> int:
    """Exit with `code` now (os._exit) after what a normal interpreter exit would do that anyone can see; returns
    `code` (for SystemExit) only where a step could not be done."""
    import atexit
    import os
    import threading

    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None or threading.current_thread() is not threading.main_thread():
        return code
    try:
        shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # a closed pipe, Ctrl-C during the hooks: the interpreter's own exit reports it
        return code
    os._exit(code)


def descendants(pid: int) -> list[int]:
    """Every living descendant of pid (from /proc; torchrun puts each worker in a session of its own, so the
    launcher's process group alone does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name in parentheses may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_process_tree(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the launcher's process group and every descendant, then SIGKILL whatever is left after grace_s."""
    import time

    def signal_all(signum: int) -> None:
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    family = descendants(proc.pid)
    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p) for p in family)):
        time.sleep(0.1)
    if proc.poll() is None or any(_alive(p) for p in family):
        signal_all(signal.SIGKILL)
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def on_import(name: str, execute) -> None:
    """Process entry only: the first import of module `name` runs as execute(run, module), where run() executes the
    module's code (its own loader's exec_module); a module already imported is left as it is. The one import hook:
    toolkit.train's rank entry and the guard of a user's script (toolkit.train.own_script_guard) both use it."""
    import importlib.abc
    import importlib.util

    class Loader(importlib.abc.Loader):
        def __init__(self, loader):
            self.loader = loader

        def create_module(self, spec):
            return self.loader.create_module(spec)

        def exec_module(self, module):
            execute(lambda: self.loader.exec_module(module), module)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is not None and spec.loader is not None:
                spec.loader = Loader(spec.loader)
            return spec

    if name not in sys.modules:
        sys.meta_path.insert(0, Finder())

"""Processes a run starts, and how they end: the launcher's tree is stopped as a whole and no rank outlives it.

toolkit.run.launcher runs the launcher with these; toolkit.train's ranks set die_with_parent themselves. Linux facts used:
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

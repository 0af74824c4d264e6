"""Running a plan's training (`toolkit launch PLAN_DIR [-- TRAIN ARGS]`, toolkit.commands.launch): the command
line, and the supervision of the processes it starts.

One node: prints and runs `accelerate launch --config_file DIR/accelerate_config.yaml -m toolkit.train --plan
DIR/plan.json ...`. Several nodes: prints each node's command and the SLURM route (sbatch DIR/slurm.sbatch), and
submits nothing. `--rehearse`: the plan's exact strategy on 2 CPU processes over gloo (4 for hybrid) with a tiny
model of the same architecture, a locally trained tokenizer and the standard-library corpus, for a few steps:
problems show up (exit code and message) before GPU time is spent.

A run holds its output folder (a lock with the owner's pid and host; a second run into it is refused), keeps every
rank's stderr in OUTPUT/toolkit-launch.log, and reports a failure as one line from the first failing rank. SIGINT,
SIGTERM and SIGHUP stop every rank it started (the launcher's process group and the workers the launcher put in
sessions of their own), leave the last complete checkpoint as it is, and print the command that resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from toolkit.errors import EXIT_USER_ERROR, UserError
from toolkit.processes import die_with_parent, start_up_done, stop_process_tree
from toolkit.plan.schema import Plan
from toolkit.plan.files import ACCELERATE_CONFIG, DS_CONFIG, PLAN_JSON



def emit_plan_files(plan: Plan, out_dir: str | Path) -> Path:
    """plan.json + the engine configs for `plan` in out_dir, written by the emitter (toolkit.emit)."""
    from toolkit.emit import emit_files

    out = Path(out_dir)
    emit_files(plan, out, force=True)
    return out


def launch_command(plan_dir: str | Path, train_argv: list[str], *, machine_rank: int | None = None,
                   main_host: str | None = None, max_restarts: int = 0, main_port: int | None = None) -> list[str]:
    """`accelerate launch` of toolkit.train with the plan's emitted accelerate config. max_restarts > 0: torchrun's
    elastic agent restarts the workers when one dies (accelerate hands --max_restarts and --monitor_interval to
    torchrun), and toolkit.train resumes each restart from the last complete checkpoint.

    One node (no machine_rank) rendezvouses on a port free at launch (`--main_process_port 0`), so two launches on
    one machine never meet: with none given, accelerate takes 29500, and two launches that both find it free both
    bind it and one fails (accelerate switches to torchrun's standalone mode only when it finds the port taken;
    docs/ENGINE_FACTS.md). A node of a multi-node run keeps the plan's fixed port (main_port, else the YAML's)."""
    plan_dir = Path(plan_dir)
    command = ["accelerate", "launch", "--config_file", str(plan_dir / ACCELERATE_CONFIG)]
    if (plan_dir / DS_CONFIG).is_file() and _is_deepspeed_yaml(plan_dir):
        # accelerate resolves the YAML's deepspeed_config_file against the working directory; name it exactly.
        command += ["--deepspeed_config_file", str(plan_dir / DS_CONFIG)]
    if machine_rank is not None:
        command += ["--machine_rank", str(machine_rank)]
    if main_host is not None:
        command += ["--main_process_ip", main_host]
    if main_port is not None or machine_rank is None:
        command += ["--main_process_port", str(main_port or 0)]
    if max_restarts:
        command += ["--max_restarts", str(max_restarts), "--monitor_interval", "1"]
    if is_user_script(train_argv):  # `toolkit launch DIR -- my_train.py ARGS`: the user's script, same configs,
        # run as `python my_train.py ARGS` would, except that the first rank to fail says why in one line.
        return command + ["-m", "toolkit.train.own_script", *train_argv]
    return command + ["-m", "toolkit.train", "--plan", str(plan_dir / PLAN_JSON), *train_argv]


def processes_phrase(count: int, *, cpu: bool) -> str:
    """'1 CPU process over gloo', '2 CPU processes over gloo', '4 processes': how a launch names where it runs."""
    noun = "process" if count == 1 else "processes"
    return f"{count} CPU {noun} over gloo" if cpu else f"{count} {noun}"


def is_user_script(train_argv: list[str]) -> bool:
    """A first argument ending in .py names the user's own training script (launch.sh decides the same way)."""
    return bool(train_argv) and train_argv[0].endswith(".py")


LOG_NAME = "toolkit-launch.log"
LOCK_NAME = ".toolkit-run.lock"


class _Stop(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def run(command: list[str], env: dict[str, str] | None = None, *, output: Path | None = None,
        resume_command: str | None = None, log_path: Path | None = None, max_restarts: int = 0) -> int:
    """Run a launcher command in the foreground; its exit code is ours, 2 when the training refused its input.

    output: the run's folder. It is locked for the run (a second run into it is refused), and every rank's stderr
    goes to output/toolkit-launch.log instead of the terminal: a failure is one line here, from the first failing
    rank (TOOLKIT_ERROR_FILE), never torchrun's traceback of every worker. Without output, stderr is the
    terminal's, unless log_path names the log (a user's script: no output folder of ours; script_log). SIGINT / SIGTERM /
    SIGHUP stop every process the run started and return 128 + the signal.
    """
    from toolkit.fileio import FolderLock

    lock = None
    log = None
    if output is not None:
        from toolkit.fileio import os_error_line, remove_created_folders

        existing = next(p for p in (output, *output.parents) if p.exists())
        try:
            output.mkdir(parents=True, exist_ok=True)
            lock = FolderLock(output / LOCK_NAME, f"output {output}").acquire()
        except (OSError, UserError) as exc:  # a full disk: nothing of this run is left behind
            remove_created_folders(output, existing)
            if isinstance(exc, UserError):
                raise
            raise UserError(os_error_line(exc, f"create --output {output}")) from None
    try:
        with tempfile.TemporaryDirectory(prefix="toolkit-launch-") as tmp:
            error_file = Path(tmp) / "error.json"
            full_env = {**os.environ, **(env or {}), "TOOLKIT_ERROR_FILE": str(error_file)}
            full_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets it too; the deepspeed launcher does not
            if output is not None:
                log_path = output / LOG_NAME
            elif log_path is not None:  # a user's script: say where its log is, before it fills
                print(f"every rank's stderr goes to {log_path}", flush=True)
            if log_path is not None:
                log = open(log_path, "ab")
                run_starts_at = log.tell()
            start_up_done()  # `toolkit launch` paused the collector for its imports (toolkit.cli.run)
            code, stopped = _run_stoppable(_resolve_launcher(command), full_env, log)
            if stopped:
                print(_stopped_text(stopped, output, resume_command), file=sys.stderr, flush=True)
                return 128 + stopped
            if code == 0:
                return 0
            failure = _read_failure(error_file)
            where = f" (full log: {log_path})" if log_path is not None else ""
            if failure is not None and failure["user_error"]:
                if log is not None:  # the rank's own line went to the log
                    print(f"error: {failure['message']}{where}", file=sys.stderr, flush=True)
                return EXIT_USER_ERROR
            if log is not None:
                log.flush()
                what = _first_failure(failure, _killed_ranks(log_path, run_starts_at), code)
                if max_restarts:
                    what = _gave_up_text(what, max_restarts, output, resume_command)
                print(f"error: {what}{where}", file=sys.stderr, flush=True)
            return code
    finally:
        if log is not None:
            log.close()
        if lock is not None:
            lock.release()


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous over loopback)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(commands: list[list[str]], env: dict[str, str] | None = None, *, output: Path) -> int:
    """Several launcher invocations on this host, one per machine rank, as the nodes of a multi-node run: all
    start, each node's stderr goes to output/node-R.log, and when one fails the others are stopped (a node whose
    peer died would wait at its next collective). The first failing node's exit code is ours."""
    import time

    from toolkit.fileio import FolderLock

    output.mkdir(parents=True, exist_ok=True)
    lock = FolderLock(output / LOCK_NAME, f"output {output}").acquire()
    procs, logs = [], []
    try:
        full_env = {**os.environ, **(env or {})}
        full_env.setdefault("OMP_NUM_THREADS", "1")
        start_up_done()  # as in run
        for rank, command in enumerate(commands):
            logs.append(open(output / f"node-{rank}.log", "ab"))
            procs.append(subprocess.Popen(_resolve_launcher(command), env=full_env, stderr=logs[-1],
                                          start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM)))
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, c) for rank, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                for p in procs:
                    if p.poll() is None:
                        stop_process_tree(p)
                rank, code = failed[0]
                print(f"error: node {rank} failed with exit code {code} (its log: {output / f'node-{rank}.log'})",
                      file=sys.stderr, flush=True)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process_tree(p)
        for log in logs:
            log.close()
        lock.release()


def _run_stoppable(command: list[str], env: dict[str, str], log) -> tuple[int, int]:
    """(exit code, signal that stopped it or 0). The launcher runs in a session of its own, so a terminal's
    Ctrl-C reaches only us and we stop everything in order; it dies with us even when we are SIGKILLed
    (PR_SET_PDEATHSIG), and toolkit.train sets the same on every rank, so no rank outlives its launcher."""
    stop_signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def on_signal(signum, frame):
        raise _Stop(signum)

    try:
        proc = subprocess.Popen(command, env=env, stderr=log, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGTERM))
    except FileNotFoundError:
        raise UserError(f"{command[0]} is not on PATH; install accelerate in this environment") from None
    previous = {s: signal.signal(s, on_signal) for s in stop_signals}
    try:
        try:
            return proc.wait(), 0
        except _Stop as stop:
            for s in stop_signals:  # a second Ctrl-C while stopping must not leave ranks behind
                signal.signal(s, signal.SIG_IGN)
            stop_process_tree(proc)
            return proc.returncode, stop.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _read_failure(error_file: Path) -> dict | None:
    try:
        data = json.loads(error_file.read_text())
        return {"rank": int(data["rank"]), "user_error": bool(data["user_error"]), "message": str(data["message"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _killed_ranks(log_path: Path, start: int) -> list[tuple[int, int]]:
    """(rank, signal) of the workers that died by a signal, from torchrun's last failure summary in this run's part
    of the log (torch.distributed.elastic's ChildFailedError: "rank : R (local_rank: L)" then "exitcode : -SIG").
    torchrun lists only the workers that had ended when it noticed, not those it then stopped itself."""
    import re

    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    root = text.rfind("Root Cause (first observed failure)")
    if root < 0:
        return []
    rule = "=" * 20
    begin = text.rfind(rule, 0, root)
    end = text.find(rule, root)
    summary = text[max(begin, 0):end if end >= 0 else len(text)]
    killed = {int(rank): -int(code) for rank, code in
              re.findall(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", summary) if int(code) < 0}
    return sorted(killed.items())


def _first_failure(failure: dict | None, killed: list[tuple[int, int]], code: int) -> str:
    """Which rank failed first, in words. A rank killed by a signal (kill -9, the OOM killer) cannot say so
    itself; the rank that reported is then only the survivor that saw its peer vanish ("Connection reset by
    peer"), so the killed rank is named first. torchrun stops the survivors with SIGTERM and may list them too
    (its "first observed failure" is by whole-second timestamps, so a tie goes to the lowest rank): a rank ended
    by any other signal is named before one ended by SIGTERM."""
    candidates = sorted(killed, key=lambda rank_signum: rank_signum[1] == signal.SIGTERM)
    first = next(((rank, signum) for rank, signum in candidates if failure is None or rank != failure["rank"]), None)
    if first is None:
        return (f"rank {failure['rank']} failed: {failure['message']}" if failure else
                f"training failed with exit code {code}")
    rank, signum = first
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    said = f"; rank {failure['rank']} then failed: {failure['message']}" if failure else ""
    return f"rank {rank} was killed by {name} (it failed first){said}"


def _stopped_text(signum: int, output: Path | None, resume_command: str | None) -> str:
    from toolkit.train.checkpoints import last_complete_checkpoint

    name = signal.Signals(signum).name
    last = last_complete_checkpoint(output) if output is not None else None
    kept = (f"the last complete checkpoint is {last}" if last else "no checkpoint was complete yet")
    resume = f"; resume with: {resume_command}" if resume_command and last else ""
    return f"stopped by {name}: every rank was stopped; {kept}{resume}"


def _gave_up_text(what: str, max_restarts: int, output: Path | None, resume_command: str | None) -> str:
    """The one line for a run whose workers (or a node) did not come back within --max-restarts."""
    from toolkit.train.checkpoints import last_complete_checkpoint

    last = last_complete_checkpoint(output) if output is not None else None
    kept = f"the last complete checkpoint is {last}" if last else "no checkpoint was complete"
    resume = f"; when the machines are back, resume with: {resume_command}" if resume_command and last else ""
    return (f"the workers did not recover within --max-restarts {max_restarts} (a worker kept dying, or a node "
            f"never came back): {what}; {kept}{resume}")


def _resolve_launcher(command: list[str]) -> list[str]:
    """The `accelerate` of the environment toolkit runs in (a venv used without activating it must not pick up another
    Python's accelerate from PATH, which would lack DeepSpeed or this toolkit): `accelerate launch` runs in this
    interpreter as toolkit.processes.ACCELERATE_LAUNCH, the function the `accelerate` script dispatches `launch` to,
    with the same arguments. It skips the script's import of accelerate's other subcommands (config, estimate, env,
    ...: transformers among them), about 0.9 s of CPU before any rank starts (measured: a 2-rank launch, 4.0-5.0 s CPU
    -> 2.9-3.6 s on a loaded 2-core box). Another accelerate subcommand: the script beside this interpreter, else
    PATH's."""
    import importlib.util

    from toolkit.processes import ACCELERATE_LAUNCH

    if command[:2] == ["accelerate", "launch"] and importlib.util.find_spec("accelerate") is not None:
        return [*ACCELERATE_LAUNCH, *command[2:]]
    beside = Path(sys.executable).parent / "accelerate"
    if command[:1] == ["accelerate"] and beside.is_file():
        return [str(beside), *command[1:]]
    return command


def _is_deepspeed_yaml(plan_dir: Path) -> bool:
    import yaml

    try:
        return yaml.safe_load((plan_dir / ACCELERATE_CONFIG).read_text()).get("distributed_type") == "DEEPSPEED"
    except (OSError, AttributeError, yaml.YAMLError):
        return False


SCRIPT_LOGS = "toolkit-logs"
"""Where a user's own script's launch log goes: the directory `toolkit launch` was run from, as `python my_train.py`
would leave its files there (the script's output folder is its own business, and the plan folder is never written
to: it may be read-only, shared, or under version control)."""


def script_log(plan_dir: Path) -> Path:
    """./toolkit-logs/launch-YYYYmmdd-HHMMSS-PID.log for a run of the user's own script; beside the plan folder
    when launched from inside it; in the temporary directory when neither is writable."""
    import time

    name = f"launch-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    here = Path.cwd().resolve()
    plan = plan_dir.resolve()
    base = plan.parent if here == plan or plan in here.parents else here
    try:
        (base / SCRIPT_LOGS).mkdir(exist_ok=True)
        path = base / SCRIPT_LOGS / name
        with open(path, "ab"):
            return path
    except OSError:
        return Path(tempfile.gettempdir()) / f"toolkit-{name}"

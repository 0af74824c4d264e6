"""`toolkit launch PLAN_DIR [-- TRAIN ARGS]`: run a plan's training on this node, or rehearse it on CPU first.

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
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from toolkit.errors import EXIT_USER_ERROR, UserError
from toolkit.processes import die_with_parent, stop_process_tree
from toolkit.plan import Plan, load_plan
from toolkit.strategy import Engine

ACCELERATE_CONFIG = "accelerate_config.yaml"


def emit_plan_files(plan: Plan, out_dir: str | Path) -> Path:
    """plan.json + the engine configs for `plan` in out_dir, written by the emitter (toolkit.emit)."""
    from toolkit.emit import emit_files

    out = Path(out_dir)
    emit_files(plan, out, force=True)
    return out


def launch_command(plan_dir: str | Path, train_argv: list[str], *, machine_rank: int | None = None,
                   main_host: str | None = None) -> list[str]:
    """`accelerate launch` of toolkit.train with the plan's emitted accelerate config."""
    plan_dir = Path(plan_dir)
    command = ["accelerate", "launch", "--config_file", str(plan_dir / ACCELERATE_CONFIG)]
    if (plan_dir / "ds_config.json").is_file() and _is_deepspeed_yaml(plan_dir):
        # accelerate resolves the YAML's deepspeed_config_file against the working directory; name it exactly.
        command += ["--deepspeed_config_file", str(plan_dir / "ds_config.json")]
    if machine_rank is not None:
        command += ["--machine_rank", str(machine_rank)]
    if main_host is not None:
        command += ["--main_process_ip", main_host]
    if is_user_script(train_argv):  # `toolkit launch DIR -- my_train.py ARGS`: the user's script, same configs,
        # run as `python my_train.py ARGS` would, except that the first rank to fail says why in one line.
        return command + ["-m", "toolkit.train.own_script", *train_argv]
    return command + ["-m", "toolkit.train", "--plan", str(plan_dir / "plan.json"), *train_argv]


def is_user_script(train_argv: list[str]) -> bool:
    """A first argument ending in .py names the user's own training script (launch.sh decides the same way)."""
    return bool(train_argv) and train_argv[0].endswith(".py")


def launch_main(plan_dir: str | Path, train_argv: list[str], *, rehearse: bool = False, dry_run: bool = False,
                processes: int | None = None, cpu: bool = False) -> int:
    """Run (or print) the plan's training; with rehearse, a CPU rehearsal of the same strategy instead. processes /
    cpu: the plan on a smaller box (toolkit.smaller_box), its files emitted for it into a temporary folder."""
    plan_dir = Path(plan_dir)
    if plan_dir.name == "plan.json":
        plan_dir = plan_dir.parent
    plan = load_plan(plan_dir)
    if (processes is not None or cpu) and not rehearse:
        return _launch_on_this_box(plan, plan_dir, train_argv, processes=processes, cpu=cpu, dry_run=dry_run)
    return _launch_folder(plan, plan_dir, train_argv, rehearse=rehearse, dry_run=dry_run)


def _launch_on_this_box(plan: Plan, plan_dir: Path, train_argv: list[str], *, processes: int | None, cpu: bool,
                        dry_run: bool) -> int:
    from toolkit.smaller_box import box_plan

    if processes is None and cpu:
        processes = min(plan.world_size, os.cpu_count() or 1)
    box, said = box_plan(plan, processes=processes, cpu=cpu)
    where = f"{box.world_size} CPU processes over gloo" if cpu else f"{box.world_size} processes"
    print(f"{plan.strategy} on {where} (planned for {plan.world_size} x {plan.gpu}); files for this box are "
          "emitted from plan.json into a temporary folder", flush=True)
    for line in said:
        print(f"note: {line}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="toolkit-box-"))
    try:
        box_dir = emit_plan_files(box, work / "plan")
        relaunch = f"toolkit launch {shlex.quote(str(plan_dir))} --processes {box.world_size}" + (" --cpu" if cpu else "")
        return _launch_folder(box, box_dir, train_argv, rehearse=False, dry_run=dry_run, log_dir=plan_dir,
                              relaunch=relaunch, env={"CUDA_VISIBLE_DEVICES": ""} if cpu else None)
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


def _launch_folder(plan: Plan, plan_dir: Path, train_argv: list[str], *, rehearse: bool, dry_run: bool,
                   log_dir: Path | None = None, relaunch: str | None = None, env: dict[str, str] | None = None) -> int:
    if not (plan_dir / ACCELERATE_CONFIG).is_file():
        raise UserError(f"{plan_dir / ACCELERATE_CONFIG} is missing; emit the plan's files with `toolkit emit` "
                        f"into {plan_dir}")
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and (plan_dir / "ds_config.json").is_file():
        read_ds_config(plan_dir / "ds_config.json")  # unreadable is refused here, rehearsal or not
    if rehearse:
        from toolkit.rehearsal import rehearse as run_rehearsal

        return run_rehearsal(plan, plan_dir, train_argv, dry_run=dry_run)
    args = None
    if is_user_script(train_argv):
        if not Path(train_argv[0]).is_file():
            raise UserError(f"training script {train_argv[0]} does not exist")
        if plan.engine == Engine.PIPELINE:
            raise UserError("a pipeline plan runs DeepSpeed's pipeline engine, which only toolkit.train drives; "
                            "launch it without a script (toolkit launch DIR -- --data D --output O)")
    else:
        args = preflight(plan, plan_dir, train_argv)
    if plan.num_machines > 1:
        print(_multi_node_text(plan, plan_dir, train_argv))
        return 0
    command = launch_command(plan_dir, train_argv)
    print("$ " + shlex.join(command), flush=True)
    if dry_run:
        return 0
    env = {**(env or {}), "TOOLKIT_PLAN_DIR": str(plan_dir.resolve())}
    shown_dir = log_dir or plan_dir  # the user's folder (a box's files live in a temporary one)
    if args is None:  # the user's own script: its output folder and resume flags are its own; its log goes beside
        return run(command, env=env, log_path=_writable_log(shown_dir))  # the plan
    resume = train_argv if args.resume else [*train_argv, "--resume"]
    return run(command, env=env, output=Path(args.output),
               resume_command=f"{relaunch or 'toolkit launch ' + shlex.quote(str(shown_dir))} -- {shlex.join(resume)}")


def _writable_log(folder: Path) -> Path:
    """folder/toolkit-launch.log (appended to), or one in the temporary directory when folder is read-only."""
    path = folder / LOG_NAME
    try:
        with open(path, "ab"):
            return path
    except OSError:
        return Path(tempfile.gettempdir()) / f"toolkit-launch-{os.getpid()}.log"


LOG_NAME = "toolkit-launch.log"
LOCK_NAME = ".toolkit-run.lock"


class _Stop(Exception):
    def __init__(self, signum: int):
        self.signum = signum


def run(command: list[str], env: dict[str, str] | None = None, *, output: Path | None = None,
        resume_command: str | None = None, log_path: Path | None = None) -> int:
    """Run a launcher command in the foreground; its exit code is ours, 2 when the training refused its input.

    output: the run's folder. It is locked for the run (a second run into it is refused), and every rank's stderr
    goes to output/toolkit-launch.log instead of the terminal: a failure is one line here, from the first failing
    rank (TOOLKIT_ERROR_FILE), never torchrun's traceback of every worker. Without output, stderr is the
    terminal's, unless log_path names the log (a user's script: no output folder of ours). SIGINT / SIGTERM /
    SIGHUP stop every process the run started and return 128 + the signal.
    """
    from toolkit.fileio import FolderLock

    lock = None
    log = None
    if output is not None:
        try:
            output.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create --output {output}: {exc.strerror}; choose another folder") from None
        lock = FolderLock(output / LOCK_NAME, f"output {output}").acquire()
    try:
        with tempfile.TemporaryDirectory(prefix="toolkit-launch-") as tmp:
            error_file = Path(tmp) / "error.json"
            full_env = {**os.environ, **(env or {}), "TOOLKIT_ERROR_FILE": str(error_file)}
            full_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets it too; the deepspeed launcher does not
            if output is not None:
                log_path = output / LOG_NAME
            if log_path is not None:
                log = open(log_path, "ab")
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
                what = (f"rank {failure['rank']} failed: {failure['message']}" if failure else
                        f"training failed with exit code {code}")
                print(f"error: {what}{where}", file=sys.stderr, flush=True)
            return code
    finally:
        if log is not None:
            log.close()
        if lock is not None:
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


def _stopped_text(signum: int, output: Path | None, resume_command: str | None) -> str:
    from toolkit.train.checkpoints import last_complete_checkpoint

    name = signal.Signals(signum).name
    last = last_complete_checkpoint(output) if output is not None else None
    kept = (f"the last complete checkpoint is {last}" if last else "no checkpoint was complete yet")
    resume = f"; resume with: {resume_command}" if resume_command and last else ""
    return f"stopped by {name}: every rank was stopped; {kept}{resume}"


def _resolve_launcher(command: list[str]) -> list[str]:
    """The `accelerate` of the environment toolkit runs in: the one installed beside this interpreter (a venv used
    without activating it must not pick up another Python's accelerate from PATH, which would lack DeepSpeed or
    this toolkit), else PATH's, else this interpreter running accelerate's launch module."""
    import shutil

    if command[:1] != ["accelerate"]:
        return command
    beside = Path(sys.executable).parent / "accelerate"
    if beside.is_file():
        return [str(beside), *command[1:]]
    if shutil.which("accelerate"):
        return command
    if command[1:2] == ["launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch", *command[2:]]
    return command


def preflight(plan: Plan, plan_dir: Path, train_argv: list[str]) -> None:
    """The checks that need no process group, made before any process starts: arguments, data path, the model's
    config against the plan (type, layers, width, sequence length) and the engine's config file."""
    from toolkit.hardware import gpu_catalog
    from toolkit.train.model import check_matches_plan, load_config, model_source

    args = _check_train_argv(plan_dir, train_argv)
    _check_output(Path(args.output), args.resume)
    if plan.gpu in gpu_catalog():  # the job rules estimate and plan apply (plans made for catalog GPUs)
        from toolkit.planner import plan_job

        plan_job(plan)
    source = model_source(plan, args.model, random_init=args.random_init)
    check_matches_plan(load_config(source, random_init=args.random_init), plan, source)
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and not (plan_dir / "ds_config.json").is_file():
        raise UserError(f"{plan_dir / 'ds_config.json'} is missing; emit the plan's files with `toolkit emit`")
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE):
        from toolkit.emit.validate import validate_ds_config_for_plan

        ds_file = plan_dir / "ds_config.json"
        try:  # DeepSpeed's and the Trainer's own validation, at the plan's world size, before any process starts
            validate_ds_config_for_plan(read_ds_config(ds_file), plan)
        except UserError:
            raise
        except Exception as exc:  # any reason the engine refuses the file, in whatever class it raises
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"DeepSpeed refuses {ds_file}: {first[:300]}; fix it or re-emit it with "
                            "`toolkit emit`") from None
    if plan.engine == Engine.DEEPSPEED:
        from toolkit.train.hf_runner import check_ds_config_agrees

        check_ds_config_agrees(plan, args, plan_dir / "ds_config.json")
    return args


def read_ds_config(path: Path) -> dict:
    """ds_config.json as a dict, or one line saying why it cannot be (truncated, binary, not an object)."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix it or re-emit it with "
                        "`toolkit emit`") from None
    except (OSError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"cannot read {path} ({type(exc).__name__}); fix it or re-emit it with `toolkit emit`") \
            from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a JSON object; re-emit it with `toolkit emit`")
    return data


def _check_output(output: Path, resume: bool) -> None:
    """The run's own refusals that need no process: a live run holding the folder, or checkpoints of an earlier
    run without --resume (toolkit.train refuses that too, but only after every rank loaded the model)."""
    from toolkit.train.checkpoints import checkpoint_dirs

    if checkpoint_dirs(output) and not resume:
        raise UserError(f"output {output} already holds checkpoints; pass --resume to continue that run, "
                        "or choose another --output")
    lock = output / LOCK_NAME
    if lock.is_file():  # a held lock refuses here, before any process starts; run() takes it for real
        from toolkit.fileio import FolderLock

        FolderLock(lock, f"output {output}").acquire().release()


def _check_train_argv(plan_dir: Path, train_argv: list[str]):
    """Catch a typo in the training arguments here rather than in N processes after the model loaded."""
    from toolkit.train.args import parse_train_args

    if "--plan" in train_argv:
        raise UserError("pass the plan as `toolkit launch PLAN_DIR`, not --plan in the training arguments")
    args = parse_train_args(["--plan", str(plan_dir / "plan.json"), *train_argv])
    data = Path(args.data).expanduser()
    if (args.data.startswith((".", "/", "~")) or data.suffix) and not data.exists():
        raise UserError(f"data {args.data} does not exist")
    _check_text_data(data)
    return args


def _check_text_data(data: Path) -> None:
    """Local text-format data (toolkit.train.data.LOADERS: text / json / csv) must be UTF-8; a binary file fails
    inside every worker, as a decoding traceback, after the model has loaded. Reads the first 64 KiB of each."""
    from toolkit.train.data import LOADERS

    files = sorted(data.iterdir()) if data.is_dir() else [data] if data.is_file() else []
    for path in files:
        if not path.is_file() or LOADERS.get(path.suffix.lower()) not in ("text", "json", "csv"):
            continue
        with open(path, "rb") as f:
            head = f.read(65536)
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as exc:
            if exc.start < len(head) - 4:  # not merely a character cut at the 64 KiB boundary
                raise UserError(f"data file {path} is not UTF-8 text (byte {exc.start}); convert it or give a "
                                "text / json / jsonl / csv / parquet file") from None
        if LOADERS.get(path.suffix.lower()) == "json":
            _check_json_records(path)


def _check_json_records(path: Path) -> None:
    """A JSON / JSON Lines data file must parse (datasets' json loader takes a JSON document or one object per
    line); a bad line otherwise fails inside every worker after the model has loaded. Streams the file once."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            first = f.read(1)
            if path.suffix.lower() == ".json" and first in ("[", "{"):
                try:
                    json.loads(first + f.read())
                    return
                except json.JSONDecodeError:
                    f.seek(0)  # not one document: maybe JSON Lines in a .json file
            else:
                f.seek(0)
            for number, line in enumerate(f, 1):
                if line.strip():
                    json.loads(line)
    except json.JSONDecodeError as exc:
        where = f"line {number}" if "number" in locals() else f"line {exc.lineno}"
        raise UserError(f"data file {path} is not valid JSON Lines ({where}: {exc.msg}); fix that line or give "
                        "a text / csv / parquet file") from None
    except UnicodeDecodeError:
        raise UserError(f"data file {path} is not UTF-8 text; convert it or give a text / json / jsonl / csv / "
                        "parquet file") from None


def _is_deepspeed_yaml(plan_dir: Path) -> bool:
    import yaml

    try:
        return yaml.safe_load((plan_dir / ACCELERATE_CONFIG).read_text()).get("distributed_type") == "DEEPSPEED"
    except (OSError, AttributeError, yaml.YAMLError):
        return False


def _multi_node_text(plan: Plan, plan_dir: Path, train_argv: list[str]) -> str:
    lines = [f"plan {plan.strategy} runs on {plan.num_machines} nodes x {plan.gpus_per_node} GPUs; "
             "nothing was started. Either run on each node (MAIN = the first node's hostname):"]
    for rank in range(plan.num_machines):
        command = launch_command(plan_dir, train_argv, machine_rank=rank, main_host="MAIN")
        lines.append(f"  node {rank}: " + shlex.join(command))
    sbatch = plan_dir / "slurm.sbatch"
    # slurm.sbatch finds the plan directory as the directory it was submitted from.
    route = f"(cd {shlex.quote(str(plan_dir))} && sbatch slurm.sbatch {shlex.join(train_argv)})"
    lines.append(f"or, under SLURM: {route}" + ("" if sbatch.is_file() else
                                                 "  (slurm.sbatch is missing: emit the plan's files again)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m toolkit.launch PLAN_DIR [--rehearse] [--dry-run] [TRAIN ARGS...]` (the toolkit CLI's launch)."""
    import argparse

    parser = argparse.ArgumentParser(prog="toolkit launch", description=__doc__.splitlines()[0])
    parser.add_argument("plan_dir")
    parser.add_argument("--rehearse", action="store_true", help="run the strategy on 2 CPU processes first")
    parser.add_argument("--dry-run", action="store_true", help="print the command(s), run nothing")
    ns, train_argv = parser.parse_known_args(argv)
    if train_argv[:1] == ["--"]:
        train_argv = train_argv[1:]
    try:
        return launch_main(ns.plan_dir, train_argv, rehearse=ns.rehearse, dry_run=ns.dry_run)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    raise SystemExit(main())

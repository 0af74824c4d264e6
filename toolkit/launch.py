"""`toolkit launch PLAN_DIR [-- TRAIN ARGS]`: run a plan's training on this node, or rehearse it on CPU first.

One node: prints and runs `accelerate launch --config_file DIR/accelerate_config.yaml -m toolkit.train --plan
DIR/plan.json ...`. Several nodes: prints each node's command and the SLURM route (sbatch DIR/slurm.sbatch), and
submits nothing. `--rehearse`: the plan's exact strategy on 2 CPU processes over gloo (4 for hybrid) with a tiny
model of the same architecture, a locally trained tokenizer and the standard-library corpus, for a few steps:
problems show up (exit code and message) before GPU time is spent.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from toolkit.errors import EXIT_USER_ERROR, UserError
from toolkit.plan import Plan, load_plan

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
    if is_user_script(train_argv):  # `toolkit launch DIR -- my_train.py ARGS`: the user's script, same configs
        return command + train_argv
    return command + ["-m", "toolkit.train", "--plan", str(plan_dir / "plan.json"), *train_argv]


def is_user_script(train_argv: list[str]) -> bool:
    """A first argument ending in .py names the user's own training script (launch.sh decides the same way)."""
    return bool(train_argv) and train_argv[0].endswith(".py")


def launch_main(plan_dir: str | Path, train_argv: list[str], *, rehearse: bool = False, dry_run: bool = False) -> int:
    """Run (or print) the plan's training; with rehearse, a CPU rehearsal of the same strategy instead."""
    plan_dir = Path(plan_dir)
    if plan_dir.name == "plan.json":
        plan_dir = plan_dir.parent
    plan = load_plan(plan_dir)
    if not (plan_dir / ACCELERATE_CONFIG).is_file():
        raise UserError(f"{plan_dir / ACCELERATE_CONFIG} is missing; emit the plan's files with `toolkit emit` "
                        f"into {plan_dir}")
    if rehearse:
        from toolkit.train.rehearsal import rehearse as run_rehearsal

        return run_rehearsal(plan, plan_dir, train_argv, dry_run=dry_run)
    if is_user_script(train_argv):
        if not Path(train_argv[0]).is_file():
            raise UserError(f"training script {train_argv[0]} does not exist")
        if plan.engine == "pipeline":
            raise UserError("a pipeline plan runs DeepSpeed's pipeline engine, which only toolkit.train drives; "
                            "launch it without a script (toolkit launch DIR -- --data D --output O)")
    else:
        preflight(plan, plan_dir, train_argv)
    if plan.num_machines > 1:
        print(_multi_node_text(plan, plan_dir, train_argv))
        return 0
    command = launch_command(plan_dir, train_argv)
    print("$ " + shlex.join(command), flush=True)
    if dry_run:
        return 0
    return run(command, env={"TOOLKIT_PLAN_DIR": str(plan_dir.resolve())})


def run(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run a launcher command in the foreground; its exit code is ours, and 2 when the training refused its
    input (rank 0 wrote the one-line reason to TOOLKIT_ERROR_FILE; torchrun itself would report 1)."""
    with tempfile.TemporaryDirectory(prefix="toolkit-launch-") as tmp:
        error_file = Path(tmp) / "error.txt"
        full_env = {**os.environ, **(env or {}), "TOOLKIT_ERROR_FILE": str(error_file)}
        full_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets it too; the deepspeed launcher does not
        try:
            code = subprocess.run(_resolve_launcher(command), env=full_env).returncode
        except FileNotFoundError:
            raise UserError(f"{command[0]} is not on PATH; install accelerate in this environment") from None
        if code != 0 and error_file.is_file():
            return EXIT_USER_ERROR
        return code


def _resolve_launcher(command: list[str]) -> list[str]:
    """`accelerate` from PATH, else the one installed beside this interpreter (a venv used without activating
    it), else this interpreter running accelerate's launch module."""
    import shutil

    if command[:1] != ["accelerate"] or shutil.which("accelerate"):
        return command
    beside = Path(sys.executable).parent / "accelerate"
    if beside.is_file():
        return [str(beside), *command[1:]]
    if command[1:2] == ["launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch", *command[2:]]
    return command


def preflight(plan: Plan, plan_dir: Path, train_argv: list[str]) -> None:
    """The checks that need no process group, made before any process starts: arguments, data path, the model's
    config against the plan (type, layers, width, sequence length) and the engine's config file."""
    from toolkit.train.model import check_matches_plan, load_config, model_source

    args = _check_train_argv(plan_dir, train_argv)
    source = model_source(plan, args.model, random_init=args.random_init)
    check_matches_plan(load_config(source, random_init=args.random_init), plan, source)
    if plan.engine in ("deepspeed", "pipeline") and not (plan_dir / "ds_config.json").is_file():
        raise UserError(f"{plan_dir / 'ds_config.json'} is missing; emit the plan's files with `toolkit emit`")
    if plan.engine == "deepspeed":
        from toolkit.train.hf_runner import check_ds_config_agrees

        check_ds_config_agrees(plan, args, plan_dir / "ds_config.json")


def _check_train_argv(plan_dir: Path, train_argv: list[str]):
    """Catch a typo in the training arguments here rather than in N processes after the model loaded."""
    from toolkit.train.args import parse_train_args

    if "--plan" in train_argv:
        raise UserError("pass the plan as `toolkit launch PLAN_DIR`, not --plan in the training arguments")
    args = parse_train_args(["--plan", str(plan_dir / "plan.json"), *train_argv])
    data = Path(args.data).expanduser()
    if (args.data.startswith((".", "/", "~")) or data.suffix) and not data.exists():
        raise UserError(f"data {args.data} does not exist")
    return args


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

"""`toolkit launch PLAN_DIR [-- TRAIN ARGS]`: run a plan's training on this node, or rehearse it on CPU first.

One node: prints and runs `accelerate launch --config_file DIR/accelerate_config.yaml -m toolkit.train --plan
DIR/plan.json ...`. Several nodes: prints each node's command and the SLURM route (sbatch DIR/slurm.sbatch), and
submits nothing. `--rehearse`: the plan's exact strategy on 2 CPU processes over gloo (4 for hybrid) with a tiny
model of the same architecture, a locally trained tokenizer and the standard-library corpus, for a few steps:
problems show up (exit code and message) before GPU time is spent. The running itself is toolkit.run."""

from __future__ import annotations


import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit import bounds
from toolkit.bounds import int_arg, text_arg
from toolkit.errors import UserError

if TYPE_CHECKING:
    from toolkit.plan.schema import Plan


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="run (or rehearse on CPU) an emitted plan")
    p.add_argument("plan_dir", type=text_arg("plan folder"))
    p.add_argument("--rehearse", action="store_true", help="run the plan's strategy on CPU processes first")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--nodes", type=int_arg("--nodes", bounds.NODES), default=1, metavar="N",
                   help="with --rehearse: run the rehearsal as N launcher invocations (machine ranks 0..N-1) over "
                        "loopback, as the nodes of a multi-node run (default %(default)s)")
    p.add_argument("--max-restarts", type=int_arg("--max-restarts", bounds.RESTARTS), default=0, metavar="N",
                   help="restart the workers up to N times when one dies (torchrun's elastic agent); each restart "
                        "resumes from the last complete checkpoint (default %(default)s)")
    p.set_defaults(func=cmd_launch, train_args=[])
    p.epilog = "Arguments after -- go to toolkit.train: toolkit launch DIR -- --model M --data D --output OUT"


def cmd_launch(args) -> int:

    return launch_main(args.plan_dir, args.train_args, rehearse=args.rehearse, dry_run=args.dry_run,
                       max_restarts=args.max_restarts, nodes=args.nodes)


def launch_main(plan_dir: str | Path, train_argv: list[str], *, rehearse: bool = False, dry_run: bool = False,
                max_restarts: int = 0, nodes: int = 1) -> int:
    """Run (or print) the plan's training; with rehearse, a CPU rehearsal of the same strategy instead."""
    from toolkit.inputs.strategy import Engine
    from toolkit.plan.schema import load_plan
    from toolkit.plan.files import ACCELERATE_CONFIG, DS_CONFIG, PLAN_JSON
    from toolkit.run.launcher import is_user_script, launch_command, run
    from toolkit.run.preflight import preflight, read_ds_config

    plan_dir = Path(plan_dir)
    if plan_dir.name == PLAN_JSON:
        plan_dir = plan_dir.parent
    plan = load_plan(plan_dir)
    if not (plan_dir / ACCELERATE_CONFIG).is_file():
        raise UserError(f"{plan_dir / ACCELERATE_CONFIG} is missing; emit the plan's files with `toolkit emit` "
                        f"into {plan_dir}")
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and (plan_dir / DS_CONFIG).is_file():
        read_ds_config(plan_dir / DS_CONFIG)  # unreadable is refused here, rehearsal or not
    if nodes > 1 and not rehearse:
        raise UserError(f"--nodes {nodes} runs a rehearsal as {nodes} nodes on this machine; add --rehearse (a real "
                        "multi-node run starts on each node: see PLAN.md)")
    if rehearse:
        from toolkit.run.rehearsal import rehearse as run_rehearsal

        return run_rehearsal(plan, plan_dir, train_argv, dry_run=dry_run, nodes=nodes)
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
    command = launch_command(plan_dir, train_argv, max_restarts=max_restarts)
    print("$ " + shlex.join(command), flush=True)
    if dry_run:
        return 0
    env = {"TOOLKIT_PLAN_DIR": str(plan_dir.resolve())}
    if args is None:  # the user's own script: its output folder and resume flags are its own
        return run(command, env=env)
    resume = train_argv if args.resume else [*train_argv, "--resume"]
    return run(command, env=env, output=Path(args.output), max_restarts=max_restarts,
               resume_command=f"toolkit launch {shlex.quote(str(plan_dir))} -- {shlex.join(resume)}")


def _multi_node_text(plan: Plan, plan_dir: Path, train_argv: list[str]) -> str:
    from toolkit.plan.files import SLURM_SBATCH
    from toolkit.run.launcher import launch_command

    lines = [f"plan {plan.strategy} runs on {plan.num_machines} nodes x {plan.gpus_per_node} GPUs; "
             "nothing was started. Either run on each node (MAIN = the first node's hostname):"]
    for rank in range(plan.num_machines):
        command = launch_command(plan_dir, train_argv, machine_rank=rank, main_host="MAIN")
        lines.append(f"  node {rank}: " + shlex.join(command))
    sbatch = plan_dir / SLURM_SBATCH
    # slurm.sbatch finds the plan directory as the directory it was submitted from.
    route = f"(cd {shlex.quote(str(plan_dir))} && sbatch slurm.sbatch {shlex.join(train_argv)})"
    lines.append(f"or, under SLURM: {route}" + ("" if sbatch.is_file() else
                                                 "  (slurm.sbatch is missing: emit the plan's files again)"))
    return "\n".join(lines)

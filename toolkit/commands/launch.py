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
    p.add_argument("plan_dir", type=text_arg("plan folder"), help="a folder that toolkit plan --out or toolkit emit wrote")
    p.add_argument("--rehearse", action="store_true", help="run the plan's strategy on CPU processes first")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--processes", type=int_arg("--processes", bounds.PROCESSES),
                   help="run the plan on N processes of this machine (fewer GPUs, or CPU processes with --cpu); "
                        "the global batch is kept by accumulation. With --rehearse: the rehearsal's N CPU processes "
                        "(default 2), for a plan with data parallelism alone")
    p.add_argument("--cpu", action="store_true",
                   help="run on CPU processes over gloo (bf16 instead of fp16; your own script gets the set-up "
                        "from toolkit.train.own_script)")
    p.add_argument("--nodes", type=int_arg("--nodes", bounds.NODES), default=1, metavar="N",
                   help="with --rehearse: run the rehearsal as N launcher invocations (machine ranks 0..N-1) over "
                        "loopback, as the nodes of a multi-node run (default %(default)s)")
    p.add_argument("--max-restarts", type=int_arg("--max-restarts", bounds.RESTARTS), default=0, metavar="N",
                   help="restart the workers up to N times when one dies (torchrun's elastic agent); each restart "
                        "resumes from the last complete checkpoint (default %(default)s)")
    p.set_defaults(func=cmd_launch, train_args=[])
    p.epilog = LAUNCH_EPILOG


LAUNCH_EPILOG = """\
Arguments after -- go to toolkit.train (--data D --output OUT, optional --model M; --resume continues from OUT's
last complete checkpoint), or to your own script when the first one ends in .py: TOOLKIT_PLAN_DIR is set, and
toolkit.train.own_script gives the script the plan's settings for this box.
--processes N [--cpu]: the plan's strategy on N processes of this machine (CPU processes over gloo with --cpu),
the global batch kept by accumulation. --rehearse: the strategy on a tiny model of the same architecture, 2 CPU
processes (--processes N for a data-parallel plan), a few steps, on the tiny data of the plan's method (text,
preference pairs for DPO, prompts for GRPO).
A failing run prints one line from the rank that failed first with the log's path (OUT/toolkit-launch.log; for
your own script ./toolkit-logs/, never the plan folder); Ctrl-C stops every rank and prints the command that
resumes."""


def cmd_launch(args) -> int:

    return launch_main(args.plan_dir, args.train_args, rehearse=args.rehearse, dry_run=args.dry_run,
                       processes=args.processes, cpu=args.cpu, max_restarts=args.max_restarts, nodes=args.nodes)


def launch_main(plan_dir: str | Path, train_argv: list[str], *, rehearse: bool = False, dry_run: bool = False,
                processes: int | None = None, cpu: bool = False, max_restarts: int = 0, nodes: int = 1) -> int:
    """Run (or print) the plan's training; with rehearse, a CPU rehearsal of the same strategy instead. processes /
    cpu: the plan on a smaller box (toolkit.run.smaller_box), its files emitted for it into a temporary folder."""
    from toolkit.plan.files import PLAN_JSON
    from toolkit.plan.schema import load_plan

    plan_dir = Path(plan_dir)
    if plan_dir.name == PLAN_JSON:
        plan_dir = plan_dir.parent
    plan = load_plan(plan_dir)
    if nodes > 1:
        from toolkit.run.preflight import check_node_count

        check_node_count(plan, nodes)
    if nodes > 1 and not rehearse:
        raise UserError(f"--nodes {nodes} runs a rehearsal as {nodes} nodes on this machine; add --rehearse (a real "
                        "multi-node run starts on each node: see PLAN.md)")
    if not rehearse and processes is None and not cpu:  # a real run: its SLURM allocation and hostfile
        from toolkit.run.preflight import check_multi_node

        check_multi_node(plan, plan_dir)
    if (processes is not None or cpu) and not rehearse:
        return _launch_on_this_box(plan, plan_dir, train_argv, processes=processes, cpu=cpu, dry_run=dry_run,
                                   max_restarts=max_restarts)
    return _launch_folder(plan, plan_dir, train_argv, rehearse=rehearse, dry_run=dry_run, nodes=nodes,
                          max_restarts=max_restarts, processes=processes)


def _launch_on_this_box(plan: Plan, plan_dir: Path, train_argv: list[str], *, processes: int | None, cpu: bool,
                        dry_run: bool, max_restarts: int = 0) -> int:
    import os
    import shutil
    import tempfile

    from toolkit.run.launcher import emit_plan_files, processes_phrase
    from toolkit.run.smaller_box import box_plan

    if processes is None and cpu:
        processes = min(plan.world_size, os.cpu_count() or 1)
    box, said = box_plan(plan, processes=processes, cpu=cpu)
    where = processes_phrase(box.world_size, cpu=cpu)
    print(f"{plan.strategy} on {where} (planned for {plan.world_size} x {plan.gpu}); files for this box are "
          "emitted from plan.json into a temporary folder", flush=True)
    for line in said:
        print(f"note: {line}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="toolkit-box-"))
    try:
        box_dir = emit_plan_files(box, work / "plan")
        relaunch = f"toolkit launch {shlex.quote(str(plan_dir))} --processes {box.world_size}" + (" --cpu" if cpu else "")
        return _launch_folder(box, box_dir, train_argv, rehearse=False, dry_run=dry_run, log_dir=plan_dir,
                              relaunch=relaunch, env={"CUDA_VISIBLE_DEVICES": ""} if cpu else None,
                              max_restarts=max_restarts)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _launch_folder(plan: Plan, plan_dir: Path, train_argv: list[str], *, rehearse: bool, dry_run: bool,
                   log_dir: Path | None = None, relaunch: str | None = None, env: dict[str, str] | None = None,
                   nodes: int = 1, max_restarts: int = 0, processes: int | None = None) -> int:
    from toolkit.fileio import file_kind_problem
    from toolkit.inputs.strategy import Engine
    from toolkit.plan.files import ACCELERATE_CONFIG, DS_CONFIG
    from toolkit.run.launcher import is_user_script, launch_command, run, script_log
    from toolkit.run.preflight import check_script, preflight, read_ds_config

    problem = file_kind_problem(plan_dir / ACCELERATE_CONFIG)
    if problem is not None:
        raise UserError(f"{plan_dir / ACCELERATE_CONFIG} is {problem}, not the accelerate config; re-emit the "
                        f"plan's files with `toolkit emit {plan_dir} --force`")
    if not (plan_dir / ACCELERATE_CONFIG).is_file():
        raise UserError(f"{plan_dir / ACCELERATE_CONFIG} is missing; emit the plan's files with `toolkit emit` "
                        f"into {plan_dir}")
    ds_file = plan_dir / DS_CONFIG
    if plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and (ds_file.exists() or ds_file.is_symlink()):
        read_ds_config(ds_file)  # unreadable is refused here, rehearsal or not
    if rehearse:
        from toolkit.run.rehearsal import rehearse as run_rehearsal

        return run_rehearsal(plan, plan_dir, train_argv, dry_run=dry_run, nodes=nodes, processes=processes)
    args = None
    if is_user_script(train_argv):
        check_script(train_argv[0])
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
    env = {**(env or {}), "TOOLKIT_PLAN_DIR": str(plan_dir.resolve())}
    shown_dir = log_dir or plan_dir  # the user's folder (a box's files live in a temporary one)
    if args is None:  # the user's own script: its output folder and resume flags are its own
        return run(command, env=env, log_path=script_log(shown_dir))
    resume = train_argv if args.resume else [*train_argv, "--resume"]
    relaunch = relaunch or f"toolkit launch {shlex.quote(str(shown_dir))}"
    return run(command, env=env, output=Path(args.output), resume_command=f"{relaunch} -- {shlex.join(resume)}",
               max_restarts=max_restarts)


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

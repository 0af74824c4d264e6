"""launch.sh (one node), slurm.sbatch and hostfile (many nodes) for an emitted plan directory.

The scripts find the plan directory by themselves (launch.sh: its own location; slurm.sbatch: the directory it
was submitted from, since SLURM runs a copy of the script), so a directory can be moved or copied as a whole.
Everything after the script name goes to toolkit.train: `./launch.sh --data corpus.jsonl --output runs/x`.
"""

from __future__ import annotations

import shlex

from toolkit.emit.accelerate import MAIN_PROCESS_PORT
from toolkit.plan import Plan


def launch_flags(plan: Plan, here: str) -> list[str]:
    """accelerate launch flags (before the module) for a directory `here`, given as shell text."""
    flags = ["--config_file", f'"{here}/accelerate_config.yaml"']
    if plan.engine == "deepspeed":
        # Overrides the YAML's deepspeed_config_file, which accelerate resolves against the working directory.
        flags += ["--deepspeed_config_file", f'"{here}/ds_config.json"']
    return flags


def train_flags(plan: Plan, here: str) -> list[str]:
    return ["-m", "toolkit.train", "--plan", f'"{here}/plan.json"', "--model", shlex.quote(plan.model)]


def summary_line(plan: Plan) -> str:
    return (f"{plan.strategy} on {plan.num_machines} x {plan.gpus_per_node} {plan.gpu}, {plan.model}, "
            f"{batch_arithmetic(plan)}")


def batch_arithmetic(plan: Plan) -> str:
    """The batch identity in words, e.g. "micro 4 x accum 8 x dp 16 = 512 sequences of 4096 tokens"."""
    stages = (f"; {plan.pipeline_stages} pipeline stages x dp {plan.data_parallel} = {plan.world_size} GPUs"
              if plan.pipeline_stages > 1 else "")
    return (f"micro {plan.micro_batch} x accum {plan.grad_accum} x dp {plan.data_parallel} = "
            f"{plan.global_batch} sequences of {plan.seq_len} tokens per step{stages}")


def launch_sh(plan: Plan) -> str:
    here = "$HERE"
    command = ["accelerate launch", *launch_flags(plan, here), *train_flags(plan, here), '"$@"']
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# {summary_line(plan)}",
        "# usage: ./launch.sh --data DATA --output OUT [more toolkit.train flags]",
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        "exec " + " \\\n  ".join(_pairs(command)),
        "",
    ])


def slurm_sbatch(plan: Plan) -> str:
    here = "$HERE"
    args = [*launch_flags(plan, here), "--num_machines", str(plan.num_machines),
            "--num_processes", str(plan.world_size), "--main_process_ip", '"$MAIN_HOST"',
            "--main_process_port", str(MAIN_PROCESS_PORT), *train_flags(plan, here), '"$@"']
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# {summary_line(plan)}",
        "# usage (from this directory): sbatch slurm.sbatch --data DATA --output OUT [more toolkit.train flags]",
        f"#SBATCH --job-name=toolkit-{plan.strategy}",
        f"#SBATCH --nodes={plan.num_machines}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={plan.gpus_per_node}",
        "#SBATCH --exclusive",
        "set -euo pipefail",
        'HERE="${TOOLKIT_PLAN_DIR:-$SLURM_SUBMIT_DIR}"',
        'MAIN_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "ARGS=(" + " \\\n  ".join(_pairs(args)) + ")",
        "# one `accelerate launch` per node, each with its own rank; it starts the node's GPU processes",
        "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "  bash -c 'exec accelerate launch --machine_rank \"$SLURM_NODEID\" \"$@\"' accelerate-launch \"${ARGS[@]}\"",
        "",
    ])


def hostfile(plan: Plan, hosts: list[str]) -> str:
    """DeepSpeed's `host slots=N` lines (the pdsh route: run once on the first host, needs passwordless ssh)."""
    return "".join(f"{host} slots={plan.gpus_per_node}\n" for host in hosts)


def default_hosts(plan: Plan) -> list[str]:
    return [f"node{i}" for i in range(plan.num_machines)]


def _pairs(words: list[str]) -> list[str]:
    """Keep a flag and its value on one line."""
    lines: list[str] = []
    for word in words:
        if lines and lines[-1].startswith("-") and " " not in lines[-1] and not word.startswith("-"):
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines

"""The launch scripts: per plan (launch.sh, slurm.sbatch, deepspeed.sh, hostfile) and the top-level launch/ ones.

Three templates, each rendered twice: into a plan folder (the plan directory is the script's own folder; the model
and the SLURM geometry are written in) and into the repository's launch/ folder (the plan directory is the first
argument; everything else is read from the plan's files at run time). `python -m toolkit.emit.scripts DIR` writes
the generic ones (tests/test_launch_scripts.py checks launch/ is up to date).

  one node      accelerate launch --config_file PLAN/accelerate_config.yaml ...
  SLURM         one task per node (srun), each running `accelerate launch --machine_rank $SLURM_NODEID` with the
                rendezvous host taken from the allocation (first host of $SLURM_JOB_NODELIST)
  DeepSpeed     DeepSpeed's launcher over ssh/pdsh with a hostfile (`host slots=N` lines), run on the first host

After the plan directory, every script takes either toolkit.train's flags (`--data D --output O ...`) or a user's
script and its arguments (`my_train.py --flag ...`: any first argument ending in .py). TOOLKIT_PLAN_DIR is exported
so that a user's script can read training_args.json.

Safety: the only plan values in a script are the model (MODEL=, shell-quoted) and numbers; comments carry names that
toolkit.emit.safety has checked for control characters, so a value can neither end a comment nor an #SBATCH line.
#SBATCH lines come right after the shebang and header comments (sbatch stops reading them at the first command).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from toolkit.emit.accelerate import MAIN_PROCESS_PORT
from toolkit.plan.schema import Plan
from toolkit.plan.files import DEEPSPEED_SH, SLURM_SBATCH

PLAN_DIR_FROM_ARG = ('if [[ $# -lt 1 || ! -f "$1/plan.json" ]]; then\n'
                     '  echo "usage: $0 PLAN_DIR [--data D --output O | your_script.py ARGS]" >&2; exit 2\n'
                     'fi\n'
                     'HERE="$(cd "$1" && pwd)"; shift')
"""Generic scripts: the plan directory is the first argument."""

PROGRAM = """if [[ "${1:-}" == *.py ]]; then
  PROGRAM=("$@")  # your own training script and its arguments
else
  PROGRAM=(%(module_flag)s toolkit.train --plan "$HERE/plan.json")
  if [[ -n "$MODEL" ]]; then PROGRAM+=(--model "$MODEL"); fi
  PROGRAM+=("$@")
fi
export TOOLKIT_PLAN_DIR="$HERE"  # your script finds training_args.json there"""


PORT_LINE = (f'PORT="${{MASTER_PORT:-{MAIN_PROCESS_PORT}}}"  '
             '# rendezvous port on the first host (MASTER_PORT=N: another)')
"""Multi-node scripts: the rendezvous port, overridable by the environment (two jobs on one host, a port taken)."""


def summary_line(plan: Plan) -> str:
    return (f"{plan.strategy} on {plan.num_machines} x {plan.gpus_per_node} {plan.gpu}, {plan.model}, "
            f"{batch_arithmetic(plan)}")


def batch_arithmetic(plan: Plan) -> str:
    """The batch identity in words, e.g. "micro 4 x accum 8 x dp 16 = 512 sequences of 4096 tokens"."""
    stages = (f"; {plan.pipeline_stages} pipeline stages x dp {plan.data_parallel} = {plan.world_size} GPUs"
              if plan.pipeline_stages > 1 else "")
    return (f"micro {plan.micro_batch} x accum {plan.grad_accum} x dp {plan.data_parallel} = "
            f"{plan.global_batch} sequences of {plan.seq_len} tokens per step{stages}")


def _model_line(model: str | None) -> str:
    if model is None:
        return 'MODEL=""  # toolkit.train loads the plan\'s model (a catalog name as its hub id); --model overrides'
    return f"MODEL={shlex.quote(model)}"


ALLOCATOR = [
    "# The allocator setting the plan's memory was predicted with (plan.json allocator_conf, toolkit.inputs.allocconf);",
    "# your own PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF in the environment wins.",
    'ALLOC_CONF="$(sed -n \'s/^  "allocator_conf": *"\\([^"]*\\)".*/\\1/p\' "$HERE/plan.json")"',
    'if [[ -n "$ALLOC_CONF" && -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]]; then',
    '  export PYTORCH_CUDA_ALLOC_CONF="$ALLOC_CONF"',
    'fi']
"""Lines of every launch script that export the plan's allocator setting unless the user set one."""


def _script(header: list[str], sbatch: list[str], here: str, model: str | None, program: str, run: list[str]) -> str:
    return "\n".join(["#!/usr/bin/env bash", *[f"# {line}" for line in header], *sbatch,
                      "set -euo pipefail", here, _model_line(model), program, *ALLOCATOR, *run, ""])


# --- one node -------------------------------------------------------------------------------------------------------

ONE_NODE_HEADER = [
    "When: every GPU of the plan is in this one machine.",
    "Runs `accelerate launch --config_file PLAN/accelerate_config.yaml` with toolkit.train or your script.",
]


def one_node(*, here: str, model: str | None, header: list[str]) -> str:
    run = ['exec accelerate launch --config_file "$HERE/accelerate_config.yaml" "${PROGRAM[@]}"']
    return _script(header, [], here, model, PROGRAM % {"module_flag": "-m"}, run)


def launch_sh(plan: Plan, model: str) -> str:
    return one_node(here='HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"', model=model, header=[
        summary_line(plan), *ONE_NODE_HEADER,
        "usage: ./launch.sh --data DATA --output OUT [toolkit.train flags]  |  ./launch.sh my_train.py [ARGS]"])


# --- SLURM ----------------------------------------------------------------------------------------------------------

SLURM_HEADER = [
    "When: a SLURM cluster; one task per node, each starts that node's GPU processes.",
    "Rendezvous: the first host of $SLURM_JOB_NODELIST, each node's rank is $SLURM_NODEID.",
]


def allocation_check(need: list[str]) -> list[str]:
    """Shell lines that refuse, with one line and exit 2 before srun starts anything, a SLURM allocation smaller
    than the plan (NEED_NODES x NEED_GPUS, set by `need`). Counts SLURM leaves unset, or writes in a form other
    than a number (after a `type:` prefix), are not compared."""
    return [*need,
            'HAVE_NODES="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-$NEED_NODES}}"',
            'HAVE_GPUS="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-$NEED_GPUS}}"; HAVE_GPUS="${HAVE_GPUS##*:}"',
            'if [[ "$HAVE_NODES$HAVE_GPUS" =~ ^[0-9]+$ ]] \\',
            '    && (( HAVE_NODES < NEED_NODES || HAVE_GPUS < NEED_GPUS )); then',
            '  echo "error: the SLURM allocation has $HAVE_NODES node(s) x $HAVE_GPUS GPU(s) but the plan needs '
            '$NEED_NODES x $NEED_GPUS; submit with --nodes=$NEED_NODES --gpus-per-node=$NEED_GPUS" >&2',
            '  exit 2',
            'fi']


PLAN_NEED = ['NEED_NODES="$(sed -n \'s/^num_machines: *\\([0-9]*\\) *$/\\1/p\' "$HERE/accelerate_config.yaml")"',
             'NEED_PROCESSES="$(sed -n \'s/^num_processes: *\\([0-9]*\\) *$/\\1/p\' "$HERE/accelerate_config.yaml")"',
             'NEED_NODES="${NEED_NODES:-1}"; NEED_GPUS=$(( ${NEED_PROCESSES:-1} / NEED_NODES ))']
"""Generic slurm.sbatch: the plan's geometry from its accelerate_config.yaml (num_machines, num_processes)."""


def slurm(*, here: str, model: str | None, header: list[str], sbatch: list[str], need: list[str]) -> str:
    # sed reads all of scontrol's output: `head -n 1` may exit first, and under pipefail scontrol's SIGPIPE (141)
    # would stop the script.
    run = [*allocation_check(need),
           'MAIN_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"',
           PORT_LINE,
           "srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
           "  bash -c 'exec accelerate launch --machine_rank \"$SLURM_NODEID\" \"$@\"' accelerate-launch \\",
           '  --config_file "$HERE/accelerate_config.yaml" --main_process_ip "$MAIN_HOST" '
           '--main_process_port "$PORT" \\',
           '  "${PROGRAM[@]}"']
    return _script(header, sbatch, here, model, PROGRAM % {"module_flag": "-m"}, run)


def slurm_sbatch(plan: Plan, model: str) -> str:
    sbatch = [f"#SBATCH --job-name=toolkit-{plan.strategy}",
              f"#SBATCH --nodes={plan.num_machines}",
              "#SBATCH --ntasks-per-node=1",
              f"#SBATCH --gpus-per-node={plan.gpus_per_node}",
              "#SBATCH --exclusive"]
    # SLURM runs a copy of the script: the plan directory is where it was submitted from.
    return slurm(here='HERE="${TOOLKIT_PLAN_DIR:-$SLURM_SUBMIT_DIR}"', model=model, sbatch=sbatch,
                 need=[f"NEED_NODES={plan.num_machines} NEED_GPUS={plan.gpus_per_node}"], header=[
        summary_line(plan), *SLURM_HEADER,
        "usage (from this directory): sbatch slurm.sbatch --data DATA --output OUT | sbatch slurm.sbatch my_train.py"])


# --- DeepSpeed launcher + hostfile ------------------------------------------------------------------------------------

DEEPSPEED_HEADER = [
    "When: several machines without SLURM, reachable by passwordless ssh (DeepSpeed's pdsh launcher).",
    "Run it on the first host of the hostfile (`host slots=GPUS` lines). Your Trainer script gets",
    "--deepspeed PLAN/ds_config.json from you; a deepspeed.initialize script reads ds_config.deepspeed.json.",
]


PDSH_SAFE = [
    "# DeepSpeed's pdsh route joins the command into one line for each host's shell, double-quoting only words with",
    "# spaces, and runs it after an unquoted `cd $PWD` (deepspeed/launcher/multinode_runner.py): a word that shell",
    "# would change is refused here, before anything starts.",
    'for WORD in "$HERE" "${PROGRAM[@]}" "$PWD/"; do',
    '  if [[ "$WORD" == *[!A-Za-z0-9_@+=:,./\\ -]* || ( "$WORD" == "$PWD/" && "$WORD" == *\\ * ) ]]; then',
    '    echo "error: DeepSpeed\'s multi-node launcher hands ${WORD@Q} to each host\'s shell, which would change it; '
    'use names, paths and values without shell characters (or spaces, for the current folder), or slurm.sbatch" >&2',
    '    exit 2',
    '  fi',
    'done']
"""Lines of deepspeed.sh that refuse what DeepSpeed's pdsh runner would hand to a remote shell unquoted."""

PDSH_ENV = [
    "# The nodes' shells get only MLFLOW* PYTHON* MV2* UCX* variables and the lines of .deepspeed_env (in the home",
    "# folder and here; DS_ENV_FILE renames it) from DeepSpeed (runner.py): TOOLKIT_PLAN_DIR joins a copy of them.",
    'ENV_NAME="${DS_ENV_FILE:-.deepspeed_env}"',
    'DS_ENV_FILE="$(mktemp)"; export DS_ENV_FILE; trap \'rm -f "$DS_ENV_FILE"\' EXIT',
    'for FOLDER in "$HOME" .; do',
    '  if [[ "$ENV_NAME" == /* ]]; then FILE="$ENV_NAME"; else FILE="$FOLDER/$ENV_NAME"; fi',
    '  if [[ -f "$FILE" ]]; then sed -e \'$a\\\' "$FILE" >> "$DS_ENV_FILE"; fi',
    'done',
    'echo "TOOLKIT_PLAN_DIR=$HERE" >> "$DS_ENV_FILE"',
    'for NAME in PYTORCH_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF; do',
    '  if [[ -n "${!NAME:-}" ]]; then echo "$NAME=${!NAME}" >> "$DS_ENV_FILE"; fi',
    'done']
"""Lines of deepspeed.sh that hand TOOLKIT_PLAN_DIR, the allocator setting (PYTORCH_*ALLOC_CONF is not among the
prefixes DeepSpeed forwards) and the user's .deepspeed_env lines to every node."""


def deepspeed(*, here: str, hostfile: str, model: str | None, header: list[str]) -> str:
    run = [hostfile, PORT_LINE, *PDSH_SAFE, *PDSH_ENV,
           'deepspeed --hostfile "$HOSTFILE" --master_port "$PORT" --no_local_rank "${PROGRAM[@]}"']
    return _script(header, [], here, model, PROGRAM % {"module_flag": "--module"}, run)


def deepspeed_sh(plan: Plan, model: str) -> str:
    return deepspeed(here='HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
                     hostfile='HOSTFILE="${HOSTFILE:-$HERE/hostfile}"', model=model, header=[
                         summary_line(plan), *DEEPSPEED_HEADER,
                         "usage: ./deepspeed.sh --data DATA --output OUT  |  ./deepspeed.sh my_train.py [ARGS]"])


def hostfile(plan: Plan, hosts: list[str]) -> str:
    """DeepSpeed's `host slots=N` lines (the pdsh route: run once on the first host, needs passwordless ssh)."""
    return "".join(f"{host} slots={plan.gpus_per_node}\n" for host in hosts)


def default_hosts(plan: Plan) -> list[str]:
    return [f"node{i}" for i in range(plan.num_machines)]


# --- the repository's launch/ folder ----------------------------------------------------------------------------------

def generic_scripts() -> dict[str, str]:
    """launch/NAME -> text: the same templates with the plan directory as the first argument."""
    return {
        "one_node.sh": one_node(here=PLAN_DIR_FROM_ARG, model=None, header=[
            *ONE_NODE_HEADER, "usage: launch/one_node.sh PLAN_DIR --data D --output O  |  ... PLAN_DIR my_train.py"]),
        SLURM_SBATCH: slurm(here=PLAN_DIR_FROM_ARG, model=None, need=PLAN_NEED, sbatch=[
            "#SBATCH --job-name=toolkit", "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive"], header=[
            *SLURM_HEADER, "usage: sbatch --nodes=N --gpus-per-node=G launch/slurm.sbatch PLAN_DIR [ARGS]",
            "(N and G as in PLAN_DIR/PLAN.md; a plan folder's own slurm.sbatch has them written in)"]),
        DEEPSPEED_SH: deepspeed(here=PLAN_DIR_FROM_ARG, hostfile='HOSTFILE="${HOSTFILE:-$HERE/hostfile}"',
                                  model=None, header=[
                                      *DEEPSPEED_HEADER,
                                      "usage: [HOSTFILE=FILE] launch/deepspeed.sh PLAN_DIR [ARGS]"]),
    }


def write_generic(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generic_scripts().items():
        path = out / name
        path.write_text(text)
        path.chmod(0o755)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_generic(sys.argv[1] if len(sys.argv) > 1 else "launch"):
        print(path)

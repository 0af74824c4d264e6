#!/usr/bin/env bash
# hybrid on 2 x 8 H100-80GB, meta-llama/Llama-2-7b-hf, micro 2 x accum 8 x dp 8 = 128 sequences of 4096 tokens per step; 2 pipeline stages x dp 8 = 16 GPUs
# When: several machines without SLURM, reachable by passwordless ssh (DeepSpeed's pdsh launcher).
# Run it on the first host of the hostfile (`host slots=GPUS` lines). Your Trainer script gets
# --deepspeed PLAN/ds_config.json from you; a deepspeed.initialize script reads ds_config.deepspeed.json.
# usage: ./deepspeed.sh --data DATA --output OUT  |  ./deepspeed.sh my_train.py [ARGS]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL=meta-llama/Llama-2-7b-hf
if [[ "${1:-}" == *.py ]]; then
  PROGRAM=("$@")  # your own training script and its arguments
else
  PROGRAM=(--module toolkit.train --plan "$HERE/plan.json")
  if [[ -n "$MODEL" ]]; then PROGRAM+=(--model "$MODEL"); fi
  PROGRAM+=("$@")
fi
export TOOLKIT_PLAN_DIR="$HERE"  # your script finds training_args.json there
# The allocator setting the plan's memory was predicted with (plan.json allocator_conf, toolkit.inputs.allocconf);
# your own PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF in the environment wins.
ALLOC_CONF="$(sed -n 's/^  "allocator_conf": *"\([^"]*\)".*/\1/p' "$HERE/plan.json")"
if [[ -n "$ALLOC_CONF" && -z "${PYTORCH_ALLOC_CONF:-}${PYTORCH_CUDA_ALLOC_CONF:-}" ]]; then
  export PYTORCH_CUDA_ALLOC_CONF="$ALLOC_CONF"
fi
HOSTFILE="${HOSTFILE:-$HERE/hostfile}"
PORT="${MASTER_PORT:-29500}"  # rendezvous port on the first host (MASTER_PORT=N: another)
# DeepSpeed's pdsh route joins the command into one line for each host's shell, double-quoting only words with
# spaces, and runs it after an unquoted `cd $PWD` (deepspeed/launcher/multinode_runner.py): a word that shell
# would change is refused here, before anything starts.
for WORD in "$HERE" "${PROGRAM[@]}" "$PWD/"; do
  if [[ "$WORD" == *[!A-Za-z0-9_@+=:,./\ -]* || ( "$WORD" == "$PWD/" && "$WORD" == *\ * ) ]]; then
    echo "error: DeepSpeed's multi-node launcher hands ${WORD@Q} to each host's shell, which would change it; use names, paths and values without shell characters (or spaces, for the current folder), or slurm.sbatch" >&2
    exit 2
  fi
done
# The nodes' shells get only MLFLOW* PYTHON* MV2* UCX* variables and the lines of .deepspeed_env (in the home
# folder and here; DS_ENV_FILE renames it) from DeepSpeed (runner.py): TOOLKIT_PLAN_DIR joins a copy of them.
ENV_NAME="${DS_ENV_FILE:-.deepspeed_env}"
DS_ENV_FILE="$(mktemp)"; export DS_ENV_FILE; trap 'rm -f "$DS_ENV_FILE"' EXIT
for FOLDER in "$HOME" .; do
  if [[ "$ENV_NAME" == /* ]]; then FILE="$ENV_NAME"; else FILE="$FOLDER/$ENV_NAME"; fi
  if [[ -f "$FILE" ]]; then sed -e '$a\' "$FILE" >> "$DS_ENV_FILE"; fi
done
echo "TOOLKIT_PLAN_DIR=$HERE" >> "$DS_ENV_FILE"
for NAME in PYTORCH_ALLOC_CONF PYTORCH_CUDA_ALLOC_CONF; do
  if [[ -n "${!NAME:-}" ]]; then echo "$NAME=${!NAME}" >> "$DS_ENV_FILE"; fi
done
deepspeed --hostfile "$HOSTFILE" --master_port "$PORT" --no_local_rank "${PROGRAM[@]}"

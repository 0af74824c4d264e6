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
HOSTFILE="${HOSTFILE:-$HERE/hostfile}"
PORT="${MASTER_PORT:-29500}"  # rendezvous port on the first host (MASTER_PORT=N: another)
exec deepspeed --hostfile "$HOSTFILE" --master_port "$PORT" --no_local_rank "${PROGRAM[@]}"

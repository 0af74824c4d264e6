#!/usr/bin/env bash
# When: several machines without SLURM, reachable by passwordless ssh (DeepSpeed's pdsh launcher).
# Run it on the first host of the hostfile (`host slots=GPUS` lines). Your Trainer script gets
# --deepspeed PLAN/ds_config.json from you; a deepspeed.initialize script reads ds_config.deepspeed.json.
# usage: [HOSTFILE=FILE] launch/deepspeed.sh PLAN_DIR [ARGS]
set -euo pipefail
if [[ $# -lt 1 || ! -f "$1/plan.json" ]]; then
  echo "usage: $0 PLAN_DIR [--data D --output O | your_script.py ARGS]" >&2; exit 2
fi
HERE="$(cd "$1" && pwd)"; shift
MODEL=""  # toolkit.train loads the plan's model (a catalog name as its hub id); --model overrides
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

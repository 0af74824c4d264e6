#!/usr/bin/env bash
# zero3-offload on 1 x 8 H100-80GB, example/llama-small, micro 1 x accum 4 x dp 8 = 32 sequences of 4096 tokens per step
# When: every GPU of the plan is in this one machine.
# Runs `accelerate launch --config_file PLAN/accelerate_config.yaml` with toolkit.train or your script.
# usage: ./launch.sh --data DATA --output OUT [toolkit.train flags]  |  ./launch.sh my_train.py [ARGS]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL=example/llama-small
if [[ "${1:-}" == *.py ]]; then
  PROGRAM=("$@")  # your own training script and its arguments
else
  PROGRAM=(-m toolkit.train --plan "$HERE/plan.json")
  if [[ -n "$MODEL" ]]; then PROGRAM+=(--model "$MODEL"); fi
  PROGRAM+=("$@")
fi
export TOOLKIT_PLAN_DIR="$HERE"  # your script finds training_args.json there
exec accelerate launch --config_file "$HERE/accelerate_config.yaml" "${PROGRAM[@]}"

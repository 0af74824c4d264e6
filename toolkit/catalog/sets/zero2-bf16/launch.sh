#!/usr/bin/env bash
# zero2 on 1 x 8 H100-80GB, meta-llama/Llama-2-7b-hf, micro 2 x accum 8 x dp 8 = 128 sequences of 4096 tokens per step
# When: every GPU of the plan is in this one machine.
# Runs `accelerate launch --config_file PLAN/accelerate_config.yaml` with toolkit.train or your script.
# usage: ./launch.sh --data DATA --output OUT [toolkit.train flags]  |  ./launch.sh my_train.py [ARGS]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
MODEL=meta-llama/Llama-2-7b-hf
if [[ "${1:-}" == *.py ]]; then
  PROGRAM=("$@")  # your own training script and its arguments
else
  PROGRAM=(-m toolkit.train --plan "$HERE/plan.json")
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
exec accelerate launch --config_file "$HERE/accelerate_config.yaml" "${PROGRAM[@]}"

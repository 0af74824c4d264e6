#!/usr/bin/env bash
# When: every GPU of the plan is in this one machine.
# Runs `accelerate launch --config_file PLAN/accelerate_config.yaml` with toolkit.train or your script.
# usage: launch/one_node.sh PLAN_DIR --data D --output O  |  ... PLAN_DIR my_train.py
set -euo pipefail
if [[ $# -lt 1 || ! -f "$1/plan.json" ]]; then
  echo "usage: $0 PLAN_DIR [--data D --output O | your_script.py ARGS]" >&2; exit 2
fi
HERE="$(cd "$1" && pwd)"; shift
MODEL=""  # toolkit.train loads the plan's model (a catalog name as its hub id); --model overrides
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

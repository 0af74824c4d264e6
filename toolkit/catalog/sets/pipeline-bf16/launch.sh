#!/usr/bin/env bash
# pipeline on 1 x 8 H100-80GB, meta-llama/Llama-2-7b-hf, micro 2 x accum 64 x dp 1 = 128 sequences of 4096 tokens per step; 8 pipeline stages x dp 1 = 8 GPUs
# usage: ./launch.sh --data DATA --output OUT [more toolkit.train flags]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec accelerate launch \
  --config_file "$HERE/accelerate_config.yaml" \
  -m toolkit.train \
  --plan "$HERE/plan.json" \
  --model meta-llama/Llama-2-7b-hf \
  "$@"

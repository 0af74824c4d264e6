#!/usr/bin/env bash
# zero1 on 1 x 8 H100-80GB, meta-llama/Llama-2-7b-hf, micro 2 x accum 8 x dp 8 = 128 sequences of 4096 tokens per step
# usage: ./launch.sh --data DATA --output OUT [more toolkit.train flags]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec accelerate launch \
  --config_file "$HERE/accelerate_config.yaml" \
  --deepspeed_config_file "$HERE/ds_config.json" \
  -m toolkit.train \
  --plan "$HERE/plan.json" \
  --model meta-llama/Llama-2-7b-hf \
  "$@"

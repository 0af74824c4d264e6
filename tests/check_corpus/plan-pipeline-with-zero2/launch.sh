#!/usr/bin/env bash
# pipeline on 1 x 4 H100-80GB, example/llama-small, micro 1 x accum 8 x dp 1 = 8 sequences of 4096 tokens per step (x 4 pipeline stages)
# usage: ./launch.sh --data DATA --output OUT [more toolkit.train flags]
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec accelerate launch \
  --config_file "$HERE/accelerate_config.yaml" \
  -m toolkit.train \
  --plan "$HERE/plan.json" \
  --model example/llama-small \
  "$@"

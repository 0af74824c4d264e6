#!/usr/bin/env bash
# Seed pattern 4, gradient accumulation with mixed precision, and checkpoints: micro-batch 2 x accumulation 2
# per rank in bf16 (the seed's GradScaler is only needed for fp16; bf16 needs none), activation
# checkpointing of every layer, checkpoints every 4 steps, then a resumed run that continues from the last
# complete checkpoint.
source "$(dirname "$0")/common.sh"
toolkit plan "$WORK/model" --gpus 2xA100-80GB --seq 64 --precision bf16 --micro-batch 2 --accumulation 2 \
  --checkpointing on --choose zero2 --force --out "$WORK/accum/plan"
args=(--model "$WORK/model" --data "$WORK/data" --output "$WORK/accum/out" --save-steps 4 --logging-steps 2 --lr 3e-3)
toolkit launch "$WORK/accum/plan" -- "${args[@]}" --max-steps 4
toolkit launch "$WORK/accum/plan" -- "${args[@]}" --max-steps 8 --resume
echo "accumulation: trained 4 steps, resumed from checkpoint-4 to step 8; model saved in $WORK/accum/out"

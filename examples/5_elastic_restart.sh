#!/usr/bin/env bash
# Fault tolerance, the seed note's last pattern: periodic checkpoints and elastic restarts. Checkpoints every 2
# steps (each marked complete only after every rank wrote its part; the newest 3 complete ones are kept), and
# `toolkit launch --max-restarts 2`: when a worker dies, torchrun's elastic agent (through accelerate launch)
# restarts the workers, and toolkit.train resumes them from the last complete checkpoint, so the run ends with
# the losses of a run nothing interrupted. To show it, this script kills one worker (SIGKILL, as an OOM killer or
# a lost GPU would) once the first checkpoint is complete. A worker that keeps dying, or a node that never comes
# back, ends the run with one line naming the checkpoint to resume from.
source "$(dirname "$0")/common.sh"
toolkit plan "$WORK/model" --gpus 2xA100-80GB --seq 64 --precision fp32 --global-batch 8 \
  --choose ddp --force --out "$WORK/elastic/plan"
out="$WORK/elastic/out"
toolkit launch "$WORK/elastic/plan" --max-restarts 2 -- --model "$WORK/model" --data "$WORK/data" \
  --output "$out" --max-steps 12 --save-steps 2 --logging-steps 2 --lr 3e-3 &
launcher=$!
until [ -f "$out/checkpoint-2/toolkit_checkpoint_complete" ]; do sleep 0.2; done
# One training rank of this launcher (its descendants running toolkit.train), killed without warning.
victim=$("$PY" -c "
import sys
from pathlib import Path
from toolkit.processes import descendants
ranks = [p for p in descendants($launcher) if b'toolkit.train' in Path(f'/proc/{p}/cmdline').read_bytes()
         and b'accelerate' not in Path(f'/proc/{p}/cmdline').read_bytes().split(b'\0')[1]]
print(ranks[-1])")
kill -9 "$victim"
echo "killed worker $victim after checkpoint-2; torchrun restarts the workers, which resume"
wait "$launcher"
grep "toolkit.train: restart" "$out/toolkit-launch.log" | head -1
echo "elastic: worker killed, restarted, resumed; trained to step 12; model saved in $out"

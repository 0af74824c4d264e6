#!/usr/bin/env bash
# The GPU day as device calls, each stage under its own time limit, every result written as it is measured.
# On the GPU machine, from the repository root, with the wheels of benchmarks/gpu_wheels.sh in .whl/ (carried):
#   bash benchmarks/gpu_day.sh first     # engines' versions, memory cases, allocator sequences
#   bash benchmarks/gpu_day.sh second    # the tune probe, the step-time set (--timing), the memory edge if time is left
# Results land in $OUT: gpu_check.json, gpu_allocator.json, gpu_tune.json, gpu-calibration.json, gpu_timing.json,
# gpu_memory_edge.json and gpu_day.log (every stage's output). The machine's own image holds torch, accelerate and
# transformers of its own versions; the wheels put this repository's versions of the engines first on the path
# (torch stays the image's: its version is in every result's meta).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_day.log"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD

stage() {  # stage NAME SECONDS COMMAND...: runs it under a hard limit, its output into the log and on the screen
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit} s) start $(date -u +%T)"
  timeout -k 5 "$limit" "$@"
  echo "=== $name exit $? end $(date -u +%T)"
}

case "${1:-first}" in
first)
  {
    stage env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "
import importlib.metadata as m, torch, sys
print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())
for n in (\"transformers\", \"accelerate\", \"deepspeed\", \"peft\", \"trl\", \"datasets\", \"pydantic\", \"liger-kernel\"):
    print(n, m.version(n))
import toolkit.cli, deepspeed, liger_kernel.transformers
print(\"imports ok\")"'
    # DeepSpeed's CPU Adam (the tune probe's offload candidate) compiles once per machine: built beside the
    # memory cases, at low priority, so the probe finds it in the cache.
    (nice -n 19 python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
      >/tmp/cpu_adam_build.log 2>&1 &)
    # Each case in a process of its own (~10 s of start-up each): 16 cases, about 4 minutes on the H200.
    stage memory 330 python3 benchmarks/gpu_check.py --device cuda --out "$OUT"
    stage allocator 60 python3 benchmarks/gpu_check.py --device cuda --allocator --out "$OUT"
    echo "--- cpu_adam build:"; tail -3 /tmp/cpu_adam_build.log
  } 2>&1 | tee -a "$LOG"
  ;;
second)
  {
    stage tune 220 python3 benchmarks/gpu_check.py --device cuda --tune --out "$OUT"
    stage timing 300 python3 benchmarks/gpu_check.py --device cuda --timing --out "$OUT"
    if [ "${EDGE_S:-0}" -gt 0 ]; then  # EDGE_S: the seconds the lease still has for it
      stage memory-edge "$EDGE_S" python3 benchmarks/gpu_check.py --device cuda --memory-edge --out "$OUT"
    fi
  } 2>&1 | tee -a "$LOG"
  ;;
*)
  echo "usage: bash benchmarks/gpu_day.sh first|second" >&2
  exit 2
  ;;
esac

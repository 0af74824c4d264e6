# Shared set-up for the examples: a tiny Llama-architecture model with a tokenizer trained here, and a corpus
# that needs no download (the Python standard library's documentation). Sourced, not run.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-$HERE/../.venv/bin/python}"
WORK="${WORK:-$(mktemp -d)}"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ ! -f "$WORK/model/config.json" ]; then
  "$PY" -c "
from toolkit.run.tiny import make_tiny_model, write_corpus
make_tiny_model('llama', '$WORK/model', layers=4, hidden=64, heads=4, kv_heads=2, ffn=128)
write_corpus('$WORK/data', max_chars=200_000)"
fi
toolkit() { "$PY" -m toolkit "$@"; }
# Plan the tiny model as if on GPUS GPUs with STRATEGY, then launch the emitted plan (on CPU processes here).
plan_and_train() {
  local name="$1" gpus="$2" strategy="$3"; shift 3
  toolkit plan "$WORK/model" --gpus "$gpus" --seq 64 --precision fp32 --choose "$strategy" --force \
    --out "$WORK/$name/plan" "$@"
  toolkit launch "$WORK/$name/plan" -- --model "$WORK/model" --data "$WORK/data" --output "$WORK/$name/out" \
    --max-steps 8 --save-steps 4 --logging-steps 2 --lr 3e-3
  echo "$name: trained; model saved in $WORK/$name/out"
}

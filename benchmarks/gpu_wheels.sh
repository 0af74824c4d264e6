#!/usr/bin/env bash
# The wheels benchmarks/gpu_day.sh installs on the GPU machine (Python 3.12, no network there): this repository's
# versions of the engines, read from the environment that runs the tests here, into .whl/ (git-ignored; carried).
# DeepSpeed publishes no wheel: one is built from its source here with no op compiled (ops build where they run).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
v() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "transformers==$(v transformers)" "accelerate==$(v accelerate)" "peft==$(v peft)" "trl==$(v trl)" \
  "datasets==$(v datasets)" "dill==$(v dill)" "multiprocess==$(v multiprocess)" "pydantic==$(v pydantic)" \
  "pydantic_core==$(v pydantic_core)" "annotated-types==$(v annotated-types)" \
  "typing-inspection==$(v typing-inspection)" "typing_extensions==$(v typing_extensions)" "hjson==$(v hjson)" \
  liger-kernel
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$(v deepspeed)" -w .whl
du -sh .whl

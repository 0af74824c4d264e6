"""`toolkit tune` on the GPU at hand, for the GPU day (issue 30): the plan's top candidates of three small Llama-style
models (random weights, a locally trained tokenizer: toolkit.run.tiny), each run for a few steps on this machine's
GPU under the launcher and runner a real run uses, predicted against measured, and the calibration they make
together. The models are of different compute sizes, so the calibration fits a fixed per-step cost beside the compute
ratio (toolkit.inputs.calibration.fit_terms), and a file of it read by benchmarks/calibrations.py holds each model's
probe out against the others'.

    python benchmarks/gpu_check.py --device cuda --tune --out "$OUT"        # writes gpu_tune.json and
                                                                           # gpu-calibration.json (add it to
                                                                           # benchmarks/data/calibrations/)
    python benchmarks/gpu_check.py --device cpu --tune --dry --out DIR     # the dry path (tests run it)

Each model is planned for 1 x --gpu (the catalog GPU, H200 by default) with `toolkit plan --out`, then tuned with
`toolkit tune PLAN_DIR` (TUNE_CANDIDATES candidates, 2 warm-up + TUNE_STEPS measured steps each, TUNE_BUDGET_MIN
minutes a model) in this process through toolkit.cli.main, with a cache of its own (TOOLKIT_CACHE_DIR), so the
calibration holds these probes only. Estimated at 3-6 minutes on one H200 (each candidate's launch, load and engine
set-up, ~20-40 s, dominates its 5 steps; an offload candidate may first build DeepSpeed's CPU Adam op, which the
budget bounds); not run on a GPU yet.

On CPU, --dry plans each model and tunes with a budget the planning alone spends (DRY_BUDGET_MIN): every candidate
is recorded as skipped and no training process starts, so the path from the models to gpu_tune.json is exercised
without a launch. Without --dry on CPU the candidates run as `tune --cpu` runs them (2 processes over gloo).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

TUNE_MODELS = {
    "llama-h512-l4": dict(hidden=512, layers=4, heads=8, kv_heads=4, ffn=1536),
    "llama-h1024-l8": dict(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=3072),
    "llama-h2048-l12": dict(hidden=2048, layers=12, heads=16, kv_heads=8, ffn=5632),
}
"""On the GPU: compute terms about 8x and 6x apart (0.01B, 0.1B, 0.6B parameters), each loaded and stepped in
seconds; three sizes, so each held out leaves two for the fit (benchmarks/calibrations.py)."""
QUICK_MODELS = {
    "llama-h64-l2": dict(hidden=64, layers=2),
    "llama-h128-l2": dict(hidden=128, layers=2),
}
"""--quick (and the CPU dry path): the tiny shapes the CPU probes use (benchmarks/calibrations.py PROBES)."""
TUNE_SEQ, QUICK_SEQ = 512, 64
TUNE_GLOBAL_BATCH = 8
TUNE_CANDIDATES, TUNE_STEPS, TUNE_BUDGET_MIN = 2, 3, 2.0
"""On one GPU the planner's rows are DDP and the offload variants (ZeRO without offload shards nothing there): the
top two, 2 warm-up + 3 measured steps each, at most 2 minutes a model (the lease is 15 minutes, all checks together)."""
DRY_BUDGET_MIN = 0.0001
"""A budget the planning of the candidates alone spends: tune skips every candidate, no process starts."""
CALIBRATION_FILE = "gpu-calibration.json"


@contextmanager
def _env(**values: str):
    """os.environ with `values` set, restored after (toolkit tune reads TOOLKIT_CACHE_DIR, its candidates inherit
    it)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def tune_argv(plan_dir: Path, cuda: bool, dry: bool, export: Path) -> list[str]:
    """The `toolkit tune` words for one model's plan folder."""
    argv = ["tune", str(plan_dir), "--candidates", str(TUNE_CANDIDATES), "--steps", str(TUNE_STEPS),
            "--budget-min", str(DRY_BUDGET_MIN if dry else TUNE_BUDGET_MIN), "--export-calibration", str(export)]
    return argv if cuda else [*argv, "--cpu", "--processes", "2"]


def tune_check(device: str, quick: bool, out_dir: str, gpu: str, dry: bool = False,
               models: dict | None = None) -> int:
    """Plan and tune each model (module docstring; `models`: name -> tiny_config sizes, TUNE_MODELS on a GPU,
    QUICK_MODELS with quick or on CPU); every model's rows and the calibration after the last go to
    out_dir/gpu_tune.json, the calibration file to out_dir/CALIBRATION_FILE when one was measured. A failing model
    is recorded and the next one runs."""
    from toolkit.cli import main as toolkit
    from toolkit.run import tiny

    cuda = device.startswith("cuda")
    if cuda and dry:
        raise SystemExit("--dry is the CPU path: drop it on the GPU")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    export = out / CALIBRATION_FILE
    export.unlink(missing_ok=True)
    seq = QUICK_SEQ if quick or not cuda else TUNE_SEQ
    rows = []
    with tempfile.TemporaryDirectory(prefix="tune-check-") as scratch, _env(TOOLKIT_CACHE_DIR=f"{scratch}/cache"):
        work = Path(scratch)
        for name, shape in (models or (QUICK_MODELS if quick or not cuda else TUNE_MODELS)).items():
            row: dict = {"model": name, "shape": shape, "seq": seq, "global_batch": TUNE_GLOBAL_BATCH}
            start = time.perf_counter()
            try:
                model = tiny.make_tiny_model("llama", work / name, corpus_chars=100_000,
                                             max_positions=max(256, 2 * seq), **shape)
                plan_dir = work / f"plan-{name}"
                row["plan_code"] = toolkit(["plan", str(model), "--gpus", f"1x{gpu}", "--seq", str(seq),
                                            "--global-batch", str(TUNE_GLOBAL_BATCH), "--out", str(plan_dir)])
                if row["plan_code"] == 0:
                    row["tune_code"] = toolkit(tune_argv(plan_dir, cuda, dry, export))
                    row.update(_tuned(plan_dir / "tune.json"))
            except Exception as exc:  # one failing model must not cost the other
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            row["wall_s"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _write(out, rows, None, cuda, gpu, dry, quick)  # a lease that ends mid-run keeps the models done
    _write(out, rows, json.loads(export.read_text()) if export.is_file() else None, cuda, gpu, dry, quick)
    return 0


def _write(out: Path, rows: list[dict], calibration: dict | None, cuda: bool, gpu: str, dry: bool,
           quick: bool) -> None:
    meta = {"device": _device_name(cuda), "gpu": gpu, "dry": dry, "quick": quick, "date": time.strftime("%Y-%m-%d")}
    (out / "gpu_tune.json").write_text(json.dumps({"meta": meta, "rows": rows, "calibration": calibration},
                                                  indent=1) + "\n")


def calibration_from_result(result: dict, versions: dict[str, str]):
    """The calibration a GPU run of tune_check exports (CALIBRATION_FILE), made again from its gpu_tune.json
    (`result`): each model's measured candidates folded in the models' order, as each `toolkit tune` folds its probe
    into the stored calibration (toolkit.inputs.calibration.combine); under the measuring machine's device name
    (`result`'s meta) and library `versions` (the day's gpu_check meta: torch of the GPU machine's own image, the
    engines carried), not this machine's. None when no candidate was measured. For the GPU day of 2026-12-04,
    whose probe stored nothing (toolkit.run.tune.priced_boxes: the boxes then carried no prediction)."""
    from dataclasses import replace

    from toolkit.inputs import calibration as cal
    from toolkit.inputs.hardware import find_gpu

    combined = None
    for row in result["rows"]:
        if not row.get("candidates"):
            continue
        count, gpu_name = row["predicted_on"].split("x", 1)
        gpu = find_gpu(gpu_name)
        runs = []
        for c in row["candidates"]:
            predicted = {"step_time_s": c["predicted_step_s"], "compute_s": c["predicted_compute_s"]}
            ratio = cal.compute_ratio(c["measured_step_s"], predicted) if c["status"] == "measured" else None
            if ratio:
                runs.append({"model": row["model"], "candidate": c["name"], "predicted_step_s": c["predicted_step_s"],
                             "predicted_compute_s": c["predicted_compute_s"],
                             "measured_step_s": c["measured_step_s"], "compute_ratio": ratio})
        combined = cal.combine(gpu, int(count), [r["compute_ratio"] for r in runs], combined,
                               today=result["meta"]["date"], measurements=runs)
    if combined is None:
        return None
    keep = {name: versions.get(name) or "none" for name in cal.LIBRARIES}
    return replace(combined, device_model=result["meta"]["device"], versions=keep)


def _tuned(path: Path) -> dict:
    """What one model's tune.json says: each candidate's status, predicted and measured step, ratios."""
    if not path.is_file():
        return {"tune_error": f"no {path.name} written"}
    result = json.loads(path.read_text())
    keep = ("name", "status", "reason", "predicted_step_s", "predicted_compute_s", "measured_step_s", "step_ratio",
            "compute_ratio", "mfu", "startup_s")
    return {"candidates": [{k: c.get(k) for k in keep} for c in result["candidates"]],
            "ranking": result["ranking"], "predicted_on": result["predicted_on"]}


def _device_name(cuda: bool) -> str:
    if not cuda:
        from toolkit.inputs.cpudevice import cpu_model

        return cpu_model()
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":  # python benchmarks/tune_check.py GPU_TUNE_JSON GPU_CHECK_JSON OUT_FILE
    import sys

    from toolkit.inputs import calibration as _cal

    _tune, _check, _out = (Path(a) for a in sys.argv[1:4])
    _meta = json.loads(_check.read_text())["meta"]
    _made = calibration_from_result(json.loads(_tune.read_text()),
                                    {"torch": _meta["torch"], **_meta.get("versions", {})})
    if _made is None:
        raise SystemExit(f"{_tune}: no measured candidate")
    _cal.export(_made, _out)
    print(f"wrote {_out}: {_made.terms_words()} over {_made.runs} runs")

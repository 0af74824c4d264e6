"""A folder of shared calibrations (`toolkit tune --export-calibration FILE`) read as published rows: each run's
predicted step time against its measured one, before calibration and after a calibration it had no part in.

A calibration file keeps, beside its compute ratio, each run behind it (toolkit.inputs.calibration, `measurements`:
the uncalibrated predicted step and compute term, the measured step). For every run the held-out calibration is
the one the OTHER probes of the same device and process count give (every file of that key, this run's own probe
left out: its runs are combined as tune combines them, toolkit.inputs.calibration.fit_terms's ratio and fixed
per-step cost where they span two compute sizes, else their ratios' geometric mean), so no run is scored against a
calibration it helped make. Applied, a calibration multiplies the compute term by its ratio, adds its fixed cost
and leaves the other terms as predicted (toolkit.estimate.efficiency divides the matmul efficiency by the ratio,
toolkit.estimate.timing adds the fixed cost); so the calibrated prediction is predicted step - compute + compute x
ratio + fixed. Each run is also scored after the held-out ratio alone (the calibration before the fixed cost), so
the page says what the fixed cost changed. A run whose key has no other probe has no held-out figure.

    python benchmarks/calibrations.py                 # reads benchmarks/data/calibrations/, writes
                                                      # benchmarks/results/calibrations.{md,json}
    python benchmarks/calibrations.py --probe         # first probes this machine's CPU (PROBES below) into that
                                                      # folder, one calibration file per probe not there yet

The data: CPU probes (`tune --cpu`, 2 processes over gloo on this machine's CPU against the CPU cost model,
toolkit.inputs.cpudevice), and the GPU day of 2026-12-04 (gpu-h200-2026-12-04.json: `toolkit tune` of three small
Llama-style models on one H200, benchmarks/tune_check.py; made again from its gpu_tune.json rows by
`python benchmarks/tune_check.py benchmarks/results/gpu_tune.json benchmarks/results/gpu_check.json FILE`, since that
probe stored nothing). Each machine is scored on its own.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from provenance import measured_line, meta

HERE = Path(__file__).parent
ROOT = HERE.parent
DATA = HERE / "data" / "calibrations"
RESULTS = HERE / "results"

PROBES = {
    "llama-h64-l2": dict(arch="llama", layers=2, hidden=64),
    "llama-h128-l4": dict(arch="llama", layers=4, hidden=128),
    "llama-h256-l4": dict(arch="llama", layers=4, hidden=256),
}
"""--probe: the tiny models (random weights, a locally trained tokenizer: toolkit.run.tiny) each probed once, on 2
CPU processes, seq 64, global batch 8, the plan's top 3 candidates, 2 measured steps each."""


def probe_here(folder: Path) -> None:
    """One `toolkit tune MODEL --cpu` per PROBES entry whose file is not in `folder` yet (delete one to probe it
    again), each with a cache of its own (so each file holds one probe), its calibration exported to
    folder/cpu-NAME.json."""
    from toolkit.run import tiny

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="calibrations-") as scratch:
        for name, shape in PROBES.items():
            out = folder / f"cpu-{name}.json"
            if out.exists():
                continue
            shape = dict(shape)
            model = tiny.make_tiny_model(shape.pop("arch"), Path(scratch) / name, corpus_chars=100_000, **shape)
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                   "TOOLKIT_CACHE_DIR": str(Path(scratch) / f"cache-{name}"),
                   "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                   # DeepSpeed's CPU ops as .ci/setup built them for this venv (tests/conftest.py points there too)
                   "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                          str(Path(sys.prefix) / "torch_extensions"))}
            subprocess.run([sys.executable, "-m", "toolkit", "tune", str(model), "--gpus", "2xA100-80GB", "--seq",
                            "64", "--global-batch", "8", "--cpu", "--processes", "2", "--steps", "2",
                            "--candidates", "3", "--budget-min", "20", "--export-calibration", str(out)],
                           env=env, check=True, cwd=ROOT)


def load(folder: Path) -> list[dict]:
    """Every calibration file of `folder`, read and checked as `estimate --calibration FILE` reads one."""
    from toolkit.inputs import calibration as cal

    return [{"file": path.name, "calibration": cal.read_file(path)} for path in sorted(folder.glob("*.json"))]


def held_out_rows(files: list[dict]) -> list[dict]:
    """One row per run: before (uncalibrated) and after (the held-out calibration) errors (module docstring); also
    after the ratio alone (`ratio_only_*`: the calibration as it was before the fixed per-step cost)."""
    from toolkit.inputs.calibration import fit_terms

    rows = []
    for f in files:
        c = f["calibration"]
        for m in c.measurements:
            others = [o for g in files for o in g["calibration"].measurements
                      if (g["calibration"].device, g["calibration"].count) == (c.device, c.count)
                      and not (g is f and o["probe"] == m["probe"])]
            alone = math.exp(statistics.fmean(math.log(o["compute_ratio"]) for o in others)) if others else None
            ratio, overhead = fit_terms(others) or (alone, 0.0)
            rest = m["predicted_step_s"] - m["predicted_compute_s"]  # the terms a calibration leaves as predicted
            after = rest + m["predicted_compute_s"] * ratio + overhead if ratio else None
            plain = rest + m["predicted_compute_s"] * alone if alone else None
            rows.append({"file": f["file"], "machine": f"{c.count}x{c.device} ({c.device_model})",
                         "probe": m["probe"], "model": m["model"], "candidate": m["candidate"],
                         "measured_step_s": m["measured_step_s"], "predicted_step_s": m["predicted_step_s"],
                         "error_before": m["predicted_step_s"] / m["measured_step_s"] - 1,
                         "held_out_ratio": ratio, "held_out_overhead_s": overhead if ratio else None,
                         "held_out_runs": len(others), "calibrated_step_s": after,
                         "error_after": after / m["measured_step_s"] - 1 if after else None,
                         "ratio_only": alone, "ratio_only_step_s": plain,
                         "error_ratio_only": plain / m["measured_step_s"] - 1 if plain else None})
    return rows


def summary(rows: list[dict]) -> dict:
    scored = [r for r in rows if r["error_after"] is not None]
    if not scored:
        return {"runs": len(rows), "scored": 0}

    def median_abs(key: str) -> float:
        return statistics.median(abs(r[key]) for r in scored)

    return {"runs": len(rows), "scored": len(scored), "median_abs_error_before": median_abs("error_before"),
            "median_abs_error_after": median_abs("error_after"),
            "median_abs_error_ratio_only": median_abs("error_ratio_only"),
            "max_abs_error_before": max(abs(r["error_before"]) for r in scored),
            "max_abs_error_after": max(abs(r["error_after"]) for r in scored),
            "max_abs_error_ratio_only": max(abs(r["error_ratio_only"]) for r in scored),
            "fixed_cost_fitted": sum(1 for r in scored if r["held_out_overhead_s"])}


def page(files: list[dict], rows: list[dict], summ: dict, measured: str) -> str:
    """The results page; `measured`: provenance.measured_line's line."""
    devices = sorted({f["calibration"].device for f in files})
    gpu = [d for d in devices if d != "cpu"]
    lines = ["# Calibrations: predicted against measured step time, before and after a held-out calibration", "",
             measured, "",
             f"{len(files)} calibration file{'s' if len(files) != 1 else ''} in `benchmarks/data/calibrations/` "
             f"({', '.join(devices) or 'none'}), {summ['runs']} measured runs. Each run is scored against the "
             "calibration the other probes of its device and process count make (its own probe held out); the "
             "calibrated prediction moves only the compute term and adds the fixed per-step cost where one was "
             "fitted (benchmarks/calibrations.py's docstring).", ""]
    if not gpu:
        lines += ["**No GPU calibration exists yet**: every file here is a CPU probe (`toolkit tune --cpu`, 2 CPU "
                  "processes over gloo against the CPU cost model of this machine, toolkit.inputs.cpudevice). They "
                  "show the path works and how far the CPU cost model is off on this machine; they say nothing of "
                  "any GPU's step time.", ""]
    for machine in sorted({r["machine"] for r in rows}):  # each device on its own: a CPU ratio says nothing of a GPU
        mine = [r for r in rows if r["machine"] == machine]
        lines += [f"## {machine}", ""] + _scored(mine, [f for f in files if any(r["file"] == f["file"] for r in mine)])
    lines += ["| file | machine | probe | model | candidate | measured s | predicted s | error | held-out ratio "
              "(runs) | fixed ms | calibrated s | error | ratio alone s | error |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        held = f"{r['held_out_ratio']:.3g} ({r['held_out_runs']})" if r["held_out_ratio"] else "none"
        fixed = f"{r['held_out_overhead_s'] * 1e3:.1f}" if r["held_out_ratio"] else "-"
        after = (f"{r['calibrated_step_s']:.4f} | {r['error_after']:+.1%}" if r["calibrated_step_s"] else "- | -")
        alone = (f"{r['ratio_only_step_s']:.4f} | {r['error_ratio_only']:+.1%}" if r["ratio_only_step_s"]
                 else "- | -")
        lines.append(f"| {r['file']} | {r['machine']} | {r['probe']} | {r['model']} | {r['candidate']} | "
                     f"{r['measured_step_s']:.4f} | {r['predicted_step_s']:.4f} | {r['error_before']:+.1%} | {held} "
                     f"| {fixed} | {after} | {alone} |")
    lines += ["", "Error: predicted / measured - 1. The CPU steps were taken on a machine shared with other work, the "
              "GPU steps on a lent machine running nothing else; a calibration carries its machine's state on its "
              "day, which is what it is for."]
    return "\n".join(lines) + "\n"


def _scored(rows: list[dict], files: list[dict]) -> list[str]:
    """The paragraphs of one machine's runs: medians before and after, the verdict, the models' order."""
    summ = summary(rows)
    if not summ["scored"]:
        return ["No run has another probe of its device and count to be held out against: nothing scored.", ""]
    lines = [f"Median |error| over {summ['scored']} scored runs: before {summ['median_abs_error_before']:.1%}; "
             f"after the held-out calibration {summ['median_abs_error_after']:.1%}; after its compute ratio "
             f"alone {summ['median_abs_error_ratio_only']:.1%} (max {summ['max_abs_error_before']:.1%}, "
             f"{summ['max_abs_error_after']:.1%}, {summ['max_abs_error_ratio_only']:.1%}). A fixed per-step "
             f"cost was fitted for {summ['fixed_cost_fitted']} of the {summ['scored']} (the other probes span two "
             "compute sizes); for the rest the calibration is the ratio alone.", ""]
    ratios = ", ".join(f"{f['file']} {f['calibration'].compute_ratio:.3g}" for f in files)
    after, before, alone = (summ[f"median_abs_error_{k}"] for k in ("after", "before", "ratio_only"))
    verdict = (f"The held-out calibration {'reduced' if after < before else 'did not reduce'} the median error "
               f"against the uncalibrated prediction, and the fixed per-step cost "
               f"{'reduced' if after < alone else 'did not reduce'} it against the ratio alone.")
    lines += [f"{verdict} Each file's own compute ratio (over all its probes): {ratios}. "
              "A ratio multiplies the compute term, so alone it carries from one model to another only as far "
              "as their ratios agree; on these small models they differ by size, because a fixed per-step cost "
              "that the compute term does not hold dominates the small model's step. The fixed cost is fitted "
              "beside the ratio (measured = ratio x predicted compute + fixed + predicted rest, least squares of "
              "the relative error, toolkit.inputs.calibration.fit_terms) where the runs span two compute sizes.",
              ""]
    return lines + _size_order(scored_rows=[r for r in rows if r["error_after"] is not None])


def _size_order(scored_rows: list[dict]) -> list[str]:
    """A paragraph when the models' median measured steps do not grow with their predicted step (smallest model
    first): then neither a ratio nor a fixed cost can follow them, and the page says so."""
    by_model: dict[str, list[dict]] = {}
    for r in scored_rows:
        by_model.setdefault(r["model"], []).append(r)
    medians = sorted((statistics.median(r["predicted_step_s"] for r in rs),
                      statistics.median(r["measured_step_s"] for r in rs), model) for model, rs in by_model.items())
    if len(medians) < 2 or all(a[1] <= b[1] for a, b in zip(medians, medians[1:])):
        return []
    said = ", ".join(f"{model} {measured:.3f} s" for _, measured, model in medians)
    return [f"The measured steps do not grow with the model here (median measured step per model, smallest "
            f"predicted first: {said}), so no compute ratio and no fixed cost fits every model: on this machine "
            "the spread between runs of one model (its candidates, measured one after another on a shared CPU) is "
            "as large as the difference between models.", ""] if scored_rows[0]["machine"].split("x", 1)[1].startswith(
                "cpu") else [f"The measured steps do not grow with the model here (median measured step per model, "
                             f"smallest predicted first: {said}): the candidates of one model differ by more than "
                             "the models do (an offload candidate beside DDP), so one ratio and fixed cost cannot "
                             "follow every row.", ""]


def main(argv: list[str]) -> int:
    folder = Path(next((a for a in argv if not a.startswith("--")), DATA))
    if "--probe" in argv:
        probe_here(folder)
    files = load(folder)
    rows = held_out_rows(files)
    summ = summary(rows)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "calibrations.json").write_text(json.dumps(
        {"meta": meta(), "summary": summ,
         "by_machine": {m: summary([r for r in rows if r["machine"] == m]) for m in sorted({r["machine"] for r in rows})},
         "files": [f["file"] for f in files], "rows": rows}, indent=2) + "\n")
    text = page(files, rows, summ, measured_line("calibrations.py"))
    (RESULTS / "calibrations.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Derive the GPU-only constants and the step-time efficiency from a gpu_check.json (benchmarks/gpu_check.py).

    python benchmarks/gpu_derive.py benchmarks/results/gpu_check.json    # writes gpu_derived.{json,md} beside it
    python benchmarks/gpu_derive.py benchmarks/results/gpu_timing.json   # --timing run: gpu_timing_derived.{json,md}

What it derives, per engine where the run has it:
  reserved / allocated   max_memory_reserved over max_memory_allocated of the same step: the caching allocator's
                         share on top of the tensor peak (toolkit.estimate.memory.ALLOCATOR_MARGIN is this minus 1)
  context                device memory in use outside the allocator after the first cuBLAS call
                         (toolkit.estimate.memory.CUDA_CONTEXT_BYTES), for the run's GPU, CUDA and torch versions
  peak error             predicted allocated / measured allocated - 1 (the error band's GPU cases)
  step-time ratio        predicted / measured step time; the measured MFU is the predicted MFU times
                         predicted / measured
From a --timing run (gpu_timing.json):
  efficiency per micro-step   predicted / measured step per tokens-per-micro-step and width: a ratio that drifts
                              with tokens says toolkit.estimate.efficiency's tokens_half is off on this GPU, with width its
                              hidden term, with sequence its attention factor
  engine overhead             each engine's step over DDP's for the same model and batch, minus 1 (world of one)
  pipeline overhead           (pipeline engine - DDP) / M seconds per micro-batch, from the M = 8 pair
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def derive(results: dict) -> dict:
    rows = [r for r in results["rows"] if "allocated_measured" in r]
    out: dict = {"meta": results["meta"], "engines": {}, "cases": []}
    if "context_bytes" in results["meta"]:
        out["context_bytes"] = results["meta"]["context_bytes"]
    by_engine: dict[str, list[dict]] = {}
    for r in rows:
        by_engine.setdefault(r["strategy"], []).append(r)
        case = {"label": r["label"], "strategy": r["strategy"], "checkpointing": r["checkpointing"],
                "reserved_over_allocated": r["reserved_measured"] / r["allocated_measured"]}
        if "allocated_predicted" in r:
            case["peak_error"] = r["allocated_predicted"] / r["allocated_measured"] - 1
            case["reserved_error"] = r["reserved_predicted"] / r["reserved_measured"] - 1
            case["step_ratio"] = r["step_predicted_s"] / r["step_measured_s"]
            case["mfu_measured"] = r["mfu_predicted"] * case["step_ratio"]
        out["cases"].append(case)
    for engine, group in by_engine.items():
        cases = [c for c in out["cases"] if c["strategy"] == engine]
        entry = {"cases": len(group),
                 "reserved_over_allocated_median": statistics.median(c["reserved_over_allocated"] for c in cases)}
        errors = [c["peak_error"] for c in cases if "peak_error" in c]
        if errors:
            entry["peak_error_worst"] = max(errors, key=abs)
            entry["mfu_measured_median"] = statistics.median(c["mfu_measured"] for c in cases if "mfu_measured" in c)
        out["engines"][engine] = entry
    return out


def render(d: dict) -> str:
    m = d["meta"]
    lines = [f"# GPU constants derived from gpu_check ({m.get('device')}, torch {m.get('torch')}, "
             f"CUDA {m.get('cuda', '-')}, {m.get('date')})", ""]
    if "context_bytes" in d:
        lines += [f"CUDA context + cuBLAS workspace outside the allocator: {d['context_bytes'] / 2**30:.2f} GiB", ""]
    lines += ["| engine | cases | reserved / allocated (median) | worst peak error | measured MFU (median) |",
              "|---|---|---|---|---|"]
    for engine, e in d["engines"].items():
        lines.append(f"| {engine} | {e['cases']} | {e['reserved_over_allocated_median']:.3f} | "
                     f"{e.get('peak_error_worst', float('nan')):+.1%} | {e.get('mfu_measured_median', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


def derive_timing(results: dict) -> dict:
    """The step-time model's checks from a --timing run (labels as benchmarks/gpu_check.timing_cases names them)."""
    rows = {r["label"]: r for r in results["rows"] if "step_measured_s" in r}
    out: dict = {"meta": results["meta"], "efficiency": [], "engine_overhead": {}, "pipeline": {}}
    for label, r in rows.items():
        if label.startswith("eff "):
            out["efficiency"].append({"label": label, "tokens_per_micro_step": r["micro_batch"] * r["seq_len"],
                                      "hidden": r.get("hidden"), "seq_len": r["seq_len"],
                                      "step_ratio": r["step_predicted_s"] / r["step_measured_s"]})
    ddp = next((r for label, r in rows.items() if label.startswith("engine ddp ")), None)
    if ddp:
        for label, r in rows.items():
            if label.startswith("engine ") and r is not ddp:
                out["engine_overhead"][r["strategy"]] = r["step_measured_s"] / ddp["step_measured_s"] - 1
    pairs = {}
    for label, r in rows.items():
        if label.startswith("pipe "):
            pairs.setdefault(r.get("accum", 1), {})[r["strategy"]] = r
    for m, pair in sorted(pairs.items()):
        if {"ddp", "pipeline1"} <= set(pair):
            extra = (pair["pipeline1"]["step_measured_s"] - pair["ddp"]["step_measured_s"]) / m
            out["pipeline"][str(m)] = {"per_micro_batch_s": extra,
                                       "per_micro_batch_fraction": extra * m / pair["ddp"]["step_measured_s"]}
    return out


def render_timing(d: dict) -> str:
    m = d["meta"]
    lines = [f"# Step-time checks from gpu_check --timing ({m.get('device')}, torch {m.get('torch')}, {m.get('date')})",
             "", "| case | tokens / micro-step | hidden | predicted / measured |", "|---|---|---|---|"]
    for e in sorted(d["efficiency"], key=lambda e: (e["hidden"] or 0, e["tokens_per_micro_step"])):
        lines.append(f"| {e['label']} | {e['tokens_per_micro_step']:,} | {e['hidden']} | {e['step_ratio']:.3f} |")
    lines += ["", "| engine (world of one) | step over DDP's, - 1 |", "|---|---|"]
    lines += [f"| {k} | {v:+.1%} |" for k, v in d["engine_overhead"].items()]
    lines += ["", "| pipeline micro-batches M | extra s per micro-batch | share of DDP's step |", "|---|---|---|"]
    lines += [f"| {k} | {v['per_micro_batch_s']:.4f} | {v['per_micro_batch_fraction']:+.1%} |"
              for k, v in d["pipeline"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or [str(Path(__file__).parent / "results" / "gpu_check.json")])[0])
    results = json.loads(path.read_text())
    if path.name == "gpu_timing.json":
        d, stem = derive_timing(results), "gpu_timing_derived"
        text = render_timing(d)
    else:
        d, stem = derive(results), "gpu_derived"
        text = render(d)
    (path.parent / f"{stem}.json").write_text(json.dumps(d, indent=1) + "\n")
    (path.parent / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

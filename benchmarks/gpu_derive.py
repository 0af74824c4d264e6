"""Derive the GPU-only constants and the step-time efficiency from a gpu_check.json (benchmarks/gpu_check.py).

    python benchmarks/gpu_derive.py benchmarks/results/gpu_check.json    # writes gpu_derived.{json,md} beside it
    python benchmarks/gpu_derive.py benchmarks/results/gpu_timing.json   # --timing run: gpu_timing_derived.{json,md}
    python benchmarks/gpu_derive.py benchmarks/results/gpu_memory_edge.json   # --memory-edge: gpu_memory_edge_derived.*

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
Which rows count (the shared-process rule, benchmarks/data/gpu_day_2026-12-04/README.md): gpu_check.py runs
every case of a set in one process and the engines do not give their memory back, so in gpu_check.json and
gpu_timing.json a row measured after the first non-DDP case (ZeRO, FSDP2, pipeline, LoRA) is contaminated: its memory
carries the earlier engines' and its step can run slower (`pipe ddp ... M1` 0.082 s after the engines against the
same job's 0.073 s before them). Such a row is replaced by the same label's row of gpu_isolated.json (each case in a
process of its own) where that file has it, else by a clean row of the same job (engine, width, micro-batch,
sequence, accumulation, checkpointing, precision), else kept and marked contaminated; the derived files say which.
From a --memory-edge run (gpu_memory_edge.json), per case and allocator setting:
  slowdown per headroom       median capped step / median uncapped step - 1, beside the allocator's retries per step
  speed headroom              the smallest headroom over the measured tensor peak at which the step, and every step
                              with more room, is within the time model's own band (toolkit/estimate/time_error_band.json)
                              and does not run out of memory: the room the planner would keep for speed; also as a
                              share of the predicted peak (toolkit.estimate's allocated_predicted)
  what the planner keeps      the estimate's reserved prediction with that allocator setting plus the peak error band,
                              over the predicted tensor peak (what toolkit.estimate.search.short_of_gpu_memory needs
                              free besides the context), and the measured step at the nearest headroom not above it
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


SHARED_ENGINES = frozenset({"ddp"})
"""Engines that leave nothing behind in gpu_check's shared process: DDP here is a plain module with a fused AdamW."""
JOB_FIELDS = ("strategy", "hidden", "micro_batch", "seq_len", "accum", "checkpointing", "precision", "liger")


def _job(row: dict) -> tuple:
    return tuple(row.get(k, 1 if k == "accum" else None) for k in JOB_FIELDS)


def select_rows(results: dict, isolated: dict | None = None, source: str | None = None) -> list[dict]:
    """The shared-process rule (module docstring): each measured row of `results` in order, marked `clean`, with
    a contaminated row replaced by `isolated`'s row of the same label (and source file, where the isolated row
    names one) or by a clean row of the same job. Rows of an isolated file are all clean."""
    alone = {r["label"]: r for r in (isolated or {}).get("rows", [])
             if "step_measured_s" in r and r.get("source", source) == source}
    # A case that failed in the shared process (an error row) still counts when it was measured alone.
    measured = [r for r in results["rows"]
                if "step_measured_s" in r or "allocated_measured" in r or r.get("label") in alone]
    if all(r.get("isolated") for r in measured):
        return [{**r, "clean": True, "from": "isolated"} for r in measured]
    out, dirty = [], False
    for r in measured:
        out.append({**r, "clean": not dirty and "error" not in r, "from": "shared"})
        dirty = dirty or r.get("strategy") not in SHARED_ENGINES
    clean_jobs = {_job(r): r for r in out if r["clean"]}
    for i, r in enumerate(out):
        if r["clean"]:
            continue
        if r["label"] in alone:
            out[i] = {**alone[r["label"]], "clean": True, "from": "isolated"}
        elif _job(r) in clean_jobs:
            twin = clean_jobs[_job(r)]
            out[i] = {**twin, "label": r["label"], "clean": True, "from": f"same job: {twin['label']}"}
    return out


def derive(results: dict, isolated: dict | None = None, source: str | None = None) -> dict:
    chosen = select_rows(results, isolated, source)
    rows = [r for r in chosen if "allocated_measured" in r and r["clean"]]
    out: dict = {"meta": results["meta"], "engines": {}, "cases": [], "rows": _row_sources(chosen)}
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


def _row_sources(chosen: list[dict]) -> list[dict]:
    return [{"label": r["label"], "clean": r["clean"], "from": r["from"]} for r in chosen]


def render_sources(d: dict) -> list[str]:
    """The prose saying which rows were used and where from (the shared-process rule)."""
    rows = d.get("rows", [])
    if not rows:
        return []
    replaced = [r for r in rows if r["clean"] and r["from"] != "shared"]
    dirty = [r["label"] for r in rows if not r["clean"]]
    if all(r["from"] == "isolated" for r in rows):
        return ["Every row was measured in a process of its own (gpu_isolated.json): all clean.", ""]
    out = [f"Rows: {len(rows)}; measured clean in the shared process: "
           f"{sum(r['from'] == 'shared' and r['clean'] for r in rows)} (before the first non-DDP case, and that "
           "case itself)."]
    if replaced:
        out.append("Replaced because the shared-process row is contaminated (module docstring's rule): "
                   + "; ".join(f"`{r['label']}` by {'its gpu_isolated.json row' if r['from'] == 'isolated' else r['from']}"
                               for r in replaced) + ".")
    if dirty:
        out.append("Contaminated and not used (no isolated row, no clean row of the same job): "
                   + ", ".join(f"`{x}`" for x in dirty) + ".")
    return out + [""]


def render(d: dict) -> str:
    m = d["meta"]
    lines = [f"# GPU constants derived from gpu_check ({m.get('device')}, torch {m.get('torch')}, "
             f"CUDA {m.get('cuda', '-')}, {m.get('date')})", ""]
    if "context_bytes" in d:
        lines += [f"CUDA context + cuBLAS workspace outside the allocator: {d['context_bytes'] / 2**30:.2f} GiB", ""]
    lines += render_sources(d)
    lines += ["| engine | cases | reserved / allocated (median) | worst peak error | measured MFU (median) |",
              "|---|---|---|---|---|"]
    for engine, e in d["engines"].items():
        worst = f"{e['peak_error_worst']:+.1%}" if "peak_error_worst" in e else "not predicted"
        mfu = f"{e['mfu_measured_median']:.2f}" if "mfu_measured_median" in e else "-"
        lines.append(f"| {engine} | {e['cases']} | {e['reserved_over_allocated_median']:.3f} | {worst} | {mfu} |")
    return "\n".join(lines) + "\n"


def derive_timing(results: dict, isolated: dict | None = None, source: str | None = None, predict=None) -> dict:
    """The step-time model's checks from a --timing run (labels as benchmarks/gpu_check.timing_cases names them),
    from its clean rows (select_rows). `predict(row)`: the step the time model as it is now predicts for the row's
    job (gpu_check._predict), scored as throughput.py scores the published rows (measured / predicted step - 1, i.e.
    our tokens/s over the measured - 1), per engine at the run's one GPU: the evidence nearest a one-GPU job."""
    chosen = select_rows(results, isolated, source)
    rows = {r["label"]: r for r in chosen if "step_measured_s" in r and r["clean"]}
    out: dict = {"meta": results["meta"], "efficiency": [], "engine_overhead": {}, "pipeline": {},
                 "rows": _row_sources(chosen)}
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
    if predict is not None:
        from throughput import _stats

        now = [{"label": label, "strategy": r["strategy"], "predicted_s": predict(r),
                "measured_s": r["step_measured_s"]} for label, r in rows.items()
               if r["strategy"] != "pipeline1" and not r["from"].startswith("same job")]  # each measurement once
        for e in now:
            e["error"] = e["measured_s"] / e["predicted_s"] - 1
        out["model_now"] = {"rows": now, "engines": {
            k: _stats([e["error"] for e in now if e["strategy"] == k]) for k in dict.fromkeys(e["strategy"] for e in now)}}
    return out


def render_timing(d: dict) -> str:
    m = d["meta"]
    lines = [f"# Step-time checks from gpu_check --timing ({m.get('device')}, torch {m.get('torch')}, {m.get('date')})",
             "", *render_sources(d), "| case | tokens / micro-step | hidden | predicted / measured |", "|---|---|---|---|"]
    for e in sorted(d["efficiency"], key=lambda e: (e["hidden"] or 0, e["tokens_per_micro_step"])):
        lines.append(f"| {e['label']} | {e['tokens_per_micro_step']:,} | {e['hidden']} | {e['step_ratio']:.3f} |")
    lines += ["", "| engine (world of one) | step over DDP's, - 1 |", "|---|---|"]
    lines += [f"| {k} | {v:+.1%} |" for k, v in d["engine_overhead"].items()]
    lines += ["", "| pipeline micro-batches M | extra s per micro-batch | share of DDP's step |", "|---|---|---|"]
    lines += [f"| {k} | {v['per_micro_batch_s']:.4f} | {v['per_micro_batch_fraction']:+.1%} |"
              for k, v in d["pipeline"].items()]
    if "model_now" in d:
        lines += ["", "The time model as it is now (host dispatch floor included) against the clean rows; error = "
                  "measured / predicted step - 1 (our tokens/s over the measured, as benchmarks/throughput.py scores "
                  "published runs: positive, the measured step is slower than predicted):", "",
                  "| case | predicted s | measured s | error |", "|---|---|---|---|"]
        lines += [f"| {e['label']} | {e['predicted_s']:.4f} | {e['measured_s']:.4f} | {e['error']:+.1%} |"
                  for e in d["model_now"]["rows"]]
        lines += ["", "| engine, one GPU | rows | median abs error | p90 abs error | worst |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {v['rows']} | {v['median_abs_error']:.1%} | {v['p90_abs_error']:.1%} | "
                  f"{v['worst_abs_error']:.1%} |" for k, v in d["model_now"]["engines"].items()]
        lines += ["", "These are the measured steps nearest a one-GPU job on this GPU's generation: such a job of "
                  "one of these engines is printed the wider of this p90 and the published corpus's held-out p90 "
                  "(toolkit/estimate/measured_time_band.json, written with this file; errorband.time_band). Unverified "
                  "here: every multi-GPU term (communication overlap, collectives), and each engine's overhead beyond "
                  "one GPU."]
    return "\n".join(lines) + "\n"


def derive_memory_edge(results: dict, band: float | None = None, planner_keeps=None) -> dict:
    """The memory-edge sweep's slowdowns and speed headroom (rows as benchmarks/gpu_check._edge_sweep writes them);
    `band` defaults to the time model's error band. `planner_keeps(case, allocator)`: the headroom over the tensor
    peak the planner keeps for that case and setting (kept_by_planner), or None to leave it out."""
    if band is None:
        from toolkit.estimate.errorband import time_band

        band = time_band().fraction
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results["rows"]:
        if "case" in r:
            groups.setdefault((r["case"], r["allocator"]), []).append(r)
    out: dict = {"meta": results["meta"], "band": band, "sweeps": []}
    for (case, allocator), rows in groups.items():
        base = next((r for r in rows if r.get("headroom") is None and "allocated_peak" in r), None)
        if base is None:  # a CPU rehearsal or a failed uncapped run: nothing to compare with
            continue
        points = []
        for r in sorted((r for r in rows if r.get("headroom") is not None and "skipped" not in r),
                        key=lambda r: -r["headroom"]):
            p = {"headroom": r["headroom"], "oom": r.get("oom", False)}
            if not p["oom"] and "step_median_s" in r:
                p.update(slowdown=r["step_median_s"] / base["step_median_s"] - 1, reserved_peak=r["reserved_peak"],
                         retries_per_step=r["timed"]["num_alloc_retries"] / len(r["step_times_s"]))
            if r.get("cap_bytes") and base.get("allocated_predicted"):
                p["cap_over_predicted"] = r["cap_bytes"] / base["allocated_predicted"] - 1
            points.append(p)
        keep = None
        for p in points:
            if p["oom"] or "slowdown" not in p or p["slowdown"] > band:
                break
            keep = p
        first_retry = next((p["headroom"] for p in points if p.get("retries_per_step", 0) > 0 or p["oom"]), None)
        out["sweeps"].append({
            "case": case, "allocator": allocator, "points": points, "step_uncapped_s": base["step_median_s"],
            "reserved_over_allocated_uncapped": base["reserved_peak"] / base["allocated_peak"],
            "allocated_measured_over_predicted": base["allocated_peak"] / base["allocated_predicted"]
            if base.get("allocated_predicted") else None,
            "retries_from_headroom": first_retry,
            "speed_headroom": keep["headroom"] if keep else None,
            "speed_headroom_over_predicted": keep.get("cap_over_predicted") if keep else None,
            "within_band_everywhere": keep is points[-1] if points else False,
            **(_planner_point(planner_keeps(case, allocator), points) if planner_keeps else {})})
    for allocator in dict.fromkeys(s["allocator"] for s in out["sweeps"]):
        kept = [s["speed_headroom"] for s in out["sweeps"] if s["allocator"] == allocator]
        # The planner's number: the largest any case needs; None when a case needs more than the largest measured.
        out.setdefault("speed_headroom", {})[allocator] = None if None in kept else max(kept)
    return out


def _planner_point(kept: float, points: list[dict]) -> dict:
    """The measured point at the largest headroom not above what the planner keeps: the step a GPU holding only
    what the planner asks for would run at least as slowly as."""
    below = [p for p in points if p["headroom"] <= kept]
    at = max(below, key=lambda p: p["headroom"]) if below else None
    return {"planner_keeps": kept, "planner_point": at}


def kept_by_planner(case: str, allocator: str) -> float:
    """What the planner keeps over the predicted tensor peak for an EDGE_CASES case under `allocator` on the H200:
    (reserved + peak band x peak) / peak - 1 (toolkit.estimate.search.short_of_gpu_memory; the CUDA context and
    NCCL buffers lie outside the allocator's cap)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_check import EDGE_CASES, SHAPES, _config
    from toolkit.estimate.errorband import band_for
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    c = next(c for c in EDGE_CASES if c.label == case)
    hw = parse_hardware("1xH200")
    spec = build_spec("llama", _config(SHAPES[c.shape], 128256, c.seq_len))
    job = Job(seq_len=c.seq_len, micro_batch=c.micro_batch, precision=c.precision, checkpointing=c.checkpointing,
              device_kind="cuda", allocator_conf="" if allocator == "default" else allocator)
    b = estimate_memory(spec, parse_strategy(c.strategy), job, hw)
    band = band_for(c.strategy, c.checkpointing, gpu=hw.gpu)
    return (b.reserved_bytes + band.headroom_bytes(b.peak_bytes)) / b.peak_bytes - 1


def render_memory_edge(d: dict) -> str:
    m = d["meta"]
    lines = [f"# Step time at the memory edge, gpu_check --memory-edge ({m.get('device')}, torch {m.get('torch')}, "
             f"CUDA {m.get('cuda', '-')}, {m.get('date')})", "",
             f"Band: the time model's +-{d['band']:.1%} (toolkit/estimate/time_error_band.json). Headroom: the cap "
             "over the measured tensor peak (max_memory_allocated, uncapped).", "",
             "| case | allocator | headroom | over predicted peak | slowdown | retries / step | reserved peak GiB |",
             "|---|---|---|---|---|---|---|"]
    for s in d["sweeps"]:
        for p in s["points"]:
            slow = "out of memory" if p["oom"] else f"{p['slowdown']:+.1%}" if "slowdown" in p else "-"
            over = f"{p['cap_over_predicted']:+.1%}" if "cap_over_predicted" in p else "-"
            retries = f"{p['retries_per_step']:.1f}" if "retries_per_step" in p else "-"
            reserved = f"{p['reserved_peak'] / 2**30:.2f}" if "reserved_peak" in p else "-"
            lines.append(f"| {s['case']} | {s['allocator']} | {p['headroom']:.1%} | {over} | {slow} | {retries} | "
                         f"{reserved} |")
    lines.append("")
    if not d["sweeps"]:
        lines.append("No capped run in this file (a CPU rehearsal has none): nothing to derive.")
    for allocator, keep in d.get("speed_headroom", {}).items():
        lines.append(f"Speed headroom, {allocator} allocator: " + (
            f"keep {keep:.1%} over the tensor peak" if keep is not None else
            f"more than the largest measured ({max(p['headroom'] for s in d['sweeps'] for p in s['points']):.0%})"))
    lines.append("")
    for s in d["sweeps"]:
        keep = s["speed_headroom"]
        said = ("none of the measured headrooms is within the band" if keep is None else
                f"within the band down to {keep:.1%} over the measured peak"
                + (f" ({s['speed_headroom_over_predicted']:+.1%} over the predicted one)"
                   if s["speed_headroom_over_predicted"] is not None else "")
                + (", the smallest measured" if s["within_band_everywhere"] else ""))
        retries = s["retries_from_headroom"]
        line = (f"- {s['case']}, {s['allocator']}: {said}; uncapped reserved / allocated "
                f"{s['reserved_over_allocated_uncapped']:.3f}; retries "
                + (f"from {retries:.1%}" if retries is not None else "at no measured headroom"))
        if "planner_keeps" in s:
            at = s["planner_point"]
            line += f"; the planner keeps {s['planner_keeps']:.1%}" + (
                " (more than the largest measured headroom)" if at is None and s["points"] and
                s["planner_keeps"] > s["points"][0]["headroom"] else
                "" if at is None else
                f": at {at['headroom']:.1%} the step " + ("ran out of memory" if at["oom"] else
                                                         f"ran {at['slowdown']:+.1%}" if "slowdown" in at else "-")
                + (" (outside the band)" if at.get("oom") or at.get("slowdown", 0) > d["band"] else " (within the band)"))
        lines.append(line)
    return "\n".join(lines) + "\n"


RESULTS = Path(__file__).parent / "results"


def write_measured_band(d: dict) -> None:
    """toolkit/estimate/measured_time_band.json (errorband.MEASURED_TIME_BAND_FILE): per engine, the model's error
    now on the run's clean rows, for jobs of the run's GPU generation and GPU count (one GPU: gpu_check's cases)."""
    from toolkit.estimate.errorband import MEASURED_TIME_BAND_FILE
    from toolkit.inputs.hardware import parse_hardware

    m = d["meta"]
    gpu = parse_hardware(f"1x{m.get('gpu', 'H200')}").gpu
    MEASURED_TIME_BAND_FILE.write_text(json.dumps({
        "about": "written by benchmarks/gpu_derive.py from benchmarks/results/gpu_timing.json: the step-time model's "
                 "error now (measured / predicted step - 1) on the GPU day's clean rows, per engine",
        "gpu": gpu.name, "generation": gpu.architecture, "gpus": 1, "date": m.get("date"),
        "engines": d["model_now"]["engines"]}, indent=1) + "\n")


def _model_now(meta: dict):
    """The time model's prediction now for a timing row, as gpu_check predicted it on the day (its case by label)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_check import SHAPES, _config, _predict, timing_cases

    cases = {c.label: c for c in timing_cases()}

    def predict(row: dict) -> float:
        c = cases[row["label"]]
        return _predict(c, _config(SHAPES[c.shape], 128256, c.seq_len), "cuda", meta.get("gpu", "H200"))[
            "step_predicted_s"]
    return predict


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:] or [str(Path(__file__).parent / "results" / "gpu_check.json")])[0])
    results = json.loads(path.read_text())
    alone = path.parent / "gpu_isolated.json"
    isolated = json.loads(alone.read_text()) if alone.exists() and alone != path else None
    if path.name == "gpu_timing.json":
        d, stem = derive_timing(results, isolated, path.name, _model_now(results["meta"])), "gpu_timing_derived"
        text = render_timing(d)
        if path.parent.resolve() == RESULTS.resolve():  # the committed run: the evidence the printed band reads
            write_measured_band(d)
    elif path.name == "gpu_memory_edge.json":
        measured = any("allocated_peak" in r for r in results["rows"])  # a CPU rehearsal has nothing to set against
        d, stem = derive_memory_edge(results, planner_keeps=kept_by_planner if measured else None), \
            "gpu_memory_edge_derived"
        text = render_memory_edge(d)
    else:
        d = derive(results, isolated, path.name)
        stem = "gpu_isolated_derived" if path.name == "gpu_isolated.json" else "gpu_derived"
        text = render(d)
    (path.parent / f"{stem}.json").write_text(json.dumps(d, indent=1) + "\n")
    (path.parent / f"{stem}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

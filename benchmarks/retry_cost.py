"""The price of an allocator retry, from the GPU day's memory-edge rows (benchmarks/results/gpu_memory_edge.json).

    python benchmarks/retry_cost.py        # writes toolkit/estimate/retry_cost.json and benchmarks/results/retry_cost.md

Each capped row's job is estimated as gpu_check ran it (1 x the catalog GPU, the row's PYTORCH_CUDA_ALLOC_CONF),
and the estimate's own step events (toolkit.estimate.reserved, the replay it asks for) are replayed again with the
allocator capped at the row's cap (toolkit.estimate.retries.retries_at): retries in the second step, segments freed /
pages unmapped, and what the step takes from the device again. The measured cost of a step is its median minus the
uncapped median of the same case and setting. The constants (toolkit.estimate.retries.StepRetries.seconds):
  unmap_map_s_per_gib     expandable segments: seconds per GiB a retry unmaps (and the step maps again), set by the
                          DDP rows (one retry a step) as measured extra seconds / the replay's unmapped GiB, checked
                          on the held-out FSDP2 rows;
  free_malloc_s_per_call  the default allocator: seconds per cudaFree or cudaMalloc, set by the FSDP2 rows from the
                          GPU's own counters (num_device_free + num_device_alloc a step), as the replay runs out of
                          memory at those caps; DDP ran out of memory before it retried: no row is held out for it.
Each constant is the median over its rows.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GIB = 1 << 30
SETS = {"expandable_segments:True": "edge ddp", "default": "edge fsdp2"}
"""Per allocator setting, the case whose rows set its constant; the other case's rows are held out."""


def step_inputs(case_label: str, allocator: str):
    """(regions, sizes, conf) of the replay the estimate of an EDGE_CASES case asks for (its last)."""
    from gpu_check import EDGE_CASES, SHAPES, _config

    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.reserved import replays_asked
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    c = next(c for c in EDGE_CASES if c.label == case_label)
    spec = build_spec("llama", _config(SHAPES[c.shape], 128256, c.seq_len))
    job = Job(seq_len=c.seq_len, micro_batch=c.micro_batch, precision=c.precision, checkpointing=c.checkpointing,
              device_kind="cuda", allocator_conf="" if allocator == "default" else allocator)
    with replays_asked() as asked:
        estimate_memory(spec, parse_strategy(c.strategy), job, parse_hardware("1xH200"))
    return asked[-1]


def measure(results: dict) -> list[dict]:
    from toolkit.estimate.retries import retries_at

    rows, out = results["rows"], []
    for case, allocator in sorted({(r["case"], r["allocator"]) for r in rows}):
        mine = [r for r in rows if (r["case"], r["allocator"]) == (case, allocator)]
        base = next(r for r in mine if r.get("headroom") is None)
        regions, sizes, conf = step_inputs(case, allocator)
        for r in mine:
            if r.get("headroom") is None or not r.get("cap_bytes"):
                continue
            replayed = retries_at(regions, sizes, conf, r["cap_bytes"])
            steps = len(r.get("step_times_s") or []) or 1
            timed = r.get("timed") or {}
            out.append({"case": case, "allocator": allocator, "headroom": r["headroom"], "cap_bytes": r["cap_bytes"],
                        "measured_oom": r.get("oom", False) or r.get("step_median_s") is None,
                        "measured_extra_s": None if r.get("step_median_s") is None
                        else r["step_median_s"] - base["step_median_s"],
                        "measured_retries": timed.get("num_alloc_retries", 0) / steps if timed else None,
                        "measured_calls": (timed.get("num_device_free", 0) + timed.get("num_device_alloc", 0)) / steps
                        if timed else None,
                        "replayed": vars(replayed)})
    return out


def derive(rows: list[dict]) -> dict:
    cost: dict = {"source": "benchmarks/retry_cost.py on benchmarks/results/gpu_memory_edge.json"}
    expandable = [r for r in rows if r["allocator"] == "expandable_segments:True" and r["case"].startswith(SETS[
        r["allocator"]]) and r["measured_extra_s"] is not None and r["replayed"]["retries"]
        and not r["replayed"]["oom"] and r["replayed"]["freed_bytes"]]
    cost["unmap_map_s_per_gib"] = statistics.median(
        r["measured_extra_s"] * GIB / r["replayed"]["freed_bytes"] for r in expandable)
    cost["unmap_map_s_per_gib_rows"] = [f"{r['case']} cap +{r['headroom']:.1%}" for r in expandable]
    default = [r for r in rows if r["allocator"] == "default" and r["case"].startswith(SETS["default"])
               and r["measured_extra_s"] is not None and r["measured_calls"]]
    cost["free_malloc_s_per_call"] = statistics.median(r["measured_extra_s"] / r["measured_calls"] for r in default)
    cost["free_malloc_s_per_call_rows"] = [f"{r['case']} cap +{r['headroom']:.1%}" for r in default]
    return cost


def render(rows: list[dict], cost: dict) -> str:
    from toolkit.estimate.retries import StepRetries

    lines = ["# Allocator retries priced (benchmarks/retry_cost.py)", "",
             "Each capped memory-edge row replayed at its cap from the estimate's own step events; the constant of "
             "each allocator setting set by one case's rows, the other case held out.", "",
             f"- expandable segments: {cost['unmap_map_s_per_gib'] * 1e3:.2f} ms per GiB a retry unmaps (mapped again) "
             f"(set by {len(cost['unmap_map_s_per_gib_rows'])} rows: {', '.join(cost['unmap_map_s_per_gib_rows'])})",
             f"- default allocator: {cost['free_malloc_s_per_call'] * 1e3:.2f} ms per cudaFree or cudaMalloc, from "
             f"the GPU's counters (set by {len(cost['free_malloc_s_per_call_rows'])} rows: "
             f"{', '.join(cost['free_malloc_s_per_call_rows'])}; none held out)", "",
             "| case | allocator | cap | role | retries / step measured | replayed | replayed freed GiB | "
             "replayed segments freed | measured frees + mallocs / step | extra s measured | priced |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    held = [r for r in rows if not r["case"].startswith(SETS[r["allocator"]]) and r["measured_retries"]]
    both = [r for r in held if r["replayed"]["retries"] and not r["replayed"]["oom"]]
    ratios = [StepRetries(**r["replayed"]).seconds(cost) / r["measured_extra_s"] for r in both]
    lines[6:6] = [f"- held out: {len(held)} rows retried on the GPU; the replay retries in {len(both)} of them, "
                  + (f"priced at {min(ratios):.2f}x to {max(ratios):.2f}x the measured extra seconds; "
                     if ratios else "") +
                  f"{len(held) - len(both)} it does not price (no retry replayed, or out of memory: the replay's "
                  "reserved memory lies below or its fragmentation above the GPU's there)"]
    for r in rows:
        p = r["replayed"]
        role = "sets" if r["case"].startswith(SETS[r["allocator"]]) else "held out"
        priced = "oom" if p["oom"] else f"{StepRetries(**p).seconds(cost):.4f}"
        measured = "oom" if r["measured_oom"] else f"{r['measured_extra_s']:+.4f}"
        got = "-" if r["measured_retries"] is None else f"{r['measured_retries']:.1f}"
        lines.append(f"| {r['case']} | {r['allocator']} | +{r['headroom']:.1%} | {role} | {got} | {p['retries']} | "
                     f"{p['freed_bytes'] / GIB:.2f} | {p['device_frees']} | "
                     f"{'-' if r['measured_calls'] is None else round(r['measured_calls'], 1)} | {measured} | {priced} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    results = json.loads((ROOT / "benchmarks/results/gpu_memory_edge.json").read_text())
    rows = measure(results)
    cost = derive(rows)
    (ROOT / "toolkit/estimate/retry_cost.json").write_text(json.dumps(cost, indent=1) + "\n")
    (ROOT / "benchmarks/results/retry_cost.json").write_text(json.dumps(rows, indent=1) + "\n")
    (ROOT / "benchmarks/results/retry_cost.md").write_text(render(rows, cost))
    print(render(rows, cost))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One rank traced in a fake world against the planner's per-rank model, and against real gloo runs where we have them.

toolkit.estimate.fakeworld runs the real wrapping of a plan (FSDP2 per layer + root, HSDP, or transformers' own
TP + FSDP2 from the model's plans) at the plan's world size in one process, under a fake process group and
FakeTensorMode, through two training steps under torch's FSDPMemTracker. For each case this script records the
rank's traced parameter / gradient / optimizer bytes and tensor peak beside toolkit.estimate.memory.estimate_memory
for the same strategy, job and grid, and, for the small CPU cases, the peak measured on real gloo ranks by
benchmarks/distributed_memory.py and benchmarks/dimension_memory.py (their .json files).

    python benchmarks/fakeworld.py        # writes benchmarks/results/fakeworld.{md,json} (minutes on 2 cores)
    python benchmarks/fakeworld.py --md   # rewrite the .md from the stored .json
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from provenance import meta as provenance_meta

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["TOOLKIT_NO_CACHE"] = "1"  # every trace runs here, timed
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).parent / "results"
TINY = dict(vocab_size=2000, layers=4, hidden=256, heads=8, kv_heads=2, ffn=688, max_positions=512)
"""The model of distributed_memory.md and dimension_memory.md (measured there on real gloo ranks)."""

# name, model (TINY or a catalog name), layers kept (None: all), strategy, nodes, gpus per node, tensor, seq,
# micro-batch, precision, device kind, checkpointing, measured (results file, row key) or None
CASES = [
    ("tiny fsdp2 x2 fp32", "tiny", None, "fsdp2", 1, 2, 1, 128, 2, "fp32", "cpu", False,
     ("distributed_memory.json", "fsdp2/fp32")),
    ("tiny fsdp2 x2 bf16", "tiny", None, "fsdp2", 1, 2, 1, 128, 2, "bf16", "cpu", False,
     ("distributed_memory.json", "fsdp2/bf16")),
    ("tiny fsdp2 dp2 x tp2 fp32", "tiny", None, "fsdp2", 1, 4, 2, 128, 2, "fp32", "cpu", False,
     ("dimension_memory.json", "fsdp2-tp2")),
    ("tiny fsdp2-grad-op x4 fp32", "tiny", None, "fsdp2-grad-op", 1, 4, 1, 128, 2, "fp32", "cpu", False, None),
    ("tiny fsdp2-hybrid 2x2 fp32", "tiny", None, "fsdp2-hybrid", 2, 2, 1, 128, 2, "fp32", "cpu", False, None),
    ("qwen2.5-7b 4 layers fsdp2 x8", "qwen2.5-7b", 4, "fsdp2", 1, 8, 1, 2048, 1, "bf16", "cuda", True, None),
    ("qwen2.5-7b 4 layers dp4 x tp2", "qwen2.5-7b", 4, "fsdp2", 1, 8, 2, 2048, 1, "bf16", "cuda", True, None),
    ("mistral-7b 4 layers fsdp2 x8", "mistral-7b", 4, "fsdp2", 1, 8, 1, 2048, 1, "bf16", "cuda", True, None),
    ("mistral-7b 4 layers dp2 x tp4", "mistral-7b", 4, "fsdp2", 1, 8, 4, 2048, 1, "bf16", "cuda", True, None),
    ("gemma-2-2b 4 layers fsdp2 x8", "gemma-2-2b", 4, "fsdp2", 1, 8, 1, 2048, 1, "bf16", "cuda", True, None),
    ("llama-3.1-8b fsdp2 x8", "llama-3.1-8b", None, "fsdp2", 1, 8, 1, 4096, 1, "bf16", "cuda", True, None),
    ("llama-3.1-8b dp4 x tp2", "llama-3.1-8b", None, "fsdp2", 1, 8, 2, 4096, 1, "bf16", "cuda", True, None),
]


def _spec(model: str, layers: int | None):
    from toolkit.inputs.modelconfig import reduced_config
    from toolkit.inputs.modelspec import build_spec, resolve_model

    if model == "tiny":
        from toolkit.run.tiny import tiny_config

        return build_spec("llama", tiny_config("llama", **TINY))
    spec = resolve_model(model)
    if layers is None:
        return spec
    return build_spec(f"{model} ({layers} layers)", reduced_config(spec.hf_config(), spec.num_layers, layers))


def _measured_peak(source) -> int | None:
    if source is None:
        return None
    name, key = source
    rows = json.loads((RESULTS / name).read_text())["rows"]
    for row in rows:
        tag = f"{row.get('strategy')}/{row.get('precision')}" if "strategy" in row else row.get("case", row.get("name"))
        if tag == key:
            return int(row["measured_peak_bytes"])
    return None


def run_case(case) -> dict:
    from toolkit.estimate.fakeworld import trace_world
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.strategy import parse_strategy

    name, model, layers, strat, nodes, gpus, tensor, seq, micro, precision, kind, ckpt, measured = case
    spec = _spec(model, layers)
    strategy = parse_strategy(strat)
    grid = ParallelGrid.for_strategy(strategy, nodes=nodes, gpus_per_node=gpus, tensor=tensor)
    job = Job(seq_len=seq, micro_batch=micro, precision=precision, device_kind=kind, checkpointing=ckpt)
    start = time.perf_counter()
    world = trace_world(spec, strategy, job, grid)
    seconds = time.perf_counter() - start
    hw = parse_hardware(f"{nodes}x{gpus}xH100-80GB" if nodes > 1 else f"{gpus}xH100-80GB")
    b = estimate_memory(spec, strategy, job, hw, grid=grid)
    return {"case": name, "grid": grid.describe(), "params": spec.params, "seq": seq, "micro_batch": micro,
            "precision": precision, "device_kind": kind, "checkpointing": ckpt, "trace_s": round(seconds, 1),
            "route": world.route, "traced": world.to_dict(),
            "estimate": {"parameters_bytes": b.parameters_bytes, "gradients_bytes": b.gradients_bytes,
                         "optimizer_bytes": b.optimizer_bytes, "peak_bytes": b.peak_bytes, "peak_phase": b.peak_phase},
            "prefetch_layer_bytes": _prefetched_layer_bytes(spec, grid, job, strategy),
            "measured_peak_bytes": _measured_peak(measured)}


def _prefetched_layer_bytes(spec, grid, job, strategy) -> int:
    """The second unsharded layer the planner adds on a GPU (FSDP2's all-gather stream), at the rank's shapes."""
    if job.device_kind != "cuda" or strategy.fsdp_mode == "grad_op":
        return 0
    from toolkit.inputs.choices import compute_bytes
    from toolkit.inputs.tensorplan import per_rank_spec

    rank = per_rank_spec(spec, grid.tensor) if grid.tensor > 1 else spec
    return max(rank.layer_params) * compute_bytes(job.precision)


def _set_aside(r: dict) -> float:
    """Traced peak over the model's peak without the GPU-prefetched layer."""
    return r["traced"]["peak_bytes"] / (r["estimate"]["peak_bytes"] - r["prefetch_layer_bytes"])


def _hub_name(model: str) -> str:
    """The model as its hub id names it (catalog 'llama-3.1-8b' -> 'Llama-3.1-8B'), else as given."""
    from toolkit.inputs.resolve import catalog_hub_id

    return (catalog_hub_id(model) or model).split("/")[-1]


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:,.2f}"


def _line(r: dict) -> str:
    t, e = r["traced"], r["estimate"]
    same = lambda a, b: "=" if a == b else f"{a - b:+,}"  # noqa: E731
    step = t["optimizer_bytes"] - e["optimizer_bytes"]
    measured = r["measured_peak_bytes"]
    real = f"{_mb(measured)} ({t['peak_bytes'] / measured:.3f} / {e['peak_bytes'] / measured:.3f})" if measured else "-"
    return (f"| {r['case']} | {r['grid']} | {r['trace_s']} | {_mb(t['parameters_bytes'])} "
            f"{same(t['parameters_bytes'], e['parameters_bytes'])} | {_mb(t['gradients_bytes'])} "
            f"{same(t['gradients_bytes'], e['gradients_bytes'])} | {_mb(t['optimizer_bytes'])} +{step:,} B | "
            f"{_mb(t['peak_bytes'])} | {_mb(e['peak_bytes'])} | {e['peak_phase']} | "
            f"{t['peak_bytes'] / e['peak_bytes']:.3f} | "
            f"{_set_aside(r):.3f} | {real} |")


def markdown(rows: list[dict], meta: dict) -> str:
    exact = all(r["traced"]["parameters_bytes"] == r["estimate"]["parameters_bytes"]
                and r["traced"]["gradients_bytes"] == r["estimate"]["gradients_bytes"] for r in rows)
    raw = [r["traced"]["peak_bytes"] / r["estimate"]["peak_bytes"] for r in rows]
    head_rows = [r for r in rows if r["prefetch_layer_bytes"] and "tp" not in r["grid"]
                 and r["estimate"]["peak_phase"].startswith("backward (head")]
    layer_rows = [r for r in rows if r["prefetch_layer_bytes"] and "(layer" in r["estimate"]["peak_phase"]]
    real = [r for r in rows if r["measured_peak_bytes"]]
    slowest = max(rows, key=lambda r: r["trace_s"])
    # AdamW's per-tensor `step` counter (4 bytes each): the optimizer bytes traced beyond the states model, for the
    # largest model's FSDP2 row.
    counted = max((r for r in rows if r["grid"].startswith("dp=") and "tp" not in r["grid"]), key=lambda r: r["params"])
    step_bytes = counted["traced"]["optimizer_bytes"] - counted["estimate"]["optimizer_bytes"]
    tiny_tp = next(r for r in rows if r["case"].startswith("tiny") and "tp" in r["grid"])
    head = [
        "# One rank traced in a fake world: per-rank states and peak against the planner's model",
        "",
        f"One run, {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, {meta['machine']}. "
        "Produced by `python benchmarks/fakeworld.py` (toolkit.estimate.fakeworld, the engine behind "
        "`toolkit estimate --trace-world`). Each case builds the model on the meta device, wraps it as the run does "
        "at the plan's world size under a fake process group (FSDP2: `fully_shard` per decoder layer + root with "
        "accelerate's mixed-precision policy; HSDP over a (replicate, shard) mesh; TP: transformers' "
        "`maybe_distribute_model` with the DistributedConfig the emitter writes), materialises it under "
        "FakeTensorMode and runs two steps (forward with labels, backward, AdamW) under torch's FSDPMemTracker. "
        "The estimate is `estimate_memory(spec, strategy, job, hw, grid=grid)`. Sizes in MiB; `=` means equal to "
        "the byte. Catalog models marked \"4 layers\" keep their real config with 4 decoder layers (CPU time); the "
        "others are whole.",
        "",
        "| case | grid | trace s | params traced | grads traced | optimizer traced (vs model) | peak traced | "
        "peak model | model's peak phase | traced / model | traced / (model - GPU prefetch layer) | "
        "measured on gloo (traced / model) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[_line(r) for r in rows],
        "",
        "## Findings",
        "",
        f"**Model states are exact.** Parameter and gradient shards equal the planner's per-rank states to the byte "
        f"in {'every' if exact else 'not every'} case (FSDP2, FSDP2 grad-op, HSDP, FSDP2 x TP from the model's own "
        "tp_plan, whole and shrunk real configs, Llama-3.1-8B at 8 ranks). The optimizer states exceed the model by "
        "4 bytes per parameter tensor: torch AdamW's fp32 `step` counter per tensor, which the states model leaves "
        f"out ({step_bytes // 4:,} tensors, {step_bytes:,} B, for {_hub_name(counted['case'].split()[0])}).",
        "",
        f"**Peaks agree within {max(abs(x - 1) for x in raw):.1%}** (traced / model {min(raw):.3f} to "
        f"{max(raw):.3f}). For device kind cuda the model holds one more unsharded layer than the CPU dispatch can: "
        "the next group FSDP2 all-gathers on its own CUDA stream while the current one computes (derived, and "
        "listed as derived by --explain). The column 'traced / (model - GPU prefetch layer)' sets that layer aside. "
        "Where the model's peak is the head's backward on the FSDP2 route, that layer is the whole difference: "
        + ", ".join(f"{r['case']} {_set_aside(r):.3f}" for r in head_rows)
        + ". Where the peak is inside a layer's backward (" + ", ".join(
            f"{r['case']}: {r['traced']['peak_bytes'] / r['estimate']['peak_bytes']:.3f} raw, {_set_aside(r):.3f} "
            "set aside" for r in layer_rows)
        + ") neither column is exact: in a layer's backward the CPU dispatch also runs FSDP2's backward prefetch "
        "(issued by its pre-backward hook on any device) and its own reduce-scatter buffers, which this benchmark "
        "does not separate from the GPU term. On transformers' TP route the model keeps a layer unsharded only while it computes, so the "
        "head-phase TP rows compare raw. The CPU cases (device kind cpu, no prefetch) "
"compare directly. The tracker also charges tensors on the meta device; under TP those are transformers' "
        "stride probes (distributed/tensor_parallel.py: `torch.empty(shape, device=\"meta\")` to read a layout, "
        f"{_mb(tiny_tp['traced']['meta_peak_bytes'])} MiB of them at the peak of the tiny TP case), never memory, "
        "so the peak is the CPU device's alone.",
        "",
        "**Against real ranks.** " + (
            "; ".join(f"{r['case']}: measured {_mb(r['measured_peak_bytes'])} MiB, traced "
                      f"{r['traced']['peak_bytes'] / r['measured_peak_bytes']:.3f}, model "
                      f"{r['estimate']['peak_bytes'] / r['measured_peak_bytes']:.3f}" for r in real) + ". "
            "A fake world of one process sees what the real ranks held at their peak, TP included." if real
            else "no measured case."),
        "",
        f"**Cost.** The slowest case ({slowest['case']}) took {slowest['trace_s']} s on a shared 2-core machine; "
        "fake tensors hold no memory (a few hundred MB of RSS for an 8B model at 8 ranks), so time is Python "
        "dispatch per module and grows with layers and wrapped groups, not with sizes. That is why it is an option "
        "(`--trace-world`, disk-cached) and never on the default plan path.",
        "",
        "**What it cannot trace** (toolkit.estimate.fakeworld.untraceable_reason): DeepSpeed ZeRO "
        "(deepspeed.initialize "
        "moves the module with .to(), which cannot swap fake parameters: \"Couldn't swap Embedding.weight\", at ZeRO-2 "
        "and ZeRO-3), context parallelism (torch's ring "
        "attention shards only the CUDA SDPA kernels), Ulysses SP (DeepSpeed), DDP and the pipeline engine (nothing "
        "sharded, or another engine), adapters, Liger, activation offloading, torch.compile. **What it cannot see** "
        "in the rows it traces: the CUDA context, NCCL buffers and the allocator's margin; the GPU prefetch above; "
        "GPU kernel footprints beyond the tracer's stand-ins (attention and dropout are traced with the same stand-ins "
        "as toolkit.estimate.tracer).",
        "",
        "**Two tracker traps avoided.** FSDPMemTracker charges a DTensor optimizer step's temporaries far above their "
        "local size (AdamW on one Shard(0) DTensor over 8 fake ranks: 27x the local bytes), and torch's fused CPU "
        "AdamW under FakeTensorMode ~9x its states; the trace steps a plain for-loop AdamW over the rank's local "
        "shards (the same states and temporaries a DTensor step computes for Shard placements) and reads the states "
        "from the optimizer itself.",
        "",
    ]
    return "\n".join(head)


def main(argv: list[str]) -> int:
    if argv == ["--md"]:
        data = json.loads((RESULTS / "fakeworld.json").read_text())
        (RESULTS / "fakeworld.md").write_text(markdown(data["rows"], data["meta"]))
        return 0
    import torch
    import transformers

    rows = []
    for case in CASES:
        row = run_case(case)
        print(_line(row), flush=True)
        rows.append(row)
    meta = {**provenance_meta(), "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": platform.machine()}
    (RESULTS / "fakeworld.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (RESULTS / "fakeworld.md").write_text(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

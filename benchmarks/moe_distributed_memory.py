"""Expert-parallel routes on 2 and 4 CPU processes: predicted vs measured per-rank memory (issue 34).

    python benchmarks/moe_distributed_memory.py                    # writes benchmarks/results/moe_distributed_memory.{md,json}
    python benchmarks/moe_distributed_memory.py qwen3_moe:zero1:2:2  # one row (arch:strategy:world:expert), printed only
    python benchmarks/moe_distributed_memory.py --md               # rewrite the .md from the stored .json
    python benchmarks/moe_distributed_memory.py --replace qwen3_moe:zero2:2:2 ...  # re-run these rows into the
        stored files (each row keeps the commit it was measured at), every other row re-predicted
    python benchmarks/moe_distributed_memory.py --repredict        # every stored row predicted again by this code

Each row is a real `toolkit.train` run of a plan (toolkit.run.rehearsal.plan_for_model, emitted by
toolkit.run.launcher.emit_plan_files and started by its `accelerate launch` command) of a tiny random-weight MoE model
of a real architecture (Qwen3-MoE, Mixtral; 2 layers, hidden 64, 4 experts top-2), fp32, on each route that trains
on CPU: transformers' DistributedConfig (FSDP2 x EP), DeepSpeed AutoEP (ZeRO-1/2/3) and ZeRO-3 with the MoE block as
leaf module. The measurement is benchmarks/rl_distributed_memory.py's worker (benchmarks/distributed_memory.py's
MemTracker from before the model and the engine exist, CPU storages only): the live bytes before the measured step
and that step's peak from its inputs to the optimizer step. Predicted: toolkit.estimate.memory.estimate_memory of the
plan's job and grid (device kind cpu), its peak (the busiest expert rank's, EP_WORST_RANK_SHARE of the mean routed
rows) and its bytes between steps.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import rl_distributed_memory as rl  # noqa: E402  (its worker: the one measurement of a toolkit.train rank)
from provenance import measured_line, toolkit_commit  # noqa: E402

OUT = Path(__file__).parent / "results"
SEQ = 32
ARCHS = ("qwen3_moe", "mixtral")
# (strategy, processes, expert degree, micro-batch): every route that trains on CPU, at 2 processes and where the
# route composes EP with data parallelism, at 4 (ep 2 x fsdp 4 / AutoEP 2 x dp 4)
ROUTES = (("fsdp2", 2, 2, 2), ("zero1", 2, 2, 2), ("zero2", 2, 2, 2), ("zero3", 2, 2, 2), ("zero3", 2, 1, 2),
          ("fsdp2", 4, 2, 1), ("zero2", 4, 2, 1))
TRAIN = ("--max-steps", str(rl.STEPS), "--logging-steps", "100", "--save-steps", "100", "--lr", "1e-3",
         "--lr-scheduler", "constant", "--seed", "7", "--max-eval-blocks", "8", "--no-save-final")


# ----------------------------------------------------------------------------------------------------------------
# Worker (one rank, under accelerate launch)


def worker(out_path: str, *train_argv: str) -> None:
    """rl_distributed_memory's worker, with two additions: before the first step every parameter's local shard gets
    its own storage (transformers cuts an expert-parallel rank's shard from the loaded tensor as a view, which on CPU
    keeps the whole tensor alive: benchmarks/dimension_memory.py _compact_local_shards; a GPU copies the slice); and
    in the measured step the (token, expert) pairs this rank's tokens sent to each global expert, per MoE layer call
    (transformers' experts modules marked _is_expert_parallel: their top_k_index; DeepSpeed's AutoEPMoELayer: its
    router's num_tokens_per_expert), written beside the rank's json."""
    import torch
    import transformers
    from dimension_memory import _compact_local_shards

    original = transformers.Trainer.training_step
    calls, routed = [0], []
    trackers = []
    make_tracker = rl._tracker
    rl._tracker = lambda: trackers.append(make_tracker()) or trackers[-1]

    def sent_by_expert(module, args, kwargs):  # transformers: experts(hidden_states, top_k_index, top_k_weights)
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        routed.append(torch.bincount(index.detach().reshape(-1).long()).tolist())

    def router_counts(module, args, output):  # DeepSpeed AutoEP: RouterOutput(scores, experts, tokens per expert)
        routed.append([int(n) for n in output[2].detach().long().tolist()])

    def training_step(self, model, inputs, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            _compact_local_shards(model)
        if calls[0] != rl.MEASURED:
            return original(self, model, inputs, *args, **kwargs)
        hooks = [m.register_forward_pre_hook(sent_by_expert, with_kwargs=True) for m in model.modules()
                 if getattr(m, "_is_expert_parallel", False)]
        seen: dict = {}
        if os.environ.get("DM_STORAGES"):  # diagnostic (a folder): the live storages, named, at the step's peak
            import distributed_memory as dm

            engine = getattr(self, "deepspeed", None)
            names = dm._named_storages({"model": model, "optimizer": getattr(engine, "optimizer", self.optimizer),
                                        "params": dict(model.named_parameters())})
            dm._watch_peak(trackers[-1], seen, names, model)
        hooks += [m.router.register_forward_hook(router_counts) for m in model.modules()
                  if getattr(m, "_is_autoep_layer", False)]
        try:
            return original(self, model, inputs, *args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
            Path(f"{out_path}.rank{os.environ['RANK']}.routed.json").write_text(json.dumps(routed))
            if seen:
                folder = Path(os.environ["DM_STORAGES"])  # a folder of the caller's
                (folder / f"{Path(out_path).parent.name}.rank{os.environ['RANK']}.json").write_text(
                    json.dumps(seen, default=str))

    transformers.Trainer.training_step = training_step
    rl.worker(out_path, *train_argv)


# ----------------------------------------------------------------------------------------------------------------
# Driver


def make_plan(model_dir: Path, strategy: str, world: int, expert: int, micro: int):
    from toolkit.run.rehearsal import plan_for_model

    return plan_for_model(model_dir, strategy, gpus_per_node=world, micro_batch=micro, seq_len=SEQ,
                          precision="fp32", expert=expert)


def predict(plan, rank: int | None = None) -> dict:
    """The plan's estimate: the worst rank's (rank None), or `rank`'s own where ranks differ (ZeRO-2's gradient
    partition: toolkit.estimate.zeropartition)."""
    from toolkit.estimate.memory import estimate_memory
    from toolkit.plan.job import plan_job

    on_cpu = plan.replace(gpu="H100-SXM-80GB", device_kind="cpu")
    spec, hw, job = plan_job(on_cpu, check=False)
    b = estimate_memory(spec, on_cpu.strategy_spec, job, hw, grid=on_cpu.grid, rank=rank)
    return {"peak_bytes": int(b.peak_bytes), "peak_phase": b.peak_phase,
            "persistent_bytes": int(b.between_steps_bytes), "terms": {t.name: int(t.bytes) for t in b.terms}}


def at_received_rows(plan, ranks: list[dict]) -> list[tuple[int, float, int]]:
    """Each rank's received routed rows, the balanced count, and that rank's predicted peak (predict(plan, rank))
    moved to those rows."""
    from toolkit.estimate.experttime import expert_rows_per_rank
    from toolkit.estimate.expertrows import peak_at_received_rows, received_rows
    from toolkit.inputs.moe import moe_layer_count
    from toolkit.plan.job import plan_job

    on_cpu = plan.replace(gpu="H100-SXM-80GB", device_kind="cpu")
    spec, _, job = plan_job(on_cpu, check=False)
    rows = expert_rows_per_rank(spec, job, on_cpu.grid)
    balanced = rows * moe_layer_count(spec)
    routed = [r["routed_pairs"] for r in sorted(ranks, key=lambda r: r["rank"])]
    out = []
    for r in ranks:
        received = received_rows(routed, r["rank"], plan.expert_parallel, spec.moe_experts // plan.expert_parallel)
        peak = predict(plan, r["rank"])["peak_bytes"]
        out.append((received, balanced, peak_at_received_rows(peak, spec, job, rows, received)))
    return out


def run_one(model_dir: Path, corpus: Path, arch: str, route: tuple, workdir: Path) -> dict:
    strategy, world, expert, micro = route
    plan = make_plan(model_dir, strategy, world, expert, micro)
    base = workdir / f"{arch}-{strategy}-{world}-{expert}"
    argv = ["--output", str(base / "out"), "--data", str(corpus), *TRAIN]
    ranks, started = rl.launch_measured(plan, base, argv, world, script=__file__)
    row = {"arch": arch, "strategy": strategy, "world": world, "expert": expert, "micro_batch": micro,
           "grid": plan.grid.describe(), "leaf_modules": plan.leaf_modules, **started}
    if ranks is None:
        return row
    for r in ranks:
        routed = Path(f"{base / 'mem'}.rank{r['rank']}.routed.json")
        r["routed_pairs"] = json.loads(routed.read_text()) if routed.exists() else []
    row["ranks"] = ranks
    row["predicted"] = predict(plan)
    if expert > 1:  # the plan's peak is the busiest expert rank's: each rank's at the rows it received
        at_rows = at_received_rows(plan, ranks)
        for r, (received, balanced, peak) in zip(ranks, at_rows):
            r.update(received_rows=received, balanced_rows=balanced, predicted_peak_bytes=peak,
                     peak_ratio=peak / r["peak_bytes"])
    return rl.with_ratios(row)


def make_inputs(scratch: Path) -> tuple[dict, Path]:
    from toolkit.run import tiny

    models = {arch: tiny.make_tiny_model(arch, scratch / arch, layers=2, hidden=64, experts=4, corpus_chars=100_000)
              for arch in ARCHS}
    return models, tiny.write_corpus(scratch / "corpus", max_chars=60_000)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(*argv[1:])
        return 0
    if argv[:1] == ["--md"]:
        rows = json.loads((OUT / "moe_distributed_memory.json").read_text())
        (OUT / "moe_distributed_memory.md").write_text(markdown(rows))
        return 0
    replace = argv[:1] == ["--replace"]
    if argv[:1] == ["--repredict"]:  # every stored row predicted again by this code, its measurement kept
        with tempfile.TemporaryDirectory() as scratch:
            rows = merged([], make_inputs(Path(scratch))[0])
        (OUT / "moe_distributed_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
        (OUT / "moe_distributed_memory.md").write_text(markdown(rows))
        return 0
    argv = argv[1:] if replace else argv
    wanted = [(a, (s, int(w), int(e), 2 if int(w) == 2 else 1)) for a, s, w, e in (x.split(":") for x in argv)]
    wanted = wanted or [(a, r) for a in ARCHS for r in ROUTES]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        models, corpus = make_inputs(Path(scratch))
        for arch, route in wanted:
            row = run_one(models[arch], corpus, arch, route, Path(scratch))
            row["measured_at"] = toolkit_commit()
            rows.append(row)
            if "error" in row:
                print(f"{arch} {route} FAILED ({row['wall_s']} s):\n{row['error']}", flush=True)
                continue
            print(f"{arch} {row['strategy']} {row['grid']}: peak {row['predicted']['peak_bytes']:,} / "
                  f"{row['measured_peak_bytes']:,} = {row['peak_ratio']:.4f}  persistent "
                  f"{row['predicted']['persistent_bytes']:,} / {row['measured_persistent_bytes']:,} = "
                  f"{row['persistent_ratio']:.4f}  ranks {[r['peak_bytes'] for r in row['ranks']]} at rows "
                  f"{[(r.get('received_rows'), round(r.get('peak_ratio', 0), 4)) for r in row['ranks']]} "
                  f"({row['predicted']['peak_phase']}; {row['wall_s']} s)", flush=True)
        if replace:
            rows = merged(rows, models)
    if argv and not replace:
        return 0
    (OUT / "moe_distributed_memory.json").write_text(json.dumps(rows, indent=1) + "\n")
    (OUT / "moe_distributed_memory.md").write_text(markdown(rows))
    return 0


def _key(row: dict) -> tuple:
    return row["arch"], row["strategy"], row["world"], row["expert"]


def merged(fresh: list[dict], models: dict) -> list[dict]:
    """The stored rows with `fresh` in place of theirs; every other row keeps its measurement (and the commit it
    was measured at, read from the stored page where the row has none) and is predicted again by this code."""
    import re

    page = (OUT / "moe_distributed_memory.md").read_text()
    before = re.search(r"toolkit (\S+),", page)
    by_key = {_key(r): r for r in fresh}
    rows = []
    for old in json.loads((OUT / "moe_distributed_memory.json").read_text()):
        row = by_key.pop(_key(old), None)
        if row is None and "error" not in old:
            row = dict(old, measured_at=old.get("measured_at", before.group(1) if before else "unknown"))
            plan = make_plan(models[row["arch"]], row["strategy"], row["world"], row["expert"], row["micro_batch"])
            row["predicted"] = predict(plan)
            if row["expert"] > 1:
                at_rows = at_received_rows(plan, row["ranks"])
                for r, (_, _, peak) in zip(row["ranks"], at_rows):
                    r.update(predicted_peak_bytes=peak, peak_ratio=peak / r["peak_bytes"])
            row["peak_ratio"] = row["predicted"]["peak_bytes"] / row["measured_peak_bytes"]
            row["persistent_ratio"] = row["predicted"]["persistent_bytes"] / row["measured_persistent_bytes"]
        rows.append(row or old)
    return rows + list(by_key.values())


ROUTE_NAMES = {"fsdp2": "transformers DistributedConfig (FSDP2 x EP)", "zero1": "DeepSpeed AutoEP, ZeRO-1",
               "zero2": "DeepSpeed AutoEP, ZeRO-2", "zero3": "DeepSpeed AutoEP, ZeRO-3"}


def _route(row: dict) -> str:
    if row["expert"] == 1:
        return f"ZeRO-3, leaf module {', '.join(row['leaf_modules']) or '(none: fused experts)'}"
    return ROUTE_NAMES[row["strategy"]]


def _measured_at(rows: list[dict]) -> list[str]:
    """Which commit measured which rows, where they differ (a `--replace` run re-measures some); every row is
    predicted by the commit of the page's first line."""
    commits: dict[str, list[str]] = {}
    for r in rows:
        commits.setdefault(r.get("measured_at", "?"), []).append(f"{r['arch']} {r['strategy']} x{r['world']}")
    if len(commits) < 2:
        return []
    return ["Measured (the runs) at: " + "; ".join(f"{c}: {', '.join(names)}" for c, names in commits.items())
            + "; predicted by the commit above.", ""]


def markdown(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    lines = ["# Expert-parallel routes on 2 and 4 CPU processes: predicted vs measured per-rank memory", "",
             measured_line("moe_distributed_memory.py"), "", *_measured_at(rows),
             "Each row is a real `toolkit.train` run of a plan (toolkit.run.rehearsal.plan_for_model; its emitted "
             "accelerate config, DeepSpeed JSON and training_args, started by `accelerate launch`) over gloo, fp32, "
             f"sequences of {SEQ} tokens, {rl.STEPS} steps, of a tiny random-weight model of a real MoE architecture "
             "(toolkit.run.tiny: 2 layers, hidden 64, 4 experts top-2, vocabulary 512; Qwen3-MoE 189,312 "
             "parameters, Mixtral 287,552), on every route that trains on CPU: transformers' DistributedConfig "
             "(FSDP2 x EP, AllToAllEP), DeepSpeed AutoEP on ZeRO-1/2/3, and ZeRO-3 with the MoE block as leaf "
             "module (no EP). 2 processes at micro-batch 2; 4 processes (EP composed with data parallelism: ep 2 x "
             "fsdp 4, AutoEP 2 x dp 4) at micro-batch 1. Measured on every rank as benchmarks/distributed_memory.py "
             "measures (rl_distributed_memory.py's worker: torch's MemTracker from before the model and the engine "
             "exist, CPU storages only), after giving each local shard its own storage (transformers cuts a shard "
             "as a view of the loaded tensor, which on CPU keeps the whole tensor alive; a GPU copies it): "
             f"*between steps*, the live bytes before step {rl.MEASURED}; *peak*, the highest live total of step "
             f"{rl.MEASURED} from its inputs to the optimizer step. Predicted: `estimate_memory` of the plan's job "
             "and grid (toolkit.plan.job.plan_job, device kind cpu): Breakdown.between_steps_bytes, and the peak, "
             "which is the busiest expert rank's (it assumes 1.25x the mean routed rows, "
             "toolkit.estimate.expertrows.EP_WORST_RANK_SHARE). *At its rows*: each rank's own peak (estimate_memory "
             "of that rank: under ZeRO-2 its own gradient partition, toolkit.estimate.zeropartition; the plan's "
             "figure on the other routes) moved to the rows it really received in the measured step "
             "(toolkit.estimate.expertrows.peak_at_received_rows; the rows read from transformers' experts modules' "
             "top_k_index and AutoEP's router counts), the like-for-like comparison; the range over the ranks. Ratios are predicted / measured; off by more than 5% in "
             "bold.", "",
             "| model | route | grid | processes | between steps: predicted | measured | ratio | peak: predicted "
             "(busiest rank) | measured (largest rank) | ratio | at its rows, each rank | received / balanced rows "
             "| predicted peak phase | wall |", "|" + "---|" * 14]
    flag = lambda x: f"**{x:.4f}**" if abs(x - 1) > 0.05 else f"{x:.4f}"
    for r in rows:
        head = f"| {r['arch']} | {_route(r)} | {r['grid']} | {r['world']} |"
        if "error" in r:
            lines.append(head + " failed (see the json) |" + " |" * 9)
            continue
        p = r["predicted"]
        each = [x["peak_ratio"] for x in r["ranks"] if "peak_ratio" in x]
        at_rows = f"{flag(min(each))} to {flag(max(each))}" if each else "(no EP)"
        shares = ", ".join(f"{x['received_rows'] / x['balanced_rows']:.2f}" for x in r["ranks"]
                           if "received_rows" in x) or "-"
        lines.append(f"{head} {p['persistent_bytes']:,} B | {r['measured_persistent_bytes']:,} B | "
                     f"{flag(r['persistent_ratio'])} | {p['peak_bytes']:,} B | {r['measured_peak_bytes']:,} B | "
                     f"{flag(r['peak_ratio'])} | {at_rows} | {shares} | {p['peak_phase']} | {r['wall_s']} s |")
    ratios = [abs(r["persistent_ratio"] - 1) for r in ok]
    ratios += [abs(x.get("peak_ratio", r["peak_ratio"]) - 1) for r in ok for x in r["ranks"]]
    lines += ["", f"Worst |ratio - 1| over between steps and each rank's peak (at its rows where EP): "
              f"{max(ratios, default=float('nan')):.2%}, {len(ok)} of {len(rows)} runs (goal 5%).", "", FINDINGS]
    return "\n".join(lines) + "\n"


FINDINGS = """## What the runs found, and what changed

Engine lines are transformers 5.24 and DeepSpeed 0.19.8 as installed; the live storages at a peak were named with
the diagnostic `DM_STORAGES=<folder>` (benchmarks/distributed_memory.py's _watch_peak on the measured step).

**The token exchange is not a state.** toolkit counted expert parallelism's all-to-all send and receive buffers (2 x
tokens x top_k x hidden, 65,536 B here) among the engine buffers alive from step to step. transformers'
AllToAllEP (`distributed/expert_parallel.py` `_dispatch_tokens` / `_combine_tokens`) and AutoEP's `_AllToAllV`
(`module_inject/auto_ep_layer.py`) make them inside the MoE layer and save none of them for backward: the runs held
none between steps (before the change: Qwen3-MoE FSDP2 x EP +5.6%, AutoEP ZeRO-1 +3.7%, all of it this term) nor at
the head's loss. They are now `States.layer_transient`, live in the decoder layers' forward and backward only
(toolkit/estimate/memory.py `_simulate`): between steps every EP row is now within 0.3%.

**A ZeRO-3 group of one rank gathers nothing.** Under AutoEP with ZeRO-3 the experts are partitioned over the
expert-data-parallel group (`runtime/engine.py` `_partition_autoep_zero3_experts`), world / autoep_size ranks; at
autoep_size = world that group is one rank, and `partition_parameters.py` `all_gather_coalesced` hands its
parameters a `NoGatherHandle`, whose data is the partition itself: the local experts are never copied. toolkit
counted them gathered (+6.4% at the peak, the 196,608 B of local experts); toolkit.estimate.states.autoep_states
now gathers each group only where it spans more than one rank (1.0086 after).

**Routing.** The plan's peak is the busiest expert rank's (1.25x the mean routed rows, assumed); the random routers
of these tiny models sent 0.95x-1.05x the balanced rows to each rank, so the plan's figure is above each rank's by up
to the 1.25x share (Mixtral ep 2: 148,736 B, 4.4%). Moved to the rows each rank received, the prediction is the
like-for-like one.

**ZeRO-2's gradient partition holds whole parameters, and the head's gradient waits beside it.** DeepSpeed
allocates `grads_in_partition` at the first gradient a bucket reduction copies into a rank's partition
(`stage_1_and_2.py` `copy_grads_in_partition`), sized as the sum of the numels of `params_in_partition`: every
parameter with an element in the partition counts whole. The head (32,768 elements, above the 4,096-element bucket)
skips the IPG bucket, so its whole gradient waits until the next hook reduces it and copies it in, allocating the
partition beside it: the head rank's peak (`DM_STORAGES`). toolkit counted P/N from after the head's backward; it
now counts the worst rank's whole tensors (toolkit.estimate.zeropartition, from the model's own parameters in
DeepSpeed's order: at 4 processes the head straddles the last two dense partitions of 22,752 elements and both hold
it whole) and the head's gradient beside it at the end of the head's backward (States.head_gradient). Before ->
after, the plan's peak against the largest rank: Qwen3-MoE 0.9779 -> 1.0042 (2 processes), 0.8894 -> 0.9902 (4);
Mixtral 0.9807 -> 0.9996, 0.9185 -> 0.9934; the head ranks at their rows (Qwen3-MoE / Mixtral): at 2 processes
from -5.1% / -5.6% to -2.5% / -3.7%, at 4 from -12.7%, -10.5% / -10.4%, -9.1% to -2.6%, -0.1% / -2.9%, -1.4%.
The ZeRO-2 rows were re-run at this branch's commits (the first line above says which; toolkit.train, which the
ranks run, is the same in each), the other rows' runs kept and predicted again.

**Each rank its own gradient partition, allocated by its own first tensor.** The plan prices every rank at the worst
one (what the planner must judge: the worst rank's whole tensors from the head's backward on), which put the
4-process ranks whose partitions hold no large tensor up to 9.0% over at their rows (`DM_STORAGES`: ranks 0 and 1
peak in lm_head's backward holding its 131,072 B gradient and no partition). DeepSpeed allocates a rank's
grads_in_partition at the first reduction that copies one of its own tensors in (`copy_grads_in_partition`; a
gradient outside the partition is only cleared), and AutoEP's experts are partitioned over the
expert-data-parallel group, in which rank r is r // autoep_size (`utils/groups.py` `_get_expert_parallel_ranks`:
ranks 0, 2 and 1, 3 here). `estimate_memory(..., rank=r)` now prices rank r with its own partition
(toolkit.estimate.zeropartition.rank_gradient_partitions: its elements, and the backward region of its first
reduced tensor, from whose backward peak it is counted) and with the head's gradient at the head's backward peak
where the trace has the weight gradient there (micro-batch 1 here); the plan's figure is unchanged. Each rank at its
rows, before -> after: Qwen3-MoE 4 processes 0.9736..1.0903 -> 0.9655..1.0362, 2 processes 0.9754..1.0181 ->
0.9702..0.9962; Mixtral 0.9706..1.0896 -> 0.9608..1.0413, 0.9632..1.0200 -> 0.9595..1.0040 (Mixtral's rank 0 at 2
processes, whose partition holds both layers' local experts, re-run with `DM_STORAGES`: its peak is in layer 1's
experts' backward beside its 590,336 B partition). Left: a partition is counted from its region's backward peak,
so rank 1 at 4 processes, whose first tensor is layer 1's q_proj (that layer's last gradient), is over by 3.6% /
4.1%; and AutoEP moves the replaced routers to the end of the dense group (`runtime/engine.py`
`_remap_param_groups_after_module_replacement`) where toolkit keeps the model's order (256 elements a router: ranks
2 and 3 measured 69,856 / 57,856 elements against 70,112 / 57,344 predicted).

Not measured here: bf16 (toolkit.train's CPU runs are fp32), activation checkpointing, GPT-OSS and DeepSeek-V3
(GPT-OSS ep 2 x fsdp 4 is measured by tests/test_moe.py), GPUs (NCCL's all-to-all, the DeepEP path).
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

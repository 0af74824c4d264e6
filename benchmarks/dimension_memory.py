"""Tensor and sequence parallelism: predicted vs measured per-rank memory of real multi-process CPU runs (gloo).

The companion of benchmarks/distributed_memory.py (same model, same measurement, its helpers): for each model-parallel
dimension that runs on CPU (docs/ENGINE_FACTS.md "Which dimensions run on CPU"), torchrun starts the plan's
processes, each trains the small random-init Llama for a few steps with torch's MemTracker active from before the
model is created, and reports the live tensor bytes just before a steady-state step (persistent) and the peak over
that step.

- FSDP2 x TP (dp_shard 2 x tp 2, 4 processes): transformers shards the model as it loads it
  (`from_pretrained(distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))`, the route toolkit.train takes),
  torch AdamW(fused=True).
- ZeRO-1 / ZeRO-3 x Ulysses SP (sp 2, 2 processes): DeepSpeed with `UlyssesSPAttentionHF.register_with_transformers`
  as accelerate calls it, the DeepSpeed JSON the emitter writes for the plan, each rank fed its half of the
  sequence (position_ids and pre-shifted labels, as DeepSpeed's UlyssesSPDataLoaderAdapter does), the loss
  aggregated over the SP group as the HF Trainer does (transformers deepspeed_sp_compute_loss).

Predicted: toolkit.estimate.memory.estimate_memory(spec, strategy, job, hw, grid=plan.grid) (the planning side's
per-rank model of each dimension), and, beside it, the per-rank states formula the measurement is checked against
(module docstring of `states_formula`).

    python benchmarks/dimension_memory.py            # writes benchmarks/results/dimension_memory.{md,json}
    python benchmarks/dimension_memory.py zero3-sp2  # one case, printed only
    python benchmarks/dimension_memory.py --md       # rewrite the .md from the stored .json
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import meta as provenance_meta

sys.path.insert(0, str(Path(__file__).parent))
import distributed_memory as dm  # noqa: E402  (the shared model shape and MemTracker helpers)

SEQ, MICRO = dm.SEQ, dm.MICRO
CASES = {  # name: (strategy, world, tensor, sequence, ALST tiling, sequence length)
    "fsdp2-tp2": ("fsdp2", 4, 2, 1, False, SEQ),
    "zero1-sp2": ("zero1", 2, 1, 2, False, SEQ),
    "zero3-sp2": ("zero3", 2, 1, 2, False, SEQ),
    "zero3-sp2-tiled": ("zero3", 2, 1, 2, True, SEQ),
    "zero3-tiled": ("zero3", 2, 1, 1, True, 4 * SEQ),
}
"""The tiled cases run toolkit.patches.tiling's patch (DeepSpeed TiledMLP + SequenceTiledCompute for the logits +
loss), as toolkit.train does: zero3-sp2-tiled beside zero3-sp2 (64 tokens per rank: one chunk each, so the
difference is what tiling keeps and recomputes), zero3-tiled at 512 tokens per rank (TiledMLP in 2 chunks of 256 =
the hidden size)."""
PRECISION = "fp32"


def _plan(name: str, model_dir: str):
    from toolkit.run.rehearsal import plan_for_model

    strategy, world, tensor, sequence, tiled, seq = CASES[name]
    plan = plan_for_model(model_dir, strategy, gpus_per_node=world, micro_batch=MICRO, seq_len=seq,
                          precision=PRECISION, tensor=tensor, sequence=sequence)
    return plan.replace(tiled=True) if tiled else plan


# ----------------------------------------------------------------------------------------------------------------
# Worker (one rank, under torchrun)


def worker(name: str, model_dir: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    plan = _plan(name, model_dir)
    grid = plan.grid
    seq = plan.seq_len
    tracker = MemTracker()
    result: dict = {"rank": rank}
    with tracker:
        kwargs = dict(dtype=torch.float32, attn_implementation="sdpa")
        if grid.tensor > 1:
            from transformers.distributed.configuration_utils import DistributedConfig

            dist.init_process_group("gloo")
            model = AutoModelForCausalLM.from_pretrained(model_dir, distributed_config=DistributedConfig(
                tp_size=grid.tensor, fsdp_size=grid.dp_shard, dp_replicate_size=grid.dp_replicate), **kwargs)
            model.config.use_cache = False
            model.train()
            result["shard_view_bytes"] = _compact_local_shards(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            engine = model
        else:
            import deepspeed
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
            from transformers.integrations.deepspeed import deepspeed_sp_compute_loss  # noqa: F401  (exists)

            deepspeed.init_distributed(dist_backend="gloo")
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
            model.config.use_cache = False
            model.train()
            mpu = None
            if grid.sequence > 1:
                mpu = UlyssesSPAttentionHF.register_with_transformers(
                    model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=grid.sequence,
                    micro_batch_size=MICRO, seq_length=seq, seq_length_is_variable=True)
            if plan.tiled:
                from toolkit.patches.tiling import apply_tiling

                apply_tiling(model, agree_across_ranks=True)
            ds = dm._ds_config(plan.strategy, PRECISION, model_dir, plan=plan)
            # accelerate's _prepare_deepspeed sets this last under SP: micro x accumulation x data-parallel ranks.
            ds["train_batch_size"] = plan.grid.global_batch(plan.micro_batch, plan.grad_accum)
            result["ds_config"] = ds
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, mpu=mpu)

        # Every rank of a data-parallel group reads the same batch (dp 1 in the SP cases; per dp rank under TP).
        dp_rank = rank // (grid.tensor * grid.sequence)
        g = torch.Generator().manual_seed(dp_rank)
        ids = torch.randint(0, dm.SHAPE["vocab_size"], (MICRO, seq), generator=g)
        if grid.sequence > 1:
            sp_rank, chunk = rank % grid.sequence, seq // grid.sequence
            shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
            part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
            positions = torch.arange(seq).unsqueeze(0).expand(MICRO, -1)
            batch = {"input_ids": ids[:, part].contiguous(), "position_ids": positions[:, part].contiguous(),
                     "shift_labels": shifted[:, part].contiguous()}
            batch["labels"] = batch["shift_labels"]
        else:
            batch = {"input_ids": ids, "labels": ids.clone()}

        def step() -> float:
            loss = engine(**batch).loss
            if grid.sequence > 1:
                group = mpu.get_sequence_parallel_group()  # DeepSpeed's parallel_state_sp, public
                losses = torch.distributed.nn.functional.all_gather(loss, group=group)
                tokens = (batch["shift_labels"] != -100).sum()
                counts = torch.distributed.nn.functional.all_gather(tokens, group=group)
                loss = (torch.stack(losses) * torch.stack(counts)).sum() / torch.stack(counts).sum()
                engine.backward(loss)
                engine.step()
            elif engine is not model:  # DeepSpeed without SP
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            value = float(loss.detach())
            del loss
            return value

        def roots() -> dict:
            # What is alive, named by the attribute that holds it (as distributed_memory.json records).
            out = {"model": model, "optimizer": optimizer, "engine": engine, "params": dict(model.named_parameters())}
            inner = getattr(optimizer, "optimizer", None)
            out["optimizer.state"] = (inner or optimizer).state
            return out

        result["losses"] = dm.measured_steps(tracker, step, result, model, roots=roots)
        result["local_param_elements"] = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters()
                                             if getattr(p, "ds_id", None) is None)
    Path(f"{out_path}.rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # REFERENCE: avoids ZeRO-3's occasional abort at exit


def _compact_local_shards(model) -> int:
    """Give every local shard its own storage; return the bytes that freed.

    transformers cuts each rank's shard from the loaded tensor with `source[slices].to(device)`
    (distributed/sharding_utils.py DtensorShardOperation.shard_tensor): on a GPU `.to(cuda)` copies the slice, on
    the CPU it is a no-op and the shard stays a view that keeps the whole tensor's storage alive. Measuring that
    would count a CPU artifact as the per-rank weights, so the shards are copied out first (the losses show the
    run is otherwise unchanged)."""
    import torch

    freed = 0
    with torch.no_grad():
        for param in model.parameters():
            local = getattr(param, "_local_tensor", param)
            held = local.untyped_storage().nbytes()
            own = local.numel() * local.element_size()
            if held > own:
                local.data = local.clone()
                freed += held - own
    return freed


# ----------------------------------------------------------------------------------------------------------------
# Driver


def states_formula(name: str, spec, plan) -> dict:
    """What each rank holds between steps, fp32 weights, torch AdamW (8 bytes of states per element), checked
    against the measurement:
    - FSDP2 x TP: the local DTensor shard of every parameter, 4 (weight) + 8 (AdamW) bytes per local element;
      gradients are freed between steps (zero_grad(set_to_none=True)). Local elements = for each parameter, its
      numel / (dp_shard x tp) when the model's tp_plan shards it, / dp_shard otherwise (norms), FSDP2 padding the
      first dimension up to a multiple of dp_shard (toolkit.inputs.tensorplan says which weights TP shards).
    - ZeRO-1 x SP: the whole fp32 model 4P + the fp32 master partition 4P/N + AdamW 8P/N, N = dp x sp (DeepSpeed
      partitions over the sequence-data-parallel group).
    - ZeRO-3 x SP: 4P/N parameter partitions + 4P/N master + 8P/N AdamW + 4P/N gradient partitions + one
      reduce bucket (reduce_bucket_size x 4), N = dp x sp."""
    grid = plan.grid
    p = spec.params
    if grid.tensor > 1:
        local = _tp_local_elements(spec, grid)
        return {"formula": "12 x local elements (tp_plan shards / dp_shard x tp, the rest / dp_shard)",
                "persistent_bytes": 12 * local, "local_param_elements": local}
    n = grid.shard_group
    if plan.strategy == "zero1":
        return {"formula": "4P + 12P/N", "persistent_bytes": int(4 * p + 12 * p / n)}
    bucket = dm._ds_config(plan.strategy, PRECISION, plan.model, plan=plan)["zero_optimization"]["reduce_bucket_size"]
    return {"formula": "20P/N + reduce bucket", "persistent_bytes": int(20 * p / n + 4 * bucket)}


def _tp_local_elements(spec, grid) -> int:
    """Elements of one rank's shards: the tp_plan's split of decoder layer 0 (times the layers) and of everything
    outside the layers (toolkit.inputs.tensorplan.tensor_split reads transformers' own plan), then FSDP2's
    dp_shard-way split (every first dimension here divides evenly, so no padding)."""
    from toolkit.inputs.tensorplan import tensor_split

    split = tensor_split(spec, grid.tensor)
    return (split.rank_layer_params * spec.num_layers + split.rank_outside_params) // grid.dp_shard


def predict(name: str, model_dir: str) -> dict:
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec

    plan = _plan(name, model_dir)
    spec = build_spec("llama", dm._config())
    out = {"params": spec.params, "grid": plan.grid.describe() + (", tiled" if plan.tiled else "")
           + (f", seq {plan.seq_len}" if plan.seq_len != SEQ else "")}
    out["formula"] = states_formula(name, spec, plan)
    job = Job(seq_len=plan.seq_len, micro_batch=MICRO, precision=PRECISION, device_kind="cpu", tiled=plan.tiled)
    hw = parse_hardware(f"{plan.world_size}xA100-80GB")
    b = estimate_memory(spec, plan.strategy_spec, job, hw, grid=plan.grid)
    # Persistent as distributed_memory.py predicts it: the states model's terms alive across steps (no step
    # gradients, no gathered parameters, no step temporaries), at the rank's own shapes.
    from toolkit.estimate.dimensions import rank_view
    from toolkit.estimate.memory import states_for

    view = rank_view(spec, job, plan.grid)
    st = states_for(view.spec, plan.strategy_spec, view.job, plan.grid, params=view.spec.params)
    out["model"] = {"peak_bytes": b.peak_bytes, "peak_phase": b.peak_phase,
                    "persistent_bytes": int(st.parameters + st.gradients + st.master + st.optimizer + st.buffers),
                    "activations_bytes": b.activations_bytes,
                    "terms": [(t.name, t.bytes) for t in b.terms]}
    return out


def run_one(name: str, model_dir: str, workdir: str, port: int) -> dict:
    out = os.path.join(workdir, name)
    world = CASES[name][1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(port),
           __file__, "--worker", name, model_dir, out]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)
             if Path(f"{out}.rank{r}.json").exists()]
    row = {"case": name, "world": world, "wall_s": round(time.perf_counter() - start, 1)}
    if len(ranks) != world:
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
        return row
    row["ranks"] = ranks
    row["measured_persistent_bytes"] = max(r["persistent_bytes"] for r in ranks)
    row["measured_peak_bytes"] = max(r["peak_bytes"] for r in ranks)
    return row


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(*argv[1:4])
        return 0
    out = Path(__file__).parent / "results"
    if argv[:1] == ["--md"]:
        data = json.loads((out / "dimension_memory.json").read_text())
        (out / "dimension_memory.md").write_text(markdown(data["rows"], data["meta"]))
        return 0
    import torch

    names = argv or list(CASES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(dm._config()).save_pretrained(model_dir)
        for i, name in enumerate(names):
            row = run_one(name, model_dir, tmp, 29700 + 13 * i + os.getpid() % 100)
            row["predicted"] = predict(name, model_dir)
            _ratios(row)
            print(_line(row), flush=True)
            rows.append(row)
    if argv:
        return 0
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            **provenance_meta(), "shape": dm.SHAPE, "seq": SEQ, "micro_batch": MICRO,
            "precision": PRECISION}
    import deepspeed
    import transformers

    meta["deepspeed"], meta["transformers"] = deepspeed.__version__, transformers.__version__
    (out / "dimension_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str) + "\n")
    (out / "dimension_memory.md").write_text(markdown(rows, meta))
    print(f"wrote {out / 'dimension_memory.json'} and .md")
    return 0


def _ratios(row: dict) -> None:
    if "error" in row:
        return
    formula, model = row["predicted"].get("formula", {}), row["predicted"].get("model")
    if "persistent_bytes" in formula:
        row["formula_persistent_ratio"] = formula["persistent_bytes"] / row["measured_persistent_bytes"]
    if model:
        row["model_persistent_ratio"] = model["persistent_bytes"] / row["measured_persistent_bytes"]
        row["model_peak_ratio"] = model["peak_bytes"] / row["measured_peak_bytes"]


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['case']:10} FAILED ({row['wall_s']} s):\n{row['error']}"
    mib = 2**20
    parts = [f"{row['case']:10} measured persistent {row['measured_persistent_bytes'] / mib:7.2f} MiB, peak "
             f"{row['measured_peak_bytes'] / mib:7.2f} MiB"]
    for key in ("formula_persistent_ratio", "model_persistent_ratio", "model_peak_ratio"):
        if key in row:
            parts.append(f"{key} {row[key]:.3f}")
    parts.append(f"losses {row['ranks'][0]['losses']} ({row['wall_s']} s)")
    return "  ".join(parts)


def markdown(rows: list[dict], meta: dict) -> str:
    mib = 2**20
    fmt = lambda x: "-" if x is None else (f"**{x:.3f}**" if abs(x - 1) > 0.05 else f"{x:.3f}")
    lines = ["# Tensor and sequence parallelism: predicted / measured per-rank memory of real CPU runs", "",
             (f"One run, {meta['date']}, torch {meta['torch']}, DeepSpeed {meta.get('deepspeed', '-')}, transformers "
              f"{meta.get('transformers', '-')}, {meta['machine']}. Produced by `python benchmarks/dimension_memory.py` "
              f"(a few minutes on 2 idle cores). Model: the one of distributed_memory.md (toolkit.run.tiny llama "
              f"{meta['shape']}, P = {rows[0]['predicted']['params']:,}), random init, seq {meta['seq']}, micro-batch "
              f"{meta['micro_batch']}, {meta['precision']}, gloo (torchrun); step: forward with labels, backward, torch "
              "AdamW(fused=True); step 3 is measured."), "",
             ("Measured per rank with torch's MemTracker active from before the model is created, CPU storages only: "
              "*persistent* = live bytes just before the measured step, *peak* = the highest live total during it "
              "(the largest rank). TP: transformers' load-time sharding (`DistributedConfig(tp_size=2, "
              "fsdp_size=2)`, 4 processes), as toolkit.train runs it. SP: DeepSpeed Ulysses "
              "(`UlyssesSPAttentionHF.register_with_transformers`, the emitter's DeepSpeed JSON, each rank fed its "
              "half of the sequence with position_ids and pre-shifted labels, the loss aggregated over the SP group "
              "as the HF Trainer does), 2 processes."), "",
             ("*Formula*: the per-rank states formula (benchmarks/dimension_memory.py `states_formula`). *Model*: "
              "`estimate_memory(spec, strategy, job, hw, grid=plan.grid)`, the planner's per-rank model. Ratios are "
              "predicted / measured; off by more than 5% in bold. Tiled rows: ALST tiling (DeepSpeed TiledMLP + "
              "SequenceTiledCompute for the logits + loss, toolkit.patches.tiling); a row at another length says "
              "so in its grid column."), "",
             "| case | grid | persistent MiB measured | formula | ratio | model | ratio | peak MiB measured | model | "
             "ratio | losses (rank 0) |", "|" + "---|" * 11]
    for r in rows:
        p = r["predicted"]
        if "error" in r:
            lines.append(f"| {r['case']} | {p['grid']} | failed | | | | | | | | see json |")
            continue
        formula, model = p.get("formula", {}), p.get("model") or {}
        lines.append(
            f"| {r['case']} | {p['grid']} | {r['measured_persistent_bytes'] / mib:.2f} | "
            f"{formula['persistent_bytes'] / mib:.2f} ({formula['formula']}) | "
            f"{fmt(r.get('formula_persistent_ratio'))} | " if "persistent_bytes" in formula else
            f"| {r['case']} | {p['grid']} | {r['measured_persistent_bytes'] / mib:.2f} | - | - | ")
        lines[-1] += (f"{model['persistent_bytes'] / mib:.2f} | {fmt(r.get('model_persistent_ratio'))} | "
                      if model else "not landed | - | ")
        lines[-1] += f"{r['measured_peak_bytes'] / mib:.2f} | "
        lines[-1] += (f"{model['peak_bytes'] / mib:.2f} | {fmt(r.get('model_peak_ratio'))} | " if model
                      else "not landed | - | ")
        lines[-1] += ", ".join(f"{x:.4f}" for x in r["ranks"][0]["losses"]) + " |"
    lines += ["", findings(rows, meta)]
    return "\n".join(lines) + "\n"


HEAD_BACKWARD_PROBE_BYTES = 32_649_028
"""The LM head's backward peak a one-off probe run of fsdp2-tp2 recorded (not a case of this benchmark)."""


def _within(deviation: float) -> str:
    """A bound on |ratio - 1| as the findings say it: 0.1%, or whole per cent rounded up."""
    return "0.1%" if deviation <= 0.001 else f"{math.ceil(deviation * 100)}%"


def findings(rows: list[dict], meta: dict) -> str:
    """The findings, their numbers read from this run's rows (dimension_memory.json) and the model's shape."""
    from toolkit.inputs.job import mlp_shards

    by = {r["case"]: r for r in rows if "error" not in r}
    states = [abs(by[case][key] - 1) for case in by for key in ("formula_persistent_ratio", "model_persistent_ratio")
              if key in by[case]]
    tp_row, shape, word = by["fsdp2-tp2"], meta["shape"], {"fp32": 4, "bf16": 2}[meta["precision"]]
    tp, sp, long_seq = CASES["fsdp2-tp2"][2], CASES["zero3-sp2"][3], CASES["zero3-tiled"][5]
    vocab, hidden = shape["vocab_size"], shape["hidden"]
    tokens = meta["micro_batch"] * meta["seq"]
    head_slice, norm = vocab // tp * hidden * word, hidden * word
    losses = [", ".join(f"{x:.4f}" for x in by[c]["ranks"][0]["losses"]) for c in ("zero3-sp2", "zero3-sp2-tiled")]
    return FINDINGS.format(
        params=rows[0]["predicted"]["params"], precision=meta["precision"], states_within=_within(max(states)),
        view_mb=max(r.get("shard_view_bytes", 0) for r in tp_row["ranks"]) / 1e6,
        shard_mb=max(r["persistent_by_type"]["parameter"] for r in tp_row["ranks"]) / 1e6,
        sp_within=_within(max(abs(by[c]["model_peak_ratio"] - 1) for c in ("zero1-sp2", "zero3-sp2"))),
        tp_within=_within(abs(tp_row["model_peak_ratio"] - 1)), tp_peak_mb=tp_row["measured_peak_bytes"] / 1e6,
        tail=head_slice + norm, head_slice=head_slice, norm=norm, logits_slice=tokens * vocab // tp * word,
        logits=tokens * vocab * word, over_probe_kb=(tp_row["measured_peak_bytes"] - HEAD_BACKWARD_PROBE_BYTES) / 1000,
        sp_tokens=meta["seq"] // sp, untiled_mib=by["zero3-sp2"]["measured_peak_bytes"] / 2**20,
        tiled_mib=by["zero3-sp2-tiled"]["measured_peak_bytes"] / 2**20,
        tiled_within=_within(abs(by["zero3-sp2-tiled"]["model_peak_ratio"] - 1)),
        losses_said="equal" if losses[0] == losses[1] else "differ from", long_seq=long_seq,
        chunks=mlp_shards(long_seq, hidden), hidden=hidden,
        long_within=_within(abs(by["zero3-tiled"]["model_peak_ratio"] - 1)))


FINDINGS = """## Findings

P = {params:,} parameters, {precision}, torch AdamW (8 bytes of states per element). Storage names and what is alive at
each rank's peak are in dimension_memory.json (`storages`, `at_peak`), as in distributed_memory.json.

**Persistent states per rank are exact for every dimension that runs on CPU.** The planner's states model at the
rank's own shapes (`states_for(rank_view(spec, job, grid).spec, ...)`, toolkit.estimate.dimensions) and the
formula in `states_formula` give the same bytes, and both equal the measurement to {states_within}:
- FSDP2 x TP (dp_shard 2 x tp 2): 12 bytes per local element, the local elements being the tp_plan's split
  (toolkit.inputs.tensorplan.tensor_split: q, k, v, gate, up colwise, o, down rowwise, embedding and LM head split,
  norms whole) divided by dp_shard; the measured DTensor local shards hold exactly that many elements.
- ZeRO x Ulysses SP (sp 2): DeepSpeed partitions over the sequence-data-parallel group (dp x sp = 2 here), so the
  states are ZeRO's at N = dp x sp: ZeRO-1 4P + 12P/N, ZeRO-3 20P/N + one reduce bucket, as distributed_memory.md
  measured for plain ZeRO at N = 2. Sequence parallelism changes no state.

**A CPU artifact removed before measuring TP.** transformers cuts each rank's shard with `source[slices].to(device)`
(distributed/sharding_utils.py `DtensorShardOperation.shard_tensor`); on a GPU `.to(cuda)` copies the slice, on the
CPU it is a no-op and the shard stays a view that keeps the whole loaded tensor's storage alive: each rank held
{view_mb:.1f} MB of full-size storages for its {shard_mb:.1f} MB of shards (`shard_view_bytes`). The benchmark copies the shards out
first (`_compact_local_shards`); the losses are unchanged bit for bit.

**Peaks.** ZeRO-1 x SP and ZeRO-3 x SP are within {sp_within} (the planner traces the layers at seq / sp tokens and adds the
Ulysses all-to-all staging of q, k, v and the KV-head replication as derived terms). FSDP2 x TP matches to {tp_within},
in the phase where it is measured: the LM head's forward. It was over-predicted by 7.4% (35.06 MB in the head's
backward against {tp_peak_mb:.2f} MB measured) until the model followed what the run does (toolkit.estimate.dimensions
`logits_gather_bytes`, toolkit.estimate.memory `_fsdp_plan_groups`):
- FSDP2 groups. transformers wraps a tensor-parallel model itself (distributed/fsdp.py
  `apply_fully_sharded_data_parallelism`, from the model's `fsdp_plan`): the final norm + LM head, marked
  `keep_full_weight`, are one group unsharded from the head's forward to its backward ({tail:,} B per rank here);
  the embedding and every layer are their own groups, resharded after forward, and the root holds no parameter.
  The model had the accelerate wrapping instead (the root, embedding + norm + head, gathered all step, plus a
  layer): 2.4 MB too many at the head. Now the tail is the constant, and a layer's or the embedding's unsharded
  parameters live only while that region computes, plus, in forward, the group's all-gather output that FSDP2
  holds until the next group's copy-out or the end of the root's forward (`_fsdp_param_group.py`
  wait_for_unshard, `all_gather_state`; the {tail:,} B storage at the peak beside the tail's own {head_slice:,} +
  {norm:,} B parameters).
- The head's forward. `colwise_gather_output` computes this rank's vocab / tp slice of the logits ({logits_slice:,} B)
  and gathers them (DTensor Shard(-1) -> Replicate: an all-gather into a buffer along dim 0, then chunk + cat
  into the whole-vocabulary logits, 2 x {logits:,} B), all alive at once, while the loss's fp32 log-softmax (part
  of the head's saved bytes in the trace) does not exist yet. The trace at the rank's shapes keeps the head whole
  (the logits are whole after the gather) and only saw the whole logits; the model now takes the larger of the
  two moments. The gathered logits and their gradients are whole on every rank (the loss sees the whole
  vocabulary), the fp32 logits are counted once (fp32: `.float()` is a no-op), and the head saves the normed
  hidden state, not the logits.
- The head's backward, now modelled at 32,644,616 B, is as high as the forward: a probe run that recorded the
  backward's own peak found 32,649,028 B (the log-softmax, its gradient and the logits' gradient, whole, with
  only the tail unsharded); the forward's gather is {over_probe_kb:.0f} KB higher. Checked on its own over gloo: a Shard(-1) ->
  Replicate redistribute of a {logits_slice:,} B slice peaks at the slice + 2 x {logits:,} B.
The CPU-side TP view (transformers' `source[slices].to(device)`) plays no part in the peak once the shards are
copied out (above); on CPU MemTracker sees no gloo-internal buffer, as on a GPU it would not see NCCL's.

**ALST tiling** (`--tiled`: toolkit.patches.tiling's patch, DeepSpeed's TiledMLP in every layer and the logits +
loss through its SequenceTiledCompute, as toolkit.train applies it). zero3-sp2-tiled is zero3-sp2 with tiling: at {sp_tokens}
tokens per rank every chunk count is 1, so the difference is what tiling keeps and recomputes: the MLPs' FFN-wide
tensors and the whole logits with their log-softmax are no longer held from forward to backward, and the measured
peak falls from {untiled_mib:.2f} to {tiled_mib:.2f} MiB, predicted within {tiled_within} (the model traces the same patch under FakeTensorMode at the
rank's shapes); the losses {losses_said} the untiled run's to the printed digits, and the states do not change.
zero3-tiled runs plain ZeRO-3 (dp 2) at {long_seq} tokens per rank, so TiledMLP cuts each rank's sequence into {chunks} chunks of
{hidden} (the hidden size): its peak is predicted to {long_within}. What tiling costs in time (the MLPs' and the LM head's forward
run again in backward) is in the step-time model (toolkit.estimate.timing `tiled_recompute_s`), not measured here.

**Not measured here**: context parallelism (needs CUDA, benchmarks/gpu_check.py --multi-gpu), bf16 (the HF
Trainer refuses bf16 with DeepSpeed on CPU; the states terms for bf16 are those of distributed_memory.md), and the
communication buffers NCCL keeps on a GPU.
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

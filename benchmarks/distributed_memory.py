"""Distributed states check: predicted vs measured per-rank memory of real 2-process CPU runs (gloo).

For DDP (control), DeepSpeed ZeRO-1/2/3 and torch FSDP2, in fp32 and bf16, two processes (torchrun, gloo) train a
small random-init Llama (seq 128, micro-batch 2) for a few steps: forward with labels, backward, optimizer step
(torch AdamW(fused=True) as the client optimizer, what the HF Trainer passes). On every rank torch's MemTracker
(torch.distributed._tools.mem_tracker, the tracker toolkit.livebytes uses) is active from before the model and the
engine are created, so the engines' flat buffers are seen; measured are the live tensor bytes just before a
steady-state step (persistent states) and the peak of live tensor bytes over that step.

DeepSpeed runs the JSON the project's emitter writes (toolkit.emit.deepspeed.ds_config for a plan made by
toolkit.train.rehearsal.plan_for_model), with "auto" values resolved the way the HF Trainer does
(toolkit.emit.validate.resolve_like_trainer). Predicted is toolkit.memory.estimate_memory for the same job on
"2xA100-80GB" with --device-kind cpu.

    python benchmarks/distributed_memory.py          # writes benchmarks/results/distributed_memory.{md,json}
    python benchmarks/distributed_memory.py zero2:bf16 ddp:fp32   # a subset, printed only
    python benchmarks/distributed_memory.py --md                  # rewrite the .md from the stored .json
"""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = {"vocab_size": 2000, "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 2, "ffn": 688, "max_positions": 512}
SEQ, MICRO, WORLD = 128, 2, 2
STEPS = 3  # step 1 allocates optimizer states; step 3 is measured
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
PRECISIONS = ("fp32", "bf16")


def _config():
    from toolkit.tiny import tiny_config

    return tiny_config("llama", **SHAPE)


# ----------------------------------------------------------------------------------------------------------------
# Worker (one rank, under torchrun)


def _ds_config(strategy: str, precision: str, model_dir: str) -> dict:
    from toolkit.emit.deepspeed import ds_config, hidden_size
    from toolkit.emit.validate import resolve_like_trainer
    from toolkit.train.rehearsal import plan_for_model

    plan = plan_for_model(model_dir, strategy, gpus_per_node=WORLD, micro_batch=MICRO, seq_len=SEQ,
                          precision=precision)
    config = ds_config(plan)
    resolved = resolve_like_trainer(config, world_size=plan.world_size, micro_batch=plan.micro_batch,
                                    grad_accum=plan.grad_accum, hidden_size=hidden_size(plan),
                                    precision=precision)
    if os.environ.get("DM_REUSE_DISTANCE") and "stage3_max_reuse_distance" in resolved["zero_optimization"]:
        # Diagnostic only: what ZeRO-3 holds when parameters are released after each module's forward.
        resolved["zero_optimization"]["stage3_max_reuse_distance"] = int(os.environ["DM_REUSE_DISTANCE"])
    resolved["steps_per_print"] = 10**9
    resolved["wall_clock_breakdown"] = False
    return resolved


def _total(tracker, kind: str = "current") -> int:
    """Live bytes on the CPU. MemTracker also counts meta-device storages (DeepSpeed ZeRO-1/2 keeps
    round_robin_bit16_meta, a meta copy of every parameter): those hold no memory and are left out."""
    return sum(snap.get("Total", 0) for dev, snap in tracker.get_tracker_snapshot(kind).items()
               if str(dev).startswith("cpu"))


def _by_type(tracker) -> dict[str, int]:
    out: dict[str, int] = {}
    for d, dev in tracker.get_tracker_snapshot("current").items():
        if not str(d).startswith("cpu"):
            continue
        for k, b in dev.items():
            name = "total" if k == "Total" else str(getattr(k, "value", k)).lower()
            out[name] = out.get(name, 0) + b
    return out


def _named_storages(roots: dict) -> dict[int, str]:
    """data_ptr of every tensor reachable from the given objects' attributes (lists, tuples, dicts, two levels
    deep, optimizer state included) -> a name, to label what is alive."""
    import torch

    names: dict[int, str] = {}

    def visit(obj, name: str, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", None)  # DTensor
            t = local if isinstance(local, torch.Tensor) else obj
            try:
                if t.device.type != "meta" and t.untyped_storage().data_ptr():
                    names.setdefault(t.untyped_storage().data_ptr(), f"{name} {t.dtype} {tuple(t.shape)}")
            except (RuntimeError, NotImplementedError):  # storages without data (freed, fake)
                pass
            if getattr(obj, "grad", None) is not None:
                visit(obj.grad, name + ".grad", depth)
            return
        if depth > 3:
            return
        if isinstance(obj, dict):
            for k, v in list(obj.items())[:4000]:
                visit(v, f"{name}[{k if isinstance(k, (str, int)) else type(k).__name__}]", depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj[:4000]):
                visit(v, f"{name}[{i}]", depth + 1)
        elif hasattr(obj, "__dict__") and depth < 2 and not isinstance(obj, type):
            for k, v in vars(obj).items():
                visit(v, f"{name}.{k}", depth + 1)

    for root, obj in roots.items():
        visit(obj, root, 0)
    return names


def _live_storages(tracker, names: dict[int, str], top: int = 25) -> list[tuple[int, str]]:
    out = []
    for st, (winfo, _) in list(tracker._WINFO.items()):
        if not str(winfo.device).startswith("cpu"):
            continue
        try:
            ptr = st.data_ptr()
        except (RuntimeError, NotImplementedError):
            continue
        out.append((winfo.mem_consumed, names.get(ptr, f"? ptr={ptr:#x} nbytes_now={st.nbytes()}")))
    out.sort(reverse=True)
    return out[:top]


def _watch_peak(tracker, result: dict, names: dict[int, str], model) -> None:
    """Record the live CPU storages (largest first, named where known) each time the CPU total reaches a new
    peak: what is alive at the measured step's peak."""
    original = tracker._update_peak_stats
    params = list(model.named_parameters())
    best = {"bytes": _total(tracker)}

    def update(peak_state):
        original(peak_state)
        total = sum(snap.get("Total", 0) for dev, snap in tracker._curr_mem_snap.items() if str(dev).startswith("cpu"))
        if total > best["bytes"]:
            best["bytes"] = total
            result["at_peak"] = {"bytes": total, "backward": bool(tracker._mod_tracker.is_bw),
                                 "modules": sorted(tracker._mod_tracker.parents)[-3:],
                                 "storages": _live_storages(tracker, names, top=30),
                                 "gathered_params": [(n, q.data.numel() * q.data.element_size()) for n, q in params
                                                     if getattr(q, "ds_id", None) is not None and q.data.numel() > 1],
                                 "param_grads": [(n, q.grad.numel() * q.grad.element_size()) for n, q in params
                                                 if q.grad is not None]}

    tracker._update_peak_stats = update


def worker(strategy: str, precision: str, model_dir: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    tracker = MemTracker()
    result: dict = {"rank": rank}
    with tracker:
        if strategy != "ddp" and strategy != "fsdp2":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
        else:
            dist.init_process_group("gloo")
        torch.manual_seed(0)
        config = _config()
        config._attn_implementation = "sdpa"
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.train()
        amp = None
        if strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            engine = DistributedDataParallel(model)  # gradient_as_bucket_view=False, as accelerate leaves it
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            amp = torch.bfloat16 if precision == "bf16" else None
        elif strategy == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if precision == "bf16" else MixedPrecisionPolicy()
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
            engine = model
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        else:
            import deepspeed

            ds = _ds_config(strategy, precision, model_dir)
            result["ds_config"] = ds
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)

        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, SHAPE["vocab_size"], (MICRO, SEQ), generator=g)
        batch = {"input_ids": ids, "labels": ids.clone()}

        def step() -> float:
            ctx = torch.autocast("cpu", dtype=amp) if amp is not None else torch.autocast("cpu", enabled=False)
            with ctx:
                loss = engine(**batch).loss
            if strategy in ("ddp", "fsdp2"):
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            else:
                engine.backward(loss)
                engine.step()
            value = float(loss.detach())
            del loss
            return value

        losses = []
        for i in range(STEPS):
            gc.collect()
            tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise
            if i == STEPS - 1:
                result["persistent_bytes"] = _total(tracker)
                result["persistent_by_type"] = _by_type(tracker)
                if os.environ.get("DM_STORAGES"):
                    roots = {"model": model, "optimizer": optimizer, "engine": engine}
                    inner = getattr(optimizer, "optimizer", None)
                    if inner is not None:
                        roots["optimizer.optimizer.state"] = inner.state
                    roots["params"] = {n: p for n, p in model.named_parameters()}
                    result["storages"] = _live_storages(tracker, _named_storages(roots))
                tracker._peak_mem = {dev: snap["Total"]
                                     for dev, snap in tracker.get_tracker_snapshot("current").items()}
                if os.environ.get("DM_STORAGES"):
                    _watch_peak(tracker, result, _named_storages(roots), model)
            losses.append(step())
        result["peak_bytes"] = _total(tracker, "peak")
        gc.collect()
        result["after_bytes"] = _total(tracker)
        result["losses"] = losses
    Path(f"{out_path}.rank{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # REFERENCE: avoids ZeRO-3's occasional abort at exit


# ----------------------------------------------------------------------------------------------------------------
# Driver


def predict(strategy: str, precision: str) -> dict:
    from toolkit.hardware import parse_hardware
    from toolkit.job import Job
    from toolkit.memory import _states_for, estimate_memory
    from toolkit.modelspec import build_spec
    from toolkit.strategy import parse_strategy

    config = _config()
    spec = build_spec("llama", config)
    job = Job(seq_len=SEQ, micro_batch=MICRO, precision=precision, device_kind="cpu")
    hw = parse_hardware(f"{WORLD}xA100-80GB")
    kind = parse_strategy(strategy)
    b = estimate_memory(spec, kind, job, hw)
    s = _states_for(spec, kind, job, hw, params=spec.params, dp=WORLD)
    return {"params": spec.params, "peak_bytes": b.peak_bytes, "peak_phase": b.peak_phase,
            "breakdown_states_bytes": b.parameters_bytes + b.gradients_bytes + b.optimizer_bytes + b.buffers_bytes,
            # What the states model says is alive between steps (no step grads, no gathered params, no step temps).
            "persistent_bytes": int(s.parameters + s.gradients + s.master + s.optimizer + s.buffers),
            "states": {k: getattr(s, k) for k in ("parameters", "gradients", "step_gradients", "master", "optimizer",
                                                   "buffers", "gathered", "step_transient")},
            "activations_bytes": b.activations_bytes}


def run_one(strategy: str, precision: str, model_dir: str, workdir: str, port: int) -> dict:
    out = os.path.join(workdir, f"{strategy}-{precision}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "DM_STORAGES": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port", str(port),
           __file__, "--worker", strategy, precision, model_dir, out]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    ranks = []
    for r in range(WORLD):
        p = Path(f"{out}.rank{r}.json")
        if p.exists():
            ranks.append(json.loads(p.read_text()))
    row = {"strategy": strategy, "precision": precision, "wall_s": round(time.perf_counter() - start, 1)}
    if len(ranks) != WORLD:
        row["error"] = (proc.stdout + proc.stderr)[-3000:]
        return row
    row["ranks"] = ranks
    return row


def main(argv: list[str]) -> int:
    if argv[:1] == ["--worker"]:
        worker(*argv[1:5])
        return 0
    if argv[:1] == ["--md"]:  # rewrite the markdown from the stored json
        out = Path(__file__).parent / "results"
        data = json.loads((out / "distributed_memory.json").read_text())
        (out / "distributed_memory.md").write_text(markdown(data["rows"], data["meta"]))
        return 0
    import torch

    from toolkit.tiny import tiny_config  # noqa: F401  (fail early)

    pairs = [tuple(a.split(":")) for a in argv] or [(s, p) for s in STRATEGIES for p in PRECISIONS]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        _config().save_pretrained(model_dir)
        for i, (strategy, precision) in enumerate(pairs):
            row = run_one(strategy, precision, model_dir, tmp, 29500 + 17 * i + os.getpid() % 100)
            row["predicted"] = predict(strategy, precision)
            if "error" not in row:
                meas_persist = max(r["persistent_bytes"] for r in row["ranks"])
                meas_peak = max(r["peak_bytes"] for r in row["ranks"])
                row["measured_persistent_bytes"] = meas_persist
                row["measured_peak_bytes"] = meas_peak
                row["persistent_ratio"] = row["predicted"]["persistent_bytes"] / meas_persist
                row["peak_ratio"] = row["predicted"]["peak_bytes"] / meas_peak
                print(f"{strategy:6}{precision:5} persistent {row['predicted']['persistent_bytes'] / 2**20:7.2f} / "
                      f"{meas_persist / 2**20:7.2f} MiB = {row['persistent_ratio']:.3f}   peak "
                      f"{row['predicted']['peak_bytes'] / 2**20:7.2f} / {meas_peak / 2**20:7.2f} MiB = "
                      f"{row['peak_ratio']:.3f}  losses {row['ranks'][0]['losses']}  ({row['wall_s']} s)", flush=True)
            else:
                print(f"{strategy:6}{precision:5} FAILED ({row['wall_s']} s):\n{row['error']}", flush=True)
            rows.append(row)
    if argv:
        return 0
    out = Path(__file__).parent / "results"
    meta = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "date": time.strftime("%Y-%m-%d"), "shape": SHAPE, "seq": SEQ, "micro_batch": MICRO, "world": WORLD}
    try:
        import deepspeed

        meta["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    (out / "distributed_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2, default=str)
                                                 + "\n")
    (out / "distributed_memory.md").write_text(markdown(rows, meta))
    print(f"wrote {out / 'distributed_memory.json'} and .md")
    return 0


def _phase(rank: dict) -> str:
    at = rank.get("at_peak")
    if not at:
        return "?"
    mods = [m for m in at["modules"] if m != "Global"]
    where = mods[-1] if mods else "outside modules (optimizer step)"
    return f"{'backward' if at['backward'] else 'forward'}: {where}" if mods else where


def markdown(rows: list[dict], meta: dict) -> str:
    mib = 2**20
    lines = ["# Distributed states: predicted / measured per-rank memory of real 2-process CPU runs", "",
             (f"One run, {meta['date']}, torch {meta['torch']}, DeepSpeed {meta.get('deepspeed', '-')}, "
             f"{meta['machine']}. Produced by `python benchmarks/distributed_memory.py` (about 2 minutes on 2 idle cores). "
             f"Model: toolkit.tiny llama {meta['shape']} (P = {rows[0]['predicted']['params']:,} parameters), random "
             f"init, seq {meta['seq']}, micro-batch {meta['micro_batch']}, {meta['world']} processes over gloo "
             "(torchrun), sdpa. Step: forward with labels, backward, torch AdamW(fused=True) as the client optimizer; "
             "step 3 is measured (step 1 allocates the optimizer states)."), "",
             ("Measured per rank with torch's MemTracker active from before the model and the engine are created "
             "(so every flat buffer is seen), CPU storages only (MemTracker also counts meta-device storages: "
             "ZeRO-1/2's `round_robin_bit16_meta` would add a phantom P x dtype bytes): *persistent* = live bytes just "
             "before the measured step, *peak* = the highest live total during it (the larger of the two ranks; "
             "they differ by the uneven partition padding only). DeepSpeed runs the JSON the emitter writes "
             "(`toolkit.emit.deepspeed.ds_config` for `plan_for_model(..., precision)`, resolved with "
             "`resolve_like_trainer`); FSDP2: `fully_shard` per decoder layer and the root, "
             "`MixedPrecisionPolicy(param_dtype=bf16)` for bf16; DDP: `gradient_as_bucket_view=False`, AMP for bf16."),
             "",
             ("Predicted: `estimate_memory(spec, parse_strategy(s), Job(seq_len=128, micro_batch=2, precision, "
             "device_kind='cpu'), parse_hardware('2xA100-80GB'))`. *Persistent* predicted = the states model's "
             "parameters + gradients + master + optimizer + buffers (toolkit.states, no step gradients, no gathered "
             "parameters, no step temporaries), i.e. what the model treats as alive across steps. Ratios are "
             "predicted / measured."), "",
             ("| strategy | precision | persistent MiB (pred / meas) | ratio | peak MiB (pred / meas) | ratio | "
             "predicted peak phase | measured peak at |"), "|" + "---|" * 8]
    for r in rows:
        p = r["predicted"]
        if "error" in r:
            lines.append(f"| {r['strategy']} | {r['precision']} | {p['persistent_bytes'] / mib:.2f} / failed | | "
                         f"{p['peak_bytes'] / mib:.2f} / failed | | {p['peak_phase']} | see json |")
            continue
        rank = max(r["ranks"], key=lambda x: x["peak_bytes"])
        flag = lambda x: f"**{x:.3f}**" if abs(x - 1) > 0.05 else f"{x:.3f}"
        lines.append(f"| {r['strategy']} | {r['precision']} | {p['persistent_bytes'] / mib:.2f} / "
                     f"{r['measured_persistent_bytes'] / mib:.2f} | {flag(r['persistent_ratio'])} | "
                     f"{p['peak_bytes'] / mib:.2f} / {r['measured_peak_bytes'] / mib:.2f} | {flag(r['peak_ratio'])} | "
                     f"{p['peak_phase']} | {_phase(rank)} |")
    lines += ["", "Ratios off by more than 5% are in bold; the reasons are below.", "", FINDINGS]
    return "\n".join(lines) + "\n"


FINDINGS = """## Findings

P = 3,795,200 parameters, N = 2 ranks, pb = bytes of a compute-dtype element (4 fp32, 2 bf16), h = 256. Engine
source lines are DeepSpeed 0.19.8 / torch 2.13 as installed. Storage names come from each rank's JSON
(`storages`: live CPU storages before the measured step, named by the engine attribute that holds them;
`at_peak`: the same at the step's peak, plus, for ZeRO-3, which parameters are gathered there).

**DDP (control), ZeRO-1**: exact (persistent and peak within 0.1%). ZeRO-1 holds exactly pb*P weights (flat
`bit16_groups`), fp32 master partition 4P/N (`single_partition_of_fp32_groups`), AdamW states 8P/N, and nothing else
between steps. The model is right here.

**ZeRO-2, persistent over by 21% (fp32) / 13% (bf16)**: the states model puts the low-precision gradient partition
(`gradients = pb*P/N`) and two reduce buckets (`buffers = 2*h^2*pb`) in the persistent states. Measured, neither is
alive between steps: DeepSpeed allocates `grads_in_partition` lazily at the first bucket reduction of each backward
(stage_1_and_2.py:2190-2194, in copy_grads_in_partition) and drops it in `_release_ipg_buffers` (stage_1_and_2.py:924-931,
called from independent_gradient_partition_epilogue at :1061; `averaged_gradients` keeps it until step() frees it at
:3131); the ipg bucket is created per backward in setup_buckets (stage_1_and_2.py:3256-3280) and there is ONE buffer of
reduce_bucket_size unless overlap_comm is true, which the emitter writes false for stage 2. Persistent measured =
pb*P + 4P/N + 8P/N, the same as ZeRO-1.

**ZeRO-2, peak over by 7% (fp32) / 8% (bf16)**: the same two terms are in `base` for every phase of `_simulate`. bf16:
the peak is the head's backward, before the first reduction, and the prediction minus pb*P/N + 2h^2*pb is 45.99 MiB
against 46.00 measured (exact). fp32: the measured peak is one region later (model.norm backward) with
`grads_in_partition` (7.59 MB = 4P/N) already allocated, so simply dropping the two terms would under-predict
(62.12 MiB, ratio 0.949): the partition must appear during backward, not vanish. The model also never counts a
ZeRO-2 parameter's full `param.grad`, which exists until its hook copies it into the bucket (`step_gradients = 0`).
Suggested (not yet checked against the measurement) (toolkit/states.py zero_states, stage 2):
`s.gradients = 0`; a new backward-lifetime term `s.backward_gradients = P*pb/N` that `_simulate` adds to
`grads_done` once the first backward region has produced its weight gradients (and keeps through the step);
`s.buffers = reduce_bucket_size * pb * (2 if overlap_comm else 1)` counted from the start of backward to its end
only; and the region's own full-size weight gradients (`region.params * pb`) at its backward peak.

**ZeRO-3, persistent within 2%**: measured = optimizer states 8P/N + fp32 master 4P/N (`fp32_partitioned_groups_flat`)
+ pb*P/N parameter partitions (`fp16_partitioned_groups`) + pb*P/N `grad_partitions_flat_buffer` (stage3.py:791, dtype
gradient_accumulation_dtype = bf16 here) + ONE ipg bucket of reduce_bucket_size*pb (stage3.py:780-784), allocated
once at init and kept. The model has 4 buckets (`buffers = bucket*pb*2*2`); the right term is
`reduce_bucket_size * pb` per communication dtype (0.75 MiB over here, 1-2% of this tiny model, negligible at scale).

**ZeRO-3, peak under by 14% (fp32) / 10% (bf16)**: at the measured peak (the head's backward) every parameter of the
model is gathered (`at_peak.gathered_params`: all 39, 15.18 MB = 4P fp32), not "the largest layer + the prefetch
bucket" (`gathered = (largest_layer + 0.9 h^2) * pb` = 751,718 elements). The missing bytes are exactly
(P - 751,718) * pb = 11.6 MiB fp32 / 5.8 MiB bf16, less the bucket overcount above (0.75 / 0.375 MiB): 10.87 / 5.43
MiB, the measured gaps. A probe (forward hooks counting parameters whose `.data` is not the empty placeholder, rank
0, fp32, the emitted JSON) gives gathered elements after each decoder layer's forward 2,459,904 / 3,598,592 /
3,696,896 / 3,795,200 (= P), after forward P, then after each layer's backward 2,590,976 / 1,898,752 / 1,206,528 /
514,304 (one layer, 692,224, released per layer; the lm_head first), 2,304 (persistent norms) after backward. So
ZeRO-3 here keeps (almost) the whole model unsharded from forward into backward, and releases it region by region in
backward. Not the cause: stage3_max_reuse_distance (set to 0 with `DM_REUSE_DISTANCE=0`: 3,614,976 still gathered
after forward, same peak 76.86 MiB) and stage3_max_live_parameters (8e5: P still gathered after forward). Likely
cause, not confirmed: the prefetcher (partitioned_param_coordinator.py:451-470) pops the parameter trace ahead and
stamps `__most_recent_step_id_param_fetched_for` for parameters that are already AVAILABLE, and
`__params_to_release` (partitioned_param_coordinator.py:649-652) then refuses to release any parameter whose stamp is
later than the current step, i.e. whose reuse the prefetcher skipped. Whether a GPU run at scale does the same is
not measured here (the ratio of the prefetch bucket 0.9h^2 to a layer, ~11h^2, is the same as in real models).
Suggested until that is settled (zero_states, stage 3): `s.gathered = P * pb` (like FSDP2 grad_op), with `_simulate`
removing each region's `params * pb` from the gathered term once that region's backward is done (forward phases:
the gathered prefix of the layers done so far + the current one). That reproduces the measured peak to within the
bucket term here.

**FSDP2, persistent over by 24% (fp32) / 12% (bf16)**: measured persistent = sharded fp32 parameters 4P/N + AdamW
states 8P/N exactly (DTensor local shards named `optimizer.param_groups` / `optimizer.state`). The model adds
`buffers = 2 * layer_params * compute` (unsharded gradients of the layer being reduce-scattered) to the persistent
states and to every phase. FSDP2 creates those in backward and frees them after each reduce-scatter
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:616-630 post_backward sets `unsharded_param.grad = None`,
_fsdp_collectives.py:522 foreach_reduce). Suggested: count `buffers` for FSDP2 in the backward phase only (not in
forward, not at the step, not in states_floor).

**FSDP2, peak over by 14% (fp32) / 9% (bf16)**: mostly the same term: the prediction minus
`2 * layer_params * compute` is 56.83 / 43.36 MiB against 54.45 / 42.04 measured (+4.4% / +3.1%). The remaining few
percent: at the measured peak (layers.3 backward, fp32) one layer-sized flat storage is alive (2.77 MB =
layer_params * 4: one layer's unsharded parameters or its reduce-scatter input, same size), while the model keeps
`gathered = (2 * layer_params + root) * compute` through backward (the root's parameters do stay unsharded after
forward: _fsdp_state.py:207 sets the root's post_forward_mesh_info = None). Which of the model's 2 layers is not there
(or what else the model overcounts by ~2.4 MiB fp32 / ~1.3 MiB bf16) was not broken down in the time available.

**Measurement note**: MemTracker counts meta-device storages like real ones; DeepSpeed ZeRO-1/2 keeps
`round_robin_bit16_meta` (stage_1_and_2.py:485, a meta copy of every parameter), which would show as a phantom
P*pb bytes (a 20-40% "error" that is not there). The benchmark counts CPU storages only.
"""


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

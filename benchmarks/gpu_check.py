"""Predicted vs measured on one real GPU: peak memory (allocated and reserved) and step time, for every engine.

Prepared for a session lent one H200: one script, nothing from the network (random weights from configs built
here), under 8 minutes. Cases: DDP (1 process), ZeRO-2, ZeRO-3 (DeepSpeed, torch AdamW as the client optimizer so
no op is compiled), FSDP2 (fully_shard per decoder layer + root, bf16 MixedPrecisionPolicy), LoRA (when peft is
installed), each with and without activation checkpointing, Liger kernels where liger-kernel is installed, on
Llama-style shapes of 1B to 8B parameters. Every engine runs as a world of one (gloo on CPU, NCCL on CUDA), which
exercises each engine's own buffers; on CUDA each case in a process of its own (case_in_child: the engines keep their
memory after a case), on CPU all in this one.

    python benchmarks/gpu_check.py --device cuda --out "$OUT"     # on the GPU machine
    python benchmarks/gpu_check.py --device cuda --timing --out "$OUT"   # the step-time measurements (below)
    python benchmarks/gpu_check.py --device cpu --quick            # rehearsal here (tiny shapes; tests run it)
    python benchmarks/gpu_derive.py gpu_check.json                 # the constants and efficiencies it implies
    python benchmarks/gpu_check.py --multi-gpu --out "$OUT"        # tensor / context / sequence parallel runs
                                                                   # (MULTI_GPU_RUNS: need 2-4 GPUs)
    python benchmarks/gpu_check.py --device cuda --memory-edge --out "$OUT"   # step time at the memory edge (below)
    python benchmarks/gpu_derive.py "$OUT/gpu_memory_edge.json"    # its slowdowns and the speed headroom
    python benchmarks/gpu_check.py --device cuda --allocator --out "$OUT"     # the allocator model vs the device's
    python benchmarks/gpu_check.py --device cuda --tune --out "$OUT"   # `toolkit tune` here and its calibration

--timing runs what the published corpus (benchmarks/results/throughput.md) cannot settle, on one GPU:
  efficiency per micro-step   DDP steps of one model at 512 to 16,384 tokens per micro-step and at two widths,
                              and one long-sequence case: the measured step over toolkit.estimate.efficiency's prediction
                              tests tokens_half, the hidden term and the Hopper attention factor on this GPU
  engine overhead             the same model and batch under DDP, ZeRO-2, ZeRO-3 and FSDP2 as a world of one: no
                              network, so what each engine adds over DDP is its own non-overlapped work (gathers
                              and frees, bucket copies, partitioned optimizer); the exposed share of real
                              communication needs 2+ GPUs and stays unverified
  pipeline overhead           the DeepSpeed pipeline engine with one stage and M = 1 and 8 micro-batches beside
                              DDP accumulating the same M micro-batches: (pipeline - DDP) / M is the engine's
                              per-micro-batch cost (schedule, buffers, loss on the last stage) that the 1F1B
                              bubble term does not hold

--memory-edge measures what the one published row at the memory edge could not say (llm-foundry MPT-30B at seq
8192, 23-30% slower than its seq-4096 twin where the time model agrees): how much slower a step gets when the caching
allocator has little room above the tensor peak, and from what headroom. Each EDGE_CASES model runs uncapped, then
under torch.cuda.set_per_process_memory_fraction caps at its measured peak plus 30% down to 0.5% (EDGE_HEADROOMS),
2 warm and 5 timed steps each: median step, num_alloc_retries (cache flush + retry) per step, reserved peak, out of
memory. One child process per PYTORCH_CUDA_ALLOC_CONF (default, expandable_segments:True; the allocator reads it
at start). Estimated at about 2 minutes on an H200 (not run on one yet; each child is stopped after
EDGE_CHILD_TIMEOUT_S); gpu_derive.py then gives the smallest headroom whose step stays within the
time model's band (docs/ENGINE_FACTS.md, "The caching allocator at the memory edge").

Measured on CUDA: torch.cuda.max_memory_allocated / max_memory_reserved over a steady-state step (after one step
that creates the optimizer states), the mean time of the next steps, and once per run the CUDA context (device
memory in use outside the caching allocator, from cudaMemGetInfo). On CPU only the step runs and times (there is no
allocator to read). Predicted: toolkit.estimate.memory.estimate_memory for the same job on 1 x the catalog GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

SHAPES = {  # Llama-style: (hidden, layers, heads, kv_heads, ffn); vocab 128256 as Llama 3
    "llama-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    "llama-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
}
QUICK_SHAPE = dict(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256)


@dataclass(frozen=True)
class Case:
    label: str
    shape: str
    strategy: str
    """ddp | zero2 | zero3 | fsdp2 | lora (DDP engine with a PEFT LoRA model)"""
    precision: str = "bf16"
    checkpointing: bool = False
    liger: bool = False
    micro_batch: int = 2
    seq_len: int = 2048
    extra: dict = field(default_factory=dict)


def cases() -> list[Case]:
    out = []
    for ckpt in (False, True):
        c = " ckpt" if ckpt else ""
        b = 8 if ckpt else 2
        out += [
            Case(f"ddp llama-1b bf16{c}", "llama-1b", "ddp", checkpointing=ckpt, micro_batch=b),
            Case(f"ddp llama-1b bf16-pure{c}", "llama-1b", "ddp", precision="bf16-pure", checkpointing=ckpt,
                 micro_batch=b),
            Case(f"zero2 llama-1b bf16{c}", "llama-1b", "zero2", checkpointing=ckpt, micro_batch=b),
            Case(f"zero3 llama-1b bf16{c}", "llama-1b", "zero3", checkpointing=ckpt, micro_batch=b),
            Case(f"fsdp2 llama-3b bf16{c}", "llama-3b", "fsdp2", checkpointing=ckpt, micro_batch=b // 2),
            Case(f"lora llama-8b bf16-pure{c}", "llama-8b", "lora", precision="bf16-pure", checkpointing=ckpt,
                 micro_batch=b // 2),
        ]
    out += [Case("ddp llama-1b bf16 liger", "llama-1b", "ddp", liger=True),
            Case("ddp llama-1b bf16 ckpt liger", "llama-1b", "ddp", checkpointing=True, liger=True, micro_batch=8)]
    return out


def timing_cases() -> list[Case]:
    """The --timing set (see the module docstring): efficiency per micro-step, engine overhead, pipeline overhead."""
    out = [Case(f"eff ddp llama-1b s{seq} mb{mb}", "llama-1b", "ddp", micro_batch=mb, seq_len=seq)
           for seq, mb in ((512, 1), (1024, 1), (2048, 1), (2048, 2), (2048, 4), (2048, 8))]
    out += [Case("eff ddp llama-1b s8192 mb1", "llama-1b", "ddp", micro_batch=1, seq_len=8192),
            Case("eff ddp llama-1b s16384 mb1 ckpt", "llama-1b", "ddp", micro_batch=1, seq_len=16384,
                 checkpointing=True),
            Case("eff ddp llama-3b s2048 mb1 ckpt", "llama-3b", "ddp", micro_batch=1, checkpointing=True),
            Case("eff ddp llama-3b s2048 mb4 ckpt", "llama-3b", "ddp", micro_batch=4, checkpointing=True)]
    out += [Case(f"engine {s} llama-1b s2048 mb2", "llama-1b", s, micro_batch=2)
            for s in ("ddp", "zero2", "zero3", "fsdp2")]
    for m in (1, 8):
        out += [Case(f"pipe ddp llama-1b s2048 mb1 M{m}", "llama-1b", "ddp", micro_batch=1, extra={"accum": m}),
                Case(f"pipe pipeline1 llama-1b s2048 mb1 M{m}", "llama-1b", "pipeline1", micro_batch=1,
                     extra={"accum": m})]
    return out


def _config(shape: dict, vocab: int, seq_len: int):
    from toolkit.run.tiny import tiny_config

    return tiny_config("llama", vocab_size=vocab, max_positions=max(seq_len, 2048), **shape)


def _init_world(device: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("LOCAL_RANK", "0"),
                 ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1)


def _wrap(case: Case, model, device: str):
    """(callable running one step, the module for forward) for the case's engine."""
    import torch

    amp = case.precision == "bf16"
    if case.strategy == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    accum = case.extra.get("accum", 1)
    if case.strategy in ("ddp", "lora"):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

        def step(batch):
            for _ in range(accum):
                with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=amp):
                    loss = model(**batch).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    if case.strategy == "pipeline1":
        return _pipeline_step(case, model, device, accum)
    _init_world(device)
    if case.strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.startswith("cuda"))

        def step(batch):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    import deepspeed

    stage = 2 if case.strategy == "zero2" else 3
    ds_config = {"train_micro_batch_size_per_gpu": case.micro_batch, "gradient_accumulation_steps": 1,
                 "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True,
                 "zero_force_ds_cpu_optimizer": False,
                 "zero_optimization": {"stage": stage, "contiguous_gradients": True, "overlap_comm": stage == 3,
                                       "reduce_bucket_size": 2048 * 2048,
                                       **({"stage3_prefetch_bucket_size": int(0.9 * 2048 * 2048),
                                           "stage3_max_live_parameters": 1_000_000_000,
                                           "stage3_max_reuse_distance": 1_000_000_000} if stage == 3 else {})}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)

    def step(batch):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    return step


def _pipeline_step(case: Case, model, device: str, accum: int):
    """The DeepSpeed pipeline engine over the toolkit's own conversion of the model, one stage, `accum` micro-batches
    per train_batch: its per-micro-batch cost beside DDP doing the same micro-batches."""
    import deepspeed
    import torch

    from toolkit.train.pipeline.convert import Source, build_pipeline

    _init_world(device)
    deepspeed.init_distributed("nccl" if device.startswith("cuda") else "gloo")  # the pipeline module asks its backend
    config = model.config
    source = Source(config, None, checkpointing=case.checkpointing, attention="sdpa")
    with torch.device(device) if device.startswith("cuda") else _null():
        module = build_pipeline(source, [0, config.num_hidden_layers], num_stages=1)
    ds_config = {"train_micro_batch_size_per_gpu": case.micro_batch, "gradient_accumulation_steps": accum,
                 "bf16": {"enabled": case.precision != "fp32"}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 10**9}
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config,
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])

    def step(batch):
        ids = batch["input_ids"]
        engine.train_batch(iter([(ids, batch["labels"])] * accum))
    return step


def _null():
    import contextlib

    return contextlib.nullcontext()


def _predict(case: Case, config, kind: str, gpu: str) -> dict:
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.lora import Adapter
    from toolkit.inputs.strategy import parse_strategy
    from toolkit.estimate.timing import step_time
    from toolkit.estimate.traces import priced_step_time

    spec = build_spec("llama", config)
    # The LoRA case is _wrap's: LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), PEFT's own dropout
    # default (0.0), on a base built in bf16.
    adapter = Adapter(method="lora", r=16, alpha=32.0, dropout=0.0) if case.strategy == "lora" else Adapter()
    job = Job(seq_len=case.seq_len, micro_batch=case.micro_batch, grad_accum=case.extra.get("accum", 1),
              precision=case.precision, checkpointing=case.checkpointing, device_kind=kind, liger=case.liger,
              adapter=adapter)
    # One stage of the pipeline engine is DDP's arithmetic at a world of one; the measured difference is the point.
    strategy = parse_strategy("ddp" if case.strategy in ("lora", "pipeline1") else case.strategy)
    hw = parse_hardware(f"1x{gpu}")
    out = {"params": spec.params}
    b = estimate_memory(spec, strategy, job, hw)
    t = priced_step_time(step_time, spec, strategy, job, hw)  # with the host's dispatch where it may bind
    out.update(allocated_predicted=b.peak_bytes, reserved_predicted=b.reserved_bytes,
               peak_phase=b.peak_phase, step_predicted_s=t.step_time_s, mfu_predicted=t.mfu)
    return out


def _prepare(case: Case, device: str, quick: bool, gpu: str):
    """(case at the shapes run, the row's prediction and job fields, a callable running one step, its batch): the
    model of a real architecture from a config, random weights, wrapped by the case's engine."""
    import contextlib

    import torch

    from toolkit.estimate.profile import _batch, build_model

    cuda = device.startswith("cuda")
    shape = QUICK_SHAPE if quick else SHAPES[case.shape]
    if quick:
        case = replace(case, micro_batch=2, seq_len=64)
    config = _config(shape, 1000 if quick else 128256, case.seq_len)
    row = {"label": case.label, "strategy": case.strategy, "precision": case.precision,
           "checkpointing": case.checkpointing, "liger": case.liger, "micro_batch": case.micro_batch,
           "seq_len": case.seq_len, "accum": case.extra.get("accum", 1), "hidden": shape["hidden"]}
    try:
        row.update(_predict(case, config, "cuda" if cuda else "cpu", gpu))
    except Exception as exc:  # the measurement stands alone: the prediction can be made again off the GPU
        row["predict_error"] = f"{type(exc).__name__}: {exc}"[:300]
    model_precision = "bf16-pure" if case.precision == "bf16-pure" or case.strategy == "lora" else "fp32"
    # Built on the GPU directly: a random 8B init on the host would take minutes of the lease.
    with torch.device(device) if cuda else contextlib.nullcontext():
        model = build_model(config, model_precision, "sdpa", case.checkpointing, device)
    if case.liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    return case, row, _wrap(case, model, device), _batch(config, case.micro_batch, case.seq_len, device)


def run_case(case: Case, device: str, quick: bool, gpu: str) -> dict:
    import importlib.util

    import torch

    cuda = device.startswith("cuda")
    if case.strategy == "lora" and importlib.util.find_spec("peft") is None:
        return {"label": case.label, "skipped": "peft is not installed"}
    if case.liger and (importlib.util.find_spec("liger_kernel") is None or not cuda):
        return {"label": case.label, "skipped": "Liger kernels are Triton: they need liger-kernel and a GPU"}
    case, row, step, batch = _prepare(case, device, quick, gpu)
    step(batch)  # creates the optimizer states: the next step is a steady-state one
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step(batch)
    if cuda:
        torch.cuda.synchronize()
        row["allocated_measured"] = torch.cuda.max_memory_allocated()
        row["reserved_measured"] = torch.cuda.max_memory_reserved()
    start = time.perf_counter()
    steps = 1 if quick else 3
    for _ in range(steps):
        step(batch)
    if cuda:
        torch.cuda.synchronize()
    row["step_measured_s"] = (time.perf_counter() - start) / steps
    return row


def _versions() -> dict:
    """The engines' versions the measurement ran under (the GPU machine's own image may differ from this one's)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "accelerate", "deepspeed", "peft", "trl", "liger-kernel"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU rehearsal)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--gpu", default="H200", help="catalog GPU for the prediction")
    ap.add_argument("--only", help="comma-separated labels to run")
    ap.add_argument("--timing", action="store_true",
                    help="the step-time set: efficiency per micro-step, engine and pipeline overheads")
    ap.add_argument("--memory-edge", action="store_true",
                    help="step time and allocator retries under a memory cap at shrinking headrooms")
    ap.add_argument("--edge-child", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", action="store_true",
                    help="the caching-allocator model against the device's allocator (benchmarks/allocator_check.py)")
    ap.add_argument("--tune", action="store_true",
                    help="`toolkit tune` of three small models on this GPU and their calibration "
                         "(benchmarks/tune_check.py)")
    ap.add_argument("--dry", action="store_true", help="with --tune on CPU: plan and skip every candidate")
    ap.add_argument("--case-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tune:
        from tune_check import tune_check

        return tune_check(args.device, args.quick, args.out, args.gpu, dry=args.dry)
    if args.allocator:
        from allocator_check import allocator_check

        return allocator_check(args.device, args.out)
    if args.memory_edge:
        if args.edge_child:
            return memory_edge_child(args.device, args.quick, args.gpu, args.edge_child)
        return memory_edge(args.device, args.quick, args.out, args.gpu)

    import gc

    import torch

    cuda = args.device.startswith("cuda")
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "quick": args.quick, "gpu": args.gpu, "versions": _versions()}
    if cuda:
        torch.zeros(1, device=args.device) @ torch.zeros(1, device=args.device)  # context + cuBLAS handle
        free, total = torch.cuda.mem_get_info()
        meta["context_bytes"] = total - free - torch.cuda.memory_reserved()
        meta["cuda"] = torch.version.cuda
    rows = []
    wanted = set(args.only.split(",")) if args.only else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_timing.json" if args.timing else "gpu_check.json"
    for case in (timing_cases() if args.timing else cases()):
        if wanted and case.label not in wanted:
            continue
        start = time.perf_counter()
        if args.case_child:  # one case, in the process a parent started for it (case_in_child)
            Path(args.case_child).write_text(json.dumps(_run_guarded(case, args)))
            return 0
        row = case_in_child(case, args) if cuda else _run_guarded(case, args)
        row["wall_s"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        # Written after every case: a lease that ends mid-run still leaves the rows measured so far.
        (out / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    (out / name).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


CASE_CHILD_TIMEOUT_S = 240
"""One case's process on the GPU (an 8B LoRA model built and stepped: ~30 s on an H200)."""


def _run_guarded(case: Case, args) -> dict:
    try:
        return run_case(case, args.device, args.quick, args.gpu)
    except Exception as exc:  # one failing case must not cost the whole lease
        return {"label": case.label, "error": f"{type(exc).__name__}: {exc}"[:300]}


def case_in_child(case: Case, args) -> dict:
    """The case run in a process of its own. On the GPU day of 2026-12-04 every case of a set ran in one process,
    and the engines kept their memory after a case (DeepSpeed's engine, FSDP2's sharded modules stay referenced):
    every row after the first ZeRO / FSDP2 case read the earlier cases' memory too (fsdp2 llama-3b: 98.6 GiB
    allocated there, 56.8 GiB alone; benchmarks/data/gpu_day_2026-12-04/README.md)."""
    import subprocess
    import tempfile

    from toolkit.run.launcher import free_port

    env = {**os.environ, "MASTER_PORT": str(free_port())}  # the world of one, on a port free now
    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / "row.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--gpu", args.gpu,
                "--only", case.label, "--out", tmp, "--case-child", str(part), *(["--quick"] if args.quick else []),
                *(["--timing"] if args.timing else [])]
        try:
            proc = subprocess.run(argv, env=env, timeout=CASE_CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"label": case.label, "error": f"child process: over {CASE_CHILD_TIMEOUT_S} s"}
        if proc.returncode or not part.is_file():
            return {"label": case.label, "error": f"child process: exit code {proc.returncode}"}
        return {**json.loads(part.read_text()), "own_process": True}


# --memory-edge: step time as the caching allocator's room shrinks (docs/ENGINE_FACTS.md, "The caching allocator at
# the memory edge"). Each case runs uncapped, then capped by torch.cuda.set_per_process_memory_fraction at its
# measured tensor peak (max_memory_allocated) plus each headroom, largest first; a cap makes the allocator take the
# path a failed cudaMalloc takes (free cached blocks, synchronize, retry: num_alloc_retries).
EDGE_CASES = [
    Case("edge fsdp2 llama-1b s4096 mb2 ckpt", "llama-1b", "fsdp2", checkpointing=True, micro_batch=2, seq_len=4096),
    Case("edge ddp llama-1b s2048 mb4", "llama-1b", "ddp", micro_batch=4, seq_len=2048),
]
"""FSDP2 with checkpointing is the engine of the published row at the edge (llm-foundry MPT-30B, seq 8192, FSDP full
shard; benchmarks/results/throughput.md): per-layer gathers and recomputed activations come and go every step. DDP
without checkpointing is the other shape: activations larger than the states."""
EDGE_HEADROOMS = (0.30, 0.15, 0.08, 0.04, 0.02, 0.01, 0.005)
EDGE_ALLOCATORS = ("", "expandable_segments:True")
"""PYTORCH_CUDA_ALLOC_CONF of each child process (the allocator reads it once, at start); "" is torch's default."""
EDGE_WARM_STEPS, EDGE_TIMED_STEPS = 2, 5
EDGE_CHILD_TIMEOUT_S, EDGE_CHILD_TIMEOUT_CPU_S = 150, 900
"""A child's limit on the GPU, and on CPU: the rehearsal takes 15 s alone, several times that beside other runs."""
EDGE_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")


def memory_edge(device: str, quick: bool, out_dir: str, gpu: str) -> int:
    """One child process per allocator setting (EDGE_ALLOCATORS), each running every EDGE_CASES sweep; the rows of
    all children go to gpu_memory_edge.json. On CPU there is no caching allocator: one child runs the uncapped steps
    and the prediction, and every capped row says it needs CUDA."""
    import subprocess
    import tempfile

    from toolkit.run.launcher import free_port

    rows: list[dict] = []
    meta: dict = {}
    for setting in EDGE_ALLOCATORS:
        name = setting or "default"
        if setting and not device.startswith("cuda"):
            rows.append({"label": f"allocator {name}", "allocator": name, "skipped": "allocator settings need CUDA"})
            continue
        env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
        env["MASTER_PORT"] = str(free_port())  # FSDP2's world of one, on a port free now (a fixed one may be taken)
        if setting:
            env["PYTORCH_CUDA_ALLOC_CONF"] = setting
        with tempfile.TemporaryDirectory() as tmp:
            part = Path(tmp) / "rows.json"
            argv = [sys.executable, str(Path(__file__).resolve()), "--memory-edge", "--device", device, "--gpu", gpu,
                    "--edge-child", str(part), *(["--quick"] if quick else [])]
            limit = EDGE_CHILD_TIMEOUT_S if device.startswith("cuda") else EDGE_CHILD_TIMEOUT_CPU_S
            try:
                proc = subprocess.run(argv, env=env, timeout=limit)
                failed = f"exit code {proc.returncode}" if proc.returncode or not part.is_file() else ""
            except subprocess.TimeoutExpired:
                failed = f"over {limit} s"
            if failed:
                rows.append({"label": f"allocator {name}", "allocator": name, "error": f"child process: {failed}"})
                continue
            child = json.loads(part.read_text())
        meta = meta or child["meta"]
        rows += child["rows"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "headrooms": list(EDGE_HEADROOMS), "allocators": [a or "default" for a in EDGE_ALLOCATORS]}
    (out / "gpu_memory_edge.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


def memory_edge_child(device: str, quick: bool, gpu: str, rows_path: str) -> int:
    import gc

    import torch

    cuda = device.startswith("cuda")
    setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d"), "quick": quick, "gpu": gpu}
    if cuda:
        meta["total_bytes"] = torch.cuda.mem_get_info()[1]
    rows = []
    for case in EDGE_CASES:
        try:
            rows += _edge_sweep(case, device, quick, gpu, setting)
        except Exception as exc:  # one failing case must not cost the other
            rows.append({"label": case.label, "case": case.label, "allocator": setting or "default",
                         "error": f"{type(exc).__name__}: {exc}"[:300]})
        gc.collect()
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()
    Path(rows_path).write_text(json.dumps({"meta": meta, "rows": rows}))
    return 0


def _edge_sweep(case: Case, device: str, quick: bool, gpu: str, setting: str) -> list[dict]:
    import torch

    cuda = device.startswith("cuda")
    case, job, step, batch = _prepare(case, device, quick, gpu)
    base = {**job, "case": case.label, "allocator": setting or "default"}
    step(batch)  # creates the optimizer states
    warm, timed = (1, 1) if quick else (EDGE_WARM_STEPS, EDGE_TIMED_STEPS)
    uncapped = {**base, "label": f"{case.label} | {base['allocator']} | uncapped", "headroom": None,
                **_edge_steps(step, batch, cuda, warm, timed)}
    if cuda:
        uncapped["expandable_in_use"] = any(s.get("is_expandable") for s in torch.cuda.memory_snapshot())
    rows = [uncapped]
    for headroom in EDGE_HEADROOMS:
        row = {**base, "label": f"{case.label} | {base['allocator']} | cap +{headroom:.1%}", "headroom": headroom}
        if not cuda:
            row["skipped"] = "no caching allocator on CPU: the cap needs CUDA"
        elif any(r.get("oom") for r in rows):
            row["skipped"] = "out of memory at a larger headroom"
        else:
            row["cap_bytes"] = int(uncapped["allocated_peak"] * (1 + headroom))
            torch.cuda.set_per_process_memory_fraction(min(1.0, row["cap_bytes"] / torch.cuda.mem_get_info()[1]))
            torch.cuda.empty_cache()  # the capped run starts from the live tensors only, as a job started at the cap
            row.update(_edge_steps(step, batch, cuda, warm, timed))
        rows.append(row)
    return rows


def _edge_steps(step, batch, cuda: bool, warm: int, timed: int) -> dict:
    """`warm` steps, then `timed` steps each timed alone: their times and median, and on CUDA the tensor and reserved
    peaks of the timed steps and the allocator's counters over the warm and the timed steps apart."""
    import statistics

    import torch

    def counters() -> dict:
        stats = torch.cuda.memory_stats() if cuda else {}
        return {k: stats.get(k, 0) for k in EDGE_COUNTERS}

    times: list[float] = []
    try:
        start = counters()
        for _ in range(warm):
            step(batch)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        warmed = counters()
        for _ in range(timed):
            t = time.perf_counter()
            step(batch)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one; cuBLAS / NCCL report theirs as plain ones
        if "out of memory" not in str(exc).lower():
            raise
        return {"oom": True, "error": str(exc)[:300], "step_times_s": times}
    end = counters()
    out = {"oom": False, "step_times_s": times, "step_median_s": statistics.median(times)}
    if cuda:
        out.update(allocated_peak=torch.cuda.max_memory_allocated(), reserved_peak=torch.cuda.max_memory_reserved(),
                   warm={k: warmed[k] - start[k] for k in EDGE_COUNTERS},
                   timed={k: end[k] - warmed[k] for k in EDGE_COUNTERS})
    return out


# QLoRA: (label, arch, shape, seq, micro-batch, checkpointing). Separate from CONFIGS and main(): run with --qlora.
QLORA_CONFIGS = [
    ("llama-1b qlora nf4 r16 all-linear", "llama", dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192), 2048, 2, False),
    ("llama-1b qlora nf4 r16 all-linear ckpt", "llama", dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192), 2048, 4, True),
]


def qlora_check(device: str, quick: bool, out_dir: str) -> int:
    """QLoRA on one device: the 4-bit base's allocated bytes after loading and the peak of a steady-state step
    (bf16 autocast, fused AdamW over the adapters), against toolkit's estimate (DDP, one GPU). Random weights are
    saved to a temporary folder and loaded back through transformers' BitsAndBytesConfig, as a real run loads them."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.lora import Adapter, counts_for_spec, frozen_base_bytes
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy
    from toolkit.run.tiny import tiny_config
    from toolkit.train.adapters import quantization_config, wrap_model

    kind = "cuda" if device.startswith("cuda") else "cpu"
    adapter = Adapter(method="qlora", r=16, alpha=32, dropout=0.05, targets="all-linear")
    rows = []
    for label, arch, shape, s, b, ckpt in QLORA_CONFIGS:
        if quick:
            shape = {**shape, "hidden": 128, "layers": 2, "ffn": 256, "heads": 4, "kv_heads": 2}
            s, b = 64, 2
        config = tiny_config(arch, vocab_size=1000 if quick else 32000, max_positions=max(s, 2048), **shape)
        try:
            with tempfile.TemporaryDirectory() as tmp:
                AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
                if kind == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=quantization_config(adapter),
                                                             dtype=torch.bfloat16, device_map={"": device})
                loaded = (torch.cuda.memory_allocated() - before) if kind == "cuda" else \
                    sum(p.numel() * p.element_size() for p in model.parameters())
            model.config.use_cache = False
            if ckpt:
                model.activation_checkpointing_enable()
            model = wrap_model(model, adapter, checkpointing=ckpt)
            model.train()
            ids = torch.randint(0, config.vocab_size, (b, s), device=device)
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                          fused=kind == "cuda")

            def step():
                with torch.autocast(device_type=kind, dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            step()
            if kind == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated() if kind == "cuda" else 0
        except Exception as exc:  # one failing config must not cost the whole lease
            rows.append({"label": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            print(label, "ERROR", exc, flush=True)
            continue
        spec = build_spec(arch, config)
        job = Job(seq_len=s, micro_batch=b, precision="bf16", checkpointing=ckpt, device_kind=kind, adapter=adapter)
        predicted = estimate_memory(spec, parse_strategy("ddp"), job, parse_hardware("1xH200-141GB"))
        counts = counts_for_spec(spec, adapter)
        row = {"label": label, "seq_len": s, "micro_batch": b, "checkpointing": ckpt,
               "base_loaded_bytes": loaded, "base_predicted_bytes": frozen_base_bytes(counts, adapter, 2),
               "peak_measured": peak, "peak_predicted": predicted.peak_bytes, "step_s": elapsed,
               "trainable_params": counts.trainable_params}
        row["base_ratio"] = row["base_predicted_bytes"] / max(row["base_loaded_bytes"], 1)
        row["peak_ratio"] = row["peak_predicted"] / row["peak_measured"] if peak else None
        rows.append(row)
        print(label, row, flush=True)
        del model, optimizer
        if kind == "cuda":
            torch.cuda.empty_cache()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "qlora_check.json").write_text(json.dumps({"device": device, "quick": quick, "rows": rows}, indent=2) + "\n")
    return 0


@dataclass(frozen=True)
class MultiGpuRun:
    """A model-parallel dimension that needs more than one GPU, or CUDA itself, to run (docs/ENGINE_FACTS.md "Which
    dimensions run on CPU"): run by toolkit.train from a plan, against a one-GPU reference at the same global batch."""
    label: str
    strategy: str
    gpus: int
    context: int = 1
    tensor: int = 1
    sequence: int = 1
    why: str = ""
    """Why it is on this list and not in the CPU tests."""
    measure: str = ""
    """What the run must show."""


MULTI_GPU_RUNS = [
    MultiGpuRun("fsdp2 x cp=2 llama-1b fp32", "fsdp2", gpus=2, context=2,
                why="context parallelism: torch's ring attention shards only the CUDA SDPA kernels (on CPU "
                    "aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy)",
                measure="4 steps' losses vs the 1-GPU run within 1e-3 (fp32); ranks agree; the saved model reloads; "
                        "per-rank peak allocated vs estimate_memory(grid=plan.grid) within the error band; step "
                        "time vs the timing model's CP ring exchange term"),
    MultiGpuRun("fsdp2 x tp=2 llama-1b fp32", "fsdp2", gpus=4, tensor=2,
                why="runs on CPU (tests/test_train_dimensions.py); here for NCCL's TP all-reduce time and the "
                    "CUDA allocator's view of DTensor shards",
                measure="losses vs the 1-GPU run within 1e-3; per-rank peak allocated vs the model; step time vs "
                        "the TP all-reduce term"),
    MultiGpuRun("zero3 x sp=2 llama-1b fp32", "zero3", gpus=2, sequence=2,
                why="runs on CPU (tests/test_train_dimensions.py); here for the Ulysses all-to-all time on NVLink",
                measure="losses vs the 1-GPU run within 1e-3; per-rank peak allocated vs the model; step time vs "
                        "the all-to-all term"),
    MultiGpuRun("fsdp2-offload llama-1b fp32", "fsdp2-offload", gpus=2,
                why="FSDP2's CPUOffloadPolicy as accelerate builds it pins host memory, which needs CUDA; on CPU it "
                    "trains unpinned (tests/test_train_engines.py), where no host-device copy exists",
                measure="losses vs the 1-GPU run within 1e-3; per-rank peak allocated vs the model (no param, grad "
                        "or optimizer shard on the GPU, the gathered units and their staging copies only); step "
                        "time vs the PCIe copies + CPU optimizer step terms"),
    MultiGpuRun("fsdp2-offload 1 gpu llama-1b fp32", "fsdp2-offload", gpus=1,
                why="the same pinned CPUOffloadPolicy on the one GPU a lent machine has (the planner offers "
                    "offload strategies on one GPU)",
                measure="losses vs the 1-GPU DDP run within 1e-3; peak allocated vs the model, which holds no "
                        "param, grad or optimizer bytes on the GPU (a peak near DDP's would mean accelerate did "
                        "not apply FSDP2 to one process)"),
]
"""The GPU run list for tensor / context / sequence parallelism and FSDP2 CPU offload. A machine with fewer GPUs than a run needs
records it as skipped (the lent machine has one H200: every run here needs a machine with 2-4 GPUs)."""


def multi_gpu_check(device: str, quick: bool, out_dir: str) -> int:
    """Each MultiGpuRun through `toolkit launch` machinery: emit the plan, run toolkit.train on its GPUs and on one
    GPU at the same global batch, and record losses, per-rank peak memory (the runner's peak_mem_gib/rank<i>) and
    the prediction."""
    import tempfile

    import torch

    have = torch.cuda.device_count() if device.startswith("cuda") else 0
    rows = []
    for run in MULTI_GPU_RUNS:
        row = {"label": run.label, "gpus": run.gpus, "why": run.why, "measure": run.measure}
        if have < run.gpus:
            row["skipped"] = f"needs {run.gpus} GPUs, this machine has {have}"
        else:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    row.update(_multi_gpu_run(run, Path(tmp), quick))
                except Exception as exc:  # one failing run must not cost the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi_gpu_check.json").write_text(json.dumps({"device": device, "quick": quick, "rows": rows},
                                                         indent=2) + "\n")
    return 0


def _multi_gpu_run(run: MultiGpuRun, work: Path, quick: bool) -> dict:
    import subprocess

    from toolkit.run import tiny
    from toolkit.run.launcher import emit_plan_files, launch_command
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.hf_runner import read_rank_summaries

    shape = QUICK_SHAPE if quick else SHAPES["llama-1b"]
    seq, micro = (64, 2) if quick else (2048, 1)
    model_dir = work / "model"
    _config(shape, 1000 if quick else 32000, seq).save_pretrained(model_dir)
    tokenizer = tiny.train_tokenizer(tiny.corpus_text(100_000), vocab_size=512)
    tokenizer.save_pretrained(model_dir)
    data = tiny.write_corpus(work / "data", max_chars=400_000)
    plan = plan_for_model(model_dir, run.strategy, gpus_per_node=run.gpus, micro_batch=micro, seq_len=seq,
                          tensor=run.tensor, context=run.context, sequence=run.sequence)
    global_batch = plan.global_batch
    reference = plan_for_model(model_dir, "ddp", gpus_per_node=1, micro_batch=global_batch, seq_len=seq)
    argv = ["--data", str(data), "--random-init", "--max-steps", "4", "--logging-steps", "1", "--save-steps", "4",
            "--lr", "3e-3", "--lr-scheduler", "constant", "--seed", "7", "--max-eval-blocks", "4"]
    out: dict = {"global_batch": global_batch}
    for name, p in (("reference", reference), ("run", plan)):
        plan_dir = emit_plan_files(p, work / f"plan-{name}")
        summaries = work / f"ranks-{name}"
        command = launch_command(plan_dir, [*argv, "--output", str(work / f"out-{name}")])
        env = {**os.environ, "TOOLKIT_RANK_SUMMARY_DIR": str(summaries), "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(f"{name} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-400:]}")
        ranks = read_rank_summaries(summaries)
        history = ranks[0]["log_history"]
        out[f"{name}_losses"] = [e["loss"] for e in history if "loss" in e]
        out[f"{name}_peak_gib_by_rank"] = {k: v for e in history for k, v in e.items()
                                          if k.startswith("peak_mem_gib/rank")}
    out["max_loss_difference"] = max(abs(a - b) for a, b in zip(out["run_losses"], out["reference_losses"]))
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec

    spec = build_spec("llama", _config(shape, 1000 if quick else 32000, seq))
    job = Job(seq_len=seq, micro_batch=micro, precision="fp32", device_kind="cuda")
    out["allocated_predicted"] = estimate_memory(spec, plan.strategy_spec, job, parse_hardware(f"{run.gpus}xH200"),
                                                 grid=plan.grid).peak_bytes
    return out


def _side_check_args(flag: str) -> argparse.Namespace:
    """Arguments of the checks run apart from main(): --qlora, --multi-gpu."""
    parser = argparse.ArgumentParser()
    parser.add_argument(flag, action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return parser.parse_args()


if __name__ == "__main__":
    for flag, check in (("--multi-gpu", multi_gpu_check), ("--qlora", qlora_check)):
        if flag in sys.argv:
            a = _side_check_args(flag)
            sys.exit(check(a.device, a.quick, a.out))
    sys.exit(main())

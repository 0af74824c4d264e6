"""One rank of a sharded world, traced whole: the real engine wrapping at the plan's world size, in one process.

The idea is torchtitan's (scripts/estimate/estimation.py): a fake process group (torch.testing's FakeStore and the
"fake" backend) hallucinates every collective, so one process can build the real device mesh of any world size;
the model is built on the meta device, wrapped the way the run wraps it, materialised under FakeTensorMode and put
through training steps under torch's FSDPMemTracker. What it sees is one rank's real per-rank tensors: the sharded
parameters, gradients and optimizer states exactly, and the step's live peak with the engine's own all-gather and
reduce-scatter buffers on the CPU dispatch.

The wrapping follows what our runs do:
  - FSDP2 (accelerate's TRANSFORMER_BASED_WRAP): `fully_shard` per decoder layer, then the root, with the plan's
    reshard_after_forward and accelerate's MixedPrecisionPolicy (param, reduce and output dtype all the compute
    dtype, accelerate utils/dataclasses.py set_mixed_precision); HSDP over a (replicate, shard) mesh.
  - FSDP2 x TP (and HSDP x TP): transformers' own load-time route, `maybe_distribute_model` with the
    DistributedConfig our emitter writes (the model's tp_plan, then FSDP2 from its fsdp_plan), as toolkit.train runs it.
Not traceable here (`untraceable_reason` says which and why): DeepSpeed ZeRO (deepspeed.initialize fails under
FakeTensorMode, measured with the fake process group at ZeRO-2 and ZeRO-3), DDP and the pipeline engine, context
parallelism (torch's ring attention shards only the CUDA SDPA kernels), Ulysses sequence parallelism (DeepSpeed),
adapters, Liger, activation offloading, torch.compile, per-op selective checkpointing and optimizers other than
AdamW / SGD.
What it cannot see, derived elsewhere: the CUDA context, NCCL buffers and the caching allocator's margin; the
second layer FSDP2 prefetches on the GPU's all-gather stream (on the CPU dispatch there is no stream); GPU kernel
footprints (attention and dropout are traced with the same GPU stand-ins as toolkit.estimate.tracer).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from toolkit.errors import UserError
from toolkit.inputs.choices import GIB
from toolkit.inputs.job import CHECKPOINTING_OP
from toolkit.inputs.strategy import Engine

if TYPE_CHECKING:
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import ModelSpec
    from toolkit.inputs.strategy import Strategy

STEPS = 2
"""Training steps run under the tracker: the first creates the optimizer states, the second is a steady step."""


@dataclass(frozen=True)
class WorldTrace:
    """One rank's bytes, traced in a fake world of `world` ranks."""

    world: int
    route: str
    """How the model was wrapped (for --explain)."""
    parameters_bytes: int
    """The rank's parameter shards (local tensors of the sharded DTensors)."""
    gradients_bytes: int
    """The rank's gradient shards after backward."""
    optimizer_bytes: int
    """The optimizer states the rank holds after a step."""
    peak_bytes: int
    """FSDPMemTracker's peak over the steps on the rank's device: every tensor live at once."""
    peak_by_kind: tuple[tuple[str, int], ...]
    """The peak's categories as FSDPMemTracker sorts them (sharded / unsharded params, all-gather, activations, ...)."""
    meta_peak_bytes: int = 0
    """What the tracker charged to the meta device at its peak, left out of peak_bytes (below): never memory."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WorldTrace":
        data = dict(data)
        data["peak_by_kind"] = tuple((str(k), int(v)) for k, v in data["peak_by_kind"])
        return cls(**data)


def untraceable_reason(strategy: "Strategy", grid: "ParallelGrid", job: "Job") -> str | None:
    """Why this row cannot be traced in a fake world (None: it can)."""
    if strategy.engine == Engine.DEEPSPEED:
        return ("DeepSpeed ZeRO does not start under FakeTensorMode (deepspeed.initialize moves the module with .to(), "
                "which cannot swap fake parameters: 'Couldn't swap Embedding.weight'); its states are derived from "
                "its source and checked on real gloo ranks (benchmarks/results/distributed_memory.md)")
    if strategy.engine != Engine.FSDP2:
        return f"{strategy.name} shards nothing across ranks: the single-process trace already is one rank"
    if grid.context > 1:
        return "context parallelism shards only the CUDA SDPA kernels (torch ring attention); not on a CPU build"
    if grid.sequence > 1:
        return "Ulysses sequence parallelism runs in DeepSpeed"
    if grid.expert > 1:
        return "the fake world does not apply the model's ep_plan yet (expert parallelism's terms are derived)"
    for flag, what in ((job.adapter.is_adapter, f"{job.adapter.method} adapters"), (job.liger, "Liger kernels"),
                       (job.activation_offloading, "activation offloading"), (job.compile, "torch.compile"),
                       (job.checkpointing == CHECKPOINTING_OP, "per-op selective checkpointing"),
                       (job.chunked_loss, "chunked cross-entropy losses"),
                       (job.loss != "model", "TRL's chunked NLL losses")):
        if flag:
            return f"{what} are not traced in a fake world"
    if job.optimizer not in ("adamw", "sgd"):
        return f"{job.optimizer} is not traced in a fake world (AdamW and SGD are)"
    return None


def trace_world(spec: "ModelSpec", strategy: "Strategy", job: "Job", grid: "ParallelGrid") -> WorldTrace:
    """Per-rank bytes of `strategy` on `grid` from the real wrapping in a fake world (cached on disk)."""
    reason = untraceable_reason(strategy, grid, job)
    if reason:
        raise UserError(f"--trace-world cannot trace {strategy.name} here: {reason}; drop --trace-world")
    from toolkit import cache

    key = None
    attention = spec.effective_attention(job.attention)
    if spec.source_key:
        key = [spec.source_key, strategy.name, grid.dp_replicate, grid.dp_shard, grid.tensor, job.seq_len,
               job.micro_batch, job.precision, job.optimizer, job.checkpointing, attention, job.device_kind]
    hit = cache.get("world", key, code=trace_world, decode=WorldTrace.from_dict) if key else None
    if hit is not None:
        return hit
    from toolkit.inputs.rope import traceable_config  # dynamic NTK traced as linear (same shapes)

    out = _trace(traceable_config(spec.hf_config()), strategy, job, grid, attention)
    if key:
        cache.put("world", key, out.to_dict(), code=trace_world)
    return out


def _dtypes(precision: str):
    """(dtype the parameters are stored in, dtype FSDP2 computes in or None for no mixed-precision policy)."""
    import torch

    if precision in ("bf16", "fp16"):
        return torch.float32, torch.bfloat16 if precision == "bf16" else torch.float16
    return (torch.bfloat16 if precision == "bf16-pure" else torch.float32), None


@contextlib.contextmanager
def _fake_world(world: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("--trace-world needs a process without a process group; run it outside a distributed job")
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _wrap(model, strategy: "Strategy", grid: "ParallelGrid", compute_dtype, precision: str) -> str:
    """Wrap `model` (on the meta device) as the run does; returns the route's description."""
    from torch.distributed import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if grid.tensor > 1:
        from transformers.distributed.configuration_utils import DistributedConfig
        from transformers.distributed.utils import initialize_distributed_mesh

        from toolkit.emit.parallelism import distributed_config as config_kwargs  # what the emitter writes

        kwargs = config_kwargs(_PlanView(grid, precision))
        _, mesh = initialize_distributed_mesh(DistributedConfig(**kwargs))
        type(model).maybe_distribute_model(model, DistributedConfig(**kwargs), mesh)
        return f"transformers maybe_distribute_model({kwargs}): the model's tp_plan, then FSDP2 from its fsdp_plan"
    if grid.dp_replicate > 1:
        mesh = init_device_mesh("cpu", (grid.dp_replicate, grid.dp_shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (grid.world,), mesh_dim_names=("shard",))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype, output_dtype=compute_dtype) \
        if compute_dtype is not None else MixedPrecisionPolicy()
    reshard = strategy.fsdp_mode != "grad_op"
    from toolkit.estimate.layerkinds import decoder_layers, num_layers

    for layer in decoder_layers(model, num_layers(model.config)):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    shape = f"{grid.dp_replicate} replicas x {grid.dp_shard} shards" if grid.dp_replicate > 1 else f"{grid.world}"
    return (f"torch fully_shard per decoder layer + root over {shape} ranks, reshard_after_forward={reshard}"
            f"{f', {precision} mixed precision' if compute_dtype is not None else ''} (accelerate's FSDP2 wrap)")


@dataclass(frozen=True)
class _PlanView:
    """The two fields of a Plan the emitter's DistributedConfig reads."""

    grid: "ParallelGrid"
    precision: str


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _local_bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def _trace(config, strategy: "Strategy", job: "Job", grid: "ParallelGrid", attention: str) -> WorldTrace:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from toolkit.estimate.fakestep import build_for_trace, enable_checkpointing
    from toolkit.estimate.standins import trace_environment

    param_dtype, compute_dtype = _dtypes(job.precision)
    notes: list[str] = []
    with _fake_world(grid.world), trace_environment(attention, job.device_kind, notes) as attn_impl, \
            _quiet_view_warnings():
        # from_pretrained builds the model untied (transformers.initialization.no_tie_weights) when it shards it,
        # and ties the weights after loading them (modeling_utils `_finalize_model_loading`): the same order here.
        from transformers import initialization

        untied = initialization.no_tie_weights() if grid.tensor > 1 else contextlib.nullcontext()
        with torch.device("meta"), untied:  # mesh and wrapping outside FakeTensorMode (torchtitan's order)
            model = build_for_trace(config, param_dtype, attn_impl)
        route = _wrap(model, strategy, grid, compute_dtype, job.precision)
        if grid.tensor > 1:
            model.tie_weights()
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            model.train()
            if job.checkpointing:
                enable_checkpointing(model)
            # The optimizer steps the rank's local shards (what a DTensor step computes for Shard placements, same
            # states and temporaries): the tracker charges a DTensor step's temporaries at ~27x their local bytes
            # (measured: AdamW on one Shard(0) DTensor of 8 fake ranks). The plain for-loop AdamW, as torch's fused
            # CPU kernel under FakeTensorMode is charged ~9x its states.
            params = list(model.parameters())
            shards = [_local(p).detach() for p in params]
            opt = torch.optim.AdamW(shards, lr=1e-5, foreach=False, fused=False) if job.optimizer == "adamw" \
                else torch.optim.SGD(shards, lr=1e-5, momentum=0.9)
            ids = torch.zeros(job.micro_batch, job.seq_len // grid.seq_split, dtype=torch.long)
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((ids,))
            grads = 0
            with tracker:
                for _ in range(STEPS):
                    model(input_ids=ids, labels=ids).loss.backward()
                    grads = _local_bytes(p.grad for p in params)
                    for p, shard in zip(params, shards):
                        shard.grad = None if p.grad is None else _local(p.grad).detach()
                        p.grad = None
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()  # per-module stats only; the peak spans every step
            params = _local_bytes(params)
            states = _local_bytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
            peak = tracker.get_tracker_snapshot("peak")
    # The CPU device's peak only: the tracker also charges tensors made on the meta device, and under TP those are
    # transformers' stride probes (distributed/tensor_parallel.py builds `torch.empty(shape, device="meta")` to read
    # a layout), never memory. Without them the TP rank's peak equals a real gloo rank's within 0.01%
    # (benchmarks/results/fakeworld.md).
    kinds = {getattr(kind, "value", str(kind)): int(n) for kind, n in peak.get(torch.device("cpu"), {}).items()}
    total = kinds.pop("Total", 0)
    meta = {getattr(kind, "value", str(kind)): int(n) for kind, n in peak.get(torch.device("meta"), {}).items()}
    return WorldTrace(world=grid.world, route=route, parameters_bytes=params, gradients_bytes=grads,
                      optimizer_bytes=states, peak_bytes=total,
                      peak_by_kind=tuple((k, v) for k, v in kinds.items() if v), meta_peak_bytes=meta.get("Total", 0))


@contextlib.contextmanager
def _quiet_view_warnings():
    """FSDP2 warns once per wrapped module whose output is a view (the embedding, the tail); the model's own code
    does no in-place op on them."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        yield


_STATE_TERMS = {"parameters": "parameters_bytes", "gradients": "gradients_bytes",
                "optimizer + master": "optimizer_bytes"}
"""The Breakdown terms the fake world measures itself (toolkit.estimate.memory names them)."""


def traced_terms(terms: tuple, world: WorldTrace) -> tuple:
    """The breakdown's terms with the model states taken from the fake world, and every other term marked as
    derived; each source says which, and a traced term also shows what the states model derived."""
    from dataclasses import replace

    out = []
    for term in terms:
        field = _STATE_TERMS.get(term.name)
        if field is None:
            out.append(replace(term, source=f"per-rank model, not the fake world: {term.source}"))
            continue
        traced = getattr(world, field)
        step = " (AdamW's per-tensor step counters included)" if field == "optimizer_bytes" else ""
        out.append(replace(term, bytes=traced, source=f"fake-world trace, {world.world} ranks, {world.route}{step}; "
                                                      f"the states model derived {term.bytes:,} B ({term.source})"))
    return tuple(out)


def peak_line(world: WorldTrace, estimated_peak_bytes: int) -> str:
    unit, div = ("GiB", GIB) if world.peak_bytes >= GIB else ("MiB", 1024 ** 2)
    kinds = ", ".join(f"{k} {v / div:.2f}" for k, v in world.peak_by_kind)
    return (f"fake-world peak (tensors, CPU dispatch, {world.world} ranks): {world.peak_bytes / div:.2f} {unit} "
            f"against the estimate's {estimated_peak_bytes / div:.2f} {unit} "
            f"({world.peak_bytes / estimated_peak_bytes:.3f}); "
            f"at it, {unit}: {kinds}. Derived, not seen there: the GPU's prefetched all-gather of the next layer, GPU "
            "kernel footprints beyond the tracer's stand-ins, the CUDA context, NCCL buffers and the allocator margin")

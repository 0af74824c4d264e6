"""Host time of an eager training step: the CPU dispatches every ATen operation one by one (Python, the
dispatcher, autograd's bookkeeping, the kernel launch), and the GPU cannot finish before the host has issued its last
kernel. Where the GPU's work per operation is shorter than the host's, the host is the step.

An MoE layer runs far more operations per FLOP than a dense one: transformers 5.24's grouped_mm experts
(integrations/moe.py grouped_mm_experts_forward) sort, gather, histogram, scatter and weight the routed rows in
about twenty small operations around its two grouped GEMMs, and under expert parallelism AllToAllEP reads the split
sizes back to the host every MoE layer (distributed/expert_parallel.py `_dispatch_tokens`, `.tolist()`), so the
host cannot run ahead of the GPU by more than a layer. At TRL's 2048 tokens on 8 GPUs the GPU work of a layer is
a few milliseconds and the host's dispatch of its ~500 operations (forward, recompute, backward) is as long.

A dense step is host-bound too where its GPU work is small: the GPU day (benchmarks/results/gpu_timing.json, one
H200, a 1.5B Llama with fused AdamW, no wrapper) measured 58 ms a step at both 512 and 1024 tokens where the GPU's
work is 16 and 25 ms; the traced step dispatches 4,493 operations, 54 ms at HOST_OP_S (CPU-measured, not fitted to
these rows). So every GPU estimate takes the host's dispatch as a floor (DENSE_OPS_PER_LAYER_BOUND keeps big jobs,
whose GPU work is far longer, from tracing for it).

The count comes from the model's own code: the activation tracer's dispatch mode counts what each region dispatches
(toolkit.estimate.recording, ActivationTrace.host_ops); beside it, counted on real CPU steps, expert parallelism's
own exchange a MoE layer (EP_EXCHANGE_OPS) and the optimizer step once a step (OPTIMIZER_OPS, CLIP_OPS_PER_MESH);
the seconds per operation are measured (HOST_OP_S).
"""

from __future__ import annotations

import functools

HOST_OP_S = 12e-6
"""Host seconds per dispatched ATen operation of a training step, averaged over forward, checkpointed recompute and
backward. Measured, not fitted: benchmarks/moe_ep.py runs transformers' own Qwen3-MoE, Mixtral and GPT-OSS
training steps (4 layers, hidden 64, 8 experts top-2, 16 tokens, checkpointing, fp32) on the development box's CPU
(AMD EPYC, torch 2.13), where the kernels themselves are negligible, and divides the thread's CPU time by the
operations a dispatch mode counts in the same step: 9.5-20 us for the fastest of 7 steps over the runs made while
writing it, by the load of the shared 2-core box (moe_ep.md shows its own run's readings); 12 us sits near the low
readings. Contention only adds to a thread's CPU time, so the low readings are the host's own. A GPU host
adds the kernel launch (cudaLaunchKernel, a few us) and drops the CPU kernels; its CPU may be faster or slower.
Published per-op figures for the whole path from Python to launch span about 5-25 us, hence HOST_OP_BAND."""
HOST_OP_BAND = (0.5, 2.0)
"""The host term's band: HOST_OP_S x 0.5 to x 2 (5-25 us an operation on other hosts and drivers)."""


EP_EXCHANGE_OPS = (31, 8)
"""ATen operations transformers' AllToAllEP adds to one MoE layer when every rank has its own batch, (forward,
backward): the expert-sorted send order, the split counts, their exchange and read-back, the received rows' local
expert ids, the inverse permutation and the weighted sum (distributed/expert_parallel.py `_dispatch_tokens`,
`_combine_tokens`), and their gradients. Measured: benchmarks/moe_ep.py `ep_exchange_ops`, the model's own experts
module with and without AllToAllEP around it on a one-rank gloo group (31 + 8 for Qwen3-MoE, Mixtral and GPT-OSS
alike). On a batch-sharing group the host term prices the whole route instead (EP_ROUTE_HOST_OPS), of which these
are a small part."""

EP_ROUTE_HOST_OPS = {"all_to_all": (1652, 1626), "all_reduce": (1212, 1068)}
"""What transformers 5.24's expert-parallel route adds to the host's work a MoE layer when the expert group shares
one batch (TRL's layout), in the plain model's own operations (checkpointed layer, layer without checkpointing), by
token exchange (toolkit.inputs.moe.ep_token_exchange). It holds the exchange's own
operations (EP_EXCHANGE_OPS) and, far more, the Python around the experts' DTensor parameters (grouped_gemm's
MoEParamShard): DTensor.from_local / to_local, redistribute and sharding propagation in forward, recompute and
backward (torch.distributed.tensor's own functions take most of a profiled step's extra CPU time; the c10d calls
little), and with every rank its own batch FSDP2's hooks. Measured, not fitted: benchmarks/ep_route_host.py loads
the tiny Qwen3-MoE by each route (DistributedConfig on 2 gloo ranks; the shared batch with a tp_plan naming only
the experts, so the dense modules stay whole as in TRL's layout) and the plain model beside it, times a training
step on the main thread's CPU clock at 4 and 8 MoE layers, and divides the route's growth per layer beyond the
plain model's by the plain step's seconds per operation (benchmarks/results/moe_ep.md: MEASURED). Its runs scatter
by about +-20% on the shared box. Every rank its own batch (DistributedConfig(fsdp_size=2, ep_size=2)) read 783 and
989 the same way, but that figure holds FSDP2's per-module hooks, which the plain FSDP2 rows it is ranked against
pay too and the host term does not count for them: applied to the expert-parallel rows alone it would bias the
plan's ranking, so that layout still adds only its exchange's operations (EP_EXCHANGE_OPS)."""

OPTIMIZER_OPS = {"for-loop": (10, 0, 2), "foreach": (2, 10, 2), "fused": (0, 2, 2)}
"""torch AdamW's step, ATen operations (per parameter tensor, per param group, once): the per-parameter loop runs
~10 operations a tensor, foreach ~10 list operations a group (plus 2 a tensor), fused one kernel a group.
Measured: benchmarks/moe_ep.py `optimizer_step_ops` (torch 2.13, CPU)."""
CLIP_OPS_PER_MESH = 8
"""clip_grad_norm_ (foreach, torch's default where the gradients allow it): 8 operations for each set of gradients
on one device mesh (the Trainer clips per mesh under expert parallelism, trainer.py _mixed_mesh_grad_norm).
Measured with OPTIMIZER_OPS."""


def micro_step_host_ops(spec, grid, traced_ops: int, checkpointing: bool) -> int:
    """Operations one micro-step dispatches, in the plain model's operations: the trace's (the single-process model)
    plus, under transformers' expert parallelism, what its route adds to every MoE layer: the whole route measured
    (EP_ROUTE_HOST_OPS) on a batch-sharing group, the exchange's operations (EP_EXCHANGE_OPS, its forward again in
    the recompute) with every rank its own batch."""
    from toolkit.inputs.moe import ep_token_exchange, moe_layer_count

    if grid is None or grid.expert <= 1 or grid.autoep:
        return traced_ops
    if grid.expert_shared_batch:
        with_recompute, without = EP_ROUTE_HOST_OPS[ep_token_exchange(spec, True)]
        per_layer = with_recompute if checkpointing else without
    else:
        forward, backward = EP_EXCHANGE_OPS
        per_layer = forward * (2 if checkpointing else 1) + backward
    return traced_ops + moe_layer_count(spec) * per_layer


def optimizer_host_ops(spec, job, grid, strategy) -> int:
    """Operations the optimizer step and gradient clipping dispatch once a step. The HF Trainer's AdamW has two
    param groups (decay, no decay), split by device mesh under transformers' expert parallelism (trainer.py
    create_optimizer); a DeepSpeed ZeRO optimizer steps its flat partitions, one tensor a group, AutoEP's expert
    groups beside the dense ones."""
    from toolkit.inputs.strategy import Engine

    meshes = 2 if grid is not None and grid.expert > 1 else 1
    groups = 2 * meshes
    if strategy.engine == Engine.DEEPSPEED:
        per_tensor, per_group, once = OPTIMIZER_OPS["fused"]
        return per_group * groups + once + CLIP_OPS_PER_MESH * meshes
    per_tensor, per_group, once = OPTIMIZER_OPS[job.optimizer_impl]
    tensors = param_tensor_count(spec) if per_tensor else 0
    return per_tensor * tensors + per_group * groups + once + CLIP_OPS_PER_MESH * meshes


def param_tensor_count(spec) -> int:
    """Parameter tensors of the model (its meta-device build), what a per-parameter optimizer loops over."""
    import json

    return _tensors(json.dumps(spec.hf_config().to_dict(), sort_keys=True, default=str))


@functools.lru_cache(maxsize=8)
def _tensors(config_json: str) -> int:
    import json

    import torch

    from toolkit.inputs.modelconfig import auto_model_class, config_from_dict

    config = config_from_dict(json.loads(config_json), "tensors")
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    return sum(1 for _ in model.parameters())


DENSE_OPS_PER_LAYER_BOUND = 1000
"""More operations than a dense decoder layer dispatches in forward + recompute + backward (traced Llama: 276 a
layer, 393 checkpointed; a layer's norms, projections, rotary, attention and MLP with their backward are a few
hundred in every architecture we trace). Only a bound: where even this many operations per layer (embedding and
head counted as one layer each) take less host time than the GPU's work, the host cannot bind and the trace is
not made for it (toolkit.estimate.traces.step_time_terms)."""


def host_could_bind(num_layers: int, micro_steps: int, device_s: float) -> bool:
    """Whether a dense step's host dispatch could be longer than its GPU work `device_s` (an upper bound)."""
    return host_step_s((num_layers + 2) * DENSE_OPS_PER_LAYER_BOUND, micro_steps) * HOST_OP_BAND[1] > device_s


def host_step_s(host_ops: int, micro_steps: int, step_ops: int = 0) -> float:
    """Seconds the host spends dispatching one optimizer step: its micro-steps, each `host_ops` operations, and the
    optimizer step's `step_ops`."""
    return (host_ops * micro_steps + step_ops) * HOST_OP_S


def host_assumption(host_ops: int, host_s: float, device_s: float, step_ops: int = 0,
                    expert_exchange: bool = False, moe: bool = True) -> str:
    """What the host term assumed, for --explain."""
    bound = "host-bound: the step is the host's" if host_s > device_s else "the GPU's work is longer: not binding"
    if not moe:
        return (f"host dispatch: {host_ops:,} ATen operations a micro-step (traced) and {step_ops:,} for the "
                f"optimizer step and clipping, at {HOST_OP_S * 1e6:.0f} us each (measured on CPU, band "
                f"x{HOST_OP_BAND[0]:g}-x{HOST_OP_BAND[1]:g}): {host_s:.3f} s against the device's {device_s:.3f} s; "
                f"{bound} (a 1.5B DDP step on an H200 measured 58 ms at 512 and 1024 tokens, 54 ms by this term)")
    said = (f"host dispatch: {host_ops:,} ATen operations a micro-step (traced, forward + backward + recompute) and "
            f"{step_ops:,} for the optimizer step and clipping, at {HOST_OP_S * 1e6:.0f} us each (measured on CPU, "
            f"band x{HOST_OP_BAND[0]:g}-x{HOST_OP_BAND[1]:g}): {host_s:.3f} s against the device's {device_s:.3f} s; "
            f"{bound} (a host sync per MoE layer under expert parallelism keeps the host within a layer of the GPU)")
    if not expert_exchange:
        return said
    return (f"{said}; the count holds what transformers' expert-parallel route adds to each MoE layer, in the plain "
            "model's operations: on a batch-sharing group the whole route (its exchange and the DTensor dispatch "
            "around the experts' parameters, measured on 2 gloo ranks: hosttime.EP_ROUTE_HOST_OPS), with every "
            "rank its own batch AllToAllEP's exchange operations (its DTensor dispatch not counted)")

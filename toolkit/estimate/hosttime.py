"""Host time of an eager training step: the CPU dispatches every ATen operation one by one (Python, the
dispatcher, autograd's bookkeeping, the kernel launch), and the GPU cannot finish before the host has issued its last
kernel. Where the GPU's work per operation is shorter than the host's, the host is the step.

An MoE layer runs far more operations per FLOP than a dense one: transformers 5.24's grouped_mm experts
(integrations/moe.py grouped_mm_experts_forward) sort, gather, histogram, scatter and weight the routed rows in
about twenty small operations around its two grouped GEMMs, and under expert parallelism AllToAllEP reads the split
sizes back to the host every MoE layer (distributed/expert_parallel.py `_dispatch_tokens`, `.tolist()`), so the
host cannot run ahead of the GPU by more than a layer. At TRL's 2048 tokens on 8 GPUs the GPU work of a layer is
a few milliseconds and the host's dispatch of its ~500 operations (forward, recompute, backward) is as long.

The count comes from the model's own code: the activation tracer's dispatch mode counts what each region dispatches
(toolkit.estimate.recording, ActivationTrace.host_ops); the seconds per operation are measured (HOST_OP_S).
"""

from __future__ import annotations

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


def host_step_s(host_ops: int, micro_steps: int) -> float:
    """Seconds the host spends dispatching one optimizer step's micro-steps, each `host_ops` operations."""
    return host_ops * micro_steps * HOST_OP_S


def host_assumption(host_ops: int, host_s: float, device_s: float) -> str:
    """What the host term assumed, for --explain."""
    bound = "host-bound: the step is the host's" if host_s > device_s else "the GPU's work is longer: not binding"
    return (f"host dispatch: {host_ops:,} ATen operations a micro-step (traced, forward + backward + recompute) at "
            f"{HOST_OP_S * 1e6:.0f} us each (measured on CPU, band x{HOST_OP_BAND[0]:g}-x{HOST_OP_BAND[1]:g}): "
            f"{host_s:.3f} s against the device's {device_s:.3f} s; {bound} (a host sync per MoE layer under "
            "expert parallelism keeps the host within a layer of the GPU); expert parallelism's own dispatch "
            "operations (sort, split sizes, DTensor slicing) are not traced and not counted")

"""Per-op selective activation checkpointing: torchtitan's "op" policy (`activation_checkpoint.mode = "selective"`,
`selective_ac_option = "op"`), as its Llama 3 benchmarks of December 2024 ran it.

Each decoder layer runs under torch.utils.checkpoint (non-reentrant) with a `context_fn` from
`torch.utils.checkpoint.create_selective_checkpoint_contexts`: a policy decides, op by op in the layer's forward, which
outputs to keep (MUST_SAVE) and which to recompute in backward (PREFER_RECOMPUTE). torchtitan's policy
(torchtitan/distributed/activation_checkpoint.py `_apply_ac_to_transformer_block` up to 2025, `_save_list`) keeps the
outputs of the attention kernels (`aten._scaled_dot_product_flash_attention`, `..._efficient_attention`) and of
`reduce_scatter_tensor`, and of every other `aten.mm` of the layer: a fresh counter per checkpoint call, the odd-
numbered matmuls (1st, 3rd, ...) kept, the even ones recomputed. Everything else in the layer is recomputed from the
layer's input, which the checkpoint keeps. `addmm` (a Linear with bias, GPT-2's Conv1D) is not on the list.

Under torch.compile the same policy tags the checkpointed region's nodes (`node.meta["recompute"]`, torch's
`_CachingTorchDispatchMode`) and the partitioner keeps the MUST_SAVE ones; what a layer keeps is the same set.
"""

from __future__ import annotations

from collections import defaultdict

SOURCE = ("torchtitan per-op selective activation checkpointing (selective_ac_option 'op': the attention kernels' "
          "outputs and every other matmul output kept, the rest recomputed)")

_ON_SAVE: list = []
"""The callbacks of the selective checkpoints whose forward is running (innermost last)."""


def _save_ops() -> set:
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default}
    reduce_scatter = getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None)
    if reduce_scatter is not None:
        ops.add(reduce_scatter.default)
    return ops


def op_policy(on_save=None):
    """torchtitan's op policy for one checkpoint call (a fresh matmul counter, as its context_fn makes one per
    call). `on_save(output)` is told of each output kept in forward (the tracer charges it to the layer)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    mm = torch.ops.aten.mm.default
    save = _save_ops()
    counts: dict = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[mode] += 1
        keep = func in save and not (func == mm and counts[mode] % 2 == 0)
        if keep and on_save is not None and not ctx.is_recompute and getattr(ctx, "op_output", None) is not None:
            on_save(ctx.op_output)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_context_fn(on_save=None):
    """The `context_fn` torch.utils.checkpoint takes: each call builds the policy's caching contexts afresh. While a
    checkpointed forward runs, `kernel_saved` reaches `on_save` too (for kernels the tracer stands in for)."""

    def context_fn():
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        forward, recompute = create_selective_checkpoint_contexts(op_policy(on_save))
        return (_Announcing(forward, on_save) if on_save is not None else forward), recompute

    return context_fn


class _Announcing:
    """The forward caching context, with `on_save` registered while it is open."""

    def __init__(self, inner, on_save):
        self.inner, self.on_save = inner, on_save

    def __enter__(self):
        _ON_SAVE.append(self.on_save)
        return self.inner.__enter__()

    def __exit__(self, *exc):
        _ON_SAVE.pop()
        return self.inner.__exit__(*exc)


def kernel_saved(*outputs) -> None:
    """A stand-in of a kernel the op policy keeps (the CUDA attention kernels) made `outputs`: inside a selective
    checkpoint's forward they are kept, as the real kernel's would be."""
    if _ON_SAVE and _ON_SAVE[-1] is not None:
        for out in outputs:
            _ON_SAVE[-1](out)

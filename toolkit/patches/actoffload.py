"""TRL's activation offloading (SFTConfig / DPOConfig `activation_offloading=True`), built as TRL's trainers build it,
for toolkit.train and for the CPU measurement of its memory (toolkit.estimate.profile).

What the engine does (trl/models/activation_offloading.py, TRL 1.16, after torchtune's OffloadActivations): the
trainer builds `get_act_offloading_ctx_manager(model=self.model)` once, before accelerate wraps the model
(sft_trainer.py __init__), and runs every `training_step` inside it. The context is a `saved_tensors_hooks` pair:
every tensor autograd saves of at least 1,024 bytes that is on the accelerator, is not a parameter (nor a storage a
parameter owns: FSDP2's DTensor shards are read through `_local_tensor`) and is not saved inside the LM head (a
NoOpManager entered around `lm_head`) is copied to (pinned) host memory, on a side stream, and its device copy
dropped; backward copies it back to the device before the gradient that needs it. Under non-reentrant gradient
checkpointing the hooks see what the checkpoint saves, the layers' inputs: the checkpointed activations are what
moves.

On a CPU-only torch the engine cannot be built: `torch.accelerator.current_accelerator()` is None and its
constructor reads `.type` of it (AttributeError). `offload_context(..., on_cpu=True)` builds the same object with the
CPU named as the accelerator while it is constructed, without pinned memory (pinning needs an accelerator) and
without side streams (a CPU stream has no events), and with a no-op empty_cache (torch.cpu has none; TRL calls
it on entry when bitsandbytes is imported): the pack hook then copies each saved tensor into a new host
tensor and the original is freed, and unpack hands the copy back. The numbers trained are the engine's; on CPU
the memory it frees is given back in the same RAM (toolkit.estimate.profile measures the two sides apart).
"""

from __future__ import annotations

import contextlib

OFFLOAD_SOURCE = "TRL 1.16 trl/models/activation_offloading.py (OffloadActivations, get_act_offloading_ctx_manager)"

LAST_OFFLOADED: dict[str, int] = {}
"""What the last step's pack hooks moved to the host: tensors and bytes (toolkit.train's rank summary reports it)."""


@contextlib.contextmanager
def _cpu_named_accelerator():
    """torch.accelerator.current_accelerator() answers "cpu" while TRL's context is constructed (see the module
    docstring); nothing else reads it in that window."""
    import torch

    current = torch.accelerator.current_accelerator
    torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cpu")
    try:
        yield
    finally:
        torch.accelerator.current_accelerator = current


class _CpuDeviceModule:
    """torch.cpu as TRL's context calls it: its streams, and an empty_cache (which torch.cpu lacks and TRL calls
    on entry whenever bitsandbytes is imported) that has no cache to empty."""

    def __getattr__(self, name):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        return None


def offload_context(model, *, on_cpu: bool):
    """TRL's activation-offloading context for `model` (the unwrapped model, as SFTTrainer passes it), counting what
    its pack hook moves into LAST_OFFLOADED."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    if on_cpu:
        with _cpu_named_accelerator():
            ctx = get_act_offloading_ctx_manager(model=model, use_pin_memory=False, use_streams=False)
        ctx.device_module = _CpuDeviceModule()
    else:
        ctx = get_act_offloading_ctx_manager(model=model)
    pack = ctx.pack_hook

    def counted_pack(tensor):
        tensor_id = pack(tensor)
        moved = moved_bytes(ctx, tensor_id)
        if moved:
            LAST_OFFLOADED["tensors"] = LAST_OFFLOADED.get("tensors", 0) + 1
            LAST_OFFLOADED["bytes"] = LAST_OFFLOADED.get("bytes", 0) + moved
        return tensor_id

    ctx.pack_hook = counted_pack  # saved_tensors_hooks.__enter__ installs self.pack_hook
    return ctx


def moved_bytes(ctx, tensor_id) -> int:
    """Bytes of the host copy TRL's pack hook made for `tensor_id`, 0 when it kept the tensor where it was."""
    held, moved = ctx.tracker[tensor_id][:2]
    return held.untyped_storage().nbytes() if moved else 0


@contextlib.contextmanager
def offloading_step(ctx):
    """One training step under `ctx`, LAST_OFFLOADED counting that step alone."""
    LAST_OFFLOADED.clear()
    with ctx:
        yield

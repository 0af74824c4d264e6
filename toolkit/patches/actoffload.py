"""TRL's activation offloading (SFTConfig / DPOConfig `activation_offloading=True`), built as TRL's trainers build it,
for toolkit.train (SFT and DPO plans) and for the CPU measurement of its memory (toolkit.estimate.profile).

What the engine does (trl/models/activation_offloading.py, TRL 1.16, after torchtune's OffloadActivations): the
trainer builds `get_act_offloading_ctx_manager(model=self.model)` once, before accelerate wraps the model
(sft_trainer.py __init__; dpo_trainer.py __init__ after `Trainer.__init__`, ~889), and runs every `training_step` inside
it. In a DPO step the policy's forward over chosen + rejected saves tensors (and they move); the reference's forward
runs under no_grad, where autograd saves nothing, so the hooks never see it. The context is a `saved_tensors_hooks` pair:
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


class CheckpointOffload:
    """DeepSpeed's own checkpoint offload, CheckpointHiddenStatesOffload (DeepSpeed 0.19.8 runtime/
    activation_checkpointing/offload_activations.py: the checkpointed decoder layers' hidden_states inputs, the newest
    kept on the device), which ALST pairs with tiling and toolkit.train runs for a --tiled plan that offloads; as a
    step's context (OffloadedSteps), its stats of the step counted into LAST_OFFLOADED. On a CPU accelerator it
    moves nothing: `_should_skip` skips every tensor on a synchronized device."""

    def __init__(self, *, on_cpu: bool) -> None:
        from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

        self.engine = CheckpointHiddenStatesOffload(use_pin_memory=not on_cpu, use_streams=not on_cpu)

    def __enter__(self):
        self.engine.reset()
        return self.engine.__enter__()

    def __exit__(self, *exc):
        out = self.engine.__exit__(*exc)
        LAST_OFFLOADED.update(tensors=self.engine.stats.offloaded_tensors, bytes=self.engine.stats.offloaded_bytes)
        return out


def step_offload(plan, model, *, on_cpu: bool):
    """The offloading context toolkit.train runs each training step in for an offloading `plan`: DeepSpeed's checkpoint
    offload with --tiled (ALST's pairing, as toolkit.estimate.savers models it), else TRL's (SFTConfig's
    activation_offloading, which the emitted SFTConfig then carries)."""
    return CheckpointOffload(on_cpu=on_cpu) if plan.tiled else offload_context(model, on_cpu=on_cpu)


def offload_note(plan) -> str:
    """What an offloading plan's notes say of the offload its memory assumes (step_offload's choice)."""
    if plan.tiled:
        return ("The plan's memory assumes DeepSpeed's checkpoint offload, as ALST pairs it with tiling: toolkit.train "
                "runs DeepSpeed's CheckpointHiddenStatesOffload (runtime/activation_checkpointing/"
                "offload_activations.py) around each training step, which moves the checkpointed decoder layers' "
                "inputs but the last two to pinned host RAM; it moves nothing on CPU processes (its _should_skip "
                "skips every tensor on a synchronized device), so a rehearsal trains without it.")
    return (f"The plan's memory assumes activation offloading: TRL's {'DPOConfig' if plan.dpo else 'SFTConfig'} "
            "carries activation_offloading; toolkit.train runs TRL's offloading context around each training step as "
            "SFTTrainer and DPOTrainer do; the plain HF Trainer has no such option (re-plan without "
            "--activation-offloading for it).")


def moved_bytes(ctx, tensor_id) -> int:
    """Bytes of the host copy TRL's pack hook made for `tensor_id`, 0 when it kept the tensor where it was."""
    held, moved = ctx.tracker[tensor_id][:2]
    return held.untyped_storage().nbytes() if moved else 0


MIN_OFFLOAD_BYTES = 1024
"""get_act_offloading_ctx_manager's `min_offload_size` default (SFTTrainer passes none): smaller tensors stay."""

FWD_STASH = 5
"""Its `max_fwd_stash_size` default: with side streams, a moved tensor's storage is remembered (and a later save of
it not moved again) until a save this many tensor ids later releases it."""

_FP8_CLASSES = ("Float8TrainingTensor", "ScaledMMConfig", "LinearMMConfig")


class OffloadRule:
    """TRL's pack_tensor decision (OffloadActivations.__init__, TRL 1.16), applied to saved tensors one at a time
    in the order autograd saves them: `pack(tensor)` answers the bytes of the host copy TRL makes, 0 when it keeps
    the tensor. Kept: a storage already moved and still remembered (side streams only, see FWD_STASH; a storage
    once kept that way stays remembered for the rest of the forward, TRL re-points its key at the kept id, which
    the stash never releases), tensors under MIN_OFFLOAD_BYTES (element size x elements), parameters (the class,
    or a storage of the model's parameters: `param_storages`, storage ids), TorchAO FP8 tensors. Moved: element
    size x elements (a non-contiguous view is copied contiguous, one with a storage offset cloned), or the whole
    storage for a tensor with a zero stride (a broadcast). Without streams (TRL on CPU, toolkit's measurement) no
    storage is remembered: every save moves its own copy. The device check is the caller's (traced tensors all
    stand for device tensors); saves inside the modules TRL keeps on the device never reach pack_tensor
    (kept_modules_depth)."""

    def __init__(self, param_storages: set[int], *, streams: bool) -> None:
        self.param_storages, self.streams = param_storages, streams
        self.tensor_id = 0
        self.keys: dict[tuple, int] = {}  # storage key -> tensor id remembered for it
        self.stash: dict[int, tuple] = {}  # moved tensor id -> its storage key, in id order

    def pack(self, tensor, key: tuple | None = None) -> int:
        """Bytes TRL copies to the host for this save; `key` names its storage (default: the storage's identity,
        offset and dtype, as TRL's data pointer + offset + dtype)."""
        import torch

        self.tensor_id += 1
        tid = self.tensor_id
        st = tensor.untyped_storage()
        key = key if key is not None else (id(st), tensor.storage_offset(), tensor.dtype)
        if self.streams and key in self.keys:
            self.keys[key] = tid
            return 0
        if (tensor.element_size() * tensor.nelement() < MIN_OFFLOAD_BYTES or isinstance(tensor, torch.nn.Parameter)
                or type(tensor).__name__ in _FP8_CLASSES or id(st) in self.param_storages):
            return 0
        if self.streams:
            for old in [i for i in self.stash if i <= tid - FWD_STASH]:
                released = self.stash.pop(old)
                if self.keys.get(released) == old:
                    del self.keys[released]
            self.stash[tid] = key
            self.keys[key] = tid
        if 0 in tensor.stride():
            return st.nbytes() // tensor.element_size() * tensor.element_size()
        return tensor.element_size() * tensor.nelement()


class _KeptDepth:
    """Stands in for TRL's NoOpManager while get_act_offloading_ctx_manager hooks the modules it keeps on the
    device: instead of hiding their saves from the offloading hooks, it counts how deep the forward is in them."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self):
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1


def kept_modules_depth(model) -> _KeptDepth:
    """TRL's own choice of what stays on the device, hooked on `model` (as SFTTrainer passes it): the output head
    (`output`, `lm_head`, a decoder's head, a final norm or `head`, the first found, PEFT unwrapped) and every
    module whose name holds "liger"; `.depth` is above 0 while the forward runs inside one. Only modules called
    as modules count: Liger's fused cross-entropy and TRL's fused LM head read lm_head's weight without calling
    it, so what their loss saves is moved. Without TRL installed (an optional extra), the HF causal LM's head,
    `get_output_embeddings()`, which is TRL's pick (`lm_head`) for those models."""
    import warnings

    try:
        import trl.models.activation_offloading as engine
    except ImportError:
        depth, head = _KeptDepth(), model.get_output_embeddings()
        if head is not None:
            head.register_forward_pre_hook(lambda *args: depth.__enter__())
            head.register_forward_hook(lambda *args: depth.__exit__(), always_call=True)
        return depth

    depth, noop = _KeptDepth(), engine.NoOpManager
    engine.NoOpManager = lambda: depth
    try:  # update_model_params reads parameters' data pointers: a traced model's are fake (a warning, no use here)
        with _cpu_named_accelerator(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            engine.get_act_offloading_ctx_manager(model=model, use_pin_memory=False, use_streams=False,
                                                  warn_if_no_head=False)
    finally:
        engine.NoOpManager = noop
    return depth


@contextlib.contextmanager
def offloading_step(ctx):
    """One training step under `ctx`, LAST_OFFLOADED counting that step alone."""
    LAST_OFFLOADED.clear()
    with ctx:
        yield


class OffloadedSteps:
    """A Trainer mixin: every training_step inside `offload` (offload_context's, set once the trainer is built; None:
    no offloading), as SFTTrainer.training_step and DPOTrainer.training_step run theirs."""

    offload = None

    def training_step(self, *args, **kwargs):
        if self.offload is None:
            return super().training_step(*args, **kwargs)
        with offloading_step(self.offload):
            return super().training_step(*args, **kwargs)

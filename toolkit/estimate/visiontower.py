"""What an image-and-text step's vision encoder and projector keep for backward, traced alone under FakeTensorMode
(issue 31, Deliver 3): the model's own `get_image_features` (tower + projector, as its forward calls it) on one
image of the job's size, the pixel values the model's image processor makes of it (toolkit.inputs.images).

The whole image-text step does not trace under fake tensors (docs/ENGINE_FACTS.md: Gemma-3's image-token check and
Qwen2.5-VL's vision position ids read tensor values). The tower alone does: its grid-derived inputs (position ids,
cu_seqlens, window index) are computed on real tensors by transformers' own vision_utils functions and handed to the
fake step as fake-tensor constants, so the few values the tower reads (`lengths.tolist()` of its attention windows,
the split sizes of its output) come from them. Saved bytes are per image: images are concatenated along the patch
axis and attend within themselves (cu_seqlens), so a micro-batch's tower activations are images x one image's.

A frozen tower (--vision-tower freeze, LoRA / QLoRA, which exclude it) saves nothing without checkpointing: no
input of its operations requires grad (pixel values never do), so autograd records none of them; the trace
measures that too. The tower's backward is traced as well (TowerTrace.backward_extra_bytes): with checkpointing it
is where an image-text step peaks, the blocks recomputed while the pixel values are alive.

The same trace counts the tower's FLOPs (TowerTrace.forward_flops / backward_flops) from the shapes of the ops it
runs, with torch's own formulas (torch.utils.flop_counter's registry: mm, addmm, bmm, convolution and its
backward, the fused attention kernels); toolkit.estimate.visiontime turns them into the step's time.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TowerTrace:
    saved_bytes: int
    """Bytes the tower and projector hold from their forward to their backward for one image: the storages their
    forward made that are alive at its end (saved tensors, the patch embedding's leaf, checkpoint closures'
    tensors; parameters, autocast weight copies and the output features excluded; storages counted once)."""
    autocast_copy_bytes: int
    """Low-precision copies of the tower's weights autocast saves for backward (DDP's AMP; 0 otherwise)."""
    pixel_shape: tuple[int, ...]
    """The processor's pixel_values for one image (Qwen2-VL: patches x patch features; SigLIP: 1 x 3 x H x W)."""
    backward_extra_bytes: int = 0
    """Peak live bytes of the tower's backward for one image above its saved bytes: the gradient arriving at the
    projector's output and the backward's temporaries, with checkpointing each block's recompute and the tensors
    its recompute closures hold; parameter gradients excluded (the memory model counts them). 0 when no backward
    reaches the tower."""
    forward_flops: int = 0
    """FLOPs of the tower's and projector's forward on one image (matmuls, convolutions, attention)."""
    backward_flops: int = 0
    """FLOPs of the backward that reaches them for one image: input and weight gradients when they train, input
    gradients only for a frozen tower under checkpointing (enable_input_require_grads makes the patch embedding's
    output require grad), and the checkpointed blocks' recompute; 0 when no backward reaches the tower."""
    attention_flops: int = 0
    """The part of forward_flops + backward_flops in attention kernels (sdpa; bmm under eager attention)."""
    recompute_flops: int = 0
    """The part of backward_flops that reruns the checkpointed blocks' forward (0 without checkpointing): what the
    backward runs with grad mode on (torch.utils.checkpoint recomputes under enable_grad; autograd's engine runs
    the backward's own kernels with grad mode off, as create_graph False sets it)."""
    patches: int = 0
    """Patches the tower's blocks see for one image (the widths its matmuls run at)."""

    @property
    def pixel_bytes(self) -> int:
        """One image's pixel_values in the batch, float32 as the image processor returns them: resident from the
        step's start to its end, whether the tower trains or not (the trace's saved bytes leave them out)."""
        import math

        return 4 * math.prod(self.pixel_shape)


_CACHE: dict[tuple, TowerTrace] = {}
_BY_PIXELS: dict[tuple, TowerTrace] = {}
"""The same traces keyed by the pixel values' shape and patch grid the image processor makes of the size."""


def _is_weight_copy(t) -> bool:
    """A cast of a parameter (autocast's copy): ToCopyBackward straight from a leaf's AccumulateGrad."""
    fn = t.grad_fn
    if fn is None or not type(fn).__name__.startswith("ToCopyBackward"):
        return False
    nexts = [f for f, _ in fn.next_functions if f is not None]
    return len(nexts) == 1 and type(nexts[0]).__name__ == "AccumulateGrad"


@contextlib.contextmanager
def _constants_of_any_size():
    """Let FakeTensorMode propagate constants of any size, not only 1-element ones (fake_tensor's
    CONSTANT_NUMEL_LIMIT), while the tower runs: only the grid-derived tensors handed in as constants (and what is
    computed from them alone) are constants; every weight and activation stays a plain fake tensor."""
    import torch._subclasses.fake_tensor as fake_tensor

    limit = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = 1 << 24
    try:
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = limit


def _tower_config(config: Any) -> Any:
    """`config` with one decoder layer: the tower's trace never runs the language model."""
    from toolkit.inputs.modelconfig import text_config

    config = copy.deepcopy(config)
    text = text_config(config)
    for name in ("num_hidden_layers",):
        if getattr(text, name, None):
            setattr(text, name, 1)
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:1]
    return config


def trace_tower(config: Any, width: int, height: int, *, dtype: str = "bfloat16", autocast: bool = False,
                attention: str = "sdpa", trained: bool = True, checkpointing: bool = False,
                config_dir=None) -> TowerTrace:
    """The vision encoder + projector of `config`'s multimodal class, forward on one `width` x `height` image
    under FakeTensorMode: what autograd keeps for backward. `dtype` / `autocast` as the language model's trace
    (toolkit.estimate.traces._trace_mode); `trained` False: the tower's parameters require no grad;
    `checkpointing`: the model's activation checkpointing on, as the HF Trainer turns it on for the whole class
    (every GradientCheckpointingLayer, the tower's blocks included): a block keeps its inputs only."""
    from toolkit.inputs.images import image_tokens

    text = config.to_json_string()
    key = (text, width, height, dtype, autocast, attention, trained, checkpointing, str(config_dir))
    if key not in _CACHE:
        # two sizes the processor turns into the same pixels (Gemma-3 resizes every image to its tower's square)
        # are one trace: the traced step sees only the pixel values and their patch grid
        found = image_tokens(config, width, height, config_dir)
        same = (text, tuple(found.pixel_shape), found.grid, *key[3:-1])
        if same not in _BY_PIXELS:
            _BY_PIXELS[same] = _trace(config, width, height, dtype=dtype, autocast=autocast, attention=attention,
                                      trained=trained, checkpointing=checkpointing, config_dir=config_dir)
        _CACHE[key] = _BY_PIXELS[same]
    return _CACHE[key]


def _trace(config, width, height, *, dtype, autocast, attention, trained, checkpointing,
           config_dir) -> TowerTrace:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    from toolkit.estimate.fakestep import enable_checkpointing, weights_uninitialised
    from toolkit.estimate.recording import StorageLog, make_recorder
    from toolkit.estimate.standins import trace_environment
    from toolkit.inputs.images import image_tokens
    from toolkit.inputs.modelconfig import auto_model_class

    found = image_tokens(config, width, height, config_dir)
    compute = getattr(torch, dtype)
    param_dtype = torch.float32 if autocast else compute
    traced = _tower_config(config)
    # flash-attention (set on every sub-model, as a user's from_pretrained string sets it) through the stand-in of
    # its kernel's footprint, as the language model's trace takes it: the flash-attn package need not be here
    flash = trace_environment(attention, "cpu", []) if attention == "flash_attention_2" \
        else contextlib.nullcontext(attention)
    with flash as attention, FakeTensorMode(allow_non_fake_inputs=True) as mode:
        with weights_uninitialised():
            model = auto_model_class(traced, images=True).from_config(traced, dtype=param_dtype,
                                                                      attn_implementation=attention)
        if checkpointing:
            enable_checkpointing(model)
        model.train()
        inner = model.model if hasattr(model.model, "get_image_features") else model
        for p in model.parameters():
            p.requires_grad_(trained)
        pixels = torch.zeros(found.pixel_shape, dtype=torch.float32)  # the processor's dtype
        kwargs: dict[str, Any] = {}
        if found.grid is not None:
            kwargs = _grid_inputs(inner, found.grid, mode, unset_fake_temporarily)
        # the batch's pixel values are resident whatever the tower saves (TowerTrace.pixel_bytes): not counted here
        param_storages = {id(p.untyped_storage()) for p in model.parameters()} | {id(pixels.untyped_storage())}
        seen: set[int] = set()
        held: list = []
        copies: set[int] = set()  # log serials of autocast's weight copies

        def pack(t):
            st = t.untyped_storage()
            if id(st) in param_storages or id(st) in seen:
                return t
            seen.add(id(st))
            held.append(st)  # keeps the storage (and its id) alive while the forward runs
            if autocast and _is_weight_copy(t):
                copies.add(log.serial_of(st))
            return t

        amp = torch.autocast(device_type="cpu", dtype=compute) if autocast else contextlib.nullcontext()
        log = StorageLog()
        recorder = make_recorder(log, set(), {}, lambda: "tower")
        forward, backward = flop_counter(), flop_counter()
        with _constants_of_any_size(), recorder:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp, forward:
                features = inner.get_image_features(pixels, **kwargs)
            features = torch.cat(list(getattr(features, "pooler_output", features)))
            held.clear()  # what no graph keeps dies here, as in a real step
            out = _resident(log, log.serial_of(features.untyped_storage()), copies)
            backward_extra = 0
            if features.requires_grad:
                with backward:
                    backward_extra = _backward_extra(model, features, log, out["saved"])
    return TowerTrace(saved_bytes=out["saved"], autocast_copy_bytes=out["copies"],
                      pixel_shape=tuple(found.pixel_shape), backward_extra_bytes=backward_extra,
                      forward_flops=forward.total(), backward_flops=backward.total(),
                      attention_flops=forward.attention() + backward.attention(),
                      recompute_flops=backward.under_grad,
                      patches=_patches(traced, found))


def _resident(log, output: int | None, copies: set[int]) -> dict[str, int]:
    """Bytes of the storages the tower's forward made that are still alive at its end, its output (the features
    the language model takes) left out: what the step holds for the tower until its backward. Not the sum of what
    autograd's pack hook saw: a frozen tower's checkpointed blocks save their inputs into graphs that die with the
    forward (nothing downstream requires grad), and the step also holds tensors no pack sees: the patch
    embedding's output that enable_input_require_grads turns into a leaf requiring grad (its AccumulateGrad node
    keeps it, and the conv output it views, for backward), and the rotary cos / sin the blocks' checkpoint
    closures hold. Split into autocast's weight copies and the rest."""
    import gc

    gc.collect()
    out = {"saved": 0, "copies": 0}
    for serial, ref in list(log.alive.values()):
        storage = ref()
        if storage is None or serial == output:
            continue
        out["copies" if serial in copies else "saved"] += storage.nbytes()
    return out


def _patches(config: Any, found: Any) -> int:
    """Patches one image puts through the tower's blocks: the patch grid (Qwen2-VL family), else a fixed square
    input of image_size / patch_size a side (SigLIP)."""
    import math

    if found.grid is not None:
        return math.prod(found.grid)
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2


def flop_counter():
    """A dispatch mode that counts FLOPs with torch's own formulas (torch.utils.flop_counter.flop_registry: they
    read shapes only), without FlopCounterMode's module tracker, whose hooks on every module's outputs would keep
    tensors alive in the traced backward and move its peak. The CPU's fused attention kernel (what sdpa runs on CPU
    and under CPU fake tensors) is counted as the GPU's fused kernels are: QK^T and AV forward (torch's sdpa
    formula), and a backward of twice the forward, the convention toolkit.estimate.efficiency.flop_split counts the
    language model's attention with and its fitted attention efficiency assumes (torch's own fused backward formula
    adds the score matrix's recompute: 2.5 x)."""
    import collections

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry, sdpa_flop_count, shape_wrapper

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return 2 * sdpa_flop_count(query, key, value)

    formulas = {**flop_registry, aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(forward),
                aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(backward)}

    class FlopTally(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: collections.Counter = collections.Counter()
            self.under_grad = 0  # FLOPs counted with grad mode on: in a backward, the checkpointed recompute

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = formulas.get(func._overloadpacket)
            if formula is not None:
                flops = formula(*args, **kwargs, out_val=out)
                self.counts[str(func._overloadpacket)] += flops
                self.under_grad += flops if torch.is_grad_enabled() else 0
            return out

        def total(self) -> int:
            return sum(self.counts.values())

        def attention(self) -> int:
            """The fused attention kernels' FLOPs and bmm / baddbmm's (a tower's linear layers run as mm / addmm;
            eager attention's QK^T and AV are its batched matmuls)."""
            return sum(n for op, n in self.counts.items() if "attention" in op or "bmm" in op)

    return FlopTally()


def _backward_extra(model, features, log, saved: int) -> int:
    """The tower's backward from a gradient the size of its output (as the language model's embedding backward
    hands it over): peak live bytes above the tower's `saved` bytes, the projector's output (dead once the
    language model has taken it) and parameter gradients left out. So it holds the incoming gradient, the
    backward's temporaries and, with checkpointing, each block's recompute and what the blocks' recompute closures
    hold beside autograd's saves (the rotary cos / sin). A frozen tower still runs it under checkpointing:
    transformers' activation_checkpointing_enable calls enable_input_require_grads, which hooks every
    PreTrainedModel's input embeddings, the tower's patch embedding included, so its output requires grad."""
    import torch

    excluded = {log.serial_of(features.untyped_storage())}
    start = len(log.events)
    features.backward(torch.ones_like(features))
    excluded |= {log.serial_of(p.grad.untyped_storage()) for p in model.parameters() if p.grad is not None}
    curve = log.live_curve(excluded)
    return max(0, max(curve[start:]) - saved)


def _grid_inputs(inner: Any, grid: tuple[int, ...], mode, unset_fake_temporarily) -> dict[str, Any]:
    """A patch-grid tower's inputs that read the grid's values (Qwen2-VL family): image_grid_thw and what
    transformers.vision_utils computes from it, on real tensors, handed in as fake-tensor constants."""
    import inspect

    import torch
    from transformers import vision_utils

    tower = next(getattr(inner, n) for n in ("visual", "vision_tower") if hasattr(inner, n))
    with unset_fake_temporarily():
        thw = torch.tensor([list(grid)], dtype=torch.long)
        real = {"image_grid_thw": thw}
        source = inspect.getsource(type(tower).forward)
        merge = getattr(tower, "spatial_merge_size", 1)
        if "get_vision_position_ids" in source:
            real["position_ids"] = vision_utils.get_vision_position_ids(thw, merge)
        if "get_vision_attention_seqlens" in source or "get_vision_cu_seqlens" in source:
            real["cu_seqlens"] = vision_utils.get_vision_cu_seqlens(thw)
        if "get_vision_window_index" in source:
            real["window_index"], real["cu_window_seqlens"] = vision_utils.get_vision_window_index(
                thw, spatial_merge_size=merge, window_size=tower.window_size, patch_size=tower.patch_size)
    convert = mode.fake_tensor_converter
    return {k: convert.from_real_tensor(mode, v, make_constant=True) for k, v in real.items()}

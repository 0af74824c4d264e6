"""Calibration: run real training steps of a model in this process and compare with the prediction.

The same step the Trainer path runs on one device: forward with labels (HF's loss), backward, the optimizer's step
(`make_optimizer`: the Trainer's for each --optimizer, fused AdamW by default), zero_grad(set_to_none); with LoRA,
the base wrapped by PEFT; with Liger, the model patched by toolkit.patches.liger's substitutes (Liger's own kernels
are Triton, and keep the same tensors). Precision as the DDP engine runs it: torch AMP (fp32 weights under autocast) for bf16/fp16,
bf16 weights for bf16-pure. The step measured is a steady-state one: a first step allocates the optimizer states.

Measured peak: on CUDA, torch.cuda.max_memory_allocated over the measured step; on CPU, the peak of live tensor
bytes seen by torch's MemTracker (torch.distributed._tools.mem_tracker), which counts every storage once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from toolkit.inputs.modelconfig import text_config


@dataclass(frozen=True)
class Measured:
    peak_bytes: int
    activations_bytes: int
    """Held for backward after forward + loss with the output released, autocast weight copies excluded: every
    storage still alive (saved tensors, what checkpoint recompute closures hold: masks, rotary tables; the loss),
    as toolkit.estimate.livebytes.measure_saved_bytes sees it."""
    step_time_s: float
    """Mean of `timed_steps` steps after the measured one."""
    tokens_per_s: float
    device: str
    timed_steps: int = 0


def _dtype(precision: str):
    import torch

    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": None}[precision]


def build_model(config, precision: str, attention: str, checkpointing: bool, device: str, seed: int = 0,
                adapter=None, images: bool = False, vision_tower: str = "train"):
    """The model as the DDP path trains it; with a LoRA `adapter` (toolkit.inputs.lora.Adapter), the base in the compute
    dtype wrapped by PEFT (adapters in fp32 under autocast), as toolkit.train does; `images`: the class that runs
    images (auto_model_class), its vision encoder and projector frozen where `vision_tower` is "freeze"."""
    import torch
    from toolkit.inputs.modelconfig import auto_model_class

    torch.manual_seed(seed)
    config = config.__class__.from_dict(config.to_dict())
    config._attn_implementation = attention
    if hasattr(config, "use_cache"):
        config.use_cache = False
    lora = adapter is not None and adapter.is_adapter
    if lora:
        from toolkit.inputs.lora import base_dtype_name

        dtype = getattr(torch, base_dtype_name(precision, adapter.base_dtype))
    else:
        dtype = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    model = auto_model_class(config, images=images).from_config(config, dtype=dtype).to(device)
    model.train()
    if vision_tower == "freeze":
        from toolkit.inputs.decoder_parts import vision_parts

        for path, *_ in sum(vision_parts(model, config), ()):
            model.get_submodule(path).requires_grad_(False)
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    if lora:
        from peft import get_peft_model

        from toolkit.inputs.lora import apply_saved_dtype

        # PEFT's default autocast_adapter_dtype, as toolkit.train runs it: fp32 adapters, over a bf16-pure base too
        model = get_peft_model(model, adapter.lora_config())
        apply_saved_dtype(model, adapter.saved_dtype)
        model.train()
    return model


def _batch(config, micro_batch: int, seq_len: int, device: str, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = text_config(config).vocab_size
    ids = torch.randint(0, vocab, (micro_batch, seq_len), generator=g).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def image_batch(config, *, micro_batch: int, text_tokens: int, images: int, image_size: str, device: str = "cpu",
                seed: int = 0) -> dict:
    """Samples of `text_tokens` text tokens and `images` images of `image_size` each, laid out as a Qwen-VL processor
    writes them (per image: text, vision start, the image's tokens, vision end; Gemma-3's begin / end of image and
    its fixed count), with the pixel values (random) and patch grid the model's own image processor gives at that
    size (toolkit.inputs.images.image_tokens; Gemma-3: one square an image, token_type_ids marking its tokens); the
    labels are the ids, as in the text batch."""
    import torch

    from toolkit.inputs.images import image_tokens, parse_image_size

    found = image_tokens(config, *parse_image_size(image_size))
    g = torch.Generator().manual_seed(seed)
    fixed = found.grid is None  # Gemma-3: a fixed count an image, wrapped in its begin / end-of-image tokens
    image = config.image_token_id
    start, end = (config.boi_token_id, config.eoi_token_id) if fixed else (config.vision_start_token_id,
                                                                           config.vision_end_token_id)
    text_id_bound = min(image, start, end, getattr(config, "video_token_id", image))
    rows = []
    for _ in range(micro_batch):
        row: list[int] = []
        for _ in range(images):
            row += torch.randint(0, text_id_bound, (text_tokens // images - 2,), generator=g).tolist()
            row += [start] + [image] * found.tokens + [end]
        rows.append(row)
    ids = torch.tensor(rows, device=device)
    count = micro_batch * images
    if fixed:  # Gemma3Processor's batch: one square of pixels an image, token_type_ids 1 on the image's tokens
        return {"input_ids": ids, "labels": ids.clone(),
                "pixel_values": torch.randn(count, *found.pixel_shape[-3:], generator=g).to(device),
                "token_type_ids": (ids == image).long()}
    return {"input_ids": ids, "labels": ids.clone(),
            "pixel_values": torch.randn(count * found.pixel_shape[0], *found.pixel_shape[1:], generator=g).to(device),
            "image_grid_thw": torch.tensor([list(found.grid)] * count, device=device),
            "mm_token_type_ids": (ids == image).long()}


def make_optimizer(params, optimizer: str = "adamw", impl: str = "fused"):
    """The optimizer the HF Trainer builds for `optimizer` (TrainingArguments optim adamw_torch_fused / adamw_torch
    / adamw_bnb_8bit / sgd / adafactor): AdamW runs its step as `impl` says (fused, foreach or for-loop, as
    toolkit.estimate.savers models it); SGD keeps a momentum buffer (the 4 bytes per parameter
    toolkit.estimate.states counts); Adafactor with the Trainer's settings (no relative step, no parameter scale)."""
    import torch

    params = list(params)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, fused=impl == "fused", foreach=impl == "foreach")
    if optimizer == "adamw-8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=1e-4)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    if optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-4, scale_parameter=False, relative_step=False)
    raise ValueError(f"unknown optimizer {optimizer!r}")


def measure_step(config, *, seq_len: int, micro_batch: int, precision: str = "fp32", attention: str = "sdpa",
                 checkpointing: bool = False, device: str = "cpu", steps: int = 3, adapter=None,
                 optimizer: str = "adamw", optimizer_impl: str = "fused", liger: bool = False, images: int = 0,
                 image_size: str = "", vision_tower: str = "train") -> Measured:
    """Peak memory of a steady-state step and the mean time of `steps` steps, in this process. `images` of
    `image_size` a sample (an image-text class): `seq_len` is the text tokens, the images add theirs (image_batch)."""
    import contextlib

    import torch

    model = build_model(config, precision, attention, checkpointing, device, adapter=adapter, images=bool(images),
                        vision_tower=vision_tower)
    batch = (image_batch(config, micro_batch=micro_batch, text_tokens=seq_len, images=images, image_size=image_size,
                         device=device) if images else _batch(config, micro_batch, seq_len, device))
    amp = _dtype(precision)
    autocast = (lambda: torch.autocast(device_type=device.split(":")[0], dtype=amp)) if amp \
        else contextlib.nullcontext
    patched = contextlib.nullcontext()
    if liger:
        from toolkit.patches.liger import liger_applied

        # As the Trainer does: a PEFT model is unwrapped first, and its base patched.
        patched = liger_applied(model.get_base_model() if hasattr(model, "get_base_model") else model)
    optimizer = make_optimizer((p for p in model.parameters() if p.requires_grad), optimizer, optimizer_impl)
    with patched:
        measured = _measure(model, optimizer, batch, amp, autocast, device, steps, batch["input_ids"].numel())
    if images:  # the batch's pixel values, alive before the forward, are resident for the whole step: the estimate
        # counts them with the activations (toolkit.estimate.visiontower, TowerTrace.pixel_bytes)
        pixels = batch["pixel_values"].untyped_storage().nbytes()
        measured = replace(measured, activations_bytes=measured.activations_bytes + pixels)
    return measured


def _measure(model, optimizer, batch, amp, autocast, device: str, steps: int, tokens: int) -> Measured:
    """measure_step's measurement of a built model and optimizer."""
    import torch

    from toolkit.estimate.livebytes import frozen_params_trackable, measure_saved_bytes

    def step() -> None:
        with autocast():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # allocates the optimizer states: what follows is a steady-state step
    saved, loss = measure_saved_bytes(model, batch, autocast_dtype=amp)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    del loss
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = 0
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model, optimizer, *batch.values())
        with frozen_params_trackable(), tracker:
            step()
        peak = sum(dev["Total"] for dev in tracker.get_tracker_snapshot("peak").values())
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    return Measured(peak_bytes=int(peak), activations_bytes=saved.live_bytes - saved.autocast_copy_bytes, step_time_s=elapsed,
                    tokens_per_s=tokens / elapsed, device=device, timed_steps=steps)


def predict_step(config, *, seq_len: int, micro_batch: int, precision: str = "fp32", attention: str = "sdpa",
                 checkpointing: bool = False, device_kind: str = "cpu", adapter=None, optimizer: str = "adamw",
                 optimizer_impl: str = "fused", liger: bool = False,
                 activation_offloading: bool = False, loss: str = "model", tiled: bool = False, images: int = 0,
                 image_size: str = "", vision_tower: str = "train") -> dict[str, Any]:
    """The estimator's prediction for the same single-device step (DDP engine, one process); `seq_len` and the
    images as measure_step takes them."""
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.images import image_job
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    spec = build_spec(getattr(config, "model_type", "model"), config, images=bool(images))
    seq_len, image_fields = image_job(spec, images, image_size, seq_len)
    job = Job(seq_len=seq_len, micro_batch=micro_batch, precision=precision, attention=attention,
              checkpointing=checkpointing, device_kind=device_kind, optimizer=optimizer, optimizer_impl=optimizer_impl,
              liger=liger, activation_offloading=activation_offloading, loss=loss, tiled=tiled,
              vision_tower=vision_tower, **image_fields, **({"adapter": adapter} if adapter else {}))
    b = estimate_memory(spec, parse_strategy("ddp"), job, parse_hardware("1xH200"))
    return {"peak_bytes": b.peak_bytes, "activations_bytes": b.activations_bytes, "peak_phase": b.peak_phase,
            "params": spec.params, "host_bytes": b.cpu_bytes_per_node}


def measure_offloaded_step(config, *, seq_len: int, micro_batch: int, precision: str = "fp32",
                           attention: str = "sdpa", checkpointing: bool = True,
                           tiled: bool = False) -> dict[str, int]:
    """A steady-state step under TRL's activation offloading (toolkit.patches.actoffload), in this process on CPU,
    measured as a GPU would hold it: `peak_bytes`, the peak of MemTracker's live bytes with the host copies TRL's
    pack hook makes left out (made with the tracker's dispatch mode off) and each copy the unpack hook hands back
    counted as a new tensor (on a GPU, the copy back to the device; on CPU TRL hands the host tensor itself back);
    `host_bytes`, the peak of the offloaded copies alive at once (TRL's pinned buffers); `offloaded_tensors`."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._python_dispatch import _disable_current_modes

    from toolkit.estimate.livebytes import frozen_params_trackable
    from toolkit.patches.actoffload import moved_bytes, offload_context

    model = build_model(config, precision, attention, checkpointing, "cpu")
    if tiled:  # ALST's tiling as toolkit.train applies it
        from toolkit.patches.tiling import apply_tiling

        apply_tiling(model)
    batch = _batch(config, micro_batch, seq_len, "cpu")
    amp = _dtype(precision)
    optimizer = make_optimizer(model.parameters())
    ctx = offload_context(model, on_cpu=True)
    pack, unpack = ctx.pack_hook, ctx.unpack_hook
    host = {"live": 0, "peak": 0, "tensors": 0}

    def host_pack(tensor):
        with _disable_current_modes():
            tensor_id = pack(tensor)
        moved = moved_bytes(ctx, tensor_id)
        if moved:
            host["live"] += moved
            host["peak"], host["tensors"] = max(host["peak"], host["live"]), host["tensors"] + 1
        return tensor_id

    def device_unpack(tensor_id):
        moved = moved_bytes(ctx, tensor_id)
        tensor = unpack(tensor_id)
        if not moved:
            return tensor
        host["live"] -= moved
        return tensor.clone()

    ctx.pack_hook, ctx.unpack_hook = host_pack, device_unpack

    def step() -> None:
        with ctx:
            with torch.autocast(device_type="cpu", dtype=amp, enabled=amp is not None):
                loss = model(**batch).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # allocates the optimizer states: what follows is a steady-state step
    host.update(peak=0, tensors=0)
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *batch.values())
    with frozen_params_trackable(), tracker:
        step()
    peak = sum(dev["Total"] for dev in tracker.get_tracker_snapshot("peak").values())
    return {"peak_bytes": int(peak), "host_bytes": host["peak"], "offloaded_tensors": host["tensors"]}

"""Image tokens per sample from the model's own image processor (issue 31, Deliver 3): the class transformers maps
the config to (AutoImageProcessor's IMAGE_PROCESSOR_MAPPING, the PIL backend where torchvision is absent), with its
default settings or a local preprocessor_config.json next to a local config, run on a dummy image of the requested
size. No per-architecture table: the processor's own output says the patch grid (Qwen2-VL's `image_grid_thw`
after smart_resize with its min / max pixels, divided by merge_size squared), or the config says a fixed count per
image (Gemma-3's `mm_tokens_per_image`, its images resized to one square).

Transformers, numpy and PIL only. image_job turns estimate's and plan's --images-per-sample / --image-size into
the Job's image fields and the language model's sequence length.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.errors import UserError


@dataclass(frozen=True)
class ImageTokens:
    tokens: int
    """Image tokens one image puts in the language model's sequence."""
    pixel_shape: tuple[int, ...]
    """The processor's pixel_values for one image (Qwen2-VL: flattened patches x patch features)."""
    grid: tuple[int, ...] | None
    """Qwen2-VL's image_grid_thw of the image (temporal, height, width patches); None for a fixed-count model."""
    processor: str
    """The image processor class that produced them."""


def parse_image_size(text: str) -> tuple[int, int]:
    """'WxH' (e.g. 448x448) as (width, height) in pixels."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
    from toolkit.bounds import IMAGE_SIDE

    if not match or not all(0 < int(v) <= IMAGE_SIDE.high for v in match.groups()):
        raise UserError(f"--image-size {text!r}: give WIDTHxHEIGHT in pixels (1 to {IMAGE_SIDE.high:g} a side), "
                        "e.g. 448x448")
    return int(match.group(1)), int(match.group(2))


def image_processor(config: Any, config_dir: str | Path | None = None):
    """The model's image processor: from `config_dir`/preprocessor_config.json when there is one, else the class
    transformers maps the config to, with its defaults."""
    from transformers.models.auto.image_processing_auto import (IMAGE_PROCESSOR_MAPPING, _load_class_with_fallback)

    if config_dir is not None and (Path(config_dir) / "preprocessor_config.json").is_file():
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(config_dir), backend="pil")
    if type(config) not in IMAGE_PROCESSOR_MAPPING:
        raise UserError(f"{config.model_type} has no image processor in transformers (AutoImageProcessor); images "
                        "apply to vision-language models only: drop the images, or plan a vision-language checkpoint")
    cls = _load_class_with_fallback(IMAGE_PROCESSOR_MAPPING[type(config)], "pil")
    if cls is None:
        raise UserError(f"transformers cannot load {config.model_type}'s image processor here (PIL missing?): "
                        "install pillow")
    return cls(**_tower_settings(cls(), config.vision_config))


def _tower_settings(defaults: Any, vision: Any) -> dict[str, Any]:
    """The processor settings the vision tower fixes, where the class's defaults differ from it: the patch size
    (the tower's patch embedding), the merge size (its patch merger), the temporal patch, and a fixed square input
    (SigLIP's image_size). Qwen3.5's tower patches 16 pixels where Qwen2VLImageProcessor's default is 14; Gemma-3's
    SigLIP takes 896 x 896 where Gemma3ImageProcessor's default is 224 x 224 (the checkpoints' own
    preprocessor_config.json say the tower's numbers)."""
    wanted = {}
    for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        if getattr(defaults, ours, None) is not None and getattr(vision, theirs, None) is not None \
                and getattr(defaults, ours) != getattr(vision, theirs):
            wanted[ours] = int(getattr(vision, theirs))
    size = getattr(defaults, "size", None)
    side = getattr(vision, "image_size", None)
    if side and getattr(size, "height", None) and getattr(size, "width", None) and (size.height, size.width) != (
            side, side):
        wanted["size"] = {"height": int(side), "width": int(side)}
    return wanted


def image_tokens(config: Any, width: int, height: int, config_dir: str | Path | None = None) -> ImageTokens:
    """Run the model's image processor on one dummy RGB image of `width` x `height` pixels."""
    import numpy as np

    if getattr(config, "vision_config", None) is None:
        raise UserError(f"{config.model_type} is a text-only model (no vision_config): drop the images, or plan a "
                        "vision-language checkpoint")
    processor = image_processor(config, config_dir)
    image = np.zeros((height, width, 3), dtype=np.uint8)
    try:
        out = processor(images=[image], return_tensors="np")
    except (ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"--image-size {width}x{height}: {type(processor).__name__} refuses it ({first[:200]}); "
                        "give another size") from None
    pixels = tuple(int(n) for n in out["pixel_values"].shape)
    if "image_grid_thw" in out:
        grid = tuple(int(n) for n in out["image_grid_thw"][0])
        merge = int(getattr(processor, "merge_size", 1) or 1)
        return ImageTokens(math.prod(grid) // (merge * merge), pixels, grid, type(processor).__name__)
    fixed = getattr(config, "mm_tokens_per_image", None)
    if fixed:
        return ImageTokens(int(fixed), pixels, None, type(processor).__name__)
    raise UserError(f"{type(processor).__name__} gives no patch grid and {config.model_type}'s config no "
                    "mm_tokens_per_image: toolkit cannot count its image tokens yet")


def image_job(spec: Any, images_per_sample: int | None, image_size: str | None, text_tokens: int,
              config_dir: str | Path | None = None) -> tuple[int, dict[str, Any]]:
    """(the language model's sequence length, the Job's image fields) of `text_tokens` text tokens with
    `images_per_sample` images of `image_size` (WIDTHxHEIGHT) each: text + images x the processor's tokens per
    image. Neither given: (text_tokens, {}). A text model, one without the other, or a size the processor refuses:
    one UserError line."""
    if not images_per_sample and not image_size:
        return text_tokens, {}
    if not images_per_sample:
        raise UserError("--image-size needs --images-per-sample N (images in each sample); give both, or neither")
    if not image_size:
        raise UserError("--images-per-sample needs --image-size WIDTHxHEIGHT (each image's pixels); give both, or "
                        "neither")
    check_image_model(spec)
    width, height = parse_image_size(image_size)
    found = image_tokens(spec.hf_config(), width, height, config_dir)
    seq_len = text_tokens + images_per_sample * found.tokens
    positions = getattr(spec, "max_positions", None)
    if positions and seq_len > positions:
        raise UserError(f"{text_tokens} text tokens + {images_per_sample} x {found.tokens} image tokens = {seq_len} "
                        f"is longer than {spec.name} allows ({positions} positions); give a shorter --seq, fewer "
                        "images or a smaller --image-size")
    return seq_len, {
        "images_per_sample": images_per_sample, "image_size": f"{width}x{height}", "image_tokens": found.tokens}


_MARKS_KEYWORDS = ("mm_token_type_ids", "token_type_ids")
"""The names a processor's marks of the image tokens reach a forward under: ProcessorMixin's own, and the one
Gemma3Processor renames them to (processing_gemma3.py __call__)."""


def image_marks_keyword(config: Any) -> str | None:
    """The keyword under which the model a trace builds for `config` (toolkit.inputs.modelconfig.auto_model_class)
    takes its processor's marks of the image tokens, or None where the processor marks none or the forward takes
    none. The processor class transformers maps the config to marks them where it sets `return_mm_token_type_ids`
    (ProcessorMixin.create_mm_token_type_ids: 1 on each image's tokens) and TRL's VLM collator passes on whatever
    the processor returns; the forward takes them as `mm_token_type_ids` or `token_type_ids`. Gemma-3 builds its
    attention mask from them (an image's tokens attend each other both ways), Qwen-VL places its M-RoPE positions
    with them. No per-architecture table: the processor class's flag and the forward's signature."""
    import inspect

    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    from toolkit.inputs.modelconfig import auto_model_class

    name = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    try:
        marks = bool(name and getattr(processor_class_from_name(name), "return_mm_token_type_ids", False))
    except ImportError:  # a processor class whose module needs torchvision: not importable here
        return None
    mapping = getattr(auto_model_class(config), "_model_mapping", {})
    try:
        forward = inspect.signature(mapping[type(config)].forward).parameters
    except (KeyError, ValueError):
        return None
    return next((key for key in _MARKS_KEYWORDS if key in forward), None) if marks else None


def check_image_model(spec: Any) -> None:
    """Images apply to a multimodal class only (a spec built for images: toolkit.inputs.modelspec.build_spec): one
    UserError line for a text model, or a checkpoint with a vision config whose tower no class builds."""
    if not getattr(spec, "multimodal", False) and getattr(spec.hf_config(), "vision_config", None) is not None:
        raise UserError(f"--images-per-sample: {spec.name} has a vision config but transformers builds it without "
                        f"its vision encoder ({spec.model_class or spec.model_type}: no image-text class, "
                        "AutoModelForImageTextToText, maps to it); drop the image flags")
    if not getattr(spec, "multimodal", False):
        raise UserError(f"--images-per-sample: {spec.name} has no vision encoder (it is not a multimodal class); "
                        "drop the image flags, or plan a vision-language checkpoint")


def image_words(job: Any) -> str:
    """The line on what a job's (or a plan request's) images add to the language model's sequence ("" for a text
    job)."""
    if not job.images_per_sample:
        return ""
    added = job.images_per_sample * job.image_tokens
    return (f"images: {job.images_per_sample} x {job.image_size} per sample, {job.image_tokens} tokens each (the "
            f"model's image processor): they add {added:,} tokens to {job.seq_len - added:,} text tokens; the "
            f"language model sees {job.seq_len:,}; the vision encoder's compute is in the step time (its FLOPs "
            "counted from its traced ops)")

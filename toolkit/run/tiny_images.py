"""The image side of a tiny vision-language model (issue 31): what a rehearsal of an image plan needs beside the tiny
model (toolkit.run.tiny.make_tiny_model images=True) to train on images without the hub: the config's image tokens
in the tiny tokenizer, and the processor saved as a checkpoint ships it (the tokenizer, the image processor's
preprocessor_config.json from the tower's own settings, a chat template that places each image). The images
themselves: toolkit.run.tiny.write_image_corpus.

Found from the config and the processor class transformers maps it to, not per architecture: the special-token ids
the config names (`*_token_id` / `*_token_index`), the processor's patch grid."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

REHEARSAL_IMAGE_SIDE = 40
"""The rehearsal's images are 40 x 40 pixels (write_image_corpus's size): the image processors with a patch grid
resize them to their min_pixels, a few patches merged into a few tokens (Qwen2.5-VL: 56 x 56, 4 tokens)."""

_NOT_IMAGE = ("bos", "eos", "pad", "decoder_start", "unk", "sep", "cls", "mask")

VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{% for c in message['content'] %}{{ c['text'] }}"
    "{% endfor %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}IMAGE{% else %}"
    "{{ c['text'] }}{% endif %}{% endfor %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
"""The tiny tokenizer's chat template (toolkit.run.tiny.CHAT_TEMPLATE) with image parts, in TRL's VLM message shape
(content lists of text and image parts); IMAGE is replaced by what stands for one image before the processor expands
it (vl_chat_template)."""


def vl_chat_template(image_placeholder: str) -> str:
    """VL_CHAT_TEMPLATE with `image_placeholder` written for each image part."""
    return VL_CHAT_TEMPLATE.replace("IMAGE", image_placeholder)


def image_token_names(config: Any) -> dict[str, str]:
    """{config attribute: the tiny tokenizer's token} for each special token of the images the config names by id
    (Qwen2.5-VL: image_token_id -> '<|image|>', vision_start_token_id -> '<|vision_start|>', video, vision_end);
    bos / eos / pad and the like are the text's (toolkit.run.tiny gives them id 0)."""
    names = {}
    for name, value in config.to_dict().items():
        match = re.fullmatch(r"(\w+?)_token_(?:id|index)", name)
        if match and isinstance(value, int) and not isinstance(value, bool) and match.group(1) not in _NOT_IMAGE:
            names[name] = f"<|{match.group(1)}|>"
    return names


def tokenizer_name(config_attribute: str) -> str:
    """The tokenizer attribute a processor reads for the token a config attribute names by id
    (image_token_id / image_token_index -> image_token: Qwen2.5-VL's processor reads tokenizer.image_token)."""
    return re.sub(r"_(?:id|index)$", "", config_attribute)


def image_placeholder(names: dict[str, str]) -> str:
    """What the chat template writes for one image, which the processor expands to the image's tokens: the
    begin-of-image token where the config has one (Gemma3Processor expands it to boi + the image tokens + eoi), else
    the image token between the vision start / end tokens where the config has them (Qwen's templates)."""
    if "boi_token_index" in names:
        return names["boi_token_index"]
    return "".join(names[k] for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id") if k in names)


def save_processor(config: Any, out: Path, names: dict[str, str]) -> None:
    """The processor's files beside the tiny model: the image processor with the tower's settings
    (toolkit.inputs.images.image_processor) and the chat template; the tokenizer is already there.
    toolkit.train.imagedata.load_processor builds the processor class from them."""
    from toolkit.inputs.images import image_processor

    image_processor(config).save_pretrained(out)
    (out / "chat_template.jinja").write_text(vl_chat_template(image_placeholder(names)))
    fixed = getattr(config, "mm_tokens_per_image", None)
    if fixed:  # a processor that puts a fixed count an image (Gemma3Processor's image_seq_length, 256 by default)
        from toolkit.train.imagedata import load_processor

        processor = load_processor(str(out))
        if getattr(processor, "image_seq_length", fixed) != fixed:
            type(processor).from_pretrained(str(out), image_seq_length=fixed).save_pretrained(out)


def image_rehearsal_problem(config: Any) -> str | None:
    """Why the rehearsal cannot train the images of a plan for `config`, or None: its tiny model is built for image
    processors that count an image's tokens from its patch grid (Qwen2-VL's family: the tiny tower's few patches give
    a few tokens) and for a fixed count pooled from the tower's square (Gemma-3's mm_tokens_per_image from its
    image_size: shrunk by toolkit.run.tiny to 4 tokens from 4 x 4 patches)."""
    from toolkit.errors import UserError
    from toolkit.inputs.images import image_tokens

    try:
        found = image_tokens(config, REHEARSAL_IMAGE_SIDE, REHEARSAL_IMAGE_SIDE)
    except UserError as exc:
        return str(exc)
    vision = config.vision_config
    if found.grid is None and not (getattr(config, "mm_tokens_per_image", None) and getattr(vision, "image_size", None)
                                   and getattr(vision, "patch_size", None)):
        return (f"{found.processor} gives every image a fixed {found.tokens} tokens, and the config names no "
                "mm_tokens_per_image pooled from a square image_size that the tiny model could shrink")
    if not {"image_token_id", "image_token_index"} & set(image_token_names(config)):
        return f"{config.model_type}'s config names no image token id for the tiny tokenizer"
    return None

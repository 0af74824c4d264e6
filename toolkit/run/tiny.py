"""Tiny models of real architectures, a locally trained tokenizer and a corpus that needs no download.

Used by the demo, the rehearsal and the tests: no hub access at run time. The corpus is the documentation that
every Python installation ships (the docstrings of the standard library), so it exists wherever Python does.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

from toolkit.inputs.modelconfig import text_config

# Standard-library modules whose docstrings make the corpus; chosen for long, plain-English documentation.
CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "io", "itertools", "json",
    "logging", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "statistics", "string",
    "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)

def corpus_text(max_chars: int | None = None) -> str:
    """Docstrings of standard-library modules, classes and functions, in a fixed order, as blank-line separated
    paragraphs, each paragraph once.

    The standard library repeats itself (inherited docstrings, shared boilerplate such as "Return self==value."):
    without this deduplication most validation paragraphs also stood in the training text, and the demo's eval
    perplexity (1.9 at a training loss of 3.65) measured recall, not generalisation. The text ends at a paragraph
    boundary, so a cut never makes a fragment of a paragraph that is also present whole.
    """
    paragraphs: list[str] = []
    seen: set[str] = set()
    total = 0
    for name in CORPUS_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a stripped-down Python: use what is there
            continue
        for obj in [module, *(getattr(module, a, None) for a in sorted(dir(module)) if not a.startswith("_"))]:
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or len(doc) < 80:
                continue
            doc = "\n".join(line.strip() for line in doc.strip().splitlines())
            for paragraph in doc.split("\n\n"):
                paragraph = paragraph.strip()
                if not paragraph or paragraph in seen:
                    continue
                if max_chars is not None and total + len(paragraph) > max_chars:
                    return "\n\n".join(paragraphs)
                seen.add(paragraph)
                paragraphs.append(paragraph)
                total += len(paragraph) + 2
    return "\n\n".join(paragraphs)


def write_corpus(out_dir: str | Path, max_chars: int = 400_000, eval_fraction: float = 0.05) -> Path:
    """Write the corpus as train.txt and validation.txt in out_dir; return out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = corpus_text(max_chars)
    paragraphs = text.split("\n\n")  # unique (corpus_text), so the two files share no paragraph
    n_eval = max(1, int(len(paragraphs) * eval_fraction))
    (out / "train.txt").write_text("\n\n".join(paragraphs[:-n_eval]) + "\n")
    (out / "validation.txt").write_text("\n\n".join(paragraphs[-n_eval:]) + "\n")
    return out


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""A ChatML-like template for the tiny tokenizers; {% generation %} marks the assistant's tokens (what TRL's
assistant_only_loss and transformers' return_assistant_tokens_mask read)."""


def write_chat_corpus(out_dir: str | Path, max_chars: int = 60_000, eval_fraction: float = 0.05) -> Path:
    """train.jsonl + validation.jsonl of conversations ({"messages": [...]}) made from the corpus: the user asks
    about a paragraph's first words, the assistant answers with the paragraph. Returns out_dir."""
    rows = [{"messages": [{"role": "user", "content": _question(paragraph)},
                          {"role": "assistant", "content": paragraph}]}
            for paragraph in corpus_text(max_chars).split("\n\n")]
    return _write_rows(Path(out_dir), rows, eval_fraction)


def write_preference_corpus(out_dir: str | Path, max_chars: int = 60_000, eval_fraction: float = 0.05,
                            answer_words: int = 12, pairs: int | None = None) -> Path:
    """train.jsonl + validation.jsonl of preference pairs in TRL's format ({"prompt", "chosen", "rejected"}, all
    strings) made from the corpus: the prompt names a paragraph's first words, the chosen answer is that paragraph's
    opening (`answer_words` words), the rejected one the next paragraph's. `pairs`: that many training pairs (the
    held-out ones follow them). Returns out_dir."""
    paragraphs = [p for p in corpus_text(max_chars).split("\n\n") if len(p.split()) >= 3]
    rows = [{"prompt": _question(paragraph) + "\n", "chosen": " ".join(paragraph.split()[:answer_words]),
             "rejected": " ".join(other.split()[:answer_words])}
            for paragraph, other in zip(paragraphs, paragraphs[1:] + paragraphs[:1])]
    return _write_rows(Path(out_dir), rows, eval_fraction, train_rows=pairs)


def write_prompt_corpus(out_dir: str | Path, max_chars: int = 60_000, eval_fraction: float = 0.05) -> Path:
    """train.jsonl + validation.jsonl of prompts in TRL's prompt-only format ({"prompt": str}, what GRPOTrainer
    takes; its reward functions get the completions) made from the corpus: the questions of the preference pairs.
    Returns out_dir."""
    rows = [{"prompt": _question(paragraph) + "\n"} for paragraph in corpus_text(max_chars).split("\n\n")]
    return _write_rows(Path(out_dir), rows, eval_fraction)


COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def write_image_corpus(out_dir: str | Path, rows: int = 16, size: tuple[int, int] = (40, 40),
                       eval_fraction: float = 0.0, most_images: int = 2) -> Path:
    """train.jsonl (+ validation.jsonl) of image-and-text conversations in TRL's VLM format ({"messages": [...],
    "images": ["images/3.png", ...]}, paths relative to out_dir) and the PNGs they name, drawn with PIL: a square of
    one colour on a grey ground; the assistant names the colours. Rows cycle through one to `most_images` images.
    Returns out_dir."""
    from PIL import Image, ImageDraw

    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    records = []
    for row in range(rows):
        colours = [names[(row + k) % len(names)] for k in range(1 + row % most_images)]
        files = []
        for k, colour in enumerate(colours):
            image = Image.new("RGB", size, (128, 128, 128))
            box = [row % 7, k * 3, size[0] // 2 + row % 5, size[1] // 2]
            ImageDraw.Draw(image).rectangle(box, fill=COLOURS[colour])
            files.append(f"images/{row}-{k}.png")
            image.save(out / files[-1])
        question = "What colour is the square?" if len(files) == 1 else "What colours are the squares?"
        records.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": f"The square is {' then '.join(colours)}."}],
                        "images": files})
    if not eval_fraction:
        (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return out
    return _write_rows(out, records, eval_fraction)


def _question(paragraph: str) -> str:
    """The user's turn the chat, preference and prompt data share: a paragraph's first words to explain."""
    return f"Explain: {' '.join(paragraph.split()[:2])}"


def _write_rows(out: Path, rows: list[dict[str, Any]], eval_fraction: float, train_rows: int | None = None) -> Path:
    """rows as train.jsonl (the first `train_rows`, else all but the held-out share) and validation.jsonl (the
    `eval_fraction` share after them), one JSON object a line, as datasets' "json" loader reads them."""
    out.mkdir(parents=True, exist_ok=True)
    n_eval = max(1, int(len(rows) * eval_fraction))
    n_train = len(rows) - n_eval if train_rows is None else train_rows
    for name, part in (("train.jsonl", rows[:n_train]), ("validation.jsonl", rows[n_train:n_train + n_eval])):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in part))
    return out


def train_tokenizer(text: str, vocab_size: int = 512, named_tokens: dict[str, str] | None = None):
    """A byte-level BPE tokenizer trained on `text`, as a transformers PreTrainedTokenizerFast. `named_tokens`: more
    special tokens, each an attribute of the tokenizer under its name (image_token="<|image|>": tokenizer.image_token
    and tokenizer.image_token_id, what a processor reads)."""
    named = dict(named_tokens or {})
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", *named.values()],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                        unk_token="<|endoftext|>", pad_token="<|endoftext|>", **named)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# Size knobs under the names HF configs use (canonical names reach renamed attributes through the config class's
# own attribute_map, e.g. GPT-2's n_embd). Everything else in a config (norms, activations, rope type, soft-caps,
# biases, layer pattern) is kept: a rehearsal model differs from the real one in size only.
_FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
_EXPERT_FFN_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token")
_KV_KEYS = ("num_key_value_heads", "num_kv_heads")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def shrink_config(config, *, vocab_size: int = 512, layers: int = 4, hidden: int = 64, heads: int = 4,
                  kv_heads: int | None = None, ffn: int = 128, max_positions: int = 256, experts: int = 4,
                  images: bool = False, **overrides: Any):
    """The same architecture as `config` (its own config class, every non-size setting kept), small enough to train
    in seconds on CPU: `layers` decoder layers of width `hidden` with `heads` heads of hidden / heads dims.

    Found from the config itself, not per architecture: the size attributes under their usual names (and the class's
    attribute_map), the key/value-head ratio (kv_heads=None keeps the real model's grouping: multi-query stays
    multi-query, GQA keeps a group size that divides `heads`), experts and experts per token, sliding windows, the
    per-layer pattern (layer_types keeps every kind of layer it had), layer-index lists, and rope scaling tables
    sized by the rotary dimension. A composite config whose text config transformers builds no model of its own
    (Qwen2.5-VL), or any composite config for an image-and-text model (`images`: the tiny model of an image plan,
    with a tiny vision tower), stays whole: see _shrink_composite."""
    cls = type(config)
    text = text_config(config)
    if text is not config and (images or not _has_own_class(text)):
        return _shrink_composite(config, dict(vocab_size=vocab_size, layers=layers, hidden=hidden, heads=heads,
                                              kv_heads=kv_heads, ffn=ffn, max_positions=max_positions,
                                              experts=experts, **overrides))
    if text is not config:
        config = text
        cls = type(text)
    data = config.to_dict()
    amap = dict(getattr(cls, "attribute_map", {}) or {})

    def key(name: str) -> str:
        return amap.get(name, name)

    def present(name: str) -> bool:
        return key(name) in data

    old_layers = int(data.get(key("num_hidden_layers")) or layers)
    old_hidden = int(data.get(key("hidden_size")) or hidden)
    old_heads = int(data.get(key("num_attention_heads")) or heads)
    old_head_dim = int(data.get("head_dim") or old_hidden // old_heads)
    head_dim = hidden // heads
    # The rotary part of a head (partial_rotary_factor) and the sections it is split into (Qwen3.5's multimodal
    # mrope_section: lists summing to the rotary half): a head with its own size (head_dim in the config) stays wide
    # enough to give every section a frequency.
    rope = next((data[n] for n in ("rope_parameters", "rope_scaling") if isinstance(data.get(n), dict)), {})
    partial = float(rope.get("partial_rotary_factor") or data.get("partial_rotary_factor") or 1.0)
    old_rotary = int(old_head_dim * partial) // 2
    sections = max((len(v) for v in rope.values() if _is_partition(v, old_rotary)), default=0)
    if data.get("head_dim") and int(head_dim * partial) // 2 < sections:
        head_dim = 2 * math.ceil(sections / partial)
    data[key("num_hidden_layers")] = layers
    data[key("hidden_size")] = hidden
    data[key("num_attention_heads")] = heads
    if "head_dim" in data and data["head_dim"] is not None:
        data["head_dim"] = head_dim
    for name, value in list(data.items()):
        # Multi-head latent attention (DeepSeek-V2/V3): per-head parts (qk_nope / qk_rope / v_head_dim) scale with
        # the head, the low-rank projections (kv / q_lora_rank) with the width.
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            continue
        if name.endswith("_head_dim") and name != "head_dim":
            data[name] = max(2, 2 * round(value * head_dim / old_head_dim / 2))
        elif name.endswith("_lora_rank"):
            data[name] = max(8, value * hidden // old_hidden)
    if data.get("query_pre_attn_scalar") == old_head_dim:  # Gemma: the attention scale is 1 / sqrt(head_dim)
        data["query_pre_attn_scalar"] = head_dim
    for name in _KV_KEYS:
        if present(name) and data[key(name)] is not None:
            if kv_heads is not None:
                data[key(name)] = kv_heads
            else:
                group = max(1, old_heads // max(1, int(data[key(name)])))
                data[key(name)] = max(1, heads // min(group, heads))
    for name in _FFN_KEYS:
        if present(name):
            data[key(name)] = ffn
    for name in _EXPERT_FFN_KEYS:
        if data.get(key(name)):
            data[key(name)] = max(16, ffn // 2)
    for name in _EXPERT_KEYS:
        if isinstance(data.get(key(name)), int) and data[key(name)] >= 2:
            data[key(name)] = experts
    for name in _TOP_K_KEYS:
        if isinstance(data.get(key(name)), int) and data[key(name)] >= 1:
            data[key(name)] = min(data[key(name)], 2, experts)
    if isinstance(data.get("n_group"), int) and data["n_group"] > 1:  # group-limited routing (DeepSeek-V3):
        data["n_group"] = max(1, min(data["n_group"], experts // 2))  # 2+ experts per group, groups divide experts
        while experts % data["n_group"]:
            data["n_group"] -= 1
        if isinstance(data.get("topk_group"), int):
            data["topk_group"] = min(data["topk_group"], data["n_group"])
    if present("word_embed_proj_dim"):  # OPT: an input / output projection exists when this differs from hidden
        data["word_embed_proj_dim"] = hidden if data["word_embed_proj_dim"] == old_hidden else hidden // 2
    if isinstance(data.get("sliding_window"), int) and data["sliding_window"] > 0:
        data["sliding_window"] = min(data["sliding_window"], max_positions // 2)
    if isinstance(data.get("max_window_layers"), int):
        data["max_window_layers"] = min(data["max_window_layers"], layers)
    for name, value in list(data.items()):
        if name.endswith(("_layers", "_indexes")) and isinstance(value, list) \
                and all(isinstance(v, int) for v in value):  # layer-index lists (Qwen-MoE's mlp_only_layers,
            # Qwen2.5-VL's vision fullatt_block_indexes, Qwen3-VL's deepstack_visual_indexes): a list the cut would
            # empty keeps the last layer, so the tiny model still has that kind of layer
            data[name] = [v for v in value if v < layers] or ([layers - 1] if value else [])
    if isinstance(data.get(key("layer_types")), list):  # Nemotron-H's attribute_map: layers_block_type
        data[key("layer_types")] = _shrunk_pattern(data[key("layer_types")], layers)
    table = data.get("num_position_embeddings")  # a vision tower's learned position grid (Qwen3-VL: a square
    if isinstance(table, int) and math.isqrt(table) ** 2 == table and table > 64:  # interpolated to each image)
        data["num_position_embeddings"] = 64
    old_positions = data.get(key("max_position_embeddings"))
    if present("max_position_embeddings"):
        data[key("max_position_embeddings")] = max_positions
    ratio = max_positions / old_positions if isinstance(old_positions, int) and old_positions else 1.0
    new_rotary = int(head_dim * partial) // 2
    for name in ("rope_parameters", "rope_scaling"):
        if isinstance(data.get(name), dict):
            data[name] = _shrunk_rope(data[name], ratio, old_rotary, new_rotary)
    if isinstance(data.get("original_max_position_embeddings"), int):
        data["original_max_position_embeddings"] = max(1, int(data["original_max_position_embeddings"] * ratio))
    data[key("vocab_size")] = vocab_size
    for name in _TOKEN_ID_KEYS:  # the tiny tokenizer has one special token, id 0
        if data.get(name) is not None:
            data[name] = 0
    for name in ("transformers_version", "architectures", "torch_dtype", "dtype"):
        data.pop(name, None)  # the tiny model is stored in fp32; the plan's precision is the run's
    data.update(overrides)
    return cls(**data)


def _has_own_class(config) -> bool:
    """Whether transformers' causal-LM or image-text auto mapping builds a model from `config` itself."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)

    return type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


def _shrink_composite(config, sizes: dict[str, Any]):
    """A small whole model's config (Qwen2.5-VL: its text config has no class, so the rehearsal model is the
    image-text class auto_model_class builds): the text config shrunk with `sizes`, every other sub-config (the
    vision encoder) shrunk to 2 layers of width 32, its sizes that were the text model's width (the projector's
    output) set to the new width."""
    text = text_config(config)
    small_text = shrink_config(text, **sizes)
    data = {k: v for k, v in config.to_dict().items()
            if k not in ("transformers_version", "architectures", "torch_dtype", "dtype")}
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if sub is text:
            data[name] = small_text.to_dict()
        elif sub is not None and hasattr(sub, "to_dict"):
            small = shrink_config(sub, layers=2, hidden=32, heads=2, ffn=64).to_dict()
            small.update({k: small_text.hidden_size for k, v in sub.to_dict().items()
                          if v == text.hidden_size and small.get(k) == v})
            data[name] = small
    for name in _TOKEN_ID_KEYS:  # the composite's own copies (Gemma-3's eos_token_id [1, 106]): the tiny id 0
        if data.get(name) is not None:
            data[name] = 0
    vision = data.get("vision_config")
    if isinstance(data.get("mm_tokens_per_image"), int) and isinstance(vision, dict) and vision.get("image_size") \
            and vision.get("patch_size"):  # a fixed count an image, pooled from the tower's fixed square (Gemma-3:
        vision["image_size"] = 4 * vision["patch_size"]  # 64 x 64 patches of 14 px to 256 tokens): 4 x 4 patches
        data["mm_tokens_per_image"] = 4  # pooled 2 x 2 (Gemma3MultiModalProjector: kernel = patches a side / 2)
    return type(config)(**data)


def sizes_for_degrees(config, *, tensor: int = 1, sequence: int = 1, stages: int = 1, layers: int = 4,
                      hidden: int = 64, heads: int = 4, ffn: int = 128) -> dict[str, int]:
    """shrink_config's size knobs for a small model of `config` that every parallel degree of a plan divides, so
    that it runs the plan's grid: tensor parallelism splits the attention heads, the KV heads and the FFN widths
    (the tp_plan's colwise / packed_colwise styles; shrink_config makes the expert FFN half of `ffn`), Ulysses
    sequence parallelism splits the heads and splits or replicates the KV heads, pipeline stages take whole layers.
    Heads grow at the same head width when a degree needs more; the real model's key/value grouping is kept where
    the degrees allow it, otherwise the nearest grouping they do (Qwen3-MoE's 8:1 on 4 heads is 1 KV head, which
    tensor parallelism 2 cannot split: 2). Experts stay as shrink_config makes them (4), which the rehearsal's
    expert-parallel degree (2) divides. Context parallelism divides the sequence, not the model (the rehearsal's
    sequence length follows the grid). Derived from the degrees and the config's head counts, not per
    architecture."""
    text = text_config(config)
    head_dim = hidden // heads
    heads = math.lcm(heads, tensor, sequence)
    real_heads = getattr(text, "num_attention_heads", None)
    real_kv = next((getattr(text, k) for k in _KV_KEYS if isinstance(getattr(text, k, None), int)), None)
    group = max(1, real_heads // real_kv) if isinstance(real_heads, int) and real_kv else 1
    want = max(1, heads // min(group, heads))  # shrink_config's rule: the real grouping, capped at `heads`
    kv_heads = min(k for k in range(want, heads + 1) if heads % k == 0 and k % tensor == 0
                   and (k % sequence == 0 or sequence % k == 0))  # k = heads always qualifies
    return {"layers": max(_round_up(layers, stages), stages), "hidden": heads * head_dim, "heads": heads,
            "kv_heads": kv_heads, "ffn": _round_up(ffn, 2 * tensor)}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _shrunk_pattern(pattern: list, layers: int) -> list:
    """The first `layers` entries of a per-layer pattern, its last entries replaced by any kind of layer that the
    cut lost (Gemma-3's five sliding layers then one full one keeps a full-attention layer)."""
    out = list(pattern[:layers]) + [pattern[-1]] * max(0, layers - len(pattern))
    missing = [kind for kind in dict.fromkeys(pattern) if kind not in out]
    for i, kind in enumerate(missing[:layers]):
        out[layers - 1 - i] = kind
    return out


def _shrunk_rope(rope: dict, ratio: float, old_rotary: int, new_rotary: int) -> dict:
    """Rope parameters for the shrunk model: position lengths scaled with max_position_embeddings, per-frequency
    tables (Phi-3's longrope short/long factors) resampled to the new rotary size; nested per-layer-type dicts too."""
    out = {}
    for name, value in rope.items():
        if isinstance(value, dict):
            out[name] = _shrunk_rope(value, ratio, old_rotary, new_rotary)
        elif _is_partition(value, old_rotary) and len(value) <= new_rotary:
            out[name] = _rescaled_partition(value, new_rotary)
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            size = max(1, round(len(value) * new_rotary / max(1, old_rotary)))
            out[name] = [value[int(i * len(value) / size)] for i in range(size)]
        elif name == "original_max_position_embeddings" and isinstance(value, int):
            out[name] = max(1, int(value * ratio))
        else:
            out[name] = value
    return out


def tiny_config(arch: str, vocab_size: int = 512, *, layers: int = 4, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, ffn: int = 128, max_positions: int = 256, **overrides: Any):
    """A small config of a real architecture (model_type `arch`, transformers' defaults shrunk by shrink_config;
    random init, trains in seconds on CPU)."""
    from transformers import AutoConfig, CONFIG_MAPPING

    if arch not in CONFIG_MAPPING:
        raise ValueError(f"transformers knows no model_type {arch!r}")
    return shrink_config(AutoConfig.for_model(arch), vocab_size=vocab_size, layers=layers, hidden=hidden,
                         heads=heads, kv_heads=kv_heads, ffn=ffn, max_positions=max_positions, **overrides)


def make_tiny_model(arch: str | Any, out_dir: str | Path, *, seed: int = 0, corpus_chars: int = 200_000,
                    vocab_size: int = 512, images: bool = False, **config_overrides: Any) -> Path:
    """Save a randomly initialised tiny model and a locally trained tokenizer in out_dir (HF format).

    `arch` is a model_type (transformers' default config of it is shrunk) or a config of a real model (shrunk the
    same way: same architecture and settings, small sizes). `images` (a config of a vision-language model): the
    whole image-text class with a tiny vision tower, the tokenizer holding the config's image tokens, and the
    processor saved beside them (toolkit.run.tiny_images)."""
    import torch
    from transformers.utils import logging as hf_logging

    from toolkit.inputs.modelconfig import auto_model_class

    from toolkit.run import tiny_images

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    named = tiny_images.image_token_names(arch) if images else {}
    tokenizer = train_tokenizer(corpus_text(corpus_chars), vocab_size=vocab_size,
                                named_tokens={tiny_images.tokenizer_name(k): v for k, v in named.items()})
    if isinstance(arch, str):
        config = tiny_config(arch, vocab_size=len(tokenizer), **config_overrides)
    else:
        config = shrink_config(arch, vocab_size=len(tokenizer), images=images, **config_overrides)
    for name, token in named.items():
        setattr(config, name, tokenizer.convert_tokens_to_ids(token))
    torch.manual_seed(seed)
    model = auto_model_class(config, images=images).from_config(config)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for one tiny shard on stderr, where a rehearsal's failure is one line
    try:
        model.save_pretrained(out)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(out)
    if images:
        tiny_images.save_processor(config, out, named)
    (out / "toolkit_tiny.json").write_text(json.dumps({"arch": config.model_type, "seed": seed}) + "\n")
    return out


def _is_partition(value: Any, total: int) -> bool:
    """A list of positive ints summing to `total`: the rotary frequencies split into sections (mrope_section)."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                            for v in value) and sum(value) == total


def _rescaled_partition(value: list[int], total: int) -> list[int]:
    """The same sections in proportion, summing to `total`, each at least 1 (largest remainders round up)."""
    spare = total - len(value)
    exact = [v / sum(value) * spare for v in value]
    out = [1 + int(e) for e in exact]
    for i in sorted(range(len(value)), key=lambda i: int(exact[i]) - exact[i])[:total - sum(out)]:
        out[i] += 1
    return out

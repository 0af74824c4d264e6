"""Tiny models of real architectures, a locally trained tokenizer and a corpus that needs no download.

Used by the demo, the rehearsal and the tests: no hub access at run time. The corpus is the documentation that
every Python installation ships (the docstrings of the standard library), so it exists wherever Python does.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

# Standard-library modules whose docstrings make the corpus; chosen for long, plain-English documentation.
CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email", "enum", "fractions", "functools", "heapq", "http.client", "inspect", "io", "itertools", "json",
    "logging", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "statistics", "string",
    "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)

TINY_ARCHITECTURES = ("gpt2", "llama", "mistral", "qwen2", "opt", "gemma2", "mixtral", "phi3")


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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for paragraph in corpus_text(max_chars).split("\n\n"):
        topic = " ".join(paragraph.split()[:2])
        rows.append({"messages": [{"role": "user", "content": f"Explain: {topic}"},
                                  {"role": "assistant", "content": paragraph}]})
    n_eval = max(1, int(len(rows) * eval_fraction))
    for name, part in (("train.jsonl", rows[:-n_eval]), ("validation.jsonl", rows[-n_eval:])):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in part))
    return out


def train_tokenizer(text: str, vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on `text`, as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(arch: str, vocab_size: int = 512, *, layers: int = 4, hidden: int = 64, heads: int = 4,
                kv_heads: int = 2, ffn: int = 128, max_positions: int = 256, **overrides: Any):
    """A small config of a real architecture (random init, trains in seconds on CPU)."""
    from transformers import AutoConfig

    common = dict(vocab_size=vocab_size)
    if arch == "gpt2":
        kw = dict(n_layer=layers, n_embd=hidden, n_head=heads, n_inner=ffn, n_positions=max_positions,
                  bos_token_id=0, eos_token_id=0)
    elif arch == "opt":
        kw = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_dim=ffn,
                  word_embed_proj_dim=hidden, max_position_embeddings=max_positions, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0)
    elif arch in ("llama", "mistral", "qwen2", "gemma2", "mixtral", "phi3"):
        kw = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=ffn, max_position_embeddings=max_positions,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
        if arch == "llama":
            kw["tie_word_embeddings"] = False
        if arch == "gemma2":
            kw.update(head_dim=hidden // heads, query_pre_attn_scalar=hidden // heads, sliding_window=128)
        if arch == "mixtral":
            kw.update(num_local_experts=4, num_experts_per_tok=2)
        if arch == "phi3":  # Phi-3-mini's own: positions it was trained on, no sliding window at this length
            kw.update(original_max_position_embeddings=max_positions, sliding_window=None)
    else:
        raise ValueError(f"no tiny config for {arch!r}; known: {', '.join(TINY_ARCHITECTURES)}")
    kw.update(common)
    kw.update(overrides)
    return AutoConfig.for_model(arch, **kw)


def make_tiny_model(arch: str, out_dir: str | Path, *, seed: int = 0, corpus_chars: int = 200_000,
                    vocab_size: int = 512, **config_overrides: Any) -> Path:
    """Save a randomly initialised tiny model and a locally trained tokenizer in out_dir (HF format)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_text(corpus_chars), vocab_size=vocab_size)
    config = tiny_config(arch, vocab_size=len(tokenizer), **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "toolkit_tiny.json").write_text(json.dumps({"arch": arch, "seed": seed}) + "\n")
    return out

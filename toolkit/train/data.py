"""Training data: local files or a hub dataset, as blocks of exactly seq_len tokens.

Plain text (a "text" column, or --text-field): packed. Documents are joined with the tokenizer's EOS token and cut
into equal blocks, the remainder dropped, as causal-LM pretraining and transformers' run_clm.py do: no padding, every
token trains, every step has the seq_len tokens the plan's memory was computed for. Attention does cross the EOS
into the previous document inside a block; keeping documents apart needs per-document attention masks (varlen
flash-attention kernels fed with position_ids), which sdpa / eager attention on a padded batch do not give, and
for continued pretraining the EOS boundary is the accepted convention (GPT-2, run_clm.py).

Chat data (a "messages" column of {"role", "content"} lists): each conversation is rendered with the tokenizer's
chat template, the loss is on the assistant's tokens only (labels -100 elsewhere), and conversations are *not*
packed: each is one sequence, truncated to seq_len and right-padded (attention_mask 0, labels -100), so attention
never crosses conversations and every step keeps the planned shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.patches.lmhead import IGNORE_INDEX

# datasets' builder for each file kind we accept.
LOADERS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
           ".parquet": "parquet", ".csv": "csv"}
# File stems that mark a held-out split inside a data folder (train.txt + validation.txt, as tiny.write_corpus does).
EVAL_STEMS = ("validation", "valid", "val", "eval", "test")


def build_datasets(data: str, tokenizer: Any, seq_len: int, *, eval_fraction: float, seed: int,
                   text_field: str = "text", max_eval_blocks: int | None = None):
    """Return (train, eval or None): datasets.Dataset of seq_len sequences with "input_ids" and "labels" (packed
    text, or one conversation each with an "attention_mask" for chat data; module docstring).

    The held-out set is the data's validation file when a folder has one, else `eval_fraction` of the packed blocks
    (a seeded shuffle). When a process group is up this is collective: rank 0 tokenizes first and fills the
    datasets cache, the others then read it, so call it on every rank.
    """
    if seq_len <= 0:
        raise UserError(f"sequence length must be positive, got {seq_len}")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise UserError("the tokenizer has no EOS token to separate packed documents; set tokenizer.eos_token "
                        "(or pass --tokenizer with one)")
    with _main_process_first():
        train_raw, eval_raw = load_raw(data)
        chat = CHAT_FIELD in train_raw.column_names
        if "images" in train_raw.column_names:
            raise UserError(f"data {data} has an 'images' column but the plan is text-only: its memory holds no "
                            "images; re-plan with --images-per-sample N --image-size WxH, or drop the column")

        def blocks(raw):
            if chat:
                return _chat_blocks(raw, tokenizer, seq_len)
            return _pack(text_column(raw, text_field, data), tokenizer, seq_len, eos)

        train = blocks(train_raw)
        if len(train) == 0 and chat:
            raise UserError(f"chat data {data}: no conversation has an assistant token within the first {seq_len} "
                            "tokens; plan a longer --seq or shorten the prompts")
        if len(train) == 0:
            raise UserError(f"data {data} holds fewer than {seq_len} tokens, not one training block of seq_len "
                            f"{seq_len}; give more text or plan a shorter --seq")
        if eval_raw is not None:
            evaluation = blocks(eval_raw)
            if len(evaluation) == 0:
                evaluation = None
        elif eval_fraction > 0 and len(train) >= 2:
            n_eval = max(1, round(len(train) * eval_fraction))
            split = train.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
            train, evaluation = split["train"], split["test"]
        else:
            evaluation = None
    if evaluation is not None and max_eval_blocks is not None and len(evaluation) > max_eval_blocks:
        evaluation = evaluation.select(range(max_eval_blocks))
    return train, evaluation


class _main_process_first:
    """Rank 0 runs the block first (and fills the cache); other ranks wait, then run it from the cache."""

    def __enter__(self):
        import torch.distributed as dist

        self.dist = dist if dist.is_available() and dist.is_initialized() else None
        if self.dist is not None and self.dist.get_rank() != 0:
            self.dist.barrier()

    def __exit__(self, exc_type, exc, tb):
        # Rank 0 releases the others even when it failed, so they fail on their own (same error) and do not hang.
        if self.dist is not None and self.dist.get_rank() == 0:
            self.dist.barrier()
        return False


def load_raw(data: str):
    """(train, eval or None) as datasets.Dataset with the raw documents."""
    import datasets

    local = local_data_files(data)
    if local is not None:
        train_files, eval_files = local
        return _load_files(data, train_files), (_load_files(data, eval_files) if eval_files else None)
    try:
        loaded = datasets.load_dataset(data)
    except Exception as exc:  # offline, unknown name, private: one line that names it
        raise UserError(f"data {data} is not a local file or folder, and loading it as a hub dataset failed: "
                        f"{_first_line(exc)}") from None
    train = loaded["train"] if "train" in loaded else loaded[next(iter(loaded))]
    evaluation = next((loaded[name] for name in ("validation", "valid", "test") if name in loaded), None)
    return train, evaluation


def local_data_files(data: str) -> tuple[list[Path], list[Path]] | None:
    """(training files, validation files) of local data, None for a hub dataset name. A file is its own training
    set; a folder's files of one kind (LOADERS) split by their stem (EVAL_STEMS). Refuses what cannot be read."""
    from toolkit.fileio import file_kind_problem

    path = Path(data).expanduser()
    if path.exists() and not path.is_file() and not path.is_dir():
        raise UserError(f"data {data} is {file_kind_problem(path)}; give a regular file or a folder of them")
    if path.is_file():
        if path.suffix.lower() not in LOADERS:
            raise UserError(f"data file {data} has an unknown kind ({path.suffix or 'no extension'}); use .txt, "
                            ".json, .jsonl, .parquet or .csv")
        return [path], []
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOADERS
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not files:
            raise UserError(f"data folder {data} has no .txt/.json/.jsonl/.parquet/.csv files")
        kinds = {LOADERS[p.suffix.lower()] for p in files}
        if len(kinds) > 1:
            raise UserError(f"data folder {data} mixes file kinds ({', '.join(sorted(kinds))}); keep one kind")
        eval_files = [p for p in files if p.stem.lower().split("-")[0].split("_")[0] in EVAL_STEMS]
        train_files = [p for p in files if p not in eval_files]
        if not train_files:
            raise UserError(f"data folder {data} holds only validation files ({eval_files[0].name}); add training data")
        return train_files, eval_files
    if _looks_local(data):
        raise UserError(f"data {data} does not exist")
    return None


def _load_files(data: str, files: list[Path]):
    import datasets

    kind = LOADERS.get(files[0].suffix.lower())
    if kind is None:
        raise UserError(f"data file {files[0]} has an unknown kind; use .txt, .json, .jsonl, .parquet or .csv")
    # A text file's documents are its paragraphs (blank-line separated), which EOS separators then keep apart.
    options = {"sample_by": "paragraph"} if kind == "text" else {}
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", **options)
    except Exception as exc:
        raise UserError(f"could not read data {data} as {kind}: {_first_line(exc)}") from None


def text_column(raw, text_field: str, data: str):
    """The dataset reduced to one string column named "text"."""
    columns = raw.column_names
    if text_field not in columns:
        string_columns = [c for c, f in raw.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
        if len(string_columns) != 1:
            raise UserError(f"data {data} has no '{text_field}' column (columns: {', '.join(columns)}); "
                            "pass --text-field NAME")
        text_field = string_columns[0]
    return raw.select_columns([text_field]).rename_column(text_field, "text") if text_field != "text" \
        else raw.select_columns(["text"])


def _pack(raw, tokenizer, seq_len: int, eos: int):
    def tokenize_and_pack(batch: dict[str, list]) -> dict[str, list]:
        ids: list[int] = []
        for text in batch["text"]:
            if not text or not text.strip():
                continue
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.append(eos)
        n_blocks = len(ids) // seq_len
        blocks = [ids[i * seq_len:(i + 1) * seq_len] for i in range(n_blocks)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    # Large batches lose little at block boundaries (each batch's remainder is dropped, as in run_clm.py).
    return raw.map(tokenize_and_pack, batched=True, batch_size=2000, remove_columns=raw.column_names,
                   desc=f"tokenizing and packing into {seq_len}-token blocks")


CHAT_FIELD = "messages"
CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles chat templates render (transformers' chat-template docs; TRL's conversational format)."""


def conversation_problem(messages: Any, *, name: str = "messages", need_assistant: bool = True) -> str | None:
    """Why `messages` (the column `name`) is not a conversation the chat template and the loss mask can take, or
    None; `need_assistant` False for a DPO prompt, whose answers are the chosen / rejected turns."""
    if isinstance(messages, str):
        return f"'{name}' is a string; give a list of {{\"role\": ..., \"content\": ...}} turns"
    if not isinstance(messages, list):
        return f"'{name}' is a {type(messages).__name__}; give a list of {{\"role\": ..., \"content\": ...}} turns"
    if not messages:
        return f"'{name}' is an empty list; every conversation needs turns"
    for i, turn in enumerate(messages, 1):
        if not isinstance(turn, dict):
            return f"turn {i} is a {type(turn).__name__}, not an object with 'role' and 'content'"
        role = turn.get("role")
        if role not in CHAT_ROLES:
            return f"turn {i} has role {role!r}; use one of {', '.join(CHAT_ROLES)}"
        if "content" not in turn:
            return f"turn {i} ({role}) has no 'content'"
        if not isinstance(turn["content"], str):
            return (f"turn {i} ({role}) has content of type {type(turn.get('content')).__name__}; give the "
                    "content as a string")
    if need_assistant and not any(turn["role"] == "assistant" for turn in messages):
        return "no assistant turn: the loss is on the assistant's tokens, so this conversation trains nothing"
    return None


def chat_example(messages: list[dict[str, str]], tokenizer: Any, seq_len: int) -> dict[str, list[int]]:
    """One conversation as input_ids / attention_mask / labels of exactly seq_len: the chat template's tokens,
    labels only on the assistant's turns, truncated and right-padded.

    The assistant's tokens: the template's own {% generation %} marks when it has them (transformers'
    return_assistant_tokens_mask), else each assistant turn is the span between the rendering of the conversation
    up to it (with the generation prompt) and the rendering including it, which holds for templates whose
    rendering of a prefix is a prefix of the whole (checked; refused otherwise).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise UserError("chat data (a 'messages' column) needs a tokenizer with a chat template; pass --tokenizer "
                        "with one (an instruct model's), or give the data as plain text")
    if "{% generation %}" in template or "{%- generation %}" in template:
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        ids = list(rendered["input_ids"])
        mask = list(rendered["assistant_masks"])
    else:
        ids = _chat_ids(tokenizer, messages, generation_prompt=False)
        mask = [0] * len(ids)
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = _chat_ids(tokenizer, messages[:i], generation_prompt=True) if i else []
            end = _chat_ids(tokenizer, messages[:i + 1], generation_prompt=False)
            if ids[:len(end)] != end or end[:len(start)] != start:
                raise UserError("the tokenizer's chat template renders a conversation's beginning differently "
                                "from the whole, so the assistant's tokens cannot be found; use a template with "
                                "{% generation %} marks")
            mask[len(start):len(end)] = [1] * (len(end) - len(start))
    ids, mask = ids[:seq_len], mask[:seq_len]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    n_pad = seq_len - len(ids)
    return {"input_ids": ids + [pad] * n_pad, "attention_mask": [1] * len(ids) + [0] * n_pad,
            "labels": [t if m else IGNORE_INDEX for t, m in zip(ids, mask)] + [IGNORE_INDEX] * n_pad}


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _chat_blocks(raw, tokenizer, seq_len: int):
    """Conversations as padded sequences; ones with no assistant token left after truncation are dropped."""
    def render(batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
        for messages in batch[CHAT_FIELD]:
            if not messages:
                continue
            example = chat_example(messages, tokenizer, seq_len)
            if any(label != IGNORE_INDEX for label in example["labels"]):
                for key in out:
                    out[key].append(example[key])
        return out

    return raw.map(render, batched=True, batch_size=500, remove_columns=raw.column_names,
                   desc=f"rendering conversations into {seq_len}-token sequences")


def _looks_local(data: str) -> bool:
    return (data.startswith((".", "/", "~")) or Path(data).suffix.lower() in LOADERS
            or data.count("/") > 1 or "\\" in data)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__

"""How many tokens a training run's data holds (estimate / plan --data): read the way toolkit.train reads it
(toolkit.train.data: the same files, loader and text column), tokenized with the model's own tokenizer, and
counted as the run formats it.

Plain text is packed: each document's tokens plus the EOS that separates it from the next (toolkit.train.data's
packing). Chat data is not: each conversation that keeps an assistant token within --seq fills one padded
--seq-token sequence, so it counts --seq tokens (the step consumes global batch x seq either way).

Big data is sampled: SAMPLE_RECORDS records drawn with a fixed seed (the same data always gives the same count),
and the sample's tokens scaled by the record count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError

if TYPE_CHECKING:
    from toolkit.estimate.duration import RunSize

SAMPLE_RECORDS = 2000
"""Records tokenized at most: a few seconds of a fast tokenizer, and a sample mean within about 2% of the whole
for documents of ordinary spread (tests/test_duration.py measures it on 20,000 records)."""


@dataclass(frozen=True)
class DataTokens:
    tokens: int
    records: int
    """Records of the training split (documents, or conversations)."""
    tokenized: int
    """Records tokenized: all of them, or the sample (fewer than `records`)."""
    kind: str
    """"text" (packed) or "chat" (one padded sequence per conversation)."""

    @property
    def sampled(self) -> bool:
        return self.tokenized < self.records

    def detail(self, data: str) -> str:
        what = "documents" if self.kind == "text" else "conversations"
        how = (f"sampled: {self.tokenized:,} of {self.records:,} {what} tokenized, scaled" if self.sampled
               else f"counted: all {self.records:,} {what} tokenized")
        return f"{data}, {how}" + ("; one padded --seq sequence per conversation" if self.kind == "chat" else "")


def model_tokenizer(model: str | None):
    """The model's own tokenizer: a local folder's, or a hub id's (or catalog entry's) from the local cache only."""
    from toolkit.inputs.resolve import loadable_model

    fix = "give --dataset-tokens N instead of --data"
    if not model:
        raise UserError(f"--data counts tokens with the model's tokenizer, and a model given by numbers has none; {fix}")
    source = loadable_model(model)
    if Path(source).is_file():  # a config.json given as the model
        source = str(Path(source).parent)
    if Path(source).is_dir():
        from toolkit.run.preflight import tokenizer_files

        if not tokenizer_files(Path(source)):
            raise UserError(f"--data needs {model}'s tokenizer, and the folder holds no tokenizer files "
                            f"(tokenizer.json, tokenizer_config.json or the vocabulary files); {fix}")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as exc:  # OSError / ValueError / a tokenizer class that is not installed
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"--data needs {model}'s tokenizer, and none can be loaded here ({first[:160]}); {fix}") \
            from None


def run_size_from_data(data: str, model: str | None, *, seq_len: int, epochs: float = 1.0,
                       gpu_hour_price: float | None = None, tokenizer: Any = None) -> "RunSize":
    """The run's size from `data`, its tokens counted with `tokenizer` (by default `model`'s own) for `seq_len`
    sequences: what `--data` gives estimate and plan, and `data=` the Python API."""
    from toolkit.estimate.duration import RunSize

    counted = count_tokens(data, tokenizer if tokenizer is not None else model_tokenizer(model), seq_len=seq_len)
    if counted.tokens < 1:
        raise UserError(f"--data {data} holds no trainable tokens (no text, or no conversation with an "
                        "assistant token within --seq); give other data or --dataset-tokens")
    return RunSize(dataset_tokens=counted.tokens, epochs=epochs, gpu_hour_price=gpu_hour_price,
                   source="sampled" if counted.sampled else "counted", source_detail=counted.detail(data))


def count_tokens(data: str, tokenizer: Any, *, seq_len: int, text_field: str = "text") -> DataTokens:
    """The training tokens of `data` (a local file or folder, as toolkit.train takes it) for `seq_len` sequences."""
    from toolkit.train.data import CHAT_FIELD, load_raw, local_data_files

    from toolkit.run.data_check import sample_data

    local = local_data_files(data)
    if local is None:
        raise UserError(f"--data {data} is not a local file or folder (a hub dataset is not downloaded to count "
                        "it); give --dataset-tokens N")
    sample_data(local[0])  # the preflight's reader: a malformed row is named in one line before datasets reads it
    import datasets

    bars_on, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()  # one line of output, not datasets' bars and logged errors
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        raw, _ = load_raw(data)  # the validation split is not trained on
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_on:
            datasets.enable_progress_bars()
    records = len(raw)
    if records == 0:
        raise UserError(f"--data {data} holds no records; give data with text or conversations")
    if records > SAMPLE_RECORDS:
        import random

        # A seeded draw, not a fixed stride: a stride aliases with data that repeats a pattern (measured: 3x off on
        # documents whose length cycles with period 5, tests/test_duration.py).
        sample = raw.select(sorted(random.Random(0).sample(range(records), SAMPLE_RECORDS)))
    else:
        sample = raw
    if CHAT_FIELD in raw.column_names:
        tokens = _chat_tokens(data, sample[CHAT_FIELD], tokenizer, seq_len)
        kind = "chat"
    else:
        tokens = _text_tokens(data, sample, tokenizer, text_field)
        kind = "text"
    return DataTokens(tokens=round(tokens * records / len(sample)), records=records, tokenized=len(sample),
                      kind=kind)


def _text_tokens(data: str, sample, tokenizer: Any, text_field: str) -> int:
    from toolkit.train.data import text_column

    texts = [t for t in text_column(sample, text_field, data)["text"] if isinstance(t, str) and t.strip()]
    if not texts:
        return 0
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return sum(len(i) + 1 for i in ids)  # + the EOS separator packing adds


def _chat_tokens(data: str, conversations: list, tokenizer: Any, seq_len: int) -> int:
    from toolkit.train.data import conversation_problem
    from toolkit.train.data import IGNORE_INDEX, chat_example

    usable = 0
    for number, messages in enumerate(conversations, 1):
        if not messages:
            continue  # the run skips empty ones too
        problem = conversation_problem(messages)
        if problem:
            raise UserError(f"chat data {data}: sampled conversation {number}: {problem}")
        example = chat_example(messages, tokenizer, seq_len)
        usable += any(label != IGNORE_INDEX for label in example["labels"])
    return usable * seq_len

"""The data of a training run, opened and sampled with a size limit before any process starts (toolkit.run.preflight
calls it): readable, not empty, of one kind (plain text or chat, never both: the run would drop the text rows), the
text column present, chat rows well formed (a list of {"role", "content"} turns with known roles, string contents,
an assistant turn that survives truncation to the plan's sequence length), and enough of it for one optimizer step.

The ranks would find most of these too, but only after the run log exists, every rank has imported torch and the
model has loaded; some (a chat row among text rows, one 50 MB conversation) they would not refuse at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import UserError

SAMPLE_BYTES = 8 * 1024 * 1024
"""Bytes of data read per data set: enough rows to judge a format and to fill one step of any sane plan."""
MAX_ROW_BYTES = 8 * 1024 * 1024
"""The largest row (a JSON Lines line) read: the run keeps only --seq tokens of a conversation, so a longer row
is a file-format mistake (or a whole corpus on one line), not a training example."""
MAX_CHECKED_CONVERSATIONS = 256
"""Conversations rendered with the chat template to count the ones whose assistant turn survives truncation."""


# ----------------------------------------------------------------------------------------------------------------
# The data


@dataclass
class DataSample:
    """Rows read from the start of a data set, and whether they are all of it."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    whole: bool = True
    """True when every row of every file was read (the counts below are then the data's own)."""
    where: list[str] = field(default_factory=list)
    """Where each row came from ("train.jsonl line 3"), for the refusals."""


def sample_data(files: list[Path], *, limit: int = SAMPLE_BYTES) -> DataSample:
    """The first rows of `files` (one kind, toolkit.train.data.LOADERS), at most `limit` bytes of them."""
    from toolkit.train.data import LOADERS

    sample = DataSample()
    budget = limit
    for path in files:
        if budget <= 0:
            sample.whole = False
            break
        kind = LOADERS[path.suffix.lower()]
        budget -= {"text": _sample_text, "json": _sample_json, "csv": _sample_csv,
                   "parquet": _sample_parquet}[kind](path, budget, sample)
    return sample


def _head(path: Path, budget: int) -> tuple[bytes, bool]:
    with open(path, "rb") as f:
        data = f.read(budget + 1)
    return data[:budget], len(data) <= budget


def _decode(path: Path, data: bytes, whole: bool) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not whole and exc.start >= len(data) - 4:  # a character cut at the sample's end
            return data[:exc.start].decode("utf-8")
        raise UserError(f"data file {path} is not UTF-8 text (byte {exc.start}); convert it or give a text / "
                        "json / jsonl / csv / parquet file") from None


def _sample_text(path: Path, budget: int, sample: DataSample) -> int:
    data, whole = _head(path, budget)
    text = _decode(path, data, whole)
    sample.whole &= whole
    # datasets' text loader with sample_by="paragraph" (what toolkit.train.data uses): blank-line separated.
    for number, paragraph in enumerate(text.split("\n\n"), 1):
        if paragraph.strip():
            sample.rows.append({"text": paragraph})
            sample.where.append(f"{path.name} paragraph {number}")
    return len(data)


def _sample_json(path: Path, budget: int, sample: DataSample) -> int:
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(64).lstrip()[:1]
    if path.suffix.lower() == ".json" and first in (b"[", b"{") and size <= budget:
        data = path.read_bytes()
        try:
            document = json.loads(_decode(path, data, True))
        except json.JSONDecodeError:
            document = None  # maybe JSON Lines in a .json file
        except RecursionError:
            raise UserError(f"data file {path} nests too deeply to be a data set") from None
        if document is not None:
            rows = _document_rows(path, document)
            sample.rows.extend(rows)
            sample.where.extend(f"{path.name} record {i}" for i in range(1, len(rows) + 1))
            return len(data)
    if path.suffix.lower() == ".json" and first == b"[" and size > budget:
        sample.whole = False  # one large JSON document: datasets reads it whole; the runner's checks decide
        return 0
    used = 0
    with open(path, "rb") as f:
        number = 0
        while used < budget:
            line = f.readline(MAX_ROW_BYTES + 1)
            if not line:
                return used
            number += 1
            used += len(line)
            if len(line) > MAX_ROW_BYTES:
                raise UserError(f"data file {path} line {number} is longer than {MAX_ROW_BYTES // 2**20} MiB: one "
                                "row that long is not a training example (a run keeps --seq tokens of it); split "
                                "it into rows, one JSON object per line")
            if not line.strip():
                continue
            try:
                row = json.loads(_decode(path, line, True))
            except json.JSONDecodeError as exc:
                raise UserError(f"data file {path} is not valid JSON Lines (line {number}: {exc.msg}); fix that "
                                "line or give a text / csv / parquet file") from None
            except RecursionError:
                raise UserError(f"data file {path} line {number} nests too deeply to be a row") from None
            if not isinstance(row, dict):
                raise UserError(f"data file {path} line {number} is a JSON {type(row).__name__}, not an object; "
                                'give one object per line, e.g. {"text": "..."} or {"messages": [...]}')
            sample.rows.append(row)
            sample.where.append(f"{path.name} line {number}")
        sample.whole = sample.whole and not f.read(1)
    return used


def _document_rows(path: Path, document: Any) -> list[dict[str, Any]]:
    """Rows of one JSON document as datasets' json loader reads it: a list of objects, or an object of columns."""
    if isinstance(document, list):
        for i, row in enumerate(document, 1):
            if not isinstance(row, dict):
                raise UserError(f"data file {path} record {i} is a JSON {type(row).__name__}, not an object; give "
                                'a list of objects, e.g. [{"text": "..."}]')
        return document
    if isinstance(document, dict) and document and all(isinstance(v, list) for v in document.values()):
        lengths = {len(v) for v in document.values()}
        if len(lengths) != 1:
            raise UserError(f"data file {path} holds columns of different lengths; give a list of objects")
        return [dict(zip(document, values)) for values in zip(*document.values())]
    return [document]


def _sample_csv(path: Path, budget: int, sample: DataSample) -> int:
    import csv
    import io

    data, whole = _head(path, budget)
    text = _decode(path, data, whole)
    if not whole:
        text = text[:text.rfind("\n") + 1]
    sample.whole &= whole
    try:
        reader = csv.DictReader(io.StringIO(text))
        for number, row in enumerate(reader, 2):
            sample.rows.append(dict(row))
            sample.where.append(f"{path.name} line {number}")
    except csv.Error as exc:
        raise UserError(f"data file {path} is not valid CSV ({exc}); fix it or give a jsonl / parquet file") from None
    return len(data)


def _sample_parquet(path: Path, budget: int, sample: DataSample) -> int:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        rows_total = parquet.metadata.num_rows
        used = 0
        read = 0
        for batch in parquet.iter_batches(batch_size=256):
            rows = batch.to_pylist()
            sample.rows.extend(rows)
            sample.where.extend(f"{path.name} row {read + i}" for i in range(1, len(rows) + 1))
            read += len(rows)
            used += batch.nbytes
            if used >= budget:
                break
    except UserError:
        raise
    except Exception as exc:  # pyarrow's ArrowInvalid / OSError for a corrupt or truncated file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"data file {path} is not a readable parquet file ({first[:200]}); re-export it") from None
    sample.whole &= read >= rows_total
    return used


def check_data(data: str, *, text_field: str, tokenizer: Any, seq_len: int, global_batch: int,
               preference: bool = False, grpo: Any = None) -> str:
    """Refuse data the run cannot train one optimizer step on; returns "text", "chat" or (a DPO plan's,
    `preference`) "preference". Hub datasets are not looked at here (their loading needs the network, and the
    ranks report it)."""
    from toolkit.train.data import local_data_files

    local = local_data_files(data)
    if local is None:
        return "unknown"
    train_files, _ = local
    sample = sample_data(train_files)
    if not sample.rows and sample.whole:
        raise UserError(f"data {data} holds no rows (empty file{'s' if len(train_files) > 1 else ''}); give data "
                        "with text or conversations")
    if not sample.rows:
        return "unknown"
    if preference:
        _check_preference(data, sample, global_batch)
        return "preference"
    if grpo is not None:
        _check_prompts(data, sample, grpo, tokenizer, global_batch)
        return "prompts"
    kind = _one_kind(data, sample)
    if kind == "chat":
        _check_chat(data, sample, tokenizer, seq_len, global_batch)
    else:
        _check_text(data, sample, text_field, tokenizer, seq_len, global_batch)
    return kind


def _one_kind(data: str, sample: DataSample) -> str:
    from toolkit.train.data import CHAT_FIELD

    chat = [i for i, row in enumerate(sample.rows) if row.get(CHAT_FIELD) is not None]
    if chat and len(chat) < len(sample.rows):
        text_row = next(i for i in range(len(sample.rows)) if i not in set(chat))
        raise UserError(f"data {data} mixes chat rows ({sample.where[chat[0]]} has '{CHAT_FIELD}') and plain-text "
                        f"rows ({sample.where[text_row]} has none); the run would drop the text rows: keep one kind "
                        "per data set")
    return "chat" if chat else "text"


def _check_preference(data: str, sample: DataSample, global_batch: int) -> None:
    """A DPO plan's data: every row a prompt / chosen / rejected pair, and one optimizer step's pairs."""
    from toolkit.train.dpo import preference_row_problem

    for row, where in zip(sample.rows, sample.where):
        problem = preference_row_problem(row)
        if problem:
            raise UserError(f"DPO data {data}: {where} {problem}")
    if sample.whole and len(sample.rows) < global_batch:
        raise UserError(f"DPO data {data} holds {len(sample.rows)} pair(s), fewer than one optimizer step takes "
                        f"(global batch {global_batch} pairs); give more pairs or plan a smaller --global-batch")


def _check_prompts(data: str, sample: DataSample, grpo: Any, tokenizer: Any, global_batch: int) -> None:
    """A GRPO plan's data: every row a prompt within the plan's max_prompt_length (TRL 1.16 does not truncate
    prompts, so a longer one trains on longer sequences than planned), and one optimizer step's prompts."""
    from toolkit.train.grpo import prompt_row_problem, prompt_tokens

    for row, where in zip(sample.rows, sample.where):
        problem = prompt_row_problem(row)
        if problem:
            raise UserError(f"GRPO data {data}: {where} {problem}")
    for row, where in list(zip(sample.rows, sample.where))[:MAX_CHECKED_CONVERSATIONS]:
        tokens = prompt_tokens(row["prompt"], tokenizer)
        if tokens > grpo.max_prompt_length:
            raise UserError(f"GRPO data {data}: the prompt of {where} is {tokens} tokens, longer than the plan's "
                            f"--max-prompt-length {grpo.max_prompt_length} (its memory assumes no longer prompt); "
                            "shorten the prompts or re-plan with a larger --max-prompt-length")
    prompts = global_batch // grpo.num_generations
    if sample.whole and len(sample.rows) < prompts:
        raise UserError(f"GRPO data {data} holds {len(sample.rows)} prompt(s), fewer than one optimizer step takes "
                        f"(global batch {global_batch} completions = {prompts} prompts x {grpo.num_generations} "
                        "generations); give more prompts or plan a smaller --global-batch")


def _check_text(data: str, sample: DataSample, text_field: str, tokenizer: Any, seq_len: int,
                global_batch: int) -> None:
    columns = list(dict.fromkeys(key for row in sample.rows for key in row))
    field_name = text_field
    if text_field not in columns:
        strings = [c for c in columns if all(isinstance(row.get(c), (str, type(None))) for row in sample.rows)
                   and any(isinstance(row.get(c), str) for row in sample.rows)]
        if len(strings) != 1:  # toolkit.train.data.text_column decides the same way
            raise UserError(f"data {data} has no '{text_field}' column (columns: {', '.join(columns) or 'none'}); "
                            "pass --text-field NAME")
        field_name = strings[0]
    for row, where in zip(sample.rows, sample.where):
        value = row.get(field_name)
        if value is not None and not isinstance(value, str):
            raise UserError(f"data {data}: '{field_name}' of {where} is of type {type(value).__name__}, not text; "
                            "give strings (or pass --text-field with the text column)")
    needed = seq_len * global_batch
    tokens = 0
    for row in sample.rows:
        text = row.get(field_name)
        if text and text.strip():
            tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1  # + the EOS separator
            if tokens >= needed:
                return
    if sample.whole:
        raise UserError(f"data {data} holds {tokens:,} tokens, fewer than one optimizer step trains on (global "
                        f"batch {global_batch} x seq {seq_len} = {needed:,} tokens); give more text, or plan a "
                        "smaller --global-batch or a shorter --seq")


def _check_chat(data: str, sample: DataSample, tokenizer: Any, seq_len: int, global_batch: int) -> None:
    from toolkit.train.data import CHAT_FIELD, IGNORE_INDEX, chat_example, conversation_problem

    for row, where in zip(sample.rows, sample.where):
        problem = conversation_problem(row[CHAT_FIELD])
        if problem:
            raise UserError(f"chat data {data}: {where}: {problem}")
    usable = 0
    rendered = sample.rows[:MAX_CHECKED_CONVERSATIONS]
    for row in rendered:
        example = chat_example(row[CHAT_FIELD], tokenizer, seq_len)  # no chat template: refused here, one line
        usable += any(label != IGNORE_INDEX for label in example["labels"])
        if usable >= global_batch:
            return
    if usable == 0:
        raise UserError(f"chat data {data}: no conversation among the first {len(rendered)} has an assistant "
                        f"token within the plan's {seq_len}-token sequences (the prompts before the first "
                        "answer are longer); plan a longer --seq or shorten the prompts")
    if sample.whole and len(rendered) == len(sample.rows):
        raise UserError(f"chat data {data} holds {usable} trainable conversation(s), fewer than one optimizer step "
                        f"takes (global batch {global_batch}); give more conversations or plan a smaller "
                        "--global-batch")

"""Image-and-text training data (issue 31, Deliver 4): a local folder with a JSONL of conversations, each row a
`messages` list (TRL's conversational format, string contents) and an `images` list of image files (paths relative
to the data folder, or to the JSONL's own when --data is the file), the format TRL's VLM SFT reads
(trl/trainer/sft_trainer.py DataCollatorForVisionLanguageModeling: `messages` + `images`; trl/data_utils.py
prepare_multimodal_messages puts the images before the first user turn's text).

Rows are checked before anything starts (missing or unreadable image files, no `images` column, more images than the
plan's, a row without one); the images are decoded only as batches are made, by TRL's own collator with the model's
own processor, after each image is resized to the plan's image_size so the processor gives the plan's image_tokens.
Labels: padding and image tokens are -100; with a chat template that marks the assistant's turns ({% generation %})
only the assistant's tokens train, as TRL's assistant_only_loss, else every text token (TRL's default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.patches.lmhead import IGNORE_INDEX
from toolkit.plan.schema import Plan
from toolkit.train.data import CHAT_FIELD, _first_line, _main_process_first, conversation_problem, load_raw, \
    local_data_files

IMAGES_FIELD = "images"
SEEN: dict[str, Any] = {}
"""What the collator measured in this process (image_tokens per image), for the rank summary."""


def load_processor(source: str):
    """The checkpoint's own processor (AutoProcessor: tokenizer + image processor + chat template). Where
    transformers builds it only with torchvision (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, InternVL, SmolVLM...:
    their processor class also takes a video processor, whose class check needs torchvision) and torchvision is
    absent, the same processor class is built without its video parts (images_only_processor)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(source)
    except (OSError, ValueError, TypeError, AttributeError, ImportError) as exc:
        processor = images_only_processor(source)
        if processor is None:
            raise UserError(f"cannot load the processor of {source} (AutoProcessor; an image plan needs the model's "
                            f"processor): {_first_line(exc)[:200]}; pass --tokenizer with the checkpoint's folder") \
                from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise UserError(f"{source} has no image processor (AutoProcessor gave {type(processor).__name__}); an image "
                        "plan needs the vision-language checkpoint's processor: pass --tokenizer with its folder")
    return processor


def images_only_processor(source: str):
    """The checkpoint's processor class (its processor_config.json's processor_class, else the one transformers
    maps its config to) loaded by its own from_pretrained without its video sub-processor, when torchvision is
    absent and the class takes one; None otherwise. The class keeps its name and code; only the sub-processors
    ProcessorMixin.get_attributes names (read from the __init__ signature, transformers/processing_utils.py) leave
    the video one out, so from_pretrained loads the tokenizer, the image processor (the PIL backend), the chat
    template and the processor settings, ProcessorMixin.__init__ pairs the positional arguments with those names
    (the trailing video_processor=None falls off) and save_pretrained writes the original processor_class. A class
    whose video argument is not last fails ProcessorMixin's class check here: None."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return None
    cls = _processor_class(source)
    if cls is None or not any("video" in name for name in cls.get_attributes()):
        return None

    def get_attributes(subclass):
        return [name for name in cls.get_attributes() if "video" not in name]

    images_only = type(cls.__name__, (cls,), {"get_attributes": classmethod(get_attributes),
                                               "__module__": cls.__module__, "__doc__": cls.__doc__})
    try:
        return images_only.from_pretrained(source)
    except (OSError, ValueError, TypeError, AttributeError, ImportError):
        return None


def _processor_class(source: str):
    import json

    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING, processor_class_from_name

    for name in ("processor_config.json", "preprocessor_config.json"):
        file = Path(source).expanduser() / name
        try:
            named = json.loads(file.read_text()).get("processor_class") if file.is_file() else None
        except (OSError, ValueError, AttributeError):
            named = None
        if isinstance(named, str) and (cls := processor_class_from_name(named)) is not None:
            return cls
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError):
        return None
    return PROCESSOR_MAPPING[type(config)] if type(config) in PROCESSOR_MAPPING else None


def image_token_id(config: Any) -> int:
    """The token id the language model's sequence holds one of per image token (the config's own)."""
    for key in ("image_token_id", "image_token_index"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    raise UserError(f"{config.model_type}'s config names no image_token_id: toolkit.train cannot mask its image "
                    "tokens")


def build_image_datasets(data: str, plan: Plan, *, eval_fraction: float, seed: int,
                         max_eval_blocks: int | None = None):
    """(train, eval or None): the rows as they are, `images` holding absolute file paths; every row checked."""
    if local_data_files(data) is None:
        raise UserError(f"data {data}: an image plan trains on a local folder (a JSONL of messages + images), "
                        "not a hub dataset name")
    with _main_process_first():
        train, evaluation = (_checked(raw, data, plan) if raw is not None else None for raw in load_raw(data))
    if evaluation is None and eval_fraction > 0 and len(train) >= 2:
        split = train.train_test_split(test_size=max(1, round(len(train) * eval_fraction)), seed=seed, shuffle=True)
        train, evaluation = split["train"], split["test"]
    if evaluation is not None and max_eval_blocks is not None and len(evaluation) > max_eval_blocks:
        evaluation = evaluation.select(range(max_eval_blocks))
    return train, evaluation


def _checked(raw, data: str, plan: Plan):
    columns = raw.column_names
    if CHAT_FIELD not in columns:
        raise UserError(f"data {data} has no '{CHAT_FIELD}' column (columns: {', '.join(columns)}); an image plan "
                        f"trains on rows of {{\"{CHAT_FIELD}\": [...], \"{IMAGES_FIELD}\": [\"a.png\", ...]}}")
    if IMAGES_FIELD not in columns:
        raise UserError(f"data {data} has no '{IMAGES_FIELD}' column: it is text-only and the plan is an image-and-"
                        f"text job ({plan.images_per_sample} x {plan.image_size} a sample); give each row its image "
                        "files, or re-plan without --images-per-sample")
    root = Path(data).expanduser()
    folder = root if root.is_dir() else root.parent
    paths = []
    for row, (messages, images) in enumerate(zip(raw[CHAT_FIELD], raw[IMAGES_FIELD]), 1):
        where = f"data {data} row {row}"
        if problem := conversation_problem(messages):
            raise UserError(f"{where}: {problem}")
        if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
            raise UserError(f"{where}: '{IMAGES_FIELD}' is not a list of image file paths")
        if not images:
            raise UserError(f"{where} has no image; the plan is for {plan.images_per_sample} a sample: give it its "
                            "image, or train text rows with a text plan")
        if len(images) > plan.images_per_sample:
            raise UserError(f"{where} has {len(images)} images, more than the plan's {plan.images_per_sample} a "
                            "sample (its memory); re-plan with --images-per-sample "
                            f"{len(images)} or drop images")
        paths.append([_readable_image(p, folder, where) for p in images])
    return raw.remove_columns([c for c in columns if c != CHAT_FIELD]).add_column(IMAGES_FIELD, paths)


def _readable_image(path: str, folder: Path, where: str) -> str:
    from PIL import Image, UnidentifiedImageError

    file = Path(path).expanduser()
    if not file.is_absolute():
        file = folder / file
    if not file.is_file():
        raise UserError(f"{where}: image {path} does not exist ({file}); paths are relative to the data folder")
    try:
        with Image.open(file) as image:
            image.verify()
    except (OSError, UnidentifiedImageError, SyntaxError) as exc:
        raise UserError(f"{where}: image {path} is not a readable image ({_first_line(exc)[:120]})") from None
    return str(file.resolve())


def image_collator(processor: Any, config: Any, plan: Plan):
    """TRL's VLM collator with the model's processor, every image resized to the plan's WIDTHxHEIGHT, every
    sequence padded to the plan's seq_len; image tokens and padding masked in the labels."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from toolkit.inputs.images import parse_image_size

    template = getattr(processor, "chat_template", None) or ""
    assistant_only = "generation %}" in template
    trl_collate = DataCollatorForVisionLanguageModeling(processor, pad_to_multiple_of=plan.seq_len,
                                                        assistant_only_loss=assistant_only)
    size = parse_image_size(plan.image_size)
    token = image_token_id(config)

    def collate(rows: list[dict]) -> dict:
        from PIL import Image

        examples = []
        for row in rows:
            images = []
            for path in row[IMAGES_FIELD]:
                with Image.open(path) as image:
                    images.append(image.convert("RGB").resize(size))
            examples.append({CHAT_FIELD: row[CHAT_FIELD], IMAGES_FIELD: images})
        batch = trl_collate(examples)
        if batch["input_ids"].shape[1] != plan.seq_len:  # TRL padded to a multiple of seq_len: one is longer
            longest = int(batch["attention_mask"].sum(dim=1).max())
            raise UserError(f"a conversation holds {longest} tokens with its images, more than the plan's "
                            f"{plan.seq_len}; re-plan with a longer --seq (text tokens) or shorten the conversations")
        is_image = batch["input_ids"] == token
        batch["labels"][is_image] = IGNORE_INDEX
        n_images = sum(len(row[IMAGES_FIELD]) for row in rows)
        per_image = int(is_image.sum()) // max(n_images, 1)
        if "image_tokens" not in SEEN:
            SEEN["image_tokens"] = per_image
            if per_image != plan.image_tokens and _rank_zero():
                print(f"note: the processor puts {per_image} tokens per {plan.image_size} image in the sequence, the "
                      f"plan counted {plan.image_tokens}; the run's memory differs from the plan's: re-plan",
                      flush=True)
        return batch

    return collate, assistant_only


def count_labels_across_ranks(model: Any) -> None:
    """The Trainer passes num_items_in_batch (the labelled tokens of the whole global batch) to a model whose loss is
    transformers' ForCausalLMLoss, though its class opts out (accepts_loss_kwargs = False: Qwen2-VL, Qwen2.5-VL,
    Gemma-3's base, "fix gemma3 grad acc #37208"): the image collator already masks padding and image tokens, so the
    loss is the sum over the batch's labelled tokens over their count, as one process at the global batch computes
    it, instead of each rank's own mean averaged (rows with 48 and 61 tokens: 6.2309 vs 6.2358 at step 1). The
    forward must take **kwargs, which it hands to loss_function (transformers/trainer.py, model_accepts_loss_kwargs)."""
    import inspect

    from transformers.loss.loss_utils import ForCausalLMLoss

    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    if getattr(model, "accepts_loss_kwargs", True) is False and takes_kwargs \
            and getattr(model, "loss_function", None) is ForCausalLMLoss:
        model.accepts_loss_kwargs = True


def check_rows_fit(train, collate, plan: Plan) -> None:
    """The longest conversation, with its images, must fit the plan's seq_len: checked before the model loads by
    collating the rows with the most images and text, one at a time."""
    def size(i: int) -> tuple[int, int]:
        row = train[i]
        return len(row[IMAGES_FIELD]), sum(len(turn["content"]) for turn in row[CHAT_FIELD])

    for i in sorted(range(len(train)), key=size, reverse=True)[:4]:
        collate([train[i]])


def _rank_zero() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0

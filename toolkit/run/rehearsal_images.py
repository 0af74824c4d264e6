"""The images of an image plan's rehearsal (issue 31): the small plan's image fields on the tiny model's processor,
and what the run must show afterwards (every rank counted the tiny processor's image tokens; the vision tower's
weights moved when the plan trains it, stayed when it freezes it). The tiny model, its processor and the image data:
toolkit.run.tiny_images, toolkit.run.tiny.write_image_corpus."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.run.tiny_images import REHEARSAL_IMAGE_SIDE, image_rehearsal_problem

if TYPE_CHECKING:
    from toolkit.plan.schema import Plan

REHEARSAL_IMAGES = 2
"""Images a sample in a rehearsal, at most: two exercise the processor's and the model's several-image paths."""

REHEARSAL_IMAGE_ROWS = 16
"""Conversations in an image rehearsal's data (toolkit.run.tiny.write_image_corpus)."""


def images_problem(plan: "Plan") -> str | None:
    """Why the rehearsal of `plan` (an image plan) cannot train its images, or None (it can)."""
    from toolkit.inputs.modelconfig import config_from_dict

    return image_rehearsal_problem(config_from_dict({**plan.model_config, "model_type": plan.model_type}, plan.model))


def rehearses_images(plan: "Plan") -> bool:
    """Whether the rehearsal of `plan` trains images: an image plan whose model's tiny class can (images_problem)."""
    return bool(plan.images_per_sample) and images_problem(plan) is None


def image_seq_len(plan: "Plan", tiny_model_dir: str | Path, text_tokens: int) -> tuple[int, int]:
    """(images a sample, the small plan's seq_len): the plan's images (at most REHEARSAL_IMAGES) of
    REHEARSAL_IMAGE_SIDE pixels at the tiny processor's tokens each, after `text_tokens` text tokens."""
    images = min(plan.images_per_sample, REHEARSAL_IMAGES)
    return images, text_tokens + images * _tiny_tokens(tiny_model_dir)


def with_images(small: "Plan", plan: "Plan", tiny_model_dir: str | Path, images: int) -> tuple["Plan", str]:
    """The small plan with its image fields (images a sample, their size, the tiny processor's tokens each) and the
    line that says what the rehearsal's images are beside the plan's."""
    from toolkit.plan.job import job_from_plan, job_to_plan_fields

    side = f"{REHEARSAL_IMAGE_SIDE}x{REHEARSAL_IMAGE_SIDE}"
    tokens = _tiny_tokens(tiny_model_dir)
    job = replace(job_from_plan(small), images_per_sample=images, image_size=side, image_tokens=tokens,
                  vision_tower=plan.vision_tower)
    said = (f"images: the rehearsal trains on {images} x {side} images a sample ({tokens} tokens each on the tiny "
            f"model's vision tower, its processor built locally; the plan: {plan.images_per_sample} x "
            f"{plan.image_size}, {plan.image_tokens} tokens each)")
    return small.replace(**job_to_plan_fields(job)), said


def script_handover(small: "Plan", model_env: str, data_env: str) -> str:
    """What a user's script rehearsed on an image plan finds in the two environment variables: the tiny model with
    its processor saved beside it (AutoProcessor loads it from the same folder), and the image conversations in
    TRL's VLM format that toolkit.run.rehearsal.rehearsal_data wrote."""
    side = f"{REHEARSAL_IMAGE_SIDE}x{REHEARSAL_IMAGE_SIDE}"
    each = f"one {side} PNG" if small.images_per_sample == 1 else f"1 to {small.images_per_sample} {side} PNGs"
    return (f"a tiny {small.model_type} with its processor is in ${model_env}, {REHEARSAL_IMAGE_ROWS} image "
            f"conversations ({each} each; train.jsonl in TRL's VLM format: messages + images, paths relative to the "
            f"folder) in ${data_env}")


def _tiny_tokens(tiny_model_dir: str | Path) -> int:
    from toolkit.inputs.images import image_tokens
    from toolkit.train.model import load_config

    return image_tokens(load_config(str(tiny_model_dir)), REHEARSAL_IMAGE_SIDE, REHEARSAL_IMAGE_SIDE,
                        tiny_model_dir).tokens


def check_images(folder: Path, small: "Plan", model_dir: Path, out: Path) -> tuple[str, list[str]]:
    """(words for the passed line, problems) after an image rehearsal: every rank's collator counted the small
    plan's tokens an image (toolkit.train's rank summaries in `folder`), and, for full fine-tuning, most of the
    vision tower's tensors (the plan's vision_modules) moved from the tiny model's to the saved model's, or none did
    where the plan freezes them."""
    from toolkit.train.hf_runner import read_rank_summaries

    counted = [s.get("image_tokens_seen") for s in read_rank_summaries(folder)]
    if len(counted) != small.world_size or any(n != small.image_tokens for n in counted):
        return "", [f"the ranks' image collators counted {counted} tokens an image, the small plan "
                    f"{small.image_tokens} on each of {small.world_size} ranks: the images did not reach training"]
    words = (f" on {small.images_per_sample} x {small.image_size} images a sample ({small.image_tokens} tokens each "
             "on every rank")
    if small.method != "full":  # the saved adapter holds no tower weights to compare
        return words + ")", []
    moved, total, problem = _tower_moved(small, model_dir, out)
    if problem:
        return "", [problem]
    if small.vision_tower == "freeze":
        return words + f"; the tower's {total} tensors unmoved, frozen as planned)", []
    return words + f"; {moved} of the tower's {total} tensors moved)", []


def _tower_moved(small: "Plan", model_dir: Path, out: Path) -> tuple[int, int, str | None]:
    """(tensors of the vision tower and projector that differ between the tiny model and the saved one, their
    number, a problem or None): most must move when the plan trains them, none when it freezes them."""
    import torch

    from toolkit.inputs.modelconfig import load_pretrained

    try:
        before, after = (load_pretrained(d, images=True, dtype=torch.float32).state_dict() for d in (model_dir, out))
    except Exception as exc:  # any reason the saved model does not load is the problem to show
        return 0, 0, f"the saved model does not load with its image class: {str(exc).strip().splitlines()[0]}"
    tower = [k for k in before if k.startswith(tuple(f"{m}." for m in small.model_parts["vision_modules"]))]
    moved = sum(not torch.equal(before[k], after[k]) for k in tower if k in after)
    frozen = small.vision_tower == "freeze"
    if not tower or (moved if frozen else moved <= len(tower) // 2):
        return moved, len(tower), (f"{moved} of the vision tower's {len(tower)} tensors moved in training; the plan "
                                   f"{'freezes' if frozen else 'trains'} it")
    return moved, len(tower), None

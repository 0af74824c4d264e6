"""`toolkit launch --rehearse` of an image plan (issue 31): the tiny model keeps a tiny vision tower (sized from the
config's vision_config by toolkit.run.tiny.shrink_config), its processor is built locally beside it, tiny PNGs with
their conversations are the data, and the rehearsal trains the plan's strategy on them: every rank counts the tiny
processor's image tokens, the tower's weights move, the saved model reloads with the image class. Gemma-3's fixed
count an image, pooled from its tower's square, is shrunk with the tower."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parent / "arch_configs"


def _image_plan(name: str, strategy: str = "fsdp2", *, images: int = 2, size: str = "448x280", gpus: int = 8):
    """A plan of the real checkpoint's config for `images` images of `size` a sample after 1024 text tokens."""
    from toolkit.inputs.images import image_tokens, parse_image_size
    from toolkit.plan.job import job_from_plan, job_to_plan_fields
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.model import load_config

    source = str(MODELS / f"{name}.json")
    tokens = image_tokens(load_config(source), *parse_image_size(size)).tokens
    plan = plan_for_model(source, strategy, gpus_per_node=gpus, seq_len=1024 + images * tokens, images=True)
    job = replace(job_from_plan(plan), images_per_sample=images, image_size=size, image_tokens=tokens)
    return plan.replace(**job_to_plan_fields(job))


@pytest.mark.parametrize("name, model_class, tower, projector", [
    ("qwen2.5-vl-7b-instruct", "Qwen2_5_VLForConditionalGeneration", 58_816, 24_800),
    ("qwen3.5-27b", "Qwen3_5ForConditionalGeneration", 68_320, 24_832),
])
def test_the_tiny_model_of_an_image_plan_keeps_a_tiny_vision_tower(tmp_path, name, model_class, tower, projector):
    """The rehearsal model of an image plan is the whole image-text class (Qwen3.5's too, whose text plan shrinks to
    Qwen3_5ForCausalLM): the language model at the rehearsal's 4 x 64, the vision tower at 2 blocks of width 32 with
    the projector's output at the text width, found from the config's vision_config; the tiny counts part by part
    (toolkit's own spec of the tiny folder, the same the small plan carries), tens of thousands where the real
    tower has hundreds of millions."""
    from toolkit.inputs.modelconfig import load_pretrained
    from toolkit.inputs.modelspec import build_spec
    from toolkit.run.rehearsal import make_rehearsal_model, plan_for_model
    from toolkit.train.model import load_config

    plan = _image_plan(name)
    tiny_dir = make_rehearsal_model(plan, tmp_path / "tiny")
    config = load_config(str(tiny_dir))
    vision, text = config.vision_config, config.text_config
    assert (text.num_hidden_layers, text.hidden_size) == (4, 64)
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.out_hidden_size) == (2, 32, 2, 64)
    model = load_pretrained(tiny_dir, images=True)
    assert type(model).__name__ == model_class
    spec = build_spec(str(tiny_dir), config, images=True)
    assert (spec.vision_params, spec.projector_params) == (tower, projector)
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual.")) == tower + projector
    assert plan.model_parts["vision_params"] > 300_000_000  # the real tower the plan counted
    text_plan = plan_for_model(str(MODELS / f"{name}.json"), "fsdp2", gpus_per_node=8, seq_len=1024)
    assert type(load_pretrained(make_rehearsal_model(text_plan, tmp_path / "text"))).__name__ == (
        "Qwen3_5ForCausalLM" if name == "qwen3.5-27b" else model_class)


def test_the_small_plan_of_an_image_plan_trains_tiny_images_with_the_processor_built_beside_the_model(tmp_path):
    """small_setup of a Qwen2.5-VL plan for 2 x 448x280 images (160 tokens each): the small plan carries 2 x 40x40
    images at the tiny processor's 4 tokens each after 64 text tokens (seq 72) and says so, with no text-alone note;
    the processor loads from the tiny model's folder (built without the hub, without torchvision) and collates the
    data folder's rows to the small plan's 72 tokens with 4 tokens an image, the images' tokens unlabelled."""
    from toolkit.run.rehearsal import small_setup
    from toolkit.train.imagedata import SEEN, build_image_datasets, check_rows_fit, image_collator, load_processor
    from toolkit.train.model import load_config

    plan = _image_plan("qwen2.5-vl-7b-instruct")
    assert (plan.images_per_sample, plan.image_tokens) == (2, 160)
    model_dir, small, said, _, data = small_setup(plan, tmp_path)
    assert (small.images_per_sample, small.image_size, small.image_tokens, small.seq_len) == (2, "40x40", 4, 72)
    assert ("images: the rehearsal trains on 2 x 40x40 images a sample (4 tokens each on the tiny model's vision "
            "tower, its processor built locally; the plan: 2 x 448x280, 160 tokens each)") in said
    assert not any("text alone" in line for line in said)
    assert small.model_parts["vision_params"] == 58_816 and small.vision_tower == "train"
    processor, config = load_processor(str(model_dir)), load_config(str(model_dir))
    train, _ = build_image_datasets(str(data), small, eval_fraction=0, seed=0)
    assert len(train) == 16 and {len(row["images"]) for row in train} == {1, 2}
    collate, assistant_only = image_collator(processor, config, small)
    check_rows_fit(train, collate, small)
    SEEN.clear()
    batch = collate([train[0], train[1]])
    image = batch["input_ids"] == config.image_token_id
    assert assistant_only and batch["input_ids"].shape == (2, 72) and SEEN["image_tokens"] == 4
    assert image.sum(dim=1).tolist() == [4, 8] and not (image & (batch["labels"] != -100)).any()
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3


def test_a_plan_with_one_image_a_sample_rehearses_rows_of_one_image(tmp_path):
    from toolkit.run.rehearsal import rehearsal_data, rehearsal_plan, make_rehearsal_model

    plan = _image_plan("qwen3.5-27b", "zero3", images=1)
    small, _ = rehearsal_plan(plan, make_rehearsal_model(plan, tmp_path / "model"))
    assert (small.images_per_sample, small.seq_len) == (1, 68)
    rows = (rehearsal_data(small, tmp_path / "data") / "train.jsonl").read_text().splitlines()
    assert len(rows) == 16 and all(row.count(".png") == 1 for row in rows)


def test_a_gemma3_image_plan_rehearses_a_fixed_count_pooled_from_a_tiny_square(tmp_path):
    """Gemma-3's processor gives every image a fixed 256 tokens (mm_tokens_per_image) pooled from its tower's 896 x 896
    square; its tiny image model pools 4 x 4 patches of 14 px (image_size 56) to 4 tokens, Gemma3Processor saved with
    image_seq_length 4: the small plan carries 2 x 40x40 images at 4 tokens each, the collator puts 4 tokens an image
    in the 72, marked in the batch's token_type_ids (from which Gemma3Model builds its bidirectional image mask),
    and in two optimizer steps in process every tower tensor gets a gradient by the second (the projector's weight
    starts at zero, Gemma3PreTrainedModel._init_weights, so none reaches the tower at the first)."""
    import torch

    from toolkit.inputs.modelconfig import load_pretrained
    from toolkit.run.rehearsal import small_setup
    from toolkit.train.imagedata import SEEN, build_image_datasets, image_collator, load_processor
    from toolkit.train.model import load_config

    plan = _image_plan("gemma-3-4b-it", "ddp", size="896x896", gpus=2)
    assert plan.image_tokens == 256
    model_dir, small, said, _, data = small_setup(plan, tmp_path)
    assert (small.images_per_sample, small.image_size, small.image_tokens, small.seq_len) == (2, "40x40", 4, 72)
    assert not any("text alone" in line for line in said)
    assert (small.model_parts["vision_params"], small.model_parts["projector_params"]) == (36_512, 2_080)
    config, processor = load_config(str(model_dir)), load_processor(str(model_dir))
    assert (config.vision_config.image_size, config.mm_tokens_per_image, processor.image_seq_length) == (56, 4, 4)
    assert type(processor).__name__ == "Gemma3Processor" and config.eos_token_id == 0
    train, _ = build_image_datasets(str(data), small, eval_fraction=0, seed=0)
    collate, _ = image_collator(processor, config, small)
    marks = collate([train[0], train[1]])  # the processor's marks of the image tokens reach the model
    assert marks["token_type_ids"].tolist() == (marks["input_ids"] == config.image_token_id).long().tolist()
    model = load_pretrained(model_dir, images=True, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tower = [p for n, p in model.named_parameters() if n.startswith("model.vision_tower.")]
    reached = []
    SEEN.clear()
    for step in range(2):
        optimizer.zero_grad()
        model(**collate([train[2 * step], train[2 * step + 1]])).loss.backward()
        reached.append(sum(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in tower))
        optimizer.step()
    assert SEEN["image_tokens"] == 4 and reached == [0, len(tower)] and len(tower) == 37


def _rehearsal_trains_the_images(plan, tmp_path, capfd, processes: int | None = None) -> None:
    """`toolkit launch --rehearse` of `plan` passes on 2 x 40x40 images a sample at 4 tokens each on every rank, with
    most of the vision tower's tensors moved, checkpointed, saved and reloaded; no text-alone note."""
    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files

    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True, processes=processes)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "text alone" not in out
    passed = re.search(rf"rehearsal passed: {plan.strategy} trained 4 steps on 2 x 40x40 images a sample \(4 tokens "
                       r"each on every rank; (\d+) of the tower's (\d+) tensors moved\), checkpointed, saved and "
                       "reloaded", out)
    assert passed, out[-3000:]
    print(passed.group(0))  # the measured numbers, for -rP
    moved, total = map(int, passed.groups())
    assert total > 20 and moved > total // 2


@pytest.mark.multiprocess
def test_the_rehearsal_of_a_qwen25_vl_image_plan_trains_the_images_on_two_fsdp2_ranks(tmp_path, capfd):
    """An 8-GPU FSDP2 plan of Qwen2.5-VL-7B for 2 x 448x280 images a sample (160 tokens each), rehearsed on 2 CPU
    processes: both ranks counted the tiny processor's 4 tokens an image, most of the tower's tensors moved, and
    the saved model reloaded with the image class (measured: 30 of 30)."""
    _rehearsal_trains_the_images(_image_plan("qwen2.5-vl-7b-instruct"), tmp_path, capfd)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_the_rehearsal_of_a_gemma3_image_plan_on_one_process_trains_the_images(tmp_path, capfd):
    """A 2-GPU DDP plan of Gemma-3-4B for 2 x 896x896 images (256 tokens each) rehearsed on one CPU process
    (--processes 1: a data-parallel plan): the process counted the tiny processor's 4 tokens an image, most of the
    tower's and projector's tensors moved and the saved Gemma3ForConditionalGeneration reloaded (measured: 39 of 39)."""
    _rehearsal_trains_the_images(_image_plan("gemma-3-4b-it", "ddp", size="896x896", gpus=2), tmp_path, capfd,
                                 processes=1)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_a_users_trl_vlm_script_rehearses_a_copied_gemma3_image_plan_on_the_tiny_processor_and_images(
        tmp_path, capfd, monkeypatch):
    """`toolkit launch COPY --rehearse -- my_vlm_sft.py '$TOOLKIT_REHEARSAL_MODEL' '$TOOLKIT_REHEARSAL_DATA' ...` of a
    copied 2-GPU DDP Gemma-3-4B plan for 2 x 896x896 images, on one CPU process: the rehearsal says the tiny model's
    folder holds its processor and the data folder TRL's VLM conversations; the user's TRL script
    (tests/story/my_vlm_sft.py: SFTTrainer, AutoModelForImageTextToText, AutoProcessor, sft_config() its one toolkit
    call) loads both from there, its collator turns the first row's 40x40 image into the tiny processor's 4 tokens
    and a 56 x 56 pixel square, the global batch of 2 is kept by accumulation, both steps' losses are finite, and
    the vision tower's tensors moved (Gemma-3's projector starts at zero: the tower moves at the second step)."""
    import json
    import math
    import shutil

    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files

    plan = _image_plan("gemma-3-4b-it", "ddp", size="896x896", gpus=2)
    emit_plan_files(plan, tmp_path / "planned")
    copy = shutil.copytree(tmp_path / "planned", tmp_path / "elsewhere" / "copy")
    shutil.rmtree(tmp_path / "planned")
    script = Path(shutil.copy(Path(__file__).parent / "story" / "my_vlm_sft.py", tmp_path))
    report = tmp_path / "report.json"
    monkeypatch.chdir(tmp_path)  # the script's launch log goes to ./toolkit-logs
    code = launch_main(copy, [str(script), "$TOOLKIT_REHEARSAL_MODEL", "$TOOLKIT_REHEARSAL_DATA",
                              str(tmp_path / "out"), str(report)], rehearse=True, processes=1)
    out = capfd.readouterr().out
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "toolkit-logs").glob("*.log"))
    assert code == 0, out[-3000:] + logs[-3000:]
    assert ("a tiny gemma3 with its processor is in $TOOLKIT_REHEARSAL_MODEL, 16 image conversations (1 to 2 40x40 "
            "PNGs each; train.jsonl in TRL's VLM format: messages + images, paths relative to the folder) in "
            "$TOOLKIT_REHEARSAL_DATA") in out
    assert "rehearsal passed: your script with ddp" in out
    seen = json.loads(report.read_text())
    print({k: seen[k] for k in ("losses", "image_tokens", "pixel_values", "tower_moved")})  # measured, for -rP
    assert (seen["world"], seen["micro_batch"] * seen["accumulation"], seen["steps"]) == (1, 2, 2)
    assert seen["vision"] and len(seen["losses"]) == 2 and all(math.isfinite(v) for v in seen["losses"])
    assert (seen["images"], seen["image_tokens"], seen["pixel_values"]) == (1, 4, [1, 3, 56, 56])
    moved, total = seen["tower_moved"]
    assert total == 37 and moved > total // 2


@pytest.mark.multiprocess
def test_the_rehearsal_of_a_text_only_qwen25_vl_ddp_plan_trains_the_whole_class_on_text(tmp_path, capfd):
    """A text-only 2-GPU DDP plan of Qwen2.5-VL-7B (its whole image-text class, no causal-LM class in transformers;
    the tower trained, which text never reaches) rehearsed on 2 CPU processes: DDP runs with the plan's
    find_unused_parameters and the rehearsal passes on text, saving and reloading the class."""
    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(str(MODELS / "qwen2.5-vl-7b-instruct.json"), "ddp", gpus_per_node=2)
    assert plan.model_parts and not plan.images_per_sample and plan.vision_tower == "train"
    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    passed = re.search(r"rehearsal passed: ddp trained \d+ steps.*checkpointed, saved and reloaded", out)
    assert passed, out[-3000:]
    print(passed.group(0))

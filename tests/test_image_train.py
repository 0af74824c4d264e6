"""toolkit.train on an image-and-text plan (issue 31, Deliver 4-5): a local folder of PIL-drawn images with a JSONL of
messages + images (TRL's VLM format), the checkpoint's own processor, TRL's own VLM collator. Three real
architectures: a tiny Gemma-3 class (SigLIP tower, a fixed token count an image; its processor is tokenizer + image
processor), a tiny Qwen2.5-VL (windowed ViT with a patch merger, a token grid from the image's size, M-RoPE) and a tiny
Qwen3-VL (deepstack features, interleaved M-RoPE); the Qwen processor classes also take a video processor, which
transformers builds only with torchvision, absent here: toolkit builds the same class without it. No hub."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from toolkit.run.tiny_images import vl_chat_template

TEXT, IMAGES, SIZE, TOKENS = 80, 2, "40x40", 4  # Gemma-3's projector pools every image to mm_tokens_per_image
SEQ = TEXT + IMAGES * TOKENS
VL_TEMPLATE = vl_chat_template("<start_of_image>")
"""The tiny tokenizer's chat template with image parts (Gemma-3's processor expands <start_of_image>)."""


def _tiny_gemma3_with_processor(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3Config, Gemma3Processor

    from toolkit.inputs.images import image_processor
    from toolkit.run.tiny import corpus_text, train_tokenizer

    tokenizer = train_tokenizer(corpus_text(100_000), vocab_size=512)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<image_soft_token>",
                                                                "<end_of_image>"]})
    tokenizer.save_pretrained(out / "tok")
    tokenizer = AutoTokenizer.from_pretrained(out / "tok", extra_special_tokens={
        "boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"})
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         sliding_window=32),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=28, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=TOKENS, image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id)
    processor = Gemma3Processor(image_processor=image_processor(config), tokenizer=tokenizer,
                                chat_template=VL_TEMPLATE, image_seq_length=TOKENS)
    model_dir = out / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    return model_dir


QWEN_TEMPLATE = vl_chat_template("<|vision_start|><|image_pad|><|vision_end|>")
"""The same template with Qwen2.5-VL's image markers (its processor expands <|image_pad|> to the image's tokens)."""


def _tiny_qwen_vl_with_processor(out: Path, version: str) -> Path:
    """A tiny Qwen2.5-VL ("2.5": windowed ViT, patch 14, M-RoPE), Qwen3-VL ("3": patch 16, deepstack features
    into the language model, interleaved M-RoPE) or Qwen3.5 ("3.5": Qwen3-VL's tower without deepstack over a hybrid
    language model, 3 gated-delta-net layers to 1 attention layer, M-RoPE on a quarter of each head), saved as a checkpoint ships it: config and weights, the tokenizer,
    the image processor's preprocessor_config.json and the processor's chat_template.jinja (no video processor:
    none is built here)."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen3_5Config, Qwen3VLConfig

    from toolkit.inputs.images import image_processor
    from toolkit.run.tiny import corpus_text, train_tokenizer

    tokenizer = train_tokenizer(corpus_text(100_000), vocab_size=512)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>",
                                                                "<|vision_end|>", "<|video_pad|>"]})
    ids = {f"{key}_token_id": tokenizer.convert_tokens_to_ids(token) for key, token in
           (("vision_start", "<|vision_start|>"), ("image", "<|image_pad|>"), ("video", "<|video_pad|>"))}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64)
    if version == "2.5":
        config = Qwen2_5_VLConfig(
            text_config={**text, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
            vision_config={**vision, "fullatt_block_indexes": [1], "window_size": 56},
            pad_token_id=tokenizer.pad_token_id, **ids)
    elif version == "3.5":
        config = Qwen3_5Config(
            text_config={**text, "num_hidden_layers": 4, "head_dim": 16, "pad_token_id": tokenizer.pad_token_id,
                         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                         "linear_value_head_dim": 16, "rope_parameters": dict(
                             rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 0], mrope_interleaved=True,
                             partial_rotary_factor=0.25)},
            vision_config={**vision, "num_position_embeddings": 64}, **ids)
    else:
        config = Qwen3VLConfig(
            text_config={**text, "head_dim": 16, "pad_token_id": tokenizer.pad_token_id, "rope_parameters": dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True)},
            vision_config={**vision, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}, **ids)
    model_dir = out / "model"
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    image_processor(config).save_pretrained(model_dir)
    (model_dir / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    return model_dir


@pytest.fixture(scope="module")
def tiny_qwen_vl(tmp_path_factory, tiny_vl):
    """(tiny Qwen2.5-VL folder, the same image data folder as tiny_vl's)."""
    return _tiny_qwen_vl_with_processor(tmp_path_factory.mktemp("qwen-vl"), "2.5"), tiny_vl[1]


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory, tiny_vl):
    """(tiny Qwen3-VL folder, the same image data folder as tiny_vl's)."""
    return _tiny_qwen_vl_with_processor(tmp_path_factory.mktemp("qwen3-vl"), "3"), tiny_vl[1]


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory, tiny_vl):
    """(tiny Qwen3.5 folder, the same image data folder as tiny_vl's)."""
    return _tiny_qwen_vl_with_processor(tmp_path_factory.mktemp("qwen3.5"), "3.5"), tiny_vl[1]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    """(model folder with its processor, image data folder)."""
    from toolkit.run.tiny import write_image_corpus

    base = tmp_path_factory.mktemp("image-train")
    return _tiny_gemma3_with_processor(base), write_image_corpus(base / "data", rows=16)


def _image_plan(model_dir: Path, *, world: int = 1, micro: int = 2, strategy: str = "ddp", images: int = IMAGES):
    from toolkit.plan.job import job_from_plan, job_to_plan_fields
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(model_dir, strategy, gpus_per_node=world, micro_batch=micro, seq_len=TEXT + images * TOKENS,
                          images=True)
    job = replace(job_from_plan(plan), images_per_sample=images, image_size=SIZE, image_tokens=TOKENS)
    return replace(plan, **job_to_plan_fields(job))


def test_the_plan_counts_the_processors_image_tokens(tiny_vl):
    from toolkit.inputs.images import image_tokens
    from toolkit.train.model import load_config

    assert image_tokens(load_config(str(tiny_vl[0])), 40, 40, tiny_vl[0]).tokens == TOKENS


def test_the_collator_pads_to_the_plans_sequence_and_masks_images_and_padding(tiny_vl):
    """TRL's collator with the checkpoint's processor: every sequence is the plan's seq_len, each image puts the
    plan's 4 tokens in it, and only the assistant's text tokens carry labels (not the image tokens, not padding)."""
    from toolkit.train.imagedata import SEEN, build_image_datasets, image_collator, load_processor
    from toolkit.train.model import load_config

    model_dir, data = tiny_vl
    plan = _image_plan(model_dir)
    config = load_config(str(model_dir))
    processor = load_processor(str(model_dir))
    train, evaluation = build_image_datasets(str(data), plan, eval_fraction=0, seed=0)
    assert len(train) == 16 and evaluation is None
    collate, assistant_only = image_collator(processor, config, plan)
    SEEN.clear()
    batch = collate([train[0], train[1]])  # one image, then two
    assert assistant_only and batch["input_ids"].shape == (2, SEQ)
    image = batch["input_ids"] == config.image_token_index
    assert image.sum(dim=1).tolist() == [TOKENS, 2 * TOKENS] and SEEN["image_tokens"] == TOKENS
    assert batch["pixel_values"].shape == (3, 3, 28, 28)  # the processor's square, whatever the file's size
    labelled = batch["labels"] != -100
    assert not (labelled & image).any() and not (labelled & (batch["attention_mask"] == 0)).any()
    answer = processor.tokenizer.decode(batch["labels"][1][labelled[1]])
    assert answer == f"The square is {train[1]['messages'][1]['content'][len('The square is '):]}<|endoftext|>"


def test_qwen25_vl_processor_is_built_without_torchvision_and_collates_the_plans_grid(tiny_qwen_vl):
    """AutoProcessor cannot build Qwen2.5-VL's processor here (its video processor needs torchvision); toolkit builds
    the same class from the checkpoint's files without it: 40x40 images become 56x56 (smart_resize to min_pixels),
    a 4x4 patch grid merged 2x2 into the plan's 4 tokens, every sequence the plan's seq_len, images unlabelled."""
    from transformers import AutoProcessor

    from toolkit.train.imagedata import SEEN, build_image_datasets, image_collator, load_processor
    from toolkit.train.model import load_config

    model_dir, data = tiny_qwen_vl
    with pytest.raises((OSError, ImportError), match="(?i)video ?processor"):
        AutoProcessor.from_pretrained(model_dir)
    processor = load_processor(str(model_dir))
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and not hasattr(processor, "video_processor")
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    config = load_config(str(model_dir))
    plan = _image_plan(model_dir)
    train, _ = build_image_datasets(str(data), plan, eval_fraction=0, seed=0)
    collate, assistant_only = image_collator(processor, config, plan)
    SEEN.clear()
    batch = collate([train[0], train[1]])  # one image, then two
    assert assistant_only and batch["input_ids"].shape == (2, SEQ) and SEEN["image_tokens"] == TOKENS
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3 and batch["pixel_values"].shape == (48, 1176)
    image = batch["input_ids"] == config.image_token_id
    assert image.sum(dim=1).tolist() == [TOKENS, 2 * TOKENS] and not (image & (batch["labels"] != -100)).any()


def test_a_class_that_opts_out_of_the_token_count_gets_the_global_batchs_mean(tiny_qwen_vl):
    """Qwen2.5-VL's class sets accepts_loss_kwargs = False, so the Trainer would give each rank its own mean; toolkit
    lets it pass num_items_in_batch: two ranks' rows, each over the pair's labelled-token count, sum to the loss of
    the pair in one batch (the rows hold different numbers of labelled tokens, so the means of means differ)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from toolkit.train.imagedata import build_image_datasets, count_labels_across_ranks, image_collator, \
        load_processor
    from toolkit.train.model import load_config

    model_dir, data = tiny_qwen_vl
    plan = _image_plan(model_dir)
    collate, _ = image_collator(load_processor(str(model_dir)), load_config(str(model_dir)), plan)
    train, _ = build_image_datasets(str(data), plan, eval_fraction=0, seed=0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    assert model.accepts_loss_kwargs is False
    count_labels_across_ranks(model)
    assert model.accepts_loss_kwargs is True
    pair, first, second = collate([train[0], train[1]]), collate([train[0]]), collate([train[1]])
    labelled = [int((b["labels"][:, 1:] != -100).sum()) for b in (first, second)]
    assert labelled[0] != labelled[1]
    with torch.no_grad():
        whole = float(model(**pair).loss)
        split = [float(model(**b, num_items_in_batch=torch.tensor(sum(labelled))).loss) for b in (first, second)]
        means = [float(model(**b).loss) for b in (first, second)]
    assert sum(split) == pytest.approx(whole, abs=1e-5)
    assert abs(sum(means) / 2 - whole) > 1e-3


def test_plan_md_says_how_toolkit_train_and_a_trl_script_run_the_images(tiny_vl):
    """PLAN.md of an FSDP2 image plan: toolkit.train's data format and collator, what a user's TRL VLM SFT script
    sets, and the vision encoder's block class read from the model (Gemma-3's SigLIP encoder layer)."""
    from toolkit.emit.user_settings import plan_md_section

    text = "\n".join(plan_md_section(_image_plan(tiny_vl[0], world=2, micro=1, strategy="fsdp2")))
    assert "toolkit.train runs it on `--data FOLDER`" in text and "at most 2 images a row" in text
    assert "resizes every image to 40x40 so the processor gives 4 tokens an image" in text
    assert f"`SFTConfig(max_length=None, pad_to_multiple_of={SEQ})`" in text
    assert "add its block class `SiglipEncoderLayer` to `fsdp_transformer_layer_cls_to_wrap`" in text
    assert "runs text only" not in text


def test_training_args_json_gives_a_trl_script_the_plans_padding_not_truncation(tiny_vl):
    """training_args.json's sft_config of an image plan says what PLAN.md says: no max_length (TRL's VLM collator
    would truncate image tokens), every sequence padded to the plan's length."""
    from toolkit.emit.user_settings import method_config

    name, settings = method_config(_image_plan(tiny_vl[0], world=2, micro=1))
    assert name == "sft_config" and settings["max_length"] is None and settings["pad_to_multiple_of"] == SEQ


def _rows(data: Path, name: str, *, drop_images: bool = False, **first) -> Path:
    """The data's rows, image paths made absolute, the first row changed by `first`, written to a folder beside the
    data (whose relative image paths then name nothing) or with no 'images' at all."""
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    for row in rows:
        row["images"] = [str(data / p) for p in row["images"]]
        if drop_images:
            del row["images"]
    rows[0].update(first)
    out = data.parent / name
    out.mkdir(exist_ok=True)
    (out / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


@pytest.mark.parametrize("images, message", [
    (["images/0-0.png"], "row 1: image images/0-0.png does not exist"),
    (["train.jsonl"], "row 1: image train.jsonl is not a readable image"),
    ([], "row 1 has no image; the plan is for 2 a sample"),
    (["IMG", "IMG", "IMG"], "row 1 has 3 images, more than the plan's 2 a sample"),
])
def test_bad_image_rows_are_one_line_before_the_model_loads(tiny_vl, train_in_process, images, message):
    model_dir, data = tiny_vl
    images = [str(data / "images" / "0-0.png") if p == "IMG" else p for p in images]
    bad = _rows(data, f"bad-{sum(map(ord, message))}", images=images)
    run = train_in_process(_image_plan(model_dir), "bad-images", "--data", str(bad), "--max-steps", "1")
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert not Path(run.output).exists()


def test_text_data_on_an_image_plan_and_image_data_on_a_text_plan_are_one_line(tiny_vl, train_in_process,
                                                                               corpus_dir):
    """Each is one error line, exit 2, before the model loads and before the output folder exists."""
    from toolkit.run.rehearsal import plan_for_model

    model_dir, data = tiny_vl
    chat = _rows(data, "text-only", drop_images=True)
    text_plan = plan_for_model(model_dir, "ddp", gpus_per_node=1, micro_batch=2, seq_len=SEQ)
    for plan, name, folder, message in (
            (_image_plan(model_dir), "text-on-images", corpus_dir, "no 'messages' column"),
            (_image_plan(model_dir), "no-images", chat, "the plan is an image-and-text job (2 x 40x40 a sample)"),
            (text_plan, "images-on-text", data, "has an 'images' column but the plan is text-only")):
        run = train_in_process(plan, name, "--data", str(folder), "--max-steps", "1")
        assert run.returncode == 2 and message in run.stderr, (name, run.stderr)
        errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]  # datasets' bars apart
        assert len(errors) == 1 and message in errors[0] and "Traceback" not in run.stderr, run.stderr
        assert not Path(run.output).exists()


STEPS = 6
ARGS = ("--max-steps", str(STEPS), "--logging-steps", "1", "--save-steps", str(STEPS), "--lr", "1e-2",
        "--eval-fraction", "0")


@pytest.fixture(scope="module")
def image_runs(runs_by_name, tiny_vl, tiny_qwen_vl, tiny_qwen3_vl, tiny_qwen35):
    """One process at micro-batch 2 and two gloo ranks at micro-batch 1 (the same global batch of 2 conversations),
    started side by side, fp32: Gemma-3's one process and DDP, ZeRO-3 and FSDP2 when a test asks for them;
    Qwen2.5-VL's one process and FSDP2 ("qwen-one", "qwen-fsdp2"), DDP and ZeRO-3 when asked; Qwen3-VL's one process
    and FSDP2; Qwen3.5's one process and FSDP2 ("qwen35-..."), ZeRO-3 when asked."""
    models = {"": tiny_vl, "qwen": tiny_qwen_vl, "qwen3": tiny_qwen3_vl, "qwen35": tiny_qwen35}

    def arguments(name):
        family, _, engine = name.rpartition("-")
        model_dir, data = models[family]
        world, micro = (1, 2) if engine == "one" else (2, 1)
        plan = _image_plan(model_dir, world=world, micro=micro, strategy="ddp" if engine == "one" else engine)
        return plan, f"images-{name}", "--data", str(data), *ARGS

    return runs_by_name(arguments, together=[("one", "ddp"), ("qwen-one", "qwen-fsdp2"),
                                             ("qwen3-one", "qwen3-fsdp2"), ("qwen35-one", "qwen35-fsdp2")])


@pytest.mark.multiprocess
def test_one_process_trains_the_images_loss_falls_and_the_tower_learns(image_runs, tiny_vl):
    """The loss is finite and falls over 6 steps; the vision tower (planned to train) moved, so the pixels reached
    it; the run counted the plan's 4 tokens per image."""
    import torch
    from transformers import AutoModelForCausalLM

    run = image_runs("one")
    losses = run.losses()
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses.values())
    assert (losses[5] + losses[6]) / 2 < losses[1] - 0.1, losses
    assert run.ranks[0]["image_tokens_seen"] == TOKENS
    before = AutoModelForCausalLM.from_pretrained(tiny_vl[0], dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(run.output, dtype=torch.float32).state_dict()
    tower = [k for k in before if k.startswith("model.vision_tower")]
    assert tower and sum(not torch.equal(before[k], after[k]) for k in tower) > len(tower) // 2
    assert (Path(run.output) / "processor_config.json").is_file()  # the output loads with its processor


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "zero3", "fsdp2"])
def test_two_gloo_ranks_give_one_process_losses(image_runs, engine):
    """2 ranks at micro-batch 1 (DDP; ZeRO-3 partitioning the tower with the rest; FSDP2 sharding it with the root
    unit) give the losses of 1 process at micro-batch 2 within 1e-3, and both ranks count the plan's image tokens."""
    ref, run = image_runs("one").losses(), image_runs(engine)
    got = run.losses()
    assert got.keys() == ref.keys() and len(ref) == STEPS
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-3), (engine, step, got, ref)
    assert [rank["image_tokens_seen"] for rank in run.ranks] == [TOKENS, TOKENS]


def _falls_and_two_ranks_match(one, fsdp2):
    """One process's loss falls over the steps; the 2-rank run gives its losses within 1e-3; every rank counted the
    plan's tokens an image."""
    ref, got = one.losses(), fsdp2.losses()
    assert len(ref) == STEPS and all(math.isfinite(v) for v in ref.values())
    assert (ref[5] + ref[6]) / 2 < ref[1] - 0.1, ref
    assert got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-3), (step, got, ref)
    assert [rank["image_tokens_seen"] for rank in one.ranks + fsdp2.ranks] == [TOKENS] * 3


def _most_of_the_tower_moved(model_dir, output) -> None:
    """Most of the Qwen class's vision tower tensors (model.visual) differ after training: the pixels reached it."""
    import torch
    from transformers import AutoModelForImageTextToText

    before = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    after = AutoModelForImageTextToText.from_pretrained(output, dtype=torch.float32).state_dict()
    tower = [k for k in before if k.startswith("model.visual")]
    assert tower and sum(not torch.equal(before[k], after[k]) for k in tower) > len(tower) // 2


@pytest.mark.multiprocess
def test_qwen25_vl_trains_its_images_and_two_fsdp2_ranks_give_one_process_losses(image_runs, tiny_qwen_vl):
    """A second architecture through the same path: Qwen2.5-VL's processor built without its video processor, its
    windowed vision tower and M-RoPE positions. One process's loss falls over 6 steps and the tower moved; 2 FSDP2
    ranks (the vision blocks wrapped as their own units) give its losses within 1e-3; every rank counted the plan's
    4 tokens an image; the output keeps the processor under its own class name."""
    one, fsdp2 = image_runs("qwen-one"), image_runs("qwen-fsdp2")
    _falls_and_two_ranks_match(one, fsdp2)
    _most_of_the_tower_moved(tiny_qwen_vl[0], one.output)
    saved = json.loads((Path(one.output) / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen2_5_VLProcessor"


@pytest.mark.multiprocess
def test_a_copied_image_plan_runs_a_users_trl_vlm_sft_script_on_2_cpu_processes(tmp_path, tiny_vl, capfd,
                                                                                 monkeypatch):
    """A 4-GPU Gemma-3 image plan emitted, copied elsewhere, and launched with a user's own TRL VLM SFT script
    (tests/story/my_vlm_sft.py: SFTTrainer on AutoModelForImageTextToText with the processor, sft_config() the only
    toolkit call) on 2 CPU processes: the global batch of 4 kept by accumulation, TRL saw the images, padded to the
    plan's length, and both steps' losses are finite. `toolkit launch` runs in this process (toolkit.cli.main, what
    `python -m toolkit` calls; its ranks are processes of their own): as an interpreter of its own the launcher
    took 2.2 CPU-s before it started them (measured, the box loaded)."""
    import shutil

    from toolkit.cli import main
    from toolkit.run.launcher import emit_plan_files

    model_dir, data = tiny_vl
    emit_plan_files(_image_plan(model_dir, world=4, micro=1), tmp_path / "planned")
    copy = shutil.copytree(tmp_path / "planned", tmp_path / "elsewhere" / "copy")
    shutil.rmtree(tmp_path / "planned")
    shutil.copy(Path(__file__).parent / "story" / "my_vlm_sft.py", tmp_path)
    report = tmp_path / "report.json"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    capfd.readouterr()
    code = main(["launch", str(copy), "--processes", "2", "--cpu", "--", "my_vlm_sft.py", str(model_dir), str(data),
                 str(tmp_path / "out"), str(report)])
    done = capfd.readouterr()
    assert code == 0, done.out[-3000:] + done.err[-3000:]
    seen = json.loads(report.read_text())
    assert (seen["world"], seen["micro_batch"], seen["accumulation"], seen["steps"]) == (2, 1, 2, 2)
    assert seen["vision"] and seen["max_length"] is None and seen["pad_to_multiple_of"] == SEQ
    assert len(seen["losses"]) == 2 and all(math.isfinite(v) for v in seen["losses"])
    assert "keeps the global batch 4" in done.out and "Traceback" not in done.err


@pytest.mark.multiprocess
def test_qwen3_vl_trains_its_images_and_two_fsdp2_ranks_give_one_process_losses(image_runs):
    """A third architecture: Qwen3-VL (its processor also built without torchvision; deepstack visual features added
    inside the language model's layers). One process's loss falls; 2 FSDP2 ranks give its losses within 1e-3."""
    one, fsdp2 = image_runs("qwen3-one"), image_runs("qwen3-fsdp2")
    _falls_and_two_ranks_match(one, fsdp2)


@pytest.mark.multiprocess
def test_qwen35_trains_its_images_and_two_fsdp2_ranks_give_one_process_losses(image_runs, tiny_qwen35):
    """A fourth: Qwen3.5, whose AutoModelForCausalLM is its language model alone; the image plan loads the whole
    Qwen3_5ForConditionalGeneration (its processor also built without torchvision, its hybrid gated-delta-net /
    attention language model). One process's loss falls over 6 steps and the tower moved; 2 FSDP2 ranks give its
    losses within 1e-3; every rank counted the plan's 4 tokens an image."""
    one, fsdp2 = image_runs("qwen35-one"), image_runs("qwen35-fsdp2")
    _falls_and_two_ranks_match(one, fsdp2)
    _most_of_the_tower_moved(tiny_qwen35[0], one.output)


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["qwen-ddp", "qwen-zero3", "qwen3-ddp", "qwen3-zero3", "qwen35-zero3"])
def test_the_qwen_classes_on_two_ddp_or_zero3_ranks_give_one_process_losses(image_runs, run):
    """The Qwen classes on the other engines: 2 DDP ranks (Qwen2.5-VL, Qwen3-VL), 2 ZeRO-3 ranks partitioning the
    tower with the rest (Qwen2.5-VL, Qwen3-VL with its deepstack features, Qwen3.5's whole image-text class) give one
    process's losses within 1e-3, every rank counting the plan's 4 tokens an image."""
    _falls_and_two_ranks_match(image_runs(f"{run.split('-')[0]}-one"), image_runs(run))


def test_lora_with_the_tower_in_modules_to_save_trains_the_tower(tiny_qwen_vl, train_in_process):
    """LoRA on the language model with the vision tower trained in full, as PEFT does it (--lora-modules-to-save
    visual: Qwen2.5-VL's tower with its merger inside, a trainable copy beside the frozen original), one process on
    CPU, fp32, 6 steps: the loss is finite and falls, and the saved adapter holds the tower's trained copy, moved
    from the base's weights."""
    import torch
    from safetensors.torch import load_file

    from toolkit.inputs.lora import Adapter
    from toolkit.plan.job import job_from_plan, job_to_plan_fields

    model_dir, data = tiny_qwen_vl
    plan = _image_plan(model_dir)
    job = replace(job_from_plan(plan), adapter=Adapter(method="lora", r=8, targets="all-linear",
                                                       modules_to_save="visual"))
    plan = replace(plan, **job_to_plan_fields(job))
    run = train_in_process(plan, "images-lora-visual", "--data", str(data), *ARGS)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = run.losses()
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses.values())
    assert (losses[5] + losses[6]) / 2 < losses[1] - 0.1, losses
    saved = load_file(str(Path(run.output) / "adapter_model.safetensors"))
    tower = {k: v for k, v in saved.items() if ".visual." in k and "lora_" not in k}
    base = {k: v for f in Path(model_dir).glob("*.safetensors") for k, v in load_file(str(f)).items()}
    base_tower = {k.split("visual.", 1)[1]: v for k, v in base.items() if k.split(".")[0] in ("model", "visual")
                  and "visual." in k}
    assert len(tower) == len(base_tower) > 0, sorted(saved)[:8]
    moved = [k for k, v in tower.items() if not torch.equal(
        v.float(), base_tower[k.split(".visual.", 1)[1].replace("modules_to_save.default.", "")].float())]
    assert len(moved) > len(tower) // 2, (len(moved), len(tower))

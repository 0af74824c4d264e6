"""Text-only fine-tuning of a multimodal class (issue 31): which parts train, as the user sets it, and what the
plan and toolkit.train do with the vision encoder and projector. Real PEFT on the meta model, real configs from
tests/arch_configs."""

from __future__ import annotations

from pathlib import Path

import pytest

MODELS = Path(__file__).resolve().parent / "arch_configs"
GEMMA = str(MODELS / "gemma-3-4b-it.json")


def test_lora_on_a_multimodal_class_lands_on_the_language_model_only():
    """PEFT's all-linear on Gemma-3's whole class also wraps the SigLIP tower's linears (162 of 400 adapters); the
    planned adapter excludes the encoder and projector (LoraConfig exclude_modules), and PEFT's own matching on the
    meta model then puts every adapter in the language model, with the trainable count the plan uses."""
    from toolkit.inputs.lora import Adapter, adapter_for_model, counts_for_spec, peft_model_on_meta
    from toolkit.inputs.modelspec import resolve_model

    spec = resolve_model(GEMMA)
    everywhere = Adapter(method="lora")
    planned = adapter_for_model(spec, everywhere, dropout_given=False)
    assert planned.exclude == "model.vision_tower,model.multi_modal_projector"
    assert planned.lora_config().exclude_modules == r"(model\.vision_tower|model\.multi_modal_projector)(\..*)?"
    found = {}
    for name, adapter in (("everywhere", everywhere), ("planned", planned)):
        peft_model, _ = peft_model_on_meta(spec.hf_config(), adapter)
        wrapped = [n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")]
        in_tower = [n for n in wrapped if any(f".{m}." in n for m in spec.vision_modules)]
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        found[name] = (len(wrapped), len(in_tower), trainable)
        assert counts_for_spec(spec, adapter).trainable_params == trainable
    assert found["everywhere"][:2] == (400, 162)
    assert found["planned"][:2] == (238, 0) and found["planned"][2] == 29_802_496


def test_a_text_model_keeps_its_lora_config_unchanged():
    from toolkit.inputs.lora import Adapter, adapter_for_model
    from toolkit.inputs.modelspec import resolve_model

    spec = resolve_model(str(MODELS / "qwen3-0.6b.json"))
    adapter = adapter_for_model(spec, Adapter(method="lora"), dropout_given=False)
    assert adapter.exclude == "" and "exclude_modules" not in adapter.lora_config_kwargs()


def _estimate(capsys, *flags):
    import json

    from toolkit.cli import main

    code = main(["estimate", GEMMA, "--gpus", "8xH100-80GB", "--seq", "512", *flags, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_a_frozen_tower_keeps_its_weights_only_as_each_engine_holds_them(capsys):
    """--vision-tower freeze on Gemma-3-4B (419,816,304 encoder + projector parameters): the weights stay as each
    engine keeps them (DDP fp32 whole, ZeRO-2 bf16 whole, ZeRO-3 / FSDP2 1/8 of them), while gradients and optimizer
    states drop by exactly the tower's share, and the encoder's named share is weights only."""
    from toolkit.inputs.modelspec import resolve_model

    spec = resolve_model(GEMMA)
    tower = spec.vision_params + spec.projector_params
    assert tower == 419_816_304
    weights = {"ddp": 4 * tower, "zero2": 2 * tower, "zero3": 2 * tower / 8, "fsdp2": 4 * tower / 8}
    adam = {"ddp": 8 * tower, "zero2": 12 * tower / 8, "zero3": 12 * tower / 8, "fsdp2": 8 * tower / 8}
    for strategy in ("ddp", "zero2", "zero3", "fsdp2"):
        trained = _estimate(capsys, "--strategy", strategy)
        frozen = _estimate(capsys, "--strategy", strategy, "--vision-tower", "freeze")
        t, f = trained["per_gpu"], frozen["per_gpu"]
        assert f["parameters_bytes"] == t["parameters_bytes"], strategy
        assert t["optimizer_bytes"] - f["optimizer_bytes"] == pytest.approx(adam[strategy], rel=1e-6), strategy
        assert t["gradients_bytes"] > f["gradients_bytes"], strategy
        assert frozen["vision_share"] == {"weights_bytes": int(weights[strategy]), "gradients_bytes": 0,
                                          "optimizer_bytes": 0}, strategy
        assert trained["vision_share"]["optimizer_bytes"] > 0


def test_freezing_a_tower_a_text_model_has_not_is_refused_in_one_line(capsys):
    from toolkit.cli import main

    code = main(["estimate", str(MODELS / "qwen3-0.6b.json"), "--gpus", "1xH100-80GB", "--seq", "512",
                 "--vision-tower", "freeze"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--vision-tower freeze:" in err and "has no vision encoder" in err


def _tiny_gemma3_class(out: Path) -> Path:
    """Gemma-3's whole class (SigLIP tower + projector + text model), tiny, random weights, a local tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3Config

    from toolkit.run.tiny import corpus_text, train_tokenizer

    tokenizer = train_tokenizer(corpus_text(100_000), vocab_size=512)
    config = Gemma3Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         sliding_window=32),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=28, patch_size=14, vision_use_head=False),  # as Gemma-3's own config
        mm_tokens_per_image=4, image_token_index=len(tokenizer) - 1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    return _tiny_gemma3_class(tmp_path_factory.mktemp("tiny-gemma3"))


TOWER_TRAIN = ("--max-steps", "3", "--logging-steps", "1", "--save-steps", "3", "--lr", "2e-2")
"""3 steps at a learning rate large enough that every language weight moves in fp32."""


def _tower_plan(model_dir: Path, name: str):
    """The plan of a tower run by name: "one-TOWER", 1 process at micro-batch 2 (DDP), or "ENGINE-TOWER", 2
    processes at micro-batch 1 each; TOWER is freeze or train."""
    from toolkit.run.rehearsal import plan_for_model

    engine, tower = name.split("-")
    strategy, world, micro = ("ddp", 1, 2) if engine == "one" else (engine, 2, 1)
    return plan_for_model(model_dir, strategy, gpus_per_node=world, micro_batch=micro, seq_len=32,
                          vision_tower=tower)


@pytest.fixture(scope="module")
def tower_runs(runs_by_name, tiny_gemma3, corpus_dir):
    """The tiny Gemma-3 class's toolkit.train runs by name (_tower_plan), each made once: the one-process run of a
    tower setting serves every 2-process run of it, and starts beside the DDP one; the ZeRO-3 and FSDP2 runs of the
    frozen tower start side by side (one after the other, each 2-rank world left a core idle while it started, met
    and saved)."""
    def arguments(name):
        return _tower_plan(tiny_gemma3, name), f"mm-{name}", "--data", str(corpus_dir), *TOWER_TRAIN

    return runs_by_name(arguments, together=[("one-freeze", "ddp-freeze"), ("one-train", "ddp-train"),
                                             ("zero3-freeze", "fsdp2-freeze")])


@pytest.mark.multiprocess
def test_toolkit_train_freezes_the_planned_tower_and_trains_the_language_model(tower_runs, tiny_gemma3):
    """A tiny Gemma-3 class planned with --vision-tower freeze (DDP, fp32, 1 process): toolkit.train freezes the
    plan's encoder and projector before the Trainer builds its optimizer, so after 3 steps at a large learning rate
    every tower and projector weight is bit-identical to the checkpoint's while the language model's moved; the
    plan counts the same parts the loaded class has."""
    import torch
    from transformers import AutoModelForCausalLM

    plan = _tower_plan(tiny_gemma3, "one-freeze")
    assert plan.vision_tower == "freeze"
    assert plan.model_parts["vision_modules"] == ["model.vision_tower", "model.multi_modal_projector"]
    run = tower_runs("one-freeze")
    before = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(run.output, dtype=torch.float32).state_dict()
    tower = [k for k in before if k.startswith(tuple(plan.model_parts["vision_modules"]))]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert plan.model_parts["vision_params"] + plan.model_parts["projector_params"] == \
        sum(before[k].numel() for k in tower)
    language = [k for k in before if k not in tower]
    assert sum(not torch.equal(before[k], after[k]) for k in language) > len(language) // 2


def test_the_plan_says_which_model_the_runner_loads_and_whether_the_language_model_alone_could():
    """Found with transformers' own key renaming on the meta device: Gemma-3's causal-LM class is the whole class,
    and Gemma3ForCausalLM finds 444 of its 445 weights under no class checkpoint key (no mapping for gemma3_text);
    Qwen3.5's is the language model alone, loading every weight through the qwen3_5_text prefix change and leaving
    the 460,730,096-parameter vision encoder unloaded."""
    from toolkit.inputs.modelspec import resolve_model

    gemma = next(n for n in resolve_model(GEMMA).notes if n.startswith("the runner loads"))
    assert gemma.startswith("the runner loads the whole class Gemma3ForConditionalGeneration")
    assert "the language model alone cannot load: Gemma3ForCausalLM would find 444 of its 445 weights" in gemma
    qwen = next(n for n in resolve_model(str(MODELS / "qwen3.5-27b.json")).notes if n.startswith("the runner loads"))
    assert qwen == ("the runner loads the language model alone, Qwen3_5ForCausalLM (AutoModelForCausalLM's class "
                    "for qwen3_5): transformers renames the checkpoint's keys and leaves its vision encoder "
                    "(460,730,096 parameters) unloaded")


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine, tower", [("ddp", "freeze"), ("zero3", "freeze"), ("fsdp2", "freeze"),
                                           ("ddp", "train")])
def test_a_frozen_tower_trains_on_two_gloo_processes_as_on_one(engine, tower, tower_runs, tiny_gemma3):
    """The tiny Gemma-3 class with its tower frozen, fp32: 2 processes over gloo (micro-batch 1 each; DDP, ZeRO-3
    partitioning the frozen tower with the rest, FSDP2 sharding groups that mix frozen and trained parameters) give
    the losses of 1 process with micro-batch 2, within 1e-3, and leave the tower as loaded. Trained (the default),
    text never reaches the tower either: DDP runs it only with the plan's find_unused_parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    one, two = tower_runs(f"one-{tower}"), tower_runs(f"{engine}-{tower}")
    assert len(two.ranks) == 2 and len(one.ranks) == 1
    ref, got = one.losses(), two.losses()
    assert got.keys() == ref.keys() and len(ref) == 3
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-3), (engine, step, got, ref)
    before = AutoModelForCausalLM.from_pretrained(tiny_gemma3, dtype=torch.float32).state_dict()
    after = AutoModelForCausalLM.from_pretrained(two.output, dtype=torch.float32).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("model.vision_tower"))


def _tiny_qwen25_vl_class(out: Path) -> Path:
    """Qwen2.5-VL's whole class (windowed ViT + patch merger + M-RoPE language model), tiny, random weights, a local
    tokenizer with a chat template (tests/test_image_train.py builds it for the image runs too)."""
    from tests.test_image_train import _tiny_qwen_vl_with_processor

    return _tiny_qwen_vl_with_processor(out, "2.5")


TINY_CLASSES = {"gemma3": (_tiny_gemma3_class, "AutoModelForCausalLM", "Gemma3ForConditionalGeneration"),
                "qwen2.5-vl": (_tiny_qwen25_vl_class, "AutoModelForImageTextToText",
                               "Qwen2_5_VLForConditionalGeneration")}
"""model -> (builder, the auto class a user loads it with as the plan's notes name it, the class that loads)."""


@pytest.mark.multiprocess
@pytest.mark.parametrize("model, strategy, tower", [("gemma3", "ddp", "train"), ("gemma3", "zero3", "freeze"),
                                                    ("qwen2.5-vl", "fsdp2", "train"),
                                                    ("qwen2.5-vl", "zero3", "freeze")])
def test_a_copied_text_plan_of_the_class_runs_a_users_trl_sft_script_on_2_processes_as_on_1(model, strategy, tower,
                                                                                           tmp_path):
    """A text-only plan of a tiny multimodal class (Gemma-3, loaded with AutoModelForCausalLM; Qwen2.5-VL, which
    AutoModelForCausalLM has no class for, loaded with AutoModelForImageTextToText as the plan's notes say), emitted,
    copied elsewhere, and launched with a user's own TRL SFT script (tests/story/my_mm_text_sft.py: the auto class,
    which loads the whole class, and PLAN.md's freeze snippet; sft_config() the only toolkit call) on chat rows of
    different lengths, fp32: 2 CPU processes at micro-batch 1 (DDP or FSDP2 with the tower trained, ZeRO-3 with it
    frozen) give the 3 losses of 1 process at micro-batch 2 within 1e-3; the trainable parameters are the plan's (the
    class's, or all but the tower's), the language model moved, and the tower, which text never reaches, did not
    (compared where the rank holds whole tensors or FSDP2's gathers them). DDP with the tower trained needs
    find_unused_parameters (training_args.json says so): without it rank 1 failed at step 2, "Expected to have
    finished reduction in the prior iteration", the tower's 39 tensors without gradients."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from toolkit.emit.user_settings import auto_class_name
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.run.tiny import write_chat_corpus

    build, auto_class, class_name = TINY_CLASSES[model]
    model_dir = build(tmp_path / "tiny")
    chat = write_chat_corpus(tmp_path / "chat", max_chars=20_000) / "train.jsonl"
    shutil.copy(Path(__file__).parent / "story" / "my_mm_text_sft.py", tmp_path)
    launches, plans = {}, {}
    for world, micro in ((1, 2), (2, 1)):
        plans[world] = plan_for_model(model_dir, strategy if world == 2 else "ddp", gpus_per_node=world,
                                      micro_batch=micro, seq_len=96, vision_tower=tower)
        assert auto_class_name(plans[world]) == auto_class
        emit_plan_files(plans[world], tmp_path / "planned")
        copy = shutil.copytree(tmp_path / "planned", tmp_path / "elsewhere" / f"copy-{world}")
        shutil.rmtree(tmp_path / "planned")
        # Both launches side by side (each launcher rendezvouses on a port of its own): the one process fills the
        # core the 2 ranks leave idle while they start and meet.
        with open(tmp_path / f"launch-{world}.log", "w") as log:  # a file: a full pipe would stall a launch
            launches[world] = subprocess.Popen(
                [sys.executable, "-m", "toolkit", "launch", str(copy), "--processes", str(world), "--cpu", "--",
                 "my_mm_text_sft.py", str(model_dir), str(chat), str(tmp_path / f"out-{world}"),
                 str(tmp_path / f"report-{world}.json"), auto_class],
                cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    for launch in launches.values():
        launch.wait(timeout=600)
    seen = {}
    for world, launch in launches.items():
        assert launch.returncode == 0, (tmp_path / f"launch-{world}.log").read_text(errors="replace")[-6000:]
        seen[world] = json.loads((tmp_path / f"report-{world}.json").read_text())
    one, two = seen[1], seen[2]
    assert (two["world"], two["micro_batch"], two["accumulation"]) == (2, 1, 1) and one["micro_batch"] == 2
    assert one["class"] == class_name and two["class"].removeprefix("FSDP") == class_name  # fully_shard renames it
    parts = plans[2].model_parts
    tower_params = parts["vision_params"] + parts["projector_params"]
    assert tower_params > 0 and one["trainable"] == two["trainable"] == parts["language_params"] + (
        tower_params if tower == "train" else 0)
    assert len(one["losses"]) == len(two["losses"]) == 3
    for step, (ref, got) in enumerate(zip(one["losses"], two["losses"]), 1):
        assert got == pytest.approx(ref, abs=1e-3), (step, one["losses"], two["losses"])
    for run in (one, two) if strategy != "zero3" else (one,):  # ZeRO-3's rank holds placeholders, not compared
        assert run["tower_moved"][0] == 0 < run["tower_moved"][1]
        assert run["language_moved"][0] > run["language_moved"][1] // 2

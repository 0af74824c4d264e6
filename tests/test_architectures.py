"""Real configs of decoder families (tests/arch_configs/MANIFEST.tsv: verbatim copies with their source, and the typed
ones no verbatim copy was found for; the catalog for the rest): `toolkit plan` with a hybrid pipeline request either
offers a rehearsal or refuses at plan time naming the part that stops the converter, and the plan-time verdict is
the converter's own: where the plan offers a rehearsal, the rehearsal model (the real config shrunk by its own class)
builds and converts exactly; where it refuses, the converter refuses that model too. No tracing of real sizes beyond
the planner's, no processes but one rehearsal per family folded into one parametrised test."""

from __future__ import annotations

import copy
import csv
from pathlib import Path

import pytest
import torch

from toolkit.errors import UserError

HERE = Path(__file__).resolve().parent
MODELS = HERE / "arch_configs"
CATALOG = HERE.parent / "toolkit" / "catalog" / "models"


def _manifest() -> dict[str, dict[str, str]]:
    lines = [line for line in (MODELS / "MANIFEST.tsv").read_text().splitlines() if not line.startswith("#")]
    fields = ["file", "model_type", "hub_model", "repository", "path", "commit", "licence", "published_params",
              "params_source"]
    return {row["file"]: row for row in csv.DictReader(lines, fieldnames=fields, delimiter="\t")}


MANIFEST = _manifest()
# Families with no config in arch_configs: the catalog's published config of them (typed; test_catalog checks
# their published parameter counts).
CATALOG_FAMILIES = {"gemma-2-2b.json": "gemma2", "opt-1.3b.json": "opt", "mistral-7b.json": "mistral",
                    "qwen2.5-0.5b.json": "qwen2", "gpt2.json": "gpt2"}
# Gemma-4's decoder layers differ in shape (transformers keeps head_dim and KV heads per layer): planned below and
# in tests/test_heterogeneous_layers.py, left out of the pipeline walk (its class is multimodal: pipeline refused).
HETEROGENEOUS = {"gemma-4-26b-a4b.json"}
# Qwen2.5-VL: transformers 5.24 maps its config to AutoModelForImageTextToText only (no causal-LM class): toolkit
# builds that class (auto_model_class); estimate / plan are tested on it below (test_the_parts_of_a_class_with_its_
# projector...); the pipeline walk here loads AutoModelForCausalLM and the plan refuses its pipeline, so it stays
# out of it (its rehearsal model: test_the_rehearsal_model_of_qwen2_5_vl_...).
NOT_CAUSAL_LM = {"qwen2.5-vl-7b-instruct.json"}
CONFIGS = {**{name: (MODELS / name, row["model_type"]) for name, row in MANIFEST.items()
              if name not in HETEROGENEOUS | NOT_CAUSAL_LM},
           **{name: (CATALOG / name, kind) for name, kind in CATALOG_FAMILIES.items()}}
# DeepSeek-V3 (671B) fits no hybrid plan on 256 of the catalog's largest GPUs (2 of its MoE layers per stage at
# most 32 stages exceed a B200): the plan refuses it for memory, and its pipeline verdict is the spec's.
TOO_LARGE_FOR_ANY_GPU = {"deepseek-v3.json"}
ISSUE_FAMILIES = {"phi3", "gemma2", "gemma3_text", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmo2", "stablelm",
                  "gpt_neox", "falcon", "opt", "llama", "mistral", "qwen2", "gpt2"}


def test_the_manifest_names_every_config_and_covers_every_family_of_the_issue():
    assert sorted(MANIFEST) == sorted(p.name for p in MODELS.glob("*.json")) and HETEROGENEOUS <= set(MANIFEST)
    assert ISSUE_FAMILIES <= {kind for _, kind in CONFIGS.values()}
    for row in MANIFEST.values():
        verbatim = row["repository"] != "-"
        assert all(row[k] != "-" for k in ("path", "commit", "licence")) == verbatim, row["file"]
        if verbatim:
            assert len(row["commit"]) == 40 and row["path"].endswith(".json"), row["file"]


def _stages(layers: int) -> int:
    """A pipeline depth every family can take (each stage at least two decoder layers) and that fits the largest
    configs (DeepSeek-V3's 671B parameters: 32 stages) in B200 memory."""
    return max(s for s in (2, 4, 8, 16, 32) if s <= max(2, layers // 2) or (s == 32 and layers >= 60))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_offers_a_rehearsal_that_converts_or_refuses_pipeline_naming_the_part(name, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from tests.test_pipeline_convert import run_layers
    from toolkit.cli import main
    from toolkit.inputs.modelspec import build_spec, resolve_model
    from toolkit.run.rehearsal import make_rehearsal_model, plan_for_model
    from toolkit.train.model import load_config
    from toolkit.train.pipeline.convert import CausalLMLoss, RouterStats, Source

    path, kind = CONFIGS[name]
    spec = resolve_model(str(path))
    assert spec.model_type == kind
    row = MANIFEST.get(name, {})
    if row.get("published_params", "-") != "-":
        assert spec.params == int(row["published_params"]), row["params_source"]

    # The user's command: B200s so that even the largest config fits a hybrid plan in memory; the verdict is the
    # pipeline's, not the memory's.
    code = main(["plan", str(path), "--gpus", "32x8xB200", "--seq", "256", "--micro-batch", "1",
                 "--pipeline-stages", str(_stages(spec.num_layers)), "--strategies", "hybrid", "--choose", "hybrid",
                 "--out", str(tmp_path / "plan")])
    out = capsys.readouterr()
    if name in TOO_LARGE_FOR_ANY_GPU:
        assert code == 2 and "GiB" in out.err and spec.pipeline_blocker is None, out.err[-2000:]
    elif spec.pipeline_blocker is None:
        assert code == 0, out.err[-2000:]
        assert f"toolkit launch {tmp_path / 'plan'} --rehearse" in out.out
    else:
        assert code == 2 and not (tmp_path / "plan").exists()
        assert f"pipeline conversion cannot split {kind} ({spec.pipeline_blocker})" in out.err + out.out
        return

    # The rehearsal's model: the config shrunk by its own class. For MoE models also with the router's
    # load-balancing loss on (carried between stages): the plan's verdict on that setting is the converter's too.
    tiny_dir = make_rehearsal_model(plan_for_model(str(path), "zero3"), tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    # A vision-language config's rehearsal model is its text model (what AutoModelForCausalLM builds: Qwen3.5).
    assert model.config.model_type in (kind, load_config(str(path)).get_text_config().model_type)
    assert model.config.get_text_config().num_hidden_layers == 4
    for extra in [{}] + ([{"output_router_logits": True}] if spec.moe_experts else []):
        config = load_config(str(path))
        for key, value in extra.items():  # the plan's verdict on the real config with this setting ...
            setattr(config.get_text_config(), key, value)
        blocker = build_spec(str(path), config).pipeline_blocker
        model.config.get_text_config().output_router_logits = bool(extra)  # ... and the converter's on the tiny one
        if blocker is not None:
            with pytest.raises(UserError, match="pipeline conversion cannot split this model"):
                Source(model.config, tiny_dir)
            continue
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            source = Source(model.config, tiny_dir)
            logits = run_layers(source, ids)
            loss = CausalLMLoss(vocab, RouterStats.for_source(source))(logits, ids)
            reference = model(ids, labels=ids)
        assert isinstance(logits, tuple) == bool(extra)
        torch.testing.assert_close(logits[0] if isinstance(logits, tuple) else logits, reference.logits, atol=0,
                                   rtol=0)
        torch.testing.assert_close(loss, reference.loss)


def test_gemma_4_whose_decoder_layers_differ_in_shape_is_counted_exactly_and_split_by_every_layers_heads(capsys):
    """Gemma-4-26B-A4B: transformers keeps its global layers' head_dim (512) and KV heads (2, against 256 and 8) per
    layer; the estimate reads each layer's, counts the meta build, and refuses a tensor degree that splits the
    sliding layers' KV heads but not the global ones'."""
    from toolkit.cli import main

    code = main(["estimate", str(MODELS / "gemma-4-26b-a4b.json"), "--gpus", "8xH100-80GB", "--strategy", "zero3"])
    out = capsys.readouterr().out
    assert code == 0 and "25,805,933,872 parameters (30 x Gemma4TextDecoderLayer" in out
    code = main(["estimate", str(MODELS / "gemma-4-26b-a4b.json"), "--gpus", "8xH100-80GB", "--strategy", "fsdp2",
                 "--tensor-parallel", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--tensor-parallel 4 does not divide" in err and "2 KV heads in some decoder layers" in err


def test_a_vision_language_class_plans_text_only_with_its_tower_counted_and_named(capsys):
    """Gemma-3-4B as its multimodal class (vision tower + projector beside the language model): the trace builds it
    without running weight init (whose trunc_normal_ branched on fake values), the plan chooses ZeRO-1 (the whole
    grid's choice; asked alone beside the pipeline, it traces 2 steps, not the grid's 8), the spec names the parts
    beside the language model with counts that add up to the class, and a pipeline request names the vision tower
    the converter would drop."""
    import json

    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from toolkit.cli import main
    from toolkit.inputs.modelconfig import load_config
    from toolkit.inputs.modelspec import build_spec

    path = str(MODELS / "gemma-3-4b-it.json")
    code = main(["plan", path, "--gpus", "8xH100-80GB", "--seq", "1024", "--micro-batch", "1", "--strategies",
                 "zero1,pipeline", "--json"])
    out = capsys.readouterr()
    assert code == 0 and "Traceback" not in out.err
    plan = json.loads(out.out)
    assert plan["chosen"]["strategy"] == "zero1" and plan["params"] == 4_300_079_472
    pipeline = next(c for c in plan["candidates"] if c["strategy"] == "pipeline")
    assert "part 'model.vision_tower' (SiglipVisionModel) beside the language model" in pipeline["reason"]

    config = load_config(path)  # the parts counted apart, each built from its own config on the meta device
    with torch.device("meta"):
        text = AutoModelForCausalLM.from_config(config.get_text_config())
        tower = AutoModel.from_config(AutoConfig.for_model(**config.vision_config.to_dict()))
    text_params = sum({id(p): p.numel() for p in text.parameters()}.values())
    tower_params = sum({id(p): p.numel() for p in tower.parameters()}.values())
    spec = build_spec(path, config)
    note = next(n for n in spec.notes if n.startswith("beside the language model"))
    assert f"({text_params:,} parameters)" in note
    assert f"model.vision_tower (SiglipVisionModel) {tower_params:,}" in note
    projector = spec.params - text_params - tower_params
    assert projector > 0 and f"model.multi_modal_projector (Gemma3MultiModalProjector) {projector:,}" in note


def test_a_family_member_the_converter_cannot_split_is_refused_at_plan_time_naming_the_part(capsys):
    """Falcon-RW uses ALiBi: `toolkit plan --choose pipeline` refuses it before anything is written."""
    from toolkit.cli import main

    code = main(["plan", str(MODELS / "falcon-rw-1b.json"), "--gpus", "8xA100-80GB", "--seq", "1024",
                 "--micro-batch", "1", "--choose", "pipeline"])
    out = capsys.readouterr()
    assert code == 2
    assert "pipeline conversion cannot split falcon (falcon: ALiBi attention bias" in out.err + out.out


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["qwen1.5-moe-a2.7b.json", "gpt-oss-20b.json"])
def test_the_rehearsal_of_a_pipeline_plan_from_a_real_config_passes(name, tmp_path, capfd):
    """Qwen1.5-MoE, which rehearsals once refused ("no rehearsal model for model_type qwen2_moe"), and GPT-OSS
    (attention sinks, so eager attention; sliding layers; its own MoE router): each config shrunk, 2 pipeline stages
    on 2 CPU processes, with the router loss on (carried between the stages)."""
    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    path, kind = CONFIGS[name]
    plan = plan_for_model(str(path), "pipeline", gpus_per_node=8, pipeline_stages=8, micro_batch=2, grad_accum=4,
                          seq_len=512)
    plan = plan.replace(model_config={**plan.model_config, "output_router_logits": True})
    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert f"{kind} 4 layers" in out and "rehearsal passed" in out


def _count(module) -> int:
    return sum({id(p): p.numel() for p in module.parameters()}.values())


@pytest.mark.parametrize("name, language, vision, projector", [
    ("gemma-3-4b-it.json", 3_880_263_168, 416_866_032, 2_950_272),
    ("gemma-3-12b-it.json", 11_766_034_176, 416_866_032, 4_424_832),
])
def test_the_parts_of_a_vision_language_class_are_counted_exactly_and_shown(name, language, vision, projector, capsys):
    """Gemma-3 as its multimodal class: the spec's language model, vision encoder and projector counts equal each
    part built from its own sub-config on the meta device, add up to the class, and estimate prints them (--json
    too, with the encoder's per-GPU share of the model states, 1/8 of DDP's under ZeRO-3 on 8 GPUs)."""
    import json

    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    from toolkit.cli import main
    from toolkit.inputs.modelconfig import load_config
    from toolkit.inputs.modelspec import resolve_model

    path = str(MODELS / name)
    config = load_config(path)
    with torch.device("meta"):
        text = AutoModelForCausalLM.from_config(config.get_text_config())
        tower = AutoModel.from_config(AutoConfig.for_model(**config.vision_config.to_dict()))
        mm_projector = Gemma3MultiModalProjector(config)
    assert (_count(text), _count(tower), _count(mm_projector)) == (language, vision, projector)
    spec = resolve_model(path)
    assert (spec.language_params, spec.vision_params, spec.projector_params) == (language, vision, projector)
    assert spec.params == language + vision + projector
    assert spec.vision_modules == ("model.vision_tower", "model.multi_modal_projector")

    shares = {}
    for strategy in ("ddp", "zero3"):
        code = main(["estimate", path, "--gpus", "8xH100-80GB", "--seq", "512", "--strategy", strategy, "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["model"]["vision_params"] == vision and out["model"]["language_params"] == language
        shares[strategy] = out["vision_share"]
    fraction = (vision + projector) / spec.params
    assert shares["ddp"]["weights_bytes"] == int(4 * spec.params * fraction)  # AMP: fp32 weights on every GPU
    assert shares["zero3"]["weights_bytes"] == pytest.approx(2 * (vision + projector) / 8, rel=1e-3)
    main(["estimate", path, "--gpus", "8xH100-80GB", "--seq", "512", "--strategy", "zero3", "--explain"])
    out = capsys.readouterr().out
    assert f"parts: language model {language:,} + vision encoder {vision:,} + projector {projector:,}" in out
    assert "vision encoder's share: " in out and "as zero3 holds them (sharded over the data-parallel ranks)" in out


def test_the_parts_of_a_class_with_its_projector_inside_the_tower_are_split_by_the_model(capsys):
    """Qwen2.5-VL-7B keeps its projector (the patch merger into the language model's width) inside its vision
    module: vision_parts finds it there from the model's own modules; each part equals the part built from its own
    sub-config. AutoModelForCausalLM has no class for qwen2_5_vl, so toolkit builds the one transformers maps it to
    for image-text (AutoModelForImageTextToText) and estimates it text-only with those exact counts; tensor
    parallelism is refused in one line (the class derives its head width from hidden / heads, so one rank cannot be
    traced)."""
    import json

    from transformers import AutoModelForImageTextToText

    from toolkit.cli import main
    from toolkit.inputs.decoder_parts import vision_parts
    from toolkit.inputs.modelconfig import auto_model_class, load_config
    from toolkit.inputs.modelspec import resolve_model

    path = str(MODELS / "qwen2.5-vl-7b-instruct.json")
    config = load_config(path)
    assert auto_model_class(config) is AutoModelForImageTextToText
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
        visual = type(model.model.visual)._from_config(config.vision_config)
        text = type(model.model.language_model)._from_config(config.text_config)
    tower, projector = vision_parts(model, config)
    assert tower == (("model.visual", type(visual).__name__, _count(visual) - _count(visual.merger)),)
    assert projector == (("model.visual.merger", "Qwen2_5_VLPatchMerger", _count(visual.merger)),)
    assert (tower[0][2], projector[0][2]) == (631_975_680, 44_574_464)
    lm_head = config.text_config.vocab_size * config.text_config.hidden_size  # untied
    assert _count(model) - tower[0][2] - projector[0][2] == _count(text) + lm_head == 7_615_616_512
    spec = resolve_model(path)
    assert spec.model_class == "Qwen2_5_VLForConditionalGeneration" and spec.params == _count(model)
    assert (spec.language_params, spec.vision_params, spec.projector_params) == (7_615_616_512, 631_975_680,
                                                                                 44_574_464)
    assert main(["estimate", path, "--gpus", "8xH100-80GB", "--seq", "512", "--strategy", "zero3", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["params"] == 8_292_166_656
    # ZeRO-3 on 8 GPUs: the encoder + projector's bf16 weights, 1/8 each
    assert shown["vision_share"]["weights_bytes"] == 2 * (631_975_680 + 44_574_464) // 8
    assert main(["estimate", path, "--gpus", "8xH100-80GB", "--seq", "512", "--strategy", "fsdp2",
                 "--tensor-parallel", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "derives its head width from hidden_size / heads" in err
    assert "Traceback" not in err


def test_a_script_for_a_qwen2_5_vl_plan_loads_the_image_text_class(tmp_path, capsys):
    """PLAN.md's from_pretrained line names the auto class transformers maps the plan's config to (Qwen2.5-VL: only
    AutoModelForImageTextToText; AutoModelForCausalLM refuses its config); that class builds the plan's model from
    plan.json's model_config with the planned parameter count, and load_pretrained loads a saved one with it."""
    import json

    import transformers

    from toolkit.cli import main
    from toolkit.inputs.modelconfig import config_from_dict, load_pretrained

    path = str(MODELS / "qwen2.5-vl-7b-instruct.json")
    assert main(["plan", path, "--gpus", "1xH100-80GB", "--seq", "256", "--micro-batch", "1", "--method", "lora",
                 "--out", str(tmp_path / "plan")]) == 0
    capsys.readouterr()
    text = (tmp_path / "plan" / "PLAN.md").read_text()
    assert "model = AutoModelForImageTextToText.from_pretrained(MODEL, dtype=torch.bfloat16)" in text
    assert "AutoModelForCausalLM" not in text
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    config = config_from_dict(dict(plan["model_config"]), "plan.json")
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        transformers.AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    assert _count(model) == plan["params"] == 8_292_166_656
    small = copy.deepcopy(config)
    small.text_config.update({"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128,
                              "layer_types": ["full_attention"]})
    small.vision_config.update({"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                                "out_hidden_size": 32, "fullatt_block_indexes": [0]})
    type(model)._from_config(small).save_pretrained(tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved")
    assert type(loaded).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert _count(loaded) == _count(type(model)._from_config(small))


def test_the_rehearsal_model_of_qwen2_5_vl_is_a_small_whole_image_text_model(tmp_path):
    """Qwen2.5-VL's text config has no class of its own in transformers 5.24, so its rehearsal model (the plan's
    config shrunk by toolkit.run.tiny) keeps the whole class: the text model shrunk as every other family's, the
    vision encoder to 2 blocks of width 32 with its projector's output at the text width, its last block keeping the
    full attention the real tower's fullatt_block_indexes give some blocks; it trains text-only."""
    from toolkit.inputs.modelconfig import load_pretrained
    from toolkit.run.rehearsal import make_rehearsal_model, plan_for_model

    tiny_dir = make_rehearsal_model(plan_for_model(str(MODELS / "qwen2.5-vl-7b-instruct.json"), "zero1"),
                                    tmp_path / "tiny")
    model = load_pretrained(tiny_dir)
    config = model.config
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert (config.text_config.num_hidden_layers, config.text_config.hidden_size) == (4, 64)
    vision = config.vision_config
    assert (vision.depth, vision.hidden_size, vision.num_heads, vision.out_hidden_size) == (2, 32, 2, 64)
    assert vision.fullatt_block_indexes == [1] and model.model.visual.merger.mlp[-1].out_features == 64
    ids = torch.randint(0, config.text_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and 5.0 < loss.item() < 8.0  # about ln(vocab) for random weights
    assert plan_for_model(tiny_dir, "zero1").model_type == "qwen2_5_vl"

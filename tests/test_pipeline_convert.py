"""HF -> pipeline layers, in one process: the layers reproduce HF's logits and loss, load only their own weights,
and the runner refuses bad input before any process group starts."""

import json

import pytest
import torch

from toolkit.errors import UserError
from toolkit.train.pipeline.convert import (CausalLMLoss, DecoderLayerPipe, HeadPipe, InputsPipe, NormPipe, RouterStats,
                                      Source, TokenEmbeddingPipe, tied_head)

# Every architecture the issue names, as transformers' default config of each shrunk by toolkit.run.tiny: the converter
# finds their parts from the model (toolkit.inputs.decoder_parts), no table. MoE models ask for the router's
# load-balancing loss (output_router_logits), so it must reach the pipeline's loss; sliding windows are shorter
# than the sequence, so the sliding masks matter.
ARCHS = ("phi3", "gemma2", "gemma3_text", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "olmo2", "stablelm",
         "gpt_neox", "falcon", "opt", "llama", "mistral", "qwen2", "gpt2")


def pipeline_test_overrides(arch: str) -> dict:
    """Config settings that make HF's run and the pipeline's comparable: no dropout, a short sliding window, the
    MoE router loss on."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(arch).to_dict()
    out = {k: 0.0 for k, v in defaults.items() if isinstance(v, float) and ("dropout" in k or "pdrop" in k)}
    if defaults.get("sliding_window"):
        out["sliding_window"] = 8
    if any(k in defaults for k in ("num_local_experts", "num_experts")):
        out["output_router_logits"] = True
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from toolkit.run.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("convert")
    return {arch: make_tiny_model(arch, root / arch, corpus_chars=30_000, **pipeline_test_overrides(arch))
            for arch in ARCHS}


def run_layers(source: Source, ids: torch.Tensor):
    """Every pipeline layer in order in one process: what the stages compute together."""
    embed = TokenEmbeddingPipe(source)
    parts = source.parts
    layers = [embed] + ([InputsPipe(source)] if parts.positions or parts.dropout or parts.project_in else [])
    layers += [DecoderLayerPipe(source, i) for i in range(source.num_layers)] + [NormPipe(source)]
    head = (lambda h: tied_head(embed, h)) if source.tied else HeadPipe(source).eval()
    x = ids
    for layer in layers:
        x = layer.eval()(x)
    return head(x)


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_layers_give_hf_logits_and_loss(models, arch):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(models[arch])
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        source = Source(config, models[arch])
        out = run_layers(source, ids)
        reference = AutoModelForCausalLM.from_pretrained(models[arch]).eval()(ids, labels=ids)
        loss = CausalLMLoss(config.vocab_size, RouterStats.for_source(source))(out, ids)
    logits = out[0] if isinstance(out, tuple) else out
    assert isinstance(out, tuple) == bool(getattr(config, "output_router_logits", False))
    torch.testing.assert_close(logits, reference.logits, atol=0, rtol=0)
    torch.testing.assert_close(loss, reference.loss)


def test_the_plans_attention_implementation_is_used_with_its_own_mask(models):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(models["mistral"])
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = run_layers(Source(config, models["mistral"], attention="eager"), ids)
        reference = AutoModelForCausalLM.from_pretrained(models["mistral"], attn_implementation="eager").eval()(ids)
    assert config._attn_implementation == "eager"
    torch.testing.assert_close(logits, reference.logits, atol=0, rtol=0)


def test_a_layer_reads_only_its_own_weights(models):
    from transformers import AutoConfig

    source = Source(AutoConfig.from_pretrained(models["llama"]), models["llama"])
    layer = DecoderLayerPipe(source, 2)
    materialised = {n for n, p in source.skeleton.named_parameters() if not p.is_meta}
    assert materialised == {f"model.layers.2.{n}" for n, _ in layer.layer.named_parameters()}


def test_random_init_is_hf_init_and_the_same_on_every_rank(models):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(models["gpt2"])
    a, b = DecoderLayerPipe(Source(config, None, seed=3), 1), DecoderLayerPipe(Source(config, None, seed=3), 1)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    # GPT-2's residual projections get std 0.02 / sqrt(2 x layers) (HF's _init_weights), not the plain 0.02.
    expected = config.initializer_range / (2 * config.n_layer) ** 0.5
    assert abs(a.layer.mlp.c_proj.weight.std().item() - expected) < 0.2 * expected


def test_an_architecture_not_built_from_the_standard_parts_is_refused_naming_the_part(models):
    from toolkit.run.tiny import tiny_config

    with pytest.raises(UserError, match=r"cannot split this model: bloom: part 'transformer.ln_f' \(LayerNorm\) is "
                                        r"a second norm beside 'transformer.word_embeddings_layernorm'"):
        Source(tiny_config("bloom"), None)
    with pytest.raises(UserError, match=r"falcon: ALiBi attention bias"):
        Source(tiny_config("falcon", alibi=True), None)


def test_a_plan_with_more_stages_than_layers_is_refused_before_anything_runs(models):
    """The grid refuses it where the plan is made (the runner takes the plan's partition as checked)."""
    from tests.test_pipeline import make_plan

    with pytest.raises(UserError, match=r"model has 4 layers; --pipeline-stages 5 cannot give each stage a "
                                        r"decoder layer \(try 1\)"):
        make_plan(models["llama"], stages=5, dp=1)


@pytest.mark.parametrize("change, message", [
    ({"zero_optimization": {"stage": 2}}, "ZeRO stage 2; DeepSpeed's pipeline engine runs ZeRO 0 or 1 only"),
    ({"train_micro_batch_size_per_gpu": 4}, "sets train_micro_batch_size_per_gpu 4 but the plan says 2"),
    ({"gradient_clipping": "auto"}, "has \"auto\" values \\(gradient_clipping\\)"),
    ({"bf16": {"enabled": True}}, "does not match the plan's fp32"),
    ({"gradient_clipping": 0.5}, "sets gradient_clipping 0.5 but --max-grad-norm is 1.0"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
     "bf16 with fp32 gradient accumulation needs ZeRO stage 1"),
])
def test_ds_config_that_contradicts_the_plan_is_refused(models, tmp_path, change, message):
    from tests.test_pipeline import make_plan, write_plan_dir
    from toolkit.train.pipeline.runner import read_ds_config
    from toolkit.train.args import parse_train_args

    plan = make_plan(models["llama"], stages=2, dp=1)
    write_plan_dir(tmp_path, plan, zero_stage=0)
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    ds.update(change)
    (tmp_path / "ds_config.json").write_text(json.dumps(ds))
    args = parse_train_args(["--plan", str(tmp_path / "plan.json"), "--data", "x", "--output", str(tmp_path)])
    with pytest.raises(UserError, match=message):
        read_ds_config(plan, args)

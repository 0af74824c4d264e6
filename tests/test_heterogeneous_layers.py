"""Decoder layers that differ in shape (transformers' per_layer_config, a heterogeneous config): Gemma-4's
global-attention layers have a wider head_dim and fewer KV heads than its sliding ones, and transformers refuses the
global read of those attributes. The spec carries each layer's attention shape; the parameter count is the meta
build's, the tracer traces each layer kind, and a head split must divide every layer's heads."""

from __future__ import annotations

import pytest

from toolkit.inputs.modelspec import build_spec

SLIDING, GLOBAL = (4, 4, 16), (4, 2, 32)  # (heads, KV heads, head dim) of each kind in the tiny config below


def _tiny_gemma4_text():
    """Gemma-4-26B-A4B's text config, shrunk: its layer pattern (sliding, global), attention_k_eq_v (a global layer
    has no v_proj), the global layers' head_dim and KV heads set per layer as transformers' Gemma4TextConfig does."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING["gemma4_text"](
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, layer_types=["sliding_attention", "full_attention"] * 3,
        sliding_window=32, max_position_embeddings=512, hidden_size_per_layer_input=0, attention_k_eq_v=True,
        per_layer_config={i: {"head_dim": 32, "num_key_value_heads": 2} for i in (1, 3, 5)})


@pytest.fixture(scope="module")
def spec():
    return build_spec("tiny-gemma4", _tiny_gemma4_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma4")
    _tiny_gemma4_text().save_pretrained(path)
    return path


def test_each_layer_keeps_its_own_attention_shape_and_the_count_is_the_meta_build(spec):
    import torch
    from transformers import AutoModelForCausalLM

    assert spec.attention_shapes() == (SLIDING, GLOBAL) * 3
    assert (spec.heads, spec.kv_heads, spec.head_dim) in (SLIDING, GLOBAL)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_tiny_gemma4_text())
    assert spec.params == sum({id(p): p.numel() for p in model.parameters()}.values())
    # A global layer: q 64 -> 4 x 32, k 64 -> 2 x 32 (no v_proj: k = v), o 4 x 32 -> 64, q / k norms of 32; a sliding
    # one: q, k, v 64 -> 4 x 16 each, o 64 -> 64, norms of 16.
    wider = (64 * 128 + 64 * 64 + 128 * 64 + 2 * 32) - (4 * 64 * 64 + 2 * 16)
    assert spec.layer_params[1] - spec.layer_params[0] == wider == 4128
    assert spec.layer_params == spec.layer_params[:2] * 3


def test_attention_flops_and_the_kv_cache_sum_each_layers_shape(spec):
    from toolkit.estimate.grpo import kv_cache_bytes

    assert spec.query_width == 3 * 4 * 16 + 3 * 4 * 32 == 576
    assert kv_cache_bytes(spec, sequences=3, tokens=100, dtype_bytes=2) == 2 * (3 * 4 * 16 + 3 * 2 * 32) * 100 * 3 * 2
    assert spec.attention_words() == "3 layers x 4 KV heads x head dim 16 + 3 layers x 2 KV heads x head dim 32"


def test_the_tracer_traces_each_layer_kind_and_the_wider_global_layer_saves_more():
    """Four leading layers are traced (each kind twice: the first of a kind also holds what its kind shares, its
    rotary cos / sin, 2 x 64 x head dim x 2 bytes); the last two take their kind's trace. A sliding layer's window
    (32) is shorter than the sequence, so SDPA gets an explicit mask there and keeps it as the CUDA efficient
    kernel's additive bias, 64 x 64 x 2 bytes (the stand-in kept the shared boolean mask once before)."""
    from toolkit.estimate.tracer import trace_activations

    saved = [r.saved_bytes for r in trace_activations(_tiny_gemma4_text(), seq_len=64).layers]
    assert saved[2:] == [346242, 385282, 346242, 385282]
    assert (saved[0] - saved[2], saved[1] - saved[3]) == (2 * 64 * 16 * 2, 2 * 64 * 32 * 2)


def test_a_tensor_degree_that_divides_one_layer_kind_but_not_the_other_is_refused_in_one_line(model_dir, capsys):
    from toolkit.cli import main

    code = main(["estimate", str(model_dir), "--gpus", "8xH100-80GB", "--strategy", "fsdp2", "--tensor-parallel", "4",
                 "--seq", "64"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--tensor-parallel 4 does not divide" in err and "2 KV heads in some decoder layers" in err and "try 2" in err


def test_a_tensor_degree_dividing_every_layer_traces_one_rank_with_each_layers_heads_halved(spec):
    from toolkit.inputs.modelconfig import text_config
    from toolkit.inputs.tensorplan import per_rank_spec, tp_plan_problem

    assert tp_plan_problem(spec, 2) is None
    text = text_config(per_rank_spec(spec, 2).hf_config())
    shapes = [(c.num_attention_heads, c.num_key_value_heads, c.head_dim) for c in text.per_layer_config]
    assert shapes == [(2, 2, 16), (2, 1, 32)] * 3


def test_estimate_in_process_counts_the_meta_build_and_fits(model_dir, spec):
    from toolkit import api

    result = api.estimate(str(model_dir), "8xH100-80GB", strategy="zero3", seq_len=64, micro_batch=1)
    assert result.model.params == spec.params
    assert result.fits


def test_a_depth_cut_keeps_only_the_trailing_layers_that_share_keys_and_values():
    """Gemma-4 (and 3n): the last num_kv_shared_layers layers reuse earlier layers' keys and values; the tracer's
    leading layers keep that count of them, or none (transformers refuses a cut whose sharing layers outnumber it)."""
    from toolkit.inputs.modelconfig import reduced_config, text_config

    config = _tiny_gemma4_text()
    config.num_kv_shared_layers = 2
    assert [text_config(reduced_config(config, 6, keep)).num_kv_shared_layers for keep in (5, 4, 2)] == [1, 0, 0]
    assert reduced_config(config, 6, 5).kv_sharing_modes == config.kv_sharing_modes[:5] == [None, None, "store",
                                                                                             "store", "reuse"]


def test_a_drafter_whose_every_layer_reuses_another_models_keys_is_refused_in_one_line():
    from transformers import CONFIG_MAPPING

    from toolkit.inputs.modelconfig import causal_lm_problem

    problem = causal_lm_problem(CONFIG_MAPPING["gemma4_unified_assistant"]())
    assert "shares the keys and values of all its 30 layers (num_kv_shared_layers 30)" in problem
    assert "drafter" in problem and "\n" not in problem
    assert causal_lm_problem(_tiny_gemma4_text()) is None


def test_a_config_whose_layers_need_an_unset_size_is_refused_naming_the_fields():
    """DiffusionGemma's default config leaves its experts unset, which every decoder layer builds."""
    from transformers import CONFIG_MAPPING

    from toolkit.errors import UserError

    with pytest.raises(UserError, match=r"'text_config.num_experts' \(null\) in its config, which transformers' "
                                        "diffusion_gemma code needs"):
        build_spec("diffusion-gemma", CONFIG_MAPPING["diffusion_gemma"]())


def _shared_kv_gemma4_text():
    """The tiny Gemma-4 text config with its last two layers reusing the keys and values of the last sliding and
    global layers before them (num_kv_shared_layers, kv_sharing_modes None, None, store, store, reuse, reuse)."""
    config = _tiny_gemma4_text()
    # Per-layer inputs on (as Gemma-4's small checkpoints have them): transformers 5.24's KV-shared slicing indexes
    # them, and fails on None without.
    config.num_kv_shared_layers, config.hidden_size_per_layer_input, config.vocab_size_per_layer_input = 2, 8, 512
    return config


@pytest.mark.parametrize("prompt, completion", [(40, 1), (10, 40)])
def test_the_generation_kv_cache_is_what_transformers_dynamic_cache_stores(prompt, completion):
    """A real generate on the tiny Gemma-4 (sliding window 32, 2 KV-shared layers, random bf16 weights): the bytes of
    the storages behind the returned cache's keys and values equal generate_cache_bytes. A 40-token prompt's prefill
    leaves each sliding layer the whole prompt (a view of its last 31 tokens keeps the concatenation alive); after 40
    decode steps a sliding layer holds 32 tokens, a global one 49, a KV-shared one none."""
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.estimate.grpo import generate_cache_bytes

    config = _shared_kv_gemma4_text()
    spec = build_spec("tiny-gemma4-shared", config)
    assert spec.layer_cache_windows == (32, None, 32, None, 0, 0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    prompts = torch.randint(1, 512, (3, prompt))
    out = model.generate(prompts, max_new_tokens=completion, min_new_tokens=completion, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in cache.layers
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None}
    sliding, full = 4 * 16, 2 * 32  # KV heads x head dim of each kind, two layers of each keeping a cache
    tokens = prompt + completion - 1
    kept = 2 * 2 * (sliding * (prompt if completion == 1 else min(tokens, 32)) + full * tokens) * 3 * 2  # 2 of each
    assert sum(storages.values()) == generate_cache_bytes(spec, 3, prompt, completion, 2) == kept

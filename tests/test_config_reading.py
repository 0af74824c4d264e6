"""Configs of the architecture sweep (benchmarks/architectures.py) read as transformers reads them: a config
transformers itself wrote reads back, a model without attention heads estimates (params exact, activations traced)
and refuses the degrees that split heads, shape checks follow the model's own code, and a config that leaves a field
unset which transformers' own model code needs is refused in one line naming that field. One shrunk representative
per class, built from transformers' config classes, all in-process."""

from __future__ import annotations

import math

import pytest
import torch

from toolkit import api
from toolkit.errors import UserError
from toolkit.inputs.modelconfig import config_from_dict, model_positions


def _saved(tmp_path, kind: str, **fields) -> str:
    """A config of `kind` as transformers' save_pretrained writes it (its own JSON encoding)."""
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING[kind](**fields).save_pretrained(tmp_path)
    return str(tmp_path)


def _meta_params(config) -> int:
    from toolkit.inputs.modelconfig import auto_model_class

    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    return sum(p.numel() for p in model.parameters())


MAMBA2 = dict(hidden_size=64, num_heads=4, head_dim=32, n_groups=1, state_size=16, chunk_size=16,
              num_hidden_layers=2, vocab_size=128, expand=2)


def test_a_config_transformers_wrote_with_infinity_in_it_reads_back_as_transformers_reads_it(tmp_path):
    folder = _saved(tmp_path, "mamba2", **MAMBA2)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    spec = api.model(folder)
    assert list(spec.hf_config().time_step_limit) == [0.0, math.inf]


def test_a_model_without_attention_heads_estimates_exactly_and_refuses_splitting_heads(tmp_path):
    folder = _saved(tmp_path, "mamba2", **MAMBA2)
    spec = api.model(folder)
    assert (spec.heads, spec.kv_heads, spec.head_dim) == (0, 0, 0)
    assert spec.params == _meta_params(spec.hf_config()) == 72_216  # untied head: 2 x 128 x 64 + 2 layers x 27,884 + norm 64
    result = api.estimate(spec, "8xH100-80GB", strategy="zero3", seq_len=32)
    assert result.memory.activations_bytes > 0
    with pytest.raises(UserError, match=r"--sequence-parallel 2 split attention .* has no attention heads"):
        api.estimate(spec, "8xH100-80GB", strategy="zero3", seq_len=32, sequence_parallel=2)


def test_a_null_intermediate_size_is_what_the_model_derives_not_a_bad_config(tmp_path):
    # GPT-Neo's MLP is 4 x hidden where intermediate_size is null (GPTNeoBlock).
    folder = _saved(tmp_path, "gpt_neo", hidden_size=32, num_layers=2, num_heads=4, vocab_size=128,
                    attention_types=[[["global", "local"], 1]], max_position_embeddings=64, intermediate_size=None)
    spec = api.model(folder)
    assert spec.params == _meta_params(spec.hf_config())
    assert api.estimate(spec, "8xH100-80GB", seq_len=32).memory.activations_bytes > 0


def test_shape_checks_follow_the_config_class_not_the_raw_json():
    # A per-layer intermediate_size list (Gemma-3n) is checked entry by entry.
    config_from_dict({"model_type": "gemma3n_text", "num_hidden_layers": 2, "intermediate_size": [64, 64]}, "x")
    with pytest.raises(UserError, match=r"'intermediate_size' is \[64, 64, 64\], not a whole number"):
        config_from_dict({"model_type": "gemma3n_text", "num_hidden_layers": 2, "intermediate_size": [64, 64, 64]},
                         "x")
    # GLM-4-MoE-Lite's class carries a head_dim (MLA): 2048 / 20 heads is not its head width.
    assert config_from_dict({"model_type": "glm4_moe_lite", "hidden_size": 2048, "num_attention_heads": 20}, "x")
    # GLM-4-MoE's attention takes hidden // heads: an indivisible width is refused, naming the fix.
    with pytest.raises(UserError, match=r"hidden size 4096 does not divide by 96 attention heads.*give head_dim"):
        config_from_dict({"model_type": "glm4_moe", "hidden_size": 4096, "num_attention_heads": 96}, "x")
    # XLNet's max_position_embeddings is -1: no limit.
    assert model_positions(config_from_dict({"model_type": "xlnet"}, "x")) is None


def test_a_field_the_model_code_needs_left_null_is_refused_naming_it(tmp_path):
    # Hunyuan's attention reads config.head_dim with no fallback (built on the meta device).
    folder = _saved(tmp_path, "hunyuan_v1_dense", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                    num_hidden_layers=2, intermediate_size=128, vocab_size=128, head_dim=None)
    with pytest.raises(UserError, match=r"^'.*': 'head_dim' \(null\) in its config, which transformers' "
                                        r"hunyuan_v1_dense code needs \(modeling_hunyuan_v1_dense.py:\d+: "):
        api.model(folder)


def test_a_field_the_model_forward_needs_left_null_is_refused_naming_it(tmp_path):
    # DeepSeek-V2's router reads num_experts_per_tok in its forward (the meta build passes).
    folder = _saved(tmp_path / "d", "deepseek_v2", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                    num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32, vocab_size=128,
                    n_routed_experts=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                    v_head_dim=16, first_k_dense_replace=1, num_experts_per_tok=None)
    spec = api.model(folder)
    with pytest.raises(UserError, match=r"'num_experts_per_tok' \(null\).* in its config, which transformers' "
                                        r"deepseek_v2 code needs \(modeling_deepseek_v2.py:\d+: "):
        api.estimate(spec, "8xH100-80GB", seq_len=32)

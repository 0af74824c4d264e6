"""Models of the architecture sweep (benchmarks/architectures.py) that ended in a traceback: each either estimates
like any other model or is refused in one line naming the problem. One shrunk representative per class, built from
transformers' config classes, all in-process."""

from __future__ import annotations

import pytest

from toolkit import api
from toolkit.errors import UserError


def _saved(tmp_path, kind: str, **fields) -> str:
    """A config of `kind` as transformers' save_pretrained writes it."""
    from transformers import CONFIG_MAPPING

    CONFIG_MAPPING[kind](**fields).save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_model_that_casts_its_own_modules_while_built_is_traced(tmp_path):
    # DeepSeek-V4 builds `RMSNorm(...).to(dtype=torch.float32)`: under FakeTensorMode torch swaps each fake parameter,
    # and swap_tensors refused the fake mode's memo's weak references ("Couldn't swap DeepseekV4RMSNorm.weight").
    folder = _saved(tmp_path, "deepseek_v4", vocab_size=128, hidden_size=64, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, head_dim=32, q_lora_rank=32, n_routed_experts=4,
                    num_experts_per_tok=2, o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16,
                    index_topk=8, qk_rope_head_dim=8, sliding_window=16, hc_sinkhorn_iters=2,
                    layer_types=["sliding_attention", "compressed_sparse_attention"],
                    mlp_layer_types=["hash_moe", "moe"])
    result = api.estimate(folder, "8xH100-80GB", strategy="zero3", seq_len=64)
    assert api.model(folder).params == 151_145
    assert result.memory.activations_bytes == 2_042_284


def test_a_model_whose_code_needs_a_package_that_is_not_installed_is_refused_naming_it(tmp_path):
    # FastVLM's vision tower is a TimmWrapperModel: transformers' requires_backends raises an ImportError for timm.
    try:
        import timm  # noqa: F401
        pytest.skip("timm is installed here")
    except ImportError:
        pass
    folder = _saved(tmp_path, "fast_vlm")
    with pytest.raises(UserError, match=r"needs the timm package, which is not installed \(pip install timm\)$"):
        api.model(folder)


def test_a_model_whose_num_hidden_layers_counts_no_list_of_layers_is_refused_in_one_line(tmp_path):
    # HRM-Text's num_hidden_layers (here 4) counts its recurrent cycles, not a list of layers (stacks of 2).
    folder = _saved(tmp_path, "hrm_text", vocab_size=128, hidden_size=64, intermediate_size=128,
                    num_attention_heads=4, head_dim=16, num_hidden_layers=4, num_layers_per_stack=2)
    with pytest.raises(UserError, match=r"^cannot find the decoder layers of HrmTextForCausalLM"):
        api.estimate(folder, "8xH100-80GB", strategy="zero3", seq_len=32)


def test_an_image_text_model_whose_forward_needs_images_is_refused_in_one_line():
    # BLIP-2's forward takes pixel_values as a required argument: the language model's text-only trace cannot run
    from transformers import Blip2Config

    from toolkit.inputs.modelspec import build_spec

    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    config = Blip2Config(vision_config={**small, "image_size": 32, "patch_size": 16},
                         qformer_config={**small, "encoder_hidden_size": 32},
                         text_config={"model_type": "opt", "hidden_size": 32, "num_hidden_layers": 1,
                                      "num_attention_heads": 2, "ffn_dim": 64, "vocab_size": 256,
                                      "word_embed_proj_dim": 32},
                         num_query_tokens=4)
    with pytest.raises(UserError, match=r"its forward does not run on text alone \(.*'pixel_values'\); toolkit "
                                        r"traces an image-text model's language model through a text-only step"):
        api.estimate(build_spec("tiny-blip-2", config), "8xH100-80GB", strategy="zero3", seq_len=128)

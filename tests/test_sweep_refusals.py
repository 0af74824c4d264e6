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


def test_a_config_of_per_layer_attributes_is_read_layer_by_layer(tmp_path):
    # dots3-note's text config is heterogeneous (per_layer_config): a global read of num_attention_heads raises
    # transformers' AmbiguousGlobalPerLayerAttributeError, which the config check did on loading the folder.
    folder = _saved(tmp_path, "dots3_note_text", vocab_size=128, hidden_size=64, intermediate_size=128,
                    moe_intermediate_size=32, shared_experts_intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, n_routed_experts=4,
                    num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                    v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=8, sliding_window=16,
                    mlp_layer_types=["dense", "sparse"], layer_types=["indexed_attention", "sliding_attention"],
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    spec = api.model(folder)
    assert (spec.num_layers, spec.heads) == (2, 4)


def test_a_layer_list_counted_by_another_config_key_is_found(tmp_path):
    # LongCat-Flash's decoder layer holds two attention sub-layers: num_hidden_layers is 2 x num_layers, and
    # transformers' hidden_states recorder names num_layers (num_hidden_layers_key), the length of its layer list.
    folder = _saved(tmp_path, "longcat_flash", vocab_size=128, hidden_size=64, num_layers=3, num_attention_heads=4,
                    num_key_value_heads=4, ffn_hidden_size=128, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, moe_topk=2,
                    n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=32)
    spec = api.model(folder)
    assert (spec.num_layers, spec.params) == (3, 332_000)  # the meta build's own count
    # Its experts loop over the tokens routed to each (no grouped_mm path): refused for that, in one line.
    with pytest.raises(UserError, match=r"shapes that depend on the data \(aten\.nonzero"):
        api.estimate(folder, "8xH100-80GB", strategy="zero3", seq_len=32)


def test_a_sub_model_without_sdpa_keeps_transformers_default_attention(tmp_path):
    # Apertus-1.5's vision tokenizer has no sdpa: the traced build sets the asked attention on the language model
    # only, as transformers' own pick per sub-model leaves the tokenizer on eager.
    folder = _saved(tmp_path, "apertus1p5", image_token_id=10, audio_token_id=11, image_token_offset=100,
                    audio_token_offset=132, text_config={
                        "vocab_size": 4300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 4, "pad_token_id": 3},
                    vision_config={"codebook_size": 32, "embed_dim": 32, "latent_channels": 32, "base_channels": 32,
                                   "channel_multiplier": [1, 2], "num_res_blocks": 1, "attn_resolutions": [16],
                                   "resolution": 32})
    result = api.estimate(folder, "8xH100-80GB", strategy="zero3", seq_len=64)
    assert api.model(folder).params == 9_208_356
    assert result.memory.activations_bytes == 1_621_276


def test_rotary_sections_that_do_not_add_up_to_the_frequencies_are_refused_in_one_line(tmp_path):
    # GLM-4.1V's rotary falls back to mrope_section [8, 12, 12] (32 frequencies), which a real checkpoint's
    # head_dim 128 x partial_rotary_factor 0.5 fits; the default config's full rotary has 64 (here 16 / 2 = 8).
    text = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    folder = _saved(tmp_path / "default", "glm4v", text_config=text, vision_config=vision)
    with pytest.raises(UserError, match=r"splits 8 frequencies \(head_dim x partial_rotary_factor / 2\) into "
                                        r"mrope_section \[8, 12, 12\], which add up to 32; set rope_parameters'"):
        api.model(folder)
    fitted = _saved(tmp_path / "fitted", "glm4v", vision_config=vision, text_config={
        **text, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}})
    assert api.model(fitted).num_layers == 2


def test_an_image_text_model_whose_language_model_heads_do_not_divide_its_width_is_refused_in_one_line(tmp_path):
    # Qwen3-Omni's thinker derives its head width as hidden // heads (2048 // 28 = 73 by default), and its rotary
    # (74 wide) then misfits the queries in torch: the check on loading reads the text config too.
    folder = _saved(tmp_path, "qwen3_omni_moe_thinker", text_config={"hidden_size": 64, "num_attention_heads": 6,
                                                                     "num_key_value_heads": 2})
    with pytest.raises(UserError, match=r"config\.json \(text_config\): hidden size 64 does not divide by 6 attention "
                                        r"heads; fix the config\.json \(or give head_dim\)$"):
        api.model(folder)


def test_a_model_whose_loss_reserves_image_positions_is_refused_as_not_running_on_text_alone(tmp_path):
    # GIT's loss slices the image tokens' positions off the logits whether or not there are images, so on text
    # alone torch's cross-entropy finds fewer logits than labels (ValueError from torch, inside transformers' loss).
    folder = _saved(tmp_path, "git", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=128, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, vision_config={"hidden_size": 32, "intermediate_size": 64,
                                                   "num_hidden_layers": 1, "num_attention_heads": 2,
                                                   "image_size": 32, "patch_size": 16})
    with pytest.raises(UserError, match=r"its forward does not run on text alone \(modeling_git\.py:\d+: Expected "
                                        r"input batch_size \(58\) to match target batch_size \(63\)\.\)"):
        api.estimate(folder, "8xH100-80GB", strategy="zero3", seq_len=64)


def test_weights_built_in_fp32_whatever_the_dtype_are_traced_in_the_compute_dtype(tmp_path):
    # XLNet builds its attention weights with torch.FloatTensor (fp32 under any dtype); DeepSpeed casts every
    # parameter to bf16 (engine._cast_module_mixed_precision), so the trace does too when the forward mixes them
    # ("expected scalar type torch.bfloat16 but found torch.float32" in its einsum).
    folder = _saved(tmp_path, "xlnet", vocab_size=128, d_model=64, n_layer=2, n_head=4, d_inner=128,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    result = api.estimate(folder, "8xH100-80GB", strategy="zero3", seq_len=64)
    assert api.model(folder).params == 83_648
    assert result.memory.activations_bytes == 526_850


def test_a_head_width_the_config_names_attention_head_size_is_not_refused_as_indivisible(tmp_path):
    # Reformer's attention is heads x attention_head_size wide (768 by default, over a 256 hidden size with 12 heads):
    # the width does not come from hidden // heads, so 40 / 3 heads is no misfit.
    fields = dict(vocab_size=128, hidden_size=40, num_attention_heads=3, attention_head_size=16,
                  attn_layers=["local", "local"], feed_forward_size=64, axial_pos_shape=[8, 8],
                  axial_pos_embds_dim=[16, 24], max_position_embeddings=64, local_attn_chunk_length=16)
    decoder = _saved(tmp_path / "decoder", "reformer", is_decoder=True, **fields)
    assert (api.model(decoder).params, api.model(decoder).num_layers) == (42_224, 2)
    assert api.estimate(decoder, "8xH100-80GB", strategy="zero3", seq_len=64).memory.activations_bytes == 103_468
    # Its default config is an encoder (is_decoder false): refused as one, not for its head width.
    encoder = _saved(tmp_path / "encoder", "reformer", **fields)
    with pytest.raises(UserError, match=r"reformer is an encoder .*set \"is_decoder\": true"):
        api.model(encoder)


def test_a_layer_list_sized_by_a_second_count_the_config_copies_is_cut_with_it(tmp_path):
    # xLSTM sizes its block list from num_blocks, which its config copies from num_hidden_layers: the depth-reduced
    # trace cuts both (it built all 4 blocks under a 2-layer count before, refused as no list of 2 layers).
    folder = _saved(tmp_path, "xlstm", vocab_size=128, hidden_size=64, num_hidden_layers=4, num_heads=2)
    assert (api.model(folder).params, api.model(folder).num_layers) == (231_248, 4)
    assert api.estimate(folder, "8xH100-80GB", strategy="ddp", seq_len=64).memory.activations_bytes == 1_841_580
    assert api.estimate(folder, "8xH100-80GB", strategy="zero3", seq_len=64,
                        precision="fp32").memory.activations_bytes == 2_444_204
    # Its mLSTM kernel keeps a float32 state against bf16 weights (DeepSpeed's bf16 casts every parameter): refused
    # in one line naming what runs instead.
    with pytest.raises(UserError, match=r"its forward mixes dtypes with every weight in bfloat16 .*--precision fp32, "
                                        r"or with strategy ddp"):
        api.estimate(folder, "8xH100-80GB", strategy="zero3", seq_len=64)

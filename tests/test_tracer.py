"""The activation tracer against bytes measured on real tensors (CPU, tiny models of real architectures)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from toolkit.estimate.livebytes import measure_peaks, measure_saved_bytes, peak_step_bytes
from toolkit.run.tiny import tiny_config
from toolkit.estimate.tracer import trace_activations

TOLERANCE = 0.03


def _real_model(config, *, dtype: str, autocast: bool, attention: str, checkpointing: bool):
    """As the HF Trainer prepares it: train mode, no KV cache, checkpointing through the model's own method."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if autocast else getattr(torch, dtype),
                                             attn_implementation=attention)
    model.config.use_cache = False
    model.train()
    if checkpointing == "op":  # torchtitan's per-op selective policy as the checkpoint's context_fn
        from toolkit.estimate.selective import op_context_fn

        model.activation_checkpointing_enable({"use_reentrant": False, "context_fn": op_context_fn()})
    elif checkpointing:
        model.activation_checkpointing_enable()
    return model


def _measure(config, *, dtype: str, autocast: bool, attention: str, checkpointing: bool, micro_batch: int,
             seq_len: int):
    compute = getattr(torch, dtype)
    model = _real_model(config, dtype=dtype, autocast=autocast, attention=attention, checkpointing=checkpointing)
    ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
    measured, loss = measure_saved_bytes(model, {"input_ids": ids, "labels": ids},
                                         autocast_dtype=compute if autocast else None)
    loss.backward()
    return measured, ids.nbytes


def _trace(config, **kw):
    return trace_activations(config, device_kind=kw.pop("device_kind", "cpu"), **kw)


def _close(predicted: int, measured: int) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


CASES = [
    # arch, dtype, autocast, attention, checkpointing, micro_batch, seq_len
    ("llama", "float32", False, "eager", False, 2, 64),
    ("llama", "bfloat16", False, "sdpa", False, 1, 256),
    ("llama", "bfloat16", True, "sdpa", False, 4, 32),
    ("llama", "bfloat16", False, "sdpa", True, 2, 128),
    ("gpt2", "float32", False, "sdpa", False, 2, 64),
    ("gpt2", "bfloat16", True, "eager", True, 1, 128),
    ("gpt2", "bfloat16", False, "eager", False, 3, 64),
    ("opt", "bfloat16", False, "sdpa", False, 2, 128),
    ("opt", "float32", False, "eager", True, 2, 64),
    ("qwen2", "bfloat16", True, "eager", False, 2, 64),
    ("qwen2", "float32", False, "sdpa", True, 1, 64),
    ("gemma2", "float32", False, "eager", False, 2, 64),
    ("gemma2", "bfloat16", True, "eager", True, 1, 128),
    ("mistral", "bfloat16", False, "eager", False, 2, 128),
    ("mistral", "bfloat16", True, "sdpa", True, 4, 64),
    ("llama", "float16", False, "sdpa", False, 2, 64),
    ("gpt2", "float16", True, "sdpa", False, 2, 64),
    ("llama", "bfloat16", True, "sdpa", "op", 2, 64),
    ("qwen2", "float32", False, "sdpa", "op", 1, 64),
    ("mistral", "bfloat16", False, "eager", "op", 2, 64),
]


@pytest.mark.parametrize("arch,dtype,autocast,attention,checkpointing,micro_batch,seq_len", CASES)
def test_traced_activations_match_real_tensors(arch, dtype, autocast, attention, checkpointing, micro_batch,
                                               seq_len):
    config = tiny_config(arch, layers=2, hidden=64, vocab_size=512)
    kw = dict(dtype=dtype, autocast=autocast, attention=attention, checkpointing=checkpointing,
              micro_batch=micro_batch, seq_len=seq_len)
    trace = _trace(config, **kw)
    measured, batch_bytes = _measure(config, **kw)
    # Everything alive after forward + loss: saved tensors (the batch's token ids among them, which the
    # measurement counts as an input), autocast weight copies, the loss, what a checkpoint's closure holds.
    predicted_live = trace.activations_bytes + trace.autocast_copy_bytes + trace.loss_bytes
    assert _close(predicted_live, measured.live_bytes + batch_bytes), (predicted_live, measured)
    assert trace.autocast_copy_bytes == measured.autocast_copy_bytes
    if not checkpointing:  # a non-reentrant checkpoint holds its keyword inputs outside autograd's saved tensors
        assert _close(trace.activations_bytes, measured.saved_bytes), (trace.activations_bytes, measured)


def test_regions_match_real_tensors_layer_by_layer():
    config = tiny_config("llama", layers=2, hidden=64)
    trace = _trace(config, dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False,
                   micro_batch=2, seq_len=64)
    measured, _ = _measure(config, dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False,
                           micro_batch=2, seq_len=64)
    assert [r.saved_bytes for r in trace.layers] == [measured.by_region["layer0"], measured.by_region["layer1"]]
    assert trace.head.saved_bytes == measured.by_region["head"]


@pytest.mark.parametrize("arch,attention", [("llama", "sdpa"), ("gemma2", "eager")])
def test_reduced_trace_expands_exactly_to_six_layers(arch, attention):
    config = tiny_config(arch, layers=6, hidden=64)
    kw = dict(dtype="bfloat16", autocast=False, attention=attention, checkpointing=False, micro_batch=2,
              seq_len=64)
    trace = _trace(config, **kw)
    measured, _ = _measure(config, **kw)
    assert len(trace.layers) == 6
    assert trace.activations_bytes == measured.saved_bytes
    assert [r.saved_bytes for r in trace.layers] == [measured.by_region[f"layer{i}"] for i in range(6)]


# Architectures the tracer has no knowledge of: MLA attention with a dense first layer then MoE (deepseek_v3),
# MoE every other layer with a shared expert (qwen2_moe), 5 sliding-window layers per global one (gemma3).
UNSEEN = {
    "deepseek_v3": dict(num_hidden_layers=6, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1),
    "qwen2_moe": dict(num_hidden_layers=7, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2),
    "gemma3_text": dict(num_hidden_layers=13, head_dim=16, sliding_window=32, query_pre_attn_scalar=16),
}


@pytest.mark.parametrize("arch", sorted(UNSEEN))
def test_unseen_architectures_expand_exactly(arch):
    config = AutoConfig.for_model(arch, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=128, vocab_size=512, max_position_embeddings=256,
                                  bos_token_id=0, eos_token_id=0, pad_token_id=0, **UNSEEN[arch])
    kw = dict(dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False, micro_batch=2, seq_len=64)
    trace = _trace(config, **kw)
    measured, _ = _measure(config, **kw)
    # Real MoE runs vary by a few hundred bytes a layer with the routing (tensors sized by the experts hit).
    for i, layer in enumerate(trace.layers):
        assert _close(layer.saved_bytes, measured.by_region[f"layer{i}"]), (i, layer, measured.by_region)
    assert _close(trace.activations_bytes, measured.saved_bytes)


def test_checkpointed_expansion_to_six_layers_matches_live_bytes():
    config = tiny_config("llama", layers=6, hidden=64)
    kw = dict(dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=True, micro_batch=2, seq_len=64)
    trace = _trace(config, **kw)
    measured, batch_bytes = _measure(config, **kw)
    assert trace.activations_bytes + trace.loss_bytes == measured.live_bytes + batch_bytes


def test_first_layer_is_charged_the_shared_rotary_tables_once():
    config = tiny_config("llama", layers=4, hidden=64)
    trace = _trace(config, dtype="float32", autocast=False, attention="sdpa", checkpointing=False,
                   micro_batch=1, seq_len=64)
    head_dim = 64 // 4
    assert trace.layers[0].saved_bytes - trace.layers[1].saved_bytes == 2 * 64 * head_dim * 4  # cos and sin
    assert trace.layers[1] == trace.layers[2] == trace.layers[3]


def test_mixtral_experts_trace_matches_real_tensors():
    config = tiny_config("mixtral", layers=2, hidden=64)
    kw = dict(dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False, micro_batch=2, seq_len=64)
    trace = _trace(config, **kw)
    measured, _ = _measure(config, **kw)
    assert _close(trace.activations_bytes, measured.saved_bytes)


def test_eager_attention_without_dropout_is_the_same_on_cpu_and_cuda():
    config = tiny_config("llama", layers=2, hidden=64)
    kw = dict(dtype="bfloat16", autocast=False, attention="eager", checkpointing=False, micro_batch=2, seq_len=64)
    cpu, cuda = _trace(config, device_kind="cpu", **kw).layers, _trace(config, device_kind="cuda", **kw).layers
    assert _on_device(cpu) == _on_device(cuda)
    assert all(0 < g.offload_bytes <= c.offload_bytes for c, g in zip(cpu, cuda))  # a GPU moves a storage once


def _on_device(layers):
    """The regions without what TRL's offloading would move, which is the one figure that depends on the device: on
    CPU every save is copied, on a GPU a storage already moved is not (toolkit.patches.actoffload.OffloadRule)."""
    from dataclasses import replace

    return [replace(r, offload_bytes=0) for r in layers]


def test_cuda_attention_stand_ins_match_cpu_flash_kernel_without_dropout():
    # CPU SDPA without dropout runs a flash kernel that saves what the CUDA kernels save.
    config = tiny_config("llama", layers=2, hidden=64)
    for autocast in (False, True):
        kw = dict(dtype="bfloat16", autocast=autocast, checkpointing=False, micro_batch=2, seq_len=64)
        cpu = _bytes(_trace(config, attention="sdpa", device_kind="cpu", **kw).layers)
        assert cpu == _bytes(_trace(config, attention="sdpa", device_kind="cuda", **kw).layers)
        assert cpu == _bytes(_trace(config, attention="flash_attention_2", device_kind="cuda", **kw).layers)


def _bytes(layers):
    """The regions' byte figures on the device without their allocation events and their count of dispatched
    operations (a stand-in saves what the kernel saves, in its own order of temporaries and its own operations)."""
    from dataclasses import replace

    return [replace(r, forward_events=(), backward_events=(), host_ops=0) for r in _on_device(layers)]


def test_cuda_autocast_keeps_softmax_and_gelu_in_float32():
    config = tiny_config("gpt2", layers=2, hidden=64, heads=4, ffn=128, attn_pdrop=0.0, embd_pdrop=0.0,
                         resid_pdrop=0.0)
    kw = dict(dtype="bfloat16", autocast=True, attention="eager", checkpointing=False, micro_batch=2, seq_len=64)
    cpu, cuda = _trace(config, device_kind="cpu", **kw), _trace(config, device_kind="cuda", **kw)
    softmax_probs = 2 * 4 * 64 * 64  # batch x heads x seq x seq
    gelu_tanh = 2 * 64 * 128  # batch x seq x ffn
    # 2 more bytes per element for each: float32 on CUDA, bfloat16 under CPU autocast
    assert cuda.layers[1].saved_bytes - cpu.layers[1].saved_bytes == 2 * (softmax_probs + gelu_tanh)


def test_cuda_sdpa_keeps_no_seq_by_seq_tensor_even_with_dropout():
    config = tiny_config("gpt2", layers=2, hidden=64, max_positions=512)  # dropout 0.1 everywhere

    def layer_bytes(seq_len, device_kind):
        trace = _trace(config, dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False,
                       micro_batch=1, seq_len=seq_len, device_kind=device_kind)
        return trace.layers[1].saved_bytes, trace.notes

    (short, notes), (long, _) = layer_bytes(128, "cuda"), layer_bytes(256, "cuda")
    assert long == 2 * short
    assert any(n.startswith("sdpa: CUDA") for n in notes)
    cpu_short, cpu_long = layer_bytes(128, "cpu")[0], layer_bytes(256, "cpu")[0]
    assert cpu_long > 2 * cpu_short  # CPU's math fallback keeps seq x seq tensors


def test_cuda_sdpa_with_a_mask_keeps_the_efficient_kernels_bias_in_every_layer():
    """A masked SDPA call (Mistral's sliding window shorter than the sequence) runs CUDA's memory-efficient kernel,
    which saves the boolean mask made additive in the query's dtype, a new tensor each call, its last dimension
    padded to a multiple of 8 (PyTorch attention.cpp convert_boolean_attn_mask, preprocess_mask): b x L x ceil8(L)
    x 2 bytes more in each layer than the unmasked call; CPU's flash kernel keeps the same bias unpadded."""
    def layer_bytes(window, seq_len, device_kind):
        config = tiny_config("mistral", layers=2, hidden=64, heads=4, kv_heads=4, sliding_window=window,
                             max_positions=512)
        trace = _trace(config, dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False,
                       micro_batch=2, seq_len=seq_len, device_kind=device_kind)
        return trace.layers[1].saved_bytes, trace.notes

    for seq_len, padded in ((64, 64), (60, 64)):
        (masked, notes), (causal, _) = layer_bytes(32, seq_len, "cuda"), layer_bytes(None, seq_len, "cuda")
        assert masked - causal == 2 * seq_len * padded * 2
        assert any(n.startswith("sdpa with an explicit mask: CUDA") for n in notes)
        assert layer_bytes(32, seq_len, "cpu")[0] - causal == 2 * seq_len * seq_len * 2


def test_cuda_dropout_masks_take_one_byte_per_element():
    config = tiny_config("gpt2", layers=2, hidden=64, attn_pdrop=0.0, embd_pdrop=0.0)  # dropout after MLP only
    kw = dict(dtype="float32", autocast=False, attention="eager", checkpointing=False, micro_batch=1, seq_len=64)
    cpu, cuda = _trace(config, device_kind="cpu", **kw), _trace(config, device_kind="cuda", **kw)
    # resid dropout after attention and after the MLP: 2 masks of seq x hidden per layer, 4 bytes -> 1 byte
    assert cpu.layers[1].saved_bytes - cuda.layers[1].saved_bytes == 2 * 64 * 64 * 3
    assert any(n.startswith("dropout: CUDA") for n in cuda.notes)


def test_flash_attention_keeps_grouped_kv_unrepeated_and_linear_in_seq():
    config = tiny_config("llama", layers=2, hidden=64, heads=4, kv_heads=1, max_positions=512)
    kw = dict(dtype="bfloat16", autocast=False, checkpointing=False, micro_batch=1)
    flash = [_trace(config, attention="flash_attention_2", seq_len=s, **kw).layers[1].saved_bytes
             for s in (128, 256)]
    assert flash[1] == 2 * flash[0]
    with pytest.raises(ValueError, match="flash_attention_2"):
        _trace(config, attention="flash_attention_2", seq_len=64, **{**kw, "dtype": "float32"})


def test_checkpointing_keeps_only_layer_inputs():
    config = tiny_config("llama", layers=4, hidden=64)
    trace = _trace(config, dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=True, micro_batch=2,
                   seq_len=64)
    assert trace.layers[2].saved_bytes == 2 * 64 * 64 * 2  # hidden states in, bf16
    assert trace.layers[2].backward_extra_bytes > trace.layers[2].saved_bytes  # the recompute


def test_output_bytes_are_the_logits():
    config = tiny_config("llama", layers=2, hidden=64, vocab_size=1000)
    trace = _trace(config, dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False, micro_batch=2,
                   seq_len=32)
    assert trace.output_bytes == 2 * 32 * 1000 * 2
    assert trace.loss_bytes == 4


def test_real_training_step_peak_is_measured():
    model = AutoModelForCausalLM.from_config(tiny_config("llama", layers=2, hidden=64))
    ids = torch.randint(0, 512, (2, 32))
    peak = peak_step_bytes(model, {"input_ids": ids, "labels": ids})
    param_bytes = sum(p.nbytes for p in model.parameters())
    assert peak["total"] >= 4 * param_bytes  # weights, gradients, two AdamW moments


def test_llama_3_70b_shaped_trace_at_8k_completes():
    config = AutoConfig.for_model("llama", hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                                  num_key_value_heads=8, num_hidden_layers=80, vocab_size=128256,
                                  max_position_embeddings=8192)
    trace = trace_activations(config, seq_len=8192, micro_batch=1, dtype="bfloat16", autocast=False,
                              attention="flash_attention_2", device_kind="cuda", checkpointing=True)
    assert len(trace.layers) == 80
    assert trace.layers[1].saved_bytes == 8192 * 8192 * 2


@pytest.mark.parametrize("arch,dtype,autocast,attention,checkpointing", [
    ("llama", "float32", False, "sdpa", False),
    ("gpt2", "bfloat16", False, "eager", False),
    ("qwen2", "bfloat16", True, "sdpa", False),
    ("llama", "bfloat16", False, "sdpa", True),
    ("gemma2", "bfloat16", True, "eager", True),
    ("llama", "bfloat16", True, "sdpa", True),
])
def test_composed_peaks_match_real_tensors(arch, dtype, autocast, attention, checkpointing):
    # As toolkit.estimate.memory composes them: everything saved so far, plus the region's extra.
    config = tiny_config(arch, layers=3, hidden=64, vocab_size=1000)  # traced with 2, expanded to 3
    kw = dict(dtype=dtype, autocast=autocast, attention=attention, checkpointing=checkpointing, micro_batch=2,
              seq_len=128)
    trace = _trace(config, **kw)
    compute = getattr(torch, dtype)
    model = _real_model(config, dtype=dtype, autocast=autocast, attention=attention, checkpointing=checkpointing)
    ids = torch.randint(0, 1000, (2, 128))
    real = measure_peaks(model, {"input_ids": ids, "labels": ids}, autocast_dtype=compute if autocast else None)
    held = cached = 0
    composed = []
    for region in (trace.embedding, *trace.layers, trace.head):
        held += region.saved_bytes + region.autocast_copy_bytes
        cached += region.autocast_cache_bytes  # autocast's cache, until the forward ends
        composed.append((held + cached + region.forward_extra_bytes, held + region.backward_extra_bytes))
    for (forward, backward), measured in zip(composed[1:-1], real.layers):
        assert _close(forward, measured.forward_peak_bytes), (composed, measured)
        assert _close(backward, measured.backward_peak_bytes), (composed, measured)
    assert _close(max(f for f, _ in composed), real.forward_peak_bytes)
    if not checkpointing:  # MemTracker's whole-model backward peak misses the layers' recompute
        assert _close(max(b for _, b in composed), real.backward_peak_bytes)


def test_moe_with_data_dependent_expert_loops_is_refused_clearly():
    config = tiny_config("mixtral", layers=2, hidden=64)
    config._experts_implementation = "eager"  # a Python loop over the tokens routed to each expert
    with pytest.raises(NotImplementedError, match="depend on the data"):
        _trace(config, dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False, micro_batch=1,
               seq_len=32)


def test_the_callers_config_is_left_unchanged():
    config = tiny_config("gemma2", layers=6, hidden=64)
    before = config.to_dict()
    _trace(config, dtype="bfloat16", autocast=False, attention="eager", checkpointing=True, micro_batch=1,
           seq_len=32)
    assert config.to_dict() == before


def test_the_op_policy_keeps_every_other_matmul_and_the_cuda_attention_kernels_outputs():
    # torchtitan's per-op policy on the GPU kernels: a Llama layer keeps, beyond a full checkpoint's inputs, the 1st,
    # 3rd, 5th and 7th matmul outputs (q, v, gate, down) and the attention kernel's output and fp32 logsumexp.
    config = tiny_config("llama", layers=2, hidden=64, vocab_size=512)
    kw = dict(seq_len=128, micro_batch=2, dtype="bfloat16", device_kind="cuda")
    op = trace_activations(config, checkpointing="op", **kw)
    full = trace_activations(config, checkpointing=True, **kw)
    tokens, heads, head_dim = 2 * 128, config.num_attention_heads, config.hidden_size // config.num_attention_heads
    kept = tokens * (heads * head_dim + config.num_key_value_heads * head_dim + config.intermediate_size
                     + config.hidden_size) * 2
    attention = tokens * heads * head_dim * 2 + 2 * heads * 128 * 4
    assert op.layers[1].saved_bytes - full.layers[1].saved_bytes == kept + attention


def test_a_traces_cache_entry_is_the_json_of_asdict_and_reads_back_equal():
    """toolkit.estimate.traces stores a trace without dataclasses.asdict's int-by-int copy of the event tuples:
    the stored JSON must stay what asdict gave (entries written before still read) and read back to the trace."""
    import json
    from dataclasses import asdict

    from toolkit.estimate.traces import trace_from_dict, trace_to_dict

    config = tiny_config("llama", layers=2, hidden=64)
    trace = _trace(config, dtype="bfloat16", autocast=False, attention="sdpa", checkpointing=False, micro_batch=2,
                   seq_len=32)
    assert trace.layers[0].forward_events and trace.layers[0].backward_events
    stored = json.dumps(trace_to_dict(trace))
    assert stored == json.dumps(asdict(trace))
    assert trace_from_dict(json.loads(stored)) == trace


def test_layer_kinds_and_tensor_sizes_read_one_meta_build_per_config():
    import copy

    from toolkit.estimate.layerkinds import full_meta_model, layer_kinds_of_full_model, region_tensor_numels
    from toolkit.inputs.modelspec import spec_from_config_dict

    config = tiny_config("llama", layers=3, hidden=64, vocab_size=1000)
    model = full_meta_model(config)
    assert full_meta_model(copy.deepcopy(config)) is model  # keyed by the config's JSON, not its identity
    assert layer_kinds_of_full_model(config) == (0, 0, 0)
    spec = spec_from_config_dict(config.to_dict(), name="tiny-llama-kinds")
    pre, layers, post = region_tensor_numels(spec)
    assert pre[0] == 1000 * 64 and len(layers) == 3  # the embedding, then each layer's tensors
    assert sum(pre) + sum(map(sum, layers)) + sum(post) == sum(p.numel() for p in model.parameters())
    assert full_meta_model(tiny_config("llama", layers=2, hidden=64)) is not model

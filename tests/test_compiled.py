"""The compiled step's saved tensors, traced under FakeTensorMode with inductor's partition, against a real
torch.compile'd step on CPU (inductor's C++ backend; compiled artifacts are cached in torch's inductor cache)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from toolkit.compiled import compiled_saved_bytes, trace_compiled_activations
from toolkit.livebytes import measure_compiled_saved_bytes
from toolkit.tiny import tiny_config
from toolkit.tracer import trace_activations

TOLERANCE = 0.05


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_traced_compiled_activations_match_a_real_compiled_step(arch):
    config = tiny_config(arch, layers=2, hidden=64, vocab_size=512)
    config.use_cache = False
    traced = trace_compiled_activations(config, seq_len=64, micro_batch=2, dtype="float32", attention="sdpa",
                                        device_kind="cpu")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").train()
    ids = torch.randint(0, 512, (2, 64))
    measured, rows = measure_compiled_saved_bytes(model, {"input_ids": ids, "labels": ids})
    assert abs(traced.activations_bytes - measured) <= TOLERANCE * measured, (traced.activations_bytes, rows)
    eager = trace_activations(config, seq_len=64, micro_batch=2, dtype="float32", attention="sdpa",
                              device_kind="cpu")
    assert traced.activations_bytes != eager.activations_bytes  # the partition keeps other tensors than eager


def test_cuda_compile_keeps_the_efficient_kernels_logsumexp_and_no_seq_by_seq_score():
    config = tiny_config("llama", layers=2, hidden=64, vocab_size=512)
    notes: list = []
    saved = compiled_saved_bytes(config, seq_len=128, micro_batch=1, dtype="bfloat16", device_kind="cuda",
                                 notes=notes)
    assert any("efficient" in n for n in notes)
    layer = [r for r in saved.saved if r[0] == "layer1"]
    # logsumexp (b, h, s) in fp32; the only s x s tensor is the bias the compiled path's mask becomes
    assert (("layer1", (1, 4, 128), "float32", 4 * 128 * 4) in layer)
    assert sum(1 for r in layer if r[1][-2:] == (128, 128)) <= 1

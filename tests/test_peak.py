"""Whole-step peak of a single process (fused AdamW, steady state) predicted within 5% of what real CPU tensors
reach, and activations within 3%, for small real models of several architectures and precisions."""

from __future__ import annotations

import pytest

from toolkit.estimate.profile import measure_step, predict_step
from toolkit.run.tiny import tiny_config

CASES = [
    ("gpt2", "fp32", False, dict(hidden=128, layers=3, heads=4, ffn=512)),
    ("llama", "bf16", False, dict(hidden=128, layers=3, heads=4, kv_heads=2, ffn=344)),
    ("qwen2", "bf16-pure", True, dict(hidden=128, layers=3, heads=4, kv_heads=2, ffn=344)),
    ("opt", "bf16", True, dict(hidden=128, layers=3, heads=4, ffn=512)),
]


@pytest.mark.parametrize("arch, precision, checkpointing, shape", CASES,
                         ids=[f"{a}-{p}-{'ckpt' if c else 'full'}" for a, p, c, _ in CASES])
def test_single_process_peak_within_5_percent_of_measured(arch, precision, checkpointing, shape):
    config = tiny_config(arch, vocab_size=1000, max_positions=256, **shape)
    kwargs = dict(seq_len=128, micro_batch=2, precision=precision, checkpointing=checkpointing)
    measured = measure_step(config, steps=1, **kwargs)
    predicted = predict_step(config, device_kind="cpu", **kwargs)
    assert predicted["activations_bytes"] == pytest.approx(measured.activations_bytes, rel=0.03)
    assert predicted["peak_bytes"] == pytest.approx(measured.peak_bytes, rel=0.05)

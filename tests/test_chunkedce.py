"""torchtune's chunked cross-entropy (estimate --chunked-loss): the patched model's loss and gradients against the
model's own loss, the traced bytes and the whole-step peak against a real CPU step of the patched model, and the
refusals."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from toolkit.cli import main
from toolkit.patches.chunkedce import chunked_ce_applied
from toolkit.estimate.livebytes import measure_saved_bytes
from toolkit.estimate.profile import _batch, _dtype, build_model
from toolkit.estimate.tracer import trace_activations
from toolkit.run.tiny import tiny_config


def test_chunked_loss_equals_the_models_own_loss_and_gradients():
    config = tiny_config("llama", layers=2, hidden=64, vocab_size=512)
    ref, patched = (build_model(config, "fp32", "sdpa", False, "cpu") for _ in range(2))
    batch = _batch(config, 2, 64, "cpu")
    ref(**batch).loss.backward()
    with chunked_ce_applied(patched, 8):
        out = patched(**batch)
        assert len(out.logits) == 8 and out.logits[0].shape == (2, 8, 512)
        out.loss.backward()
    torch.testing.assert_close(out.loss, ref(**batch).loss)
    for (name, p), q in zip(ref.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("precision", ["bf16-pure", "bf16"])
def test_traced_bytes_and_step_peak_with_chunked_loss_match_a_real_cpu_step(precision):
    # A vocabulary large enough that the logits and their fp32 copies lead the peak: chunking must lower it, and
    # the estimate (trace + memory model) must follow the real step's MemTracker peak.
    from toolkit.estimate.livebytes import steady_step_peak
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    config = tiny_config("llama", vocab_size=16000, max_positions=256, hidden=128, layers=3, heads=4, kv_heads=2,
                         ffn=344)
    model = build_model(config, precision, "sdpa", False, "cpu")
    batch = _batch(config, 2, 128, "cpu")
    amp = _dtype(precision)
    with chunked_ce_applied(model, 8):
        measured = steady_step_peak(model, batch, autocast_dtype=amp)
        measured_saved, loss = measure_saved_bytes(model, batch, autocast_dtype=amp)
        del loss
    spec = build_spec("llama", config)

    def estimate(chunks: int):
        job = Job(seq_len=128, micro_batch=2, precision=precision, device_kind="cpu", chunked_loss=chunks)
        return estimate_memory(spec, parse_strategy("ddp"), job, parse_hardware("1xH200"))

    predicted, whole = estimate(8), estimate(0)
    assert predicted.peak_bytes == pytest.approx(measured, rel=0.01), (predicted.peak_phase, measured)
    assert predicted.peak_bytes < whole.peak_bytes
    trace = trace_activations(config, seq_len=128, micro_batch=2, dtype="bfloat16", autocast=precision == "bf16",
                              device_kind="cpu", chunked_loss=8)
    assert trace.activations_bytes == measured_saved.saved_bytes
    assert any("chunked cross-entropy" in n for n in trace.notes)


@pytest.mark.parametrize("extra,words", [(["--liger"], "--liger"), (["--compile"], "--compile-blocks"),
                                         (["--seq", "max"], "--seq max")])
def test_chunked_loss_refusals_are_one_line(capsys, extra, words):
    argv = ["estimate", "tinyllama-1.1b", "--gpus", "1xH100-80GB", "--chunked-loss", "8", *extra]
    if "--seq" not in extra:
        argv += ["--seq", "512"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err

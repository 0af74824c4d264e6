"""TRL's chunked NLL (estimate / plan --loss trl): TRL's own fused LM head on the model gives the model's own loss
and gradients, its traced bytes and whole-step peak equal a real CPU step of the same patched model (with and
without Liger's layer kernels), it lowers the peak against the whole-logits loss at a large vocabulary, plans carry
and emit it, toolkit.train and the rehearsal run it, and the refusals are one line."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from toolkit.cli import main
from toolkit.estimate.livebytes import measure_saved_bytes
from toolkit.estimate.profile import _batch, _dtype, build_model
from toolkit.estimate.tracer import trace_activations
from toolkit.patches.trlloss import trl_loss_applied
from toolkit.run.tiny import tiny_config


def test_trl_loss_equals_the_models_own_loss_and_gradients_and_unpatches():
    config = tiny_config("llama", layers=2, hidden=64, vocab_size=512)
    ref, patched = (build_model(config, "fp32", "sdpa", False, "cpu") for _ in range(2))
    batch = _batch(config, 2, 64, "cpu")
    ref(**batch).loss.backward()
    with trl_loss_applied(patched):
        out = patched(**batch)
        assert out.logits[0].shape == (2, 63)  # per-token log-probs, never (batch, seq, vocab) logits
        out.loss.backward()
    assert "forward" not in patched.__dict__
    torch.testing.assert_close(out.loss, ref(**batch).loss)
    for (name, p), q in zip(ref.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def _memory(config, precision, loss, device_kind="cpu", seq=128, micro_batch=2, name="llama", liger=False):
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    job = Job(seq_len=seq, micro_batch=micro_batch, precision=precision, device_kind=device_kind, loss=loss,
              liger=liger)
    return estimate_memory(build_spec(name, config), parse_strategy("ddp"), job, parse_hardware("1xH200"))


@pytest.mark.parametrize("precision,liger", [("bf16-pure", False), ("bf16", False), ("bf16", True)])
def test_traced_bytes_and_step_peak_with_trl_loss_match_a_real_cpu_step(precision, liger):
    # More than 4096 tokens, so the kernel runs two token chunks through its one tile buffer, and a vocabulary
    # above 32768, so each token chunk runs two vocabulary tiles, the second one partial. With Liger: its layer
    # kernels under TRL's head, as SFTTrainer runs use_liger_kernel (Liger's fused cross-entropy never runs).
    import contextlib

    from toolkit.estimate.livebytes import steady_step_peak
    from toolkit.patches.liger import liger_applied

    config = tiny_config("llama", vocab_size=40000, max_positions=4096, hidden=64, layers=2, heads=4, kv_heads=2,
                         ffn=128)
    model = build_model(config, precision, "sdpa", False, "cpu")
    batch = _batch(config, 2, 2100, "cpu")
    amp = _dtype(precision)
    with liger_applied(model) if liger else contextlib.nullcontext(), trl_loss_applied(model):
        measured = steady_step_peak(model, batch, autocast_dtype=amp)
        measured_saved, loss = measure_saved_bytes(model, batch, autocast_dtype=amp)
        del loss
    predicted = _memory(config, precision, "trl", seq=2100, liger=liger)
    assert predicted.peak_bytes == pytest.approx(measured, rel=0.01), (predicted.peak_phase, measured)
    trace = trace_activations(config, seq_len=2100, micro_batch=2, dtype="bfloat16", autocast=precision == "bf16",
                              device_kind="cpu", loss="trl", liger=liger)
    assert trace.activations_bytes == measured_saved.saved_bytes
    assert any("TRL's chunked NLL" in n for n in trace.notes)


def test_trl_loss_lowers_the_peak_at_a_large_vocabulary():
    # Qwen-sized vocabulary on a small body: the whole-logits loss's (tokens, vocab) logits, their fp32 copy and
    # gradient lead its peak; TRL's tiles are 4096 x 32768 whatever the vocabulary.
    config = tiny_config("llama", vocab_size=151936, max_positions=8192, hidden=256, layers=2, heads=4, kv_heads=2,
                         ffn=512)
    for device_kind in ("cuda", "cpu"):
        whole = _memory(config, "bf16", "model", device_kind=device_kind, seq=8192, micro_batch=1)
        trl = _memory(config, "bf16", "trl", device_kind=device_kind, seq=8192, micro_batch=1)
        assert trl.peak_bytes < 0.5 * whole.peak_bytes, (device_kind, trl.peak_bytes, whole.peak_bytes)


@pytest.mark.parametrize("extra,words", [(["--tiled"], "--tiled"), (["--chunked-loss", "8"], "--chunked-loss"),
                                         (["--compile"], "--compile"), (["--seq", "max"], "--seq max"),
                                         (["--method", "dpo"], "always run their chunked")])
def test_trl_loss_refusals_are_one_line(capsys, extra, words):
    argv = ["estimate", "tinyllama-1.1b", "--gpus", "1xH100-80GB", "--loss", "trl", *extra]
    if "--seq" not in extra:
        argv += ["--seq", "512"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_plan_carries_trl_loss_emits_it_and_its_prediction_is_reproduced():
    from toolkit.emit.user_settings import notes, sft_config
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import plan_candidates, predict_plan, to_plan
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.modelspec import resolve_model

    spec = resolve_model("qwen2.5-0.5b")  # a 151,936-token vocabulary on a small body
    hw = parse_hardware("2xA100-80GB")
    strategies = ("zero2", "pipeline")
    plain = {c.strategy.name: c for c in plan_candidates(spec, hw, Request(seq_len=4096, global_batch=8,
                                                                           strategies=strategies))}
    trl = {c.strategy.name: c for c in plan_candidates(spec, hw, Request(seq_len=4096, global_batch=8,
                                                                         strategies=strategies, loss="trl"))}
    assert "pipeline stages" in trl["pipeline"].reason  # the pipeline engine runs its own stages, not TRL's head
    chosen, before = trl["zero2"], plain["zero2"]
    assert chosen.job.loss == "trl" and chosen.memory.peak_bytes < before.memory.peak_bytes
    assert chosen.timing.unmodelled == ("trl loss",) and before.timing.unmodelled == ()  # the head recompute
    plan = to_plan(chosen, spec, hw, "qwen2.5-0.5b")
    assert plan.loss == "trl" and not plan.prediction_is_stale and '"loss": "trl"' in plan.to_json()
    assert predict_plan(plan).predicted["peak_bytes"] == plan.predicted["peak_bytes"]
    assert predict_plan(plan.replace(loss="model")).predicted["peak_bytes"] > plan.predicted["peak_bytes"]
    assert sft_config(plan)["loss_type"] == "nll" and "loss_type" not in sft_config(plan.replace(loss="model"))
    assert any("TRL's chunked NLL" in n for n in notes(plan))
    assert '"loss"' not in plan.replace(loss="model").to_json()  # left out at its default: older plans read as before


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_toolkit_train_runs_trls_head_with_the_models_own_losses(run_training, tiny_llama_dir, corpus_dir):
    # One CPU process, fp32: the plan with loss trl trains through TRL's own fused head (the banner says it was
    # applied) and logs the losses the model's own whole-logits loss gives, step by step.
    from toolkit.run.rehearsal import plan_for_model

    common = ("--data", str(corpus_dir), "--max-steps", "3", "--logging-steps", "1", "--save-steps", "100",
              "--lr", "3e-3", "--lr-scheduler", "constant", "--seed", "7", "--eval-fraction", "0", "--no-save-final")
    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=2, seq_len=32, precision="fp32")
    own = run_training(plan, "loss-model", *common).check()
    trl = run_training(plan.replace(loss="trl"), "loss-trl", *common).check()
    assert "TRL's chunked NLL" in trl.stdout and "TRL's chunked NLL" not in own.stdout
    assert len(own.losses()) == 3
    assert trl.losses() == pytest.approx(own.losses(), abs=1e-4)



def test_a_trl_loss_plan_is_rehearsed_with_trls_head(tiny_llama_dir):
    from toolkit.run.rehearsal import plan_for_model, rehearsal_plan

    plan = plan_for_model(tiny_llama_dir, "zero2", gpus_per_node=2, seq_len=64).replace(loss="trl")
    small, _ = rehearsal_plan(plan, tiny_llama_dir)
    assert small.loss == "trl" and rehearsal_plan(plan.replace(loss="model"), tiny_llama_dir)[0].loss == "model"

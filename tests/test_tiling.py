"""ALST tiling (--tiled): DeepSpeed's TiledMLP and the logits + loss through its sequence_tiled_compute, applied by
toolkit.patches.tiling, traced by the tracer and run by toolkit.train (the multi-process run with Ulysses SP is in
tests/test_train_dimensions.py; per-rank memory against live tensors in benchmarks/results/dimension_memory.md)."""

from __future__ import annotations

import copy

import pytest
import torch

from toolkit.run.tiny import tiny_config


@pytest.fixture(scope="module")
def config():
    return tiny_config("llama", layers=2, hidden=64)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tiled_model_has_the_plain_models_loss_and_gradients(family):
    """Same loss and every parameter's gradient within fp32 rounding, with labels masked in part (chunks of
    different labelled counts) and a micro-batch of 2 (strided chunks: GPT-2's Conv1D views its input, and failed on
    them before the chunk went in contiguous)."""
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if family == "gpt2" else {}
    config = tiny_config(family, layers=2, hidden=64, **no_dropout)
    from transformers import AutoModelForCausalLM

    from toolkit.patches.tiling import LAST_CHUNKS, apply_tiling

    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    tiled = copy.deepcopy(plain)
    apply_tiling(tiled)
    ids = torch.randint(0, config.vocab_size, (2, 256))
    labels = ids.clone()
    labels[0, :100] = -100
    for model in (plain, tiled):
        model(input_ids=ids, labels=labels).loss.backward()
    assert LAST_CHUNKS == {"mlp": 4, "loss": 1}  # ceil(256 / 64); 2 x 256 x 512 fp32 logits << 1 GiB
    torch.testing.assert_close(tiled(input_ids=ids, labels=labels).loss, plain(input_ids=ids, labels=labels).loss)
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_traced_tiling_keeps_the_mlp_input_and_no_logits(config):
    """Tiled, a layer saves less (the MLP's FFN-wide tensors are recomputed per chunk), the head keeps the hidden
    states instead of the fp32 log-softmax, and no whole-sequence logits come out."""
    from toolkit.estimate.tracer import trace_activations

    plain = trace_activations(config, seq_len=1024, dtype="float32")
    tiled = trace_activations(config, seq_len=1024, dtype="float32", tiled=True)
    hidden = 1024 * config.hidden_size * 4
    logits = 1024 * config.vocab_size * 4
    assert tiled.layers[0].saved_bytes < plain.layers[0].saved_bytes - 1024 * config.intermediate_size * 4
    assert tiled.head.saved_bytes < plain.head.saved_bytes - logits
    assert tiled.head.saved_bytes >= hidden  # SequenceTiledCompute keeps its input for the backward recompute
    assert plain.output_bytes == logits and tiled.output_bytes == 0
    assert any("MLP in 16 chunks" in n for n in tiled.notes)


def test_tiled_estimate_fits_longer_and_pays_the_recompute(capsys):
    """Llama-3.1-8B, ZeRO-3 x SP 8 at 131072 tokens: --tiled lowers the peak and adds the MLPs' and LM head's
    recompute to the step; --explain names the terms."""
    import json

    from toolkit.cli import main

    argv = ["estimate", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--strategy", "zero3", "--sequence-parallel", "8",
            "--seq", "131072", "--micro-batch", "1", "--checkpointing", "--json"]
    out = {}
    for tiled in (False, True):
        main(argv + (["--tiled"] if tiled else []))
        out[tiled] = json.loads(capsys.readouterr().out)
    assert out[True]["per_gpu"]["peak_bytes"] < 0.7 * out[False]["per_gpu"]["peak_bytes"]
    assert out[True]["timing"]["tiled_recompute_s"] > 0 and "tiled_recompute_s" not in out[False]["timing"]
    assert out[True]["timing"]["step_time_s"] == pytest.approx(
        out[False]["timing"]["step_time_s"] + out[True]["timing"]["tiled_recompute_s"], rel=1e-6)
    assert out[True]["job"]["tiled"] is True
    assert any("tiled MLP" in t["source"] for t in out[True]["terms"])
    assert any("tiled logits + loss" in t["source"] for t in out[True]["terms"])


@pytest.mark.parametrize("extra, fragment", [
    (["--strategy", "fsdp2"], "--tiled runs under DeepSpeed ZeRO"),
    (["--strategy", "ddp"], "--tiled runs under DeepSpeed ZeRO"),
    (["--strategy", "zero2", "--liger"], "--tiled with --liger is not modelled"),
    (["--strategy", "zero2", "--method", "lora"], "--tiled with lora is not modelled"),
])
def test_tiled_where_the_engines_do_not_run_it_is_one_line(extra, fragment, capsys):
    from toolkit.cli import main

    assert main(["estimate", "llama-3.1-8b", "--gpus", "2xH100-80GB", "--seq", "4096", "--tiled", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_tiled_plan_tells_the_users_script_how(tiny_llama_dir):
    from toolkit.emit.user_settings import notes
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(tiny_llama_dir, "zero3", gpus_per_node=2, seq_len=256, sequence=2).replace(tiled=True)
    assert plan.to_dict()["tiled"] is True
    said = " ".join(notes(plan))
    assert "apply_tiling(model, agree_across_ranks=True)" in said
    assert "here 2 and 1 chunks of the 128 tokens per rank" in said
    untiled = plan.replace(tiled=False)
    assert "tiled" not in untiled.to_dict() and "apply_tiling" not in " ".join(notes(untiled))


def test_the_planner_tiles_only_what_fits_tiled_alone(tmp_path, capsys):
    """Llama-3.1-8B at 131072 tokens on 8 x A100-40GB, ZeRO-3 x SP 4, no savers: untiled it needs more than the GPU
    (--tiled off: nothing fits; the savers would fit it with Liger); the default plan (--tiled auto) chooses it tiled, under capacity, and writes the
    folder --tiled writes for that grid, byte for byte."""
    import json

    from toolkit.cli import main

    # --savers off: since 0021a70 Liger is planned with ZeRO-3, and the savers would fit it untiled as +liger
    argv = ["plan", "llama-3.1-8b", "--gpus", "8xA100-40GB", "--seq", "131072", "--micro-batch", "1",
            "--strategies", "zero3", "--sequence-parallel", "4", "--savers", "off", "--json"]
    assert main(argv + ["--tiled", "off"]) == 1
    off = json.loads(capsys.readouterr().out)
    plain = off["candidates"][0]
    assert off["chosen"] is None and plain["tiled"] is False and plain["sequence_parallel"] == 4
    assert plain["peak_bytes"] > plain["capacity_bytes"] and plain["reason"].startswith("needs "), plain
    folders = {}
    for flags in ([], ["--tiled"]):
        folders[bool(flags)] = tmp_path / ("tiled" if flags else "auto")
        assert main(argv + flags + ["--out", str(folders[bool(flags)])]) == 0
        chosen = json.loads(capsys.readouterr().out)["chosen"]
        assert chosen["tiled"] is True and chosen["name"] == "zero3 (dp=2 x sp=4) +tiled", chosen
        assert chosen["peak_bytes"] < chosen["capacity_bytes"] < plain["peak_bytes"]
    assert json.loads((folders[False] / "plan.json").read_text())["tiled"] is True
    auto, tiled = (sorted(p.name for p in folders[k].iterdir()) for k in (False, True))
    assert auto == tiled and all((folders[False] / n).read_bytes() == (folders[True] / n).read_bytes() for n in auto)
    # plan --explain: the chosen row as estimate --explain prints it, every term with its source
    assert main(argv[:-1] + ["--explain"]) == 0
    text = capsys.readouterr().out.split("the chosen row, explained")[1]
    assert "zero3 (dp=2 x sp=4) +tiled" in text and "tiled recompute" in text and "  note: tiled:" in text
    assert text.count("<- ") >= 8 and "<- final norm and the hidden states and labels the tiled logits" in text


def test_a_short_plan_is_untiled_and_tiled_within_the_band_ranks_after():
    """At 2048 tokens every configuration fits untiled: no row is tiled by default (Request.tiled None, plan's
    --tiled auto), while --tiled (True) still tiles every ZeRO row and refuses the others with --tiled's own line. A
    tiled candidate faster within the step-time band stays behind the untiled one; beyond the band it is preferred."""
    from dataclasses import replace

    from toolkit.estimate.errorband import time_band
    from toolkit.estimate.ranking import rank
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import plan_candidates, prefer_untiled
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.modelspec import resolve_model

    spec, hw = resolve_model("llama-3.1-8b"), parse_hardware("4xH100-80GB")
    req = Request(seq_len=2048, global_batch=8, strategies=("zero2", "fsdp2"), tensor_parallel=1,
                  context_parallel=1, sequence_parallel=1, tiled=None)
    auto = plan_candidates(spec, hw, req)
    assert len(auto) == 2 and all(c.feasible and not c.job.tiled for c in auto), [c.name for c in auto]
    tiled = {c.strategy.name: c for c in plan_candidates(spec, hw, replace(req, tiled=True))}
    assert tiled["zero2"].feasible and tiled["zero2"].job.tiled and tiled["zero2"].name == "zero2 +tiled"
    assert tiled["fsdp2"].reason.startswith("--tiled runs under DeepSpeed ZeRO"), tiled["fsdp2"].reason

    plain = next(c for c in auto if c.strategy.name == "zero2")
    band = plain.time_band.fraction
    assert band > 0

    def tiled_at(speedup: float):
        t = plain.timing
        return replace(plain, job=replace(plain.job, tiled=True),
                       timing=replace(t, tokens_per_s=t.tokens_per_s * speedup, step_time_s=t.step_time_s / speedup))

    within, beyond = tiled_at(1 + band / 2), tiled_at(1 + band * 2)
    assert prefer_untiled(plain, within) is plain and prefer_untiled(plain, beyond) is beyond
    assert rank([within, plain]) == [plain, within] and rank([beyond, plain]) == [beyond, plain]


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_tiled_json_is_only_json_when_deepspeed_is_first_imported(tiny_llama_dir, tmp_path):
    """DeepSpeed's first import logs the accelerator it found through a handler bound to stdout; in a fresh process
    with a cold cache the --tiled trace is that first import, and `--json` must still print JSON alone."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TOOLKIT_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "toolkit", "estimate", str(tiny_llama_dir), "--gpus", "2xH100-80GB",
                           "--strategy", "zero3", "--sequence-parallel", "2", "--seq", "256", "--tiled", "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["job"]["tiled"] is True


def _small_real_config(name: str, tmp_path=None, **sizes):
    """A real model's config (tests/arch_configs) with fewer, narrower layers and fewer experts."""
    import json
    from pathlib import Path

    from toolkit.inputs.modelconfig import config_from_dict
    from toolkit.run.tiny import shrink_config

    path = Path(__file__).parent / "arch_configs" / f"{name}.json"
    config = shrink_config(config_from_dict(json.loads(path.read_text()), name), layers=2, **sizes)
    if tmp_path is not None:
        config.save_pretrained(tmp_path)
    return config


@pytest.mark.parametrize("name, mlp_class, why, extra", [
    ("qwen3-30b-a3b", "Qwen3MoeSparseMoeBlock", "fails on a [3, 64] chunk (ValueError", {}),
    ("gpt-oss-20b", "GptOssMLP", "returns a tuple, not one tensor", {}),
    ("mixtral-8x7b-v0.1", "MixtralSparseMoeBlock", "fails on a [3, 64] chunk (ValueError", {}),
    # a dense first layer, then a MoE one: the dense MLP alone would be tileable
    ("deepseek-v3", "DeepseekV3MoE", "routes tokens to experts", {"first_k_dense_replace": 1}),
])
def test_tiling_refuses_an_mlp_tiled_mlp_cannot_run_in_one_line(name, mlp_class, why, extra, tmp_path, capsys):
    """TiledMLP hands the MLP flattened [tokens, hidden] chunks in its backward and wants one tensor of that shape
    back: a sparse-MoE block that unpacks [batch, seq, hidden], or returns (hidden, router scores), is found by
    probing the model's own MLP on the meta device. --tiled on refuses it in one line; the planner's auto tiling
    does not try it (the crash: `plan` over Qwen3-30B-A3B on 2x8xH100 ended in the block's ValueError)."""
    from toolkit.cli import main
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import auto_tiling
    from toolkit.inputs.modelspec import resolve_model
    from toolkit.inputs.strategy import parse_strategy

    _small_real_config(name, tmp_path, experts=4, **extra)
    spec = resolve_model(str(tmp_path))
    assert spec.tiling_blocker.startswith(f"DeepSpeed's TiledMLP cannot run its MLP {mlp_class}: "), spec.tiling_blocker
    assert why in spec.tiling_blocker
    assert any(n.startswith("ALST tiling not tried: ") for n in spec.notes)
    assert not auto_tiling(spec, parse_strategy("zero3"), Request(seq_len=256, global_batch=8))
    assert main(["plan", str(tmp_path), "--gpus", "2xH100-80GB", "--seq", "256", "--global-batch", "8", "--tiled", "on"]) == 2
    # (transformers' own warning about the shrunk config's rope scaling is not ours)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[transformers]")]
    assert len(err) == 1 and f"TiledMLP cannot run its MLP {mlp_class}" in err[0] and "drop --tiled" in err[0], err


def test_an_mlp_with_dropout_is_not_tiled():
    """TiledMLP recomputes each chunk in backward without restoring the random state: GPT-2's MLP with its default
    dropout (0.1) would get gradients of other masks, so the planner refuses to tile it; at dropout 0 it tiles."""
    from transformers import AutoModelForCausalLM

    from toolkit.inputs.tileable import model_tiling_blocker

    with_dropout = AutoModelForCausalLM.from_config(tiny_config("gpt2", layers=2, hidden=64))
    why = model_tiling_blocker(with_dropout, 64)
    assert why and "dropout (p=0.1)" in why and "set the model's dropout to 0" in why
    without = AutoModelForCausalLM.from_config(tiny_config("gpt2", layers=2, hidden=64, resid_pdrop=0.0))
    assert model_tiling_blocker(without, 64) is None


def test_dense_mlps_stay_tileable():
    from toolkit.inputs.modelspec import resolve_model

    for name in ("llama-3.1-8b", "phi-3-mini-4k-instruct", "gemma-3-1b", "falcon-7b"):
        spec = resolve_model(str(__import__("pathlib").Path(__file__).parent / "arch_configs" / f"{name}.json"))
        assert spec.tiling_blocker is None, (name, spec.tiling_blocker)


def test_apply_tiling_leaves_the_mlps_tiled_mlp_cannot_run():
    """Qwen1.5-MoE with a dense layer (mlp_only_layers): apply_tiling tiles the dense MLP only and the loss; the
    MoE block keeps its own forward, and loss and gradients match the plain model's."""
    from transformers import AutoModelForCausalLM

    from toolkit.patches.tiling import apply_tiling
    from toolkit.inputs.tileable import tileable_mlps

    config = _small_real_config("qwen1.5-moe-a2.7b", experts=4, mlp_only_layers=[1])
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    tiled = copy.deepcopy(plain)
    ok, refused = tileable_mlps(tiled, config.hidden_size)
    assert ok == [tiled.model.layers[1].mlp] and list(refused) == ["Qwen2MoeSparseMoeBlock"]
    apply_tiling(tiled)
    assert "forward" not in vars(tiled.model.layers[0].mlp) and "forward" in vars(tiled.model.layers[1].mlp)
    ids = torch.randint(0, config.vocab_size, (2, 128))
    losses = [model(input_ids=ids, labels=ids).loss for model in (plain, tiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0])
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_tiling_with_offloading_is_planned_with_deepspeeds_checkpoint_offload(capsys, monkeypatch):
    """--tiled with --activation-offloading is planned as ALST pairs them: DeepSpeed's CheckpointHiddenStatesOffload
    (toolkit.estimate.savers). Its own code run on the checkpointed, tiled tiny Llama (2 x 512 tokens, fp32), with
    the one check that keeps it idle on a CPU accelerator (`is_synchronized_device`) answered as a GPU's: it marks
    the 3 layers' hidden_states inputs, keeps the newest and copies 2 out, 1,048,576 bytes, what the estimate puts in
    host RAM; the estimate's GPU peak is the tiled step's less one layer input (3 layers less the 2 kept at the end
    of the forward: the newest, and the one whose copy-out its stream holds), and `estimate` plans it (exit 0)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    from toolkit.cli import main
    from toolkit.estimate.profile import _batch, build_model, predict_step
    from toolkit.patches.tiling import apply_tiling
    from toolkit.run.tiny import tiny_config

    config = tiny_config("llama", vocab_size=1000, max_positions=1024, hidden=128, layers=3, heads=4, kv_heads=2,
                         ffn=344)
    kwargs = dict(seq_len=512, micro_batch=2, precision="fp32", checkpointing=True)
    model = build_model(config, "fp32", "sdpa", True, "cpu")
    apply_tiling(model)
    monkeypatch.setattr(get_accelerator(), "is_synchronized_device", lambda: False)
    offload = CheckpointHiddenStatesOffload(use_pin_memory=False, use_streams=False)
    with offload:
        model(**_batch(config, 2, 512, "cpu")).loss.backward()
    layer_input = 2 * 512 * 128 * 4
    assert offload.stats.marked_tensors == 3 and offload.stats.kept_last_tensors == 1
    assert offload.stats.offloaded_tensors == 2 and offload.stats.offloaded_bytes == 2 * layer_input
    assert torch.isfinite(torch.stack([p.grad.norm() for p in model.parameters()])).all()
    offloaded = predict_step(config, device_kind="cpu", activation_offloading=True, tiled=True, **kwargs)
    tiled = predict_step(config, device_kind="cpu", tiled=True, **kwargs)
    assert offloaded["host_bytes"] == offload.stats.offloaded_bytes == 1_048_576
    assert tiled["peak_bytes"] - offloaded["peak_bytes"] == layer_input
    monkeypatch.undo()
    capsys.readouterr()  # DeepSpeed's first import in this process logs its accelerator
    assert main(["estimate", "llama-3.1-8b", "--gpus", "2xH100-80GB", "--seq", "4096", "--strategy", "zero2",
                 "--tiled", "--activation-offloading", "--checkpointing", "on"]) == 0
    out = capsys.readouterr().out
    # 31 of the 32 layers' 4096 x 4096 bf16 inputs (32 MiB each) pinned per rank, 30 of them off the GPU
    assert "1.94 GiB pinned host RAM per node (0.97 GiB x 2 ranks)" in out, out
    assert "CheckpointHiddenStatesOffload" in out, out


def test_deepspeeds_checkpoint_offload_runs_with_tiling_and_moves_nothing_on_cpu():
    """DeepSpeed 0.19.8's own checkpoint offload (CheckpointHiddenStatesOffload, what ALST pairs with tiling) marks
    only the checkpointed layers' hidden_states inputs, so the tiled MLP and loss recompute untouched beside it; on
    a CPU accelerator it skips every tensor, so toolkit cannot train or measure it here (docs/ENGINE_FACTS.md, "ALST
    tiling + activation offloading")."""
    import torch
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    from toolkit.estimate.profile import _batch, build_model
    from toolkit.patches.tiling import LAST_CHUNKS, apply_tiling
    from toolkit.run.tiny import tiny_config

    config = tiny_config("llama", vocab_size=1000, max_positions=1024, hidden=128, layers=3, heads=4, kv_heads=2,
                         ffn=344)
    model = build_model(config, "fp32", "sdpa", True, "cpu")
    apply_tiling(model)
    offload = CheckpointHiddenStatesOffload(use_pin_memory=False, use_streams=False)
    with offload:
        model(**_batch(config, 2, 512, "cpu")).loss.backward()
    assert LAST_CHUNKS == {"mlp": 4, "loss": 1}
    assert offload.stats.marked_tensors == 3 and offload.stats.skipped_marked_tensors == 3
    assert offload.stats.offloaded_bytes == 0 and all(p.grad is not None for p in model.parameters())
    assert torch.isfinite(torch.stack([p.grad.norm() for p in model.parameters()])).all()

"""One rank traced in a fake world (toolkit.estimate.fakeworld): the real FSDP2 / FSDP2 x TP wrapping at the plan's
world size in one process agrees with the planner's per-rank model states, and --explain says which term came from
where."""

from __future__ import annotations

import json

import pytest

from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.job import Job
from toolkit.inputs.strategy import parse_strategy

PEAK_TOLERANCE = 0.02
"""The fake world's tensor peak against the estimate's, CPU dispatch and fp32 (benchmarks/results/fakeworld.md: FSDP2
over 2 ranks 1.005 and dp2 x tp2 1.000, the fake world equal to a real gloo rank's peak within 0.01% in both)."""


@pytest.fixture(scope="module")
def tiny_llama():
    from toolkit.inputs.modelspec import build_spec
    from toolkit.run.tiny import tiny_config

    # The model of benchmarks/results/dimension_memory.md (GQA, untied head), measured there on real gloo ranks.
    return build_spec("llama", tiny_config("llama", vocab_size=2000, layers=4, hidden=256, heads=8, kv_heads=2,
                                           ffn=688, max_positions=512))


def _param_tensors(spec) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return len(list(AutoModelForCausalLM.from_config(spec.hf_config()).parameters()))


@pytest.mark.parametrize("tensor", [1, 2], ids=["fsdp2-4", "fsdp2-dp2-tp2"])
def test_fake_world_states_equal_the_per_rank_states_model(tiny_llama, tensor, monkeypatch):
    from toolkit.estimate.fakeworld import trace_world
    from toolkit.estimate.memory import estimate_memory

    monkeypatch.setenv("TOOLKIT_NO_CACHE", "1")
    strategy = parse_strategy("fsdp2")
    grid = ParallelGrid.for_strategy(strategy, nodes=1, gpus_per_node=4, tensor=tensor)
    job = Job(seq_len=128, micro_batch=2, precision="fp32", device_kind="cpu")
    world = trace_world(tiny_llama, strategy, job, grid)
    b = estimate_memory(tiny_llama, strategy, job, parse_hardware("4xH100-80GB"), grid=grid)
    assert world.world == 4
    assert world.parameters_bytes == b.parameters_bytes
    assert world.gradients_bytes == b.gradients_bytes
    # The states model counts exp_avg and exp_avg_sq; torch's AdamW also keeps one fp32 `step` scalar per tensor.
    assert world.optimizer_bytes - b.optimizer_bytes == 4 * _param_tensors(tiny_llama)
    assert world.parameters_bytes < 4 * tiny_llama.params / 3  # sharded, not whole
    assert abs(world.peak_bytes / b.peak_bytes - 1) < PEAK_TOLERANCE


def test_a_tied_head_traces_under_tensor_parallelism_as_from_pretrained_shards_it(monkeypatch):
    """A tied embedding (Qwen2.5-0.5B, Llama-3.2): transformers shards the model untied and ties it after loading;
    the fake world does the same (a tied model made maybe_distribute_model look the head up as a module: KeyError
    'lm_head.weight'), and the shards equal the states model's, the tied matrix counted once."""
    from toolkit.estimate.fakeworld import trace_world
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.modelspec import build_spec
    from toolkit.run.tiny import tiny_config

    monkeypatch.setenv("TOOLKIT_NO_CACHE", "1")
    config = tiny_config("qwen2", vocab_size=512, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128)
    config.tie_word_embeddings = True
    spec = build_spec("qwen2-tied", config)
    assert spec.tied
    strategy = parse_strategy("fsdp2")
    grid = ParallelGrid.for_strategy(strategy, nodes=1, gpus_per_node=4, tensor=2)
    job = Job(seq_len=64, micro_batch=1, precision="fp32", device_kind="cpu")
    world = trace_world(spec, strategy, job, grid)
    b = estimate_memory(spec, strategy, job, parse_hardware("4xH100-80GB"), grid=grid)
    assert world.parameters_bytes == b.parameters_bytes and world.gradients_bytes == b.gradients_bytes


def test_explain_names_the_fake_world_terms_and_the_derived_ones(tmp_path, monkeypatch, capsys):
    from toolkit.cli import main

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    from toolkit.run.tiny import tiny_config

    tiny_config("llama", vocab_size=512, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128).save_pretrained(tmp_path)
    argv = ["estimate", str(tmp_path), "--gpus", "4xH100-80GB", "--strategy", "fsdp2", "--tensor-parallel", "2",
            "--seq", "64", "--explain", "--trace-world"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("<- fake-world trace, 4 ranks, transformers maybe_distribute_model") == 3
    assert "<- per-rank model, not the fake world: assumed" in out
    assert "fake-world peak (tensors, CPU dispatch, 4 ranks)" in out
    assert main(argv[:-2] + ["--json", "--trace-world"]) == 0  # second call: from the disk cache
    data = json.loads(capsys.readouterr().out)
    terms = {t["name"]: t["bytes"] for t in data["terms"]}
    assert terms["parameters"] == data["fake_world"]["parameters_bytes"] == data["per_gpu"]["parameters_bytes"]


def test_trace_world_refuses_deepspeed_in_one_line(capsys):
    from toolkit.cli import main

    code = main(["estimate", "llama-3.1-8b", "--strategy", "zero3", "--trace-world", "--explain"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "DeepSpeed ZeRO" in err[0] and "drop --trace-world" in err[0]

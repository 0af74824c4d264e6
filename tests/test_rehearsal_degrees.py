"""The rehearsal's tiny model keeps every divisibility its grid needs (toolkit.run.tiny.sizes_for_degrees), and the
one fact of which grids can resume (ParallelGrid.resumable)."""

from __future__ import annotations

import pytest

from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.strategy import parse_strategy


@pytest.mark.parametrize("strategy, degrees, resumable", [
    ("fsdp2", {"tensor": 2}, False),
    ("fsdp2-hybrid", {"tensor": 2}, False),
    ("fsdp2", {}, True),
    ("fsdp2", {"context": 2}, True),
    ("zero3", {"sequence": 2}, True),
    ("zero2", {}, True),
    ("ddp", {}, True),
    ("hybrid", {}, True),
])
def test_only_tensor_parallel_grids_cannot_resume(strategy, degrees, resumable):
    """transformers shards a TP model at load time and its Trainer checkpoints no optimizer for it."""
    grid = ParallelGrid.for_strategy(parse_strategy(strategy), nodes=2, gpus_per_node=4, **degrees)
    assert grid.resumable is resumable
    assert (grid.resume_problem() is None) is resumable
    if not resumable:
        assert "cannot resume" in grid.resume_problem()


REAL_CONFIGS = ("qwen3-30b-a3b", "mixtral-8x7b-v0.1", "llama-3.1-8b", "qwen2.5-7b-instruct", "falcon-7b",
                "gemma-3-1b", "phi-3-mini-4k-instruct", "qwen1.5-moe-a2.7b")
DEGREES = [(t, s, p) for t in (1, 2, 4, 8) for s in (1, 2, 4) for p in (1, 2, 4)]


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_the_tiny_model_keeps_every_divisibility_the_degrees_need(name):
    """For every (tensor, sequence, stages) of the grid: the model's own tp_plan splits the tiny model's heads, KV
    heads and FFN widths (toolkit.inputs.tensorplan.tp_plan_problem, the planner's rule), Ulysses splits its heads
    (ParallelGrid.check_model), the pipeline stages take whole layers; heads stay a multiple of the KV heads, and
    with no degree the real model's grouping is kept (Qwen3-MoE's 8:1 on 4 heads: 1 KV head)."""
    import json
    from pathlib import Path

    from toolkit.inputs.modelconfig import config_from_dict

    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.partition import check_stage_count
    from toolkit.inputs.tensorplan import model_tp_plan, tp_plan_problem
    from toolkit.run.tiny import shrink_config, sizes_for_degrees

    real = config_from_dict(json.loads((Path(__file__).parent / "arch_configs" / f"{name}.json").read_text()), name)
    specs = {}
    for tensor, sequence, stages in DEGREES:
        sizes = sizes_for_degrees(real, tensor=tensor, sequence=sequence, stages=stages)
        key = tuple(sorted(sizes.items()))
        if key not in specs:
            specs[key] = build_spec(name, shrink_config(real, **sizes))
        spec, config = specs[key], specs[key].hf_config()
        where = f"{name} tp={tensor} sp={sequence} pp={stages}: {sizes}"
        assert spec.heads % spec.kv_heads == 0 and spec.heads == sizes["heads"], where
        if model_tp_plan(spec):
            assert tp_plan_problem(spec, tensor) is None, where
        for key_name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if getattr(config, key_name, None):
                assert getattr(config, key_name) % tensor == 0, (key_name, where)
        if sequence > 1:
            grid = ParallelGrid.for_strategy(parse_strategy("zero3"), nodes=1, gpus_per_node=2 * sequence,
                                             sequence=sequence)
            grid.check_model(spec)
        check_stage_count(spec.num_layers, stages, stages)
        if (tensor, sequence, stages) == (1, 1, 1):
            plain = build_spec(name, shrink_config(real))  # shrink_config's own sizes and grouping
            assert (spec.heads, spec.kv_heads, spec.hidden) == (plain.heads, plain.kv_heads, plain.hidden), where


@pytest.mark.multiprocess
def test_rehearsal_of_qwen3_moe_fsdp2_x_tp_passes_on_4_processes(tmp_path, capfd):
    """The plan the planner picks for Qwen3-30B-A3B on 2x8xH100 (fsdp2 dp=8 x tp=2) rehearses on a tiny Qwen3-MoE of
    the same config: 32 heads over 4 KV heads shrink to 4 over 2 (the 8:1 grouping would leave 1 KV head, which
    tp 2 cannot split), trains 4 steps on 4 gloo processes (dp 2 x tp 2), saves and reloads; the output says the
    plan cannot resume."""
    import shutil
    from pathlib import Path

    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    real = tmp_path / "qwen3-30b-a3b"
    real.mkdir()
    shutil.copy(Path(__file__).parent / "arch_configs" / "qwen3-30b-a3b.json", real / "config.json")
    plan = plan_for_model(real, "fsdp2", num_machines=2, gpus_per_node=8, micro_batch=4, grad_accum=2,
                          seq_len=4096, tensor=2)
    assert plan.grid.describe() == "dp=8 x tp=2" and not plan.grid.resumable
    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "rehearsal of fsdp2 dp=2 x tp=2 (fp32) on 4 CPU processes over gloo: qwen3_moe 4 layers" in out, out
    assert "note: tensor parallelism: transformers shards the model" in out and "cannot resume" in out
    assert "rehearsal passed" in out


def test_a_plan_that_cannot_be_rehearsed_says_so_when_it_is_written(tmp_path, capsys):
    """FSDP2 x CP needs CUDA's SDPA kernels: plan's "run it" line gives the reason instead of offering a rehearsal
    that launch would refuse (with the same words)."""
    from toolkit.cli import main
    from toolkit.run.rehearsal import rehearsal_problem
    from toolkit.plan.schema import load_plan

    out = tmp_path / "cp"
    assert main(["plan", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--seq", "8192", "--global-batch", "16",
                 "--strategies", "fsdp2", "--context-parallel", "2", "--choose", "fsdp2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    problem = rehearsal_problem(load_plan(out))
    assert problem and problem.startswith("context parallelism needs a GPU")
    assert f"run it:  toolkit launch {out}  (no CPU rehearsal: {problem})" in text and "--rehearse" not in text


@pytest.mark.multiprocess
def test_an_hsdp_x_tp_plan_rehearses_as_2_nodes_of_2_shards_x_tp_2(tmp_path, capfd):
    """fsdp2-hybrid (dp=2x4 x tp=2) of Qwen3-30B-A3B on 2x8 GPUs: 2 replicas x 2 shards x tp 2 = 8 processes as 2
    launcher invocations (fewer leaves a node's FSDP2 nothing to shard over, which the grid refuses), trained for
    real: 4 steps, checkpoints, the saved model reloaded (Mixtral-8x7B's plan passes the same way, run by hand)."""
    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    import shutil
    from pathlib import Path

    real = tmp_path / "qwen3-30b-a3b"
    real.mkdir()
    shutil.copy(Path(__file__).parent / "arch_configs" / "qwen3-30b-a3b.json", real / "config.json")
    plan = plan_for_model(real, "fsdp2-hybrid", num_machines=2, gpus_per_node=8, micro_batch=1, grad_accum=4,
                          seq_len=4096, tensor=2)
    assert plan.grid.describe() == "dp=2x4 x tp=2"
    code = launch_main(emit_plan_files(plan, tmp_path / "p"), [], rehearse=True)
    out = capfd.readouterr().out
    assert code == 0, out[-3000:]
    assert "rehearsal of fsdp2-hybrid dp=2x2 x tp=2 (fp32) on 8 CPU processes over gloo (2 launcher" in out, out
    assert "rehearsal passed: fsdp2-hybrid dp=2x2 x tp=2 trained 4 steps, checkpointed, saved and reloaded" in out


def test_the_rehearsal_refuses_a_saved_model_that_reloads_with_weights_missing(tiny_llama_dir, tmp_path):
    """from_pretrained initialises at random what a saved file lacks and still builds every parameter, so a count of
    parameters passed an AutoEP run whose file names its experts AutoEP's way (mlp.experts.w1, all of the model's
    experts missing on reload). The reload check reads from_pretrained's missing keys: the intact folder passes, the
    same folder without its final norm and with a stray weight is refused, naming both."""
    import shutil

    from safetensors.torch import load_file, save_file

    from toolkit.run.rehearsal import _check_saved_model, plan_for_model

    small = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1)
    assert _check_saved_model(tiny_llama_dir, small) == []
    out = tmp_path / "out"
    shutil.copytree(tiny_llama_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["model.norm.w1"] = weights.pop("model.norm.weight")
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    assert _check_saved_model(out, small) == [
        "the saved model lacks 1 of the model's weights (e.g. model.norm.weight), which from_pretrained initialises at "
        "random; it holds 1 it does not know (e.g. model.norm.w1)"]

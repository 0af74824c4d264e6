"""The host's dispatch of an eager MoE step (toolkit.estimate.hosttime): the trace counts the operations the model's
own code dispatches, and the step time is at least their host time. In-process, CPU only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ARCH = Path(__file__).parent / "arch_configs"
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from moe_ep import real_step, tiny_moe_config  # noqa: E402  (the benchmark that measures hosttime.HOST_OP_S)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b-v0.1"])
def test_the_trace_counts_the_operations_a_real_checkpointed_step_dispatches(name):
    from toolkit.estimate.tracer import trace_activations

    config = tiny_moe_config(name)
    traced = trace_activations(config, seq_len=16, dtype="float32", device_kind="cpu", checkpointing=True)
    real, _ = real_step(config, 16)
    assert traced.host_ops == pytest.approx(real, rel=0.05)
    assert traced.layers[1].host_ops > 300  # forward, recompute and backward of one MoE layer


def test_a_host_bound_moe_step_is_the_hosts_dispatch_and_a_short_count_leaves_the_step_alone():
    from toolkit.estimate.hosttime import HOST_OP_S
    from toolkit.estimate.timing import step_time
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import spec_from_config_dict
    from toolkit.inputs.strategy import parse_strategy

    spec = spec_from_config_dict(json.loads((ARCH / "qwen3-30b-a3b.json").read_text()), name="qwen3-30b-a3b")
    hw, strategy = parse_hardware("8xH100-80GB"), parse_strategy("fsdp2")
    grid = ParallelGrid.for_strategy(strategy, nodes=1, gpus_per_node=8, expert=8, expert_shared_batch=True)
    job = Job(seq_len=2048, micro_batch=1, grad_accum=2, precision="bf16-pure", checkpointing=True)
    device = step_time(spec, strategy, job, hw, grid=grid)
    assert device.host_s == 0.0
    hosted = step_time(spec, strategy, job, hw, grid=grid, host_ops=25_000)
    assert hosted.host_s == pytest.approx(2 * 25_000 * HOST_OP_S)  # every micro-step dispatches them again
    assert hosted.step_time_s == pytest.approx(max(device.step_time_s, hosted.host_s))
    assert hosted.step_time_s > device.step_time_s
    few = step_time(spec, strategy, job, hw, grid=grid, host_ops=100)
    assert few.step_time_s == pytest.approx(device.step_time_s)


def test_an_moe_estimate_is_host_bound_and_its_speed_is_not_claimed_inside_the_dense_band(tmp_path, capsys):
    from toolkit.cli import main

    tiny_moe_config("qwen3-30b-a3b").save_pretrained(tmp_path)
    assert main(["estimate", str(tmp_path), "--strategy", "fsdp2", "--gpus", "2xH100-80GB", "--seq", "256",
                 "--micro-batch", "1", "--checkpointing", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "host-bound: the step is the host's" in out
    assert "not for a mixture of experts: no published MoE step is scored within it" in out

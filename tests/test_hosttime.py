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
    from toolkit.estimate.hosttime import EP_ROUTE_HOST_OPS, HOST_OP_S
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
    # every micro-step dispatches them again, with what the shared-batch AllToAllEP route adds to each of the 48
    # checkpointed MoE layers; the fused AdamW step and clipping once (2 param groups x 2 device meshes)
    micro = 25_000 + 48 * EP_ROUTE_HOST_OPS["all_to_all"][0]
    assert hosted.host_s == pytest.approx((2 * micro + 2 * 4 + 2 + 8 * 2) * HOST_OP_S)
    assert hosted.step_time_s == pytest.approx(max(device.step_time_s, hosted.host_s))
    assert hosted.step_time_s > device.step_time_s
    # without expert parallelism (no route to add) a short count leaves the step to the GPU's work
    plain = step_time(spec, strategy, job, hw)
    few = step_time(spec, strategy, job, hw, host_ops=100)
    assert few.host_s > 0 and few.step_time_s == pytest.approx(plain.step_time_s)


def test_an_moe_estimate_is_host_bound_and_its_speed_is_not_claimed_inside_the_dense_band(tmp_path, capsys):
    from toolkit.cli import main

    tiny_moe_config("qwen3-30b-a3b").save_pretrained(tmp_path)
    assert main(["estimate", str(tmp_path), "--strategy", "fsdp2", "--gpus", "2xH100-80GB", "--seq", "256",
                 "--micro-batch", "1", "--checkpointing", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "host-bound: the step is the host's" in out
    assert "not for a mixture of experts: no published MoE step is scored within it" in out


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_the_expert_exchange_adds_what_alltoallep_dispatches_on_a_real_cpu_layer(name):
    """Under transformers' expert parallelism each MoE layer also runs AllToAllEP's dispatch and combine; the host
    term adds EP_EXCHANGE_OPS a layer, which is what the real exchange dispatches around the model's own experts
    (one-rank gloo group, CPU), whatever the architecture."""
    from moe_ep import ep_exchange_ops

    from toolkit.estimate.hosttime import EP_EXCHANGE_OPS

    assert ep_exchange_ops(name) == EP_EXCHANGE_OPS


def test_the_masked_route_dispatches_fewer_operations_than_alltoallep_on_a_real_cpu_layer():
    """The masked route TRL's benchmark report says its expert parallelism ran (AllReduceEP in 5.24: a mask, the
    masked weights and an all-reduce, no sort or split sizes) adds 9 + 3 operations a MoE layer around the model's
    own experts, fewer than AllToAllEP's EP_EXCHANGE_OPS: the report's route shortens the host step of TRL's row
    (benchmarks/results/moe_ep.md)."""
    from moe_ep import ep_exchange_ops

    from toolkit.estimate.hosttime import EP_EXCHANGE_OPS

    masked = ep_exchange_ops("qwen3-30b-a3b", route="AllReduceEP")
    assert masked == (9, 3)
    assert sum(masked) < sum(EP_EXCHANGE_OPS)


def test_the_default_experts_path_is_grouped_mm_behind_alltoallep_in_a_checkpointed_training_step():
    """What the TRL row's job runs where nobody sets a path (benchmarks/moe_ep.py default_path): a Qwen3-MoE built by
    transformers resolves grouped_mm, and AutoEP on a batch-sharing group takes AllToAllEP in every MoE layer's
    forward and recompute of a checkpointed training step (gradients on: non-reentrant checkpointing), AllReduceEP
    only in a forward without gradients: the path hosttime traces (grouped_mm) and counts beside the trace."""
    from moe_ep import default_path

    path = default_path()
    layers = path["moe_layers"]
    assert (path["experts_implementation"], path["ep_implementation"]) == ("grouped_mm", "auto")
    assert path["routes"] == {"training step (forward + recompute): all_to_all": 2 * layers,
                              "forward without gradients: all_reduce": layers}


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_the_optimizer_steps_host_operations_are_a_real_cpu_adamw_steps(impl):
    """The optimizer step's share of the host term: a real CPU AdamW step (with foreach clipping) over a tiny
    Qwen3-MoE's parameters in the Trainer's two groups, within 5% of optimizer_host_ops; the per-parameter loop
    dispatches ~10 operations a tensor, foreach and fused a few a group."""
    from moe_ep import optimizer_step_ops

    from toolkit.estimate.hosttime import optimizer_host_ops
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import spec_from_config_dict
    from toolkit.inputs.strategy import parse_strategy

    spec = spec_from_config_dict(tiny_moe_config("qwen3-30b-a3b").to_dict(), name="tiny")
    job = Job(seq_len=16, micro_batch=1, grad_accum=1, precision="fp32", optimizer="adamw", optimizer_impl=impl)
    strategy = parse_strategy("fsdp2")
    grid = ParallelGrid.for_strategy(strategy, nodes=1, gpus_per_node=2)
    real = optimizer_step_ops("qwen3-30b-a3b", impl)
    assert optimizer_host_ops(spec, job, grid, strategy) == pytest.approx(real, rel=0.05)
    if impl == "for-loop":
        assert real > 10 * 30  # 4 layers of ~10 tensors: the loop is per tensor


def _gpu_day_rows() -> dict:
    results = Path(__file__).parents[1] / "benchmarks" / "results"
    return {r["label"]: r for r in json.loads((results / "gpu_timing.json").read_text())["rows"]}


@pytest.mark.parametrize("label", ["eff ddp llama-1b s512 mb1", "eff ddp llama-1b s1024 mb1"])
def test_a_small_dense_gpu_step_is_the_hosts_dispatch_as_the_gpu_day_measured(label):
    """The GPU day's 1.5B DDP step at 512 and 1024 tokens (58 ms both, H200) against gpu_check's own prediction:
    without the host's dispatch the model said 16 and 25 ms; the traced 4,493 operations at HOST_OP_S give 54 ms."""
    from gpu_check import SHAPES, _config, _predict, timing_cases

    case = next(c for c in timing_cases() if c.label == label)
    predicted = _predict(case, _config(SHAPES[case.shape], 128256, case.seq_len), "cuda", "H200")["step_predicted_s"]
    measured = _gpu_day_rows()[label]["step_measured_s"]
    assert predicted / measured - 1 == pytest.approx(-0.07, abs=0.03)


def test_the_host_floor_leaves_a_long_dense_step_and_a_cpu_job_untraced():
    """A step whose GPU work is longer than any dense host dispatch could be takes no trace (and is unchanged);
    neither does a CPU job, whose kernels run on the host thread the compute term already prices."""
    from gpu_check import SHAPES, _config

    from toolkit.estimate.traces import step_time_terms
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    spec = build_spec("llama", _config(SHAPES["llama-1b"], 128256, 2048))
    ddp = parse_strategy("ddp")
    # 16 layers + embedding + head, at most 1000 operations each, at 2 x 12 us: 0.432 s at most.
    assert step_time_terms(spec, Job(seq_len=2048, micro_batch=16), ddp, device_s=0.58) == {}
    assert step_time_terms(spec, Job(seq_len=512, micro_batch=1, device_kind="cpu"), ddp, device_s=0.001) == {}
    assert step_time_terms(spec, Job(seq_len=512, micro_batch=1), ddp, device_s=0.016)["host_ops"] == 4493


def test_a_host_bound_dense_estimate_says_its_step_is_the_hosts_dispatch(capsys):
    """Qwen2.5-0.5B at 512 tokens on one H100: 0.010 s of compute, and the host's dispatch of its 24 layers'
    operations is the step; the printed terms say so instead of not adding up."""
    from toolkit.cli import main

    assert main(["estimate", "qwen2.5-0.5b", "--strategy", "ddp", "--gpus", "1xH100-80GB", "--seq", "512",
                 "--micro-batch", "1"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted step"))
    step = float(line.split()[2])
    assert f"host-bound: the host's dispatch, {step:.3f} s, is the step" in line
    assert float(line.split("(compute ")[1].split()[0]) < step / 4


def test_the_host_term_adds_what_the_grids_route_costs_each_moe_layer():
    """micro_step_host_ops adds, on a batch-sharing group, EP_ROUTE_HOST_OPS (measured on the routes themselves,
    benchmarks/ep_route_host.py) by token exchange: AllToAllEP (5.24's default plan) or the masked all-reduce (a
    plan with ep_router + moe_tp_experts), a layer checkpointed or not; with every rank its own batch AllToAllEP's
    exchange operations (EP_EXCHANGE_OPS); nothing without expert parallelism. Each measured route costs the host
    more than ten times its exchange's own operations: the experts' DTensor parameters' Python is most of it."""
    from toolkit.estimate.hosttime import EP_EXCHANGE_OPS, EP_ROUTE_HOST_OPS, micro_step_host_ops
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.modelspec import spec_from_config_dict
    from toolkit.inputs.strategy import parse_strategy

    config = json.loads((ARCH / "qwen3-30b-a3b.json").read_text())
    spec = spec_from_config_dict(config, name="qwen3-30b-a3b")
    masked = spec_from_config_dict({**config, "base_model_ep_plan": {
        "layers.*.mlp.gate": "ep_router", "layers.*.mlp.experts": "moe_tp_experts"}}, name="qwen3-30b-a3b")

    def grid(expert, shared=False):
        return ParallelGrid.for_strategy(parse_strategy("fsdp2"), nodes=1, gpus_per_node=8, expert=expert,
                                         expert_shared_batch=shared)

    assert micro_step_host_ops(spec, grid(1), 1000, True) == 1000
    assert micro_step_host_ops(spec, None, 1000, True) == 1000
    for model, key in ((spec, "all_to_all"), (masked, "all_reduce")):
        with_recompute, without = EP_ROUTE_HOST_OPS[key]
        assert micro_step_host_ops(model, grid(8, True), 1000, True) == 1000 + 48 * with_recompute
        assert micro_step_host_ops(model, grid(8, True), 1000, False) == 1000 + 48 * without
        assert min(with_recompute, without) > 10 * (2 * EP_EXCHANGE_OPS[0] + EP_EXCHANGE_OPS[1])
    forward, backward = EP_EXCHANGE_OPS
    assert micro_step_host_ops(spec, grid(8), 1000, True) == 1000 + 48 * (2 * forward + backward)
    assert micro_step_host_ops(spec, grid(8), 1000, False) == 1000 + 48 * (forward + backward)

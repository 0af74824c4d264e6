"""`toolkit estimate`: the scriptable contract, model-state arithmetic against DeepSpeed's own estimators, and
one-line refusals of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from toolkit.cli import main
from toolkit.inputs.choices import GIB
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.job import Job
from toolkit.estimate.memory import estimate_memory
from toolkit.inputs.modelspec import resolve_model
from toolkit.estimate.states import zero_states
from toolkit.inputs.strategy import parse_strategy


def run_json(capsys, *argv: str) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def llama7b():
    return resolve_model("llama-2-7b")


def test_json_contract_has_the_documented_keys(capsys):
    out = run_json(capsys, "gpt2", "--gpus", "1xA100-80GB", "--seq", "1024", "--micro-batch", "2")
    assert out["params"] == 124_439_808
    for key in ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes"):
        assert isinstance(out["per_gpu"][key], int) and out["per_gpu"][key] > 0


def test_single_gpu_ddp_mixed_precision_holds_sixteen_bytes_per_parameter(capsys):
    out = run_json(capsys, "gpt2", "--gpus", "1xA100-80GB", "--seq", "512")
    P = out["params"]
    per_gpu = out["per_gpu"]
    # torch AMP: fp32 weights (4) + fp32 grads (4) + AdamW exp_avg and exp_avg_sq (8).
    assert per_gpu["parameters_bytes"] == 4 * P
    assert per_gpu["gradients_bytes"] == 4 * P
    assert per_gpu["optimizer_bytes"] == 8 * P
    assert per_gpu["autocast_copy_bytes"] > 0


def test_peak_is_not_the_sum_of_every_component(capsys):
    out = run_json(capsys, "gpt2", "--gpus", "1xA100-80GB", "--seq", "1024", "--micro-batch", "4")
    g = out["per_gpu"]
    states = g["parameters_bytes"] + g["optimizer_bytes"]
    assert states < g["peak_bytes"] < states + g["gradients_bytes"] + g["activations_bytes"] \
        + g["autocast_copy_bytes"] + g["buffers_bytes"] + g["transient_bytes"] + 1


def test_activations_grow_linearly_with_micro_batch(capsys):
    a1 = run_json(capsys, "gpt2", "--seq", "512", "--micro-batch", "1")["per_gpu"]["activations_bytes"]
    a2 = run_json(capsys, "gpt2", "--seq", "512", "--micro-batch", "2")["per_gpu"]["activations_bytes"]
    a4 = run_json(capsys, "gpt2", "--seq", "512", "--micro-batch", "4")["per_gpu"]["activations_bytes"]
    assert a4 - a2 == 2 * (a2 - a1)


def test_checkpointing_keeps_far_fewer_activations(capsys):
    base = ["llama-2-7b", "--gpus", "8xA100-80GB", "--strategy", "zero3", "--seq", "4096"]
    full = run_json(capsys, *base)["per_gpu"]["activations_bytes"]
    ckpt = run_json(capsys, *base, "--checkpointing")["per_gpu"]["activations_bytes"]
    # A checkpointed Llama layer keeps its bf16 input: 2 bytes x seq x hidden per layer (docs/ENGINE_FACTS.md, measured).
    per_layer_input = 2 * 4096 * 4096
    assert ckpt < full / 5
    assert 32 * per_layer_input <= ckpt < 32 * per_layer_input * 1.5 + 2 * 4096 * 32000 * 4


# ---------------------------------------------------------------------------------------------------------------
# Model states against DeepSpeed's estimator arithmetic (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py)


def test_zero2_states_equal_deepspeeds_2p_plus_18p_over_n(llama7b):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    P, N = llama7b.params, 8
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=N, cpu_offload=False)
    s = zero_states(P, Job(seq_len=8), parse_strategy("zero2"), dp=N, hidden=4096, largest_layer=0)
    # Ours: bf16 weights + bf16 grad partition (backward to step) + fp32 grad partition (during the step) + fp32
    # master + Adam: the same bytes, each alive in the phases DeepSpeed allocates it.
    ours = s.parameters + s.backward_gradients + s.step_transient + s.master + s.optimizer
    assert ours == pytest.approx(ds_gpu, rel=1e-6)


def test_zero2_offload_leaves_only_the_bf16_weights_on_the_gpu(llama7b):
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    P = llama7b.params
    _, ds_gpu = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=8, cpu_offload=True)
    s = zero_states(P, Job(seq_len=8), parse_strategy("zero2-offload"), dp=8, hidden=4096, largest_layer=0)
    assert s.parameters + s.gradients + s.master + s.optimizer == ds_gpu


def test_zero3_states_differ_from_deepspeeds_18_by_the_partitioned_bf16_weights(llama7b):
    """DeepSpeed's ZeRO-3 estimator charges 18 bytes/param/N (2 grads16 + 4 grads32 + 4 params32 + 8 Adam) and
    leaves out the rank's bf16 parameter partition (2P/N), which stage3.py allocates (fp16_partitioned_groups);
    ours counts it, and the fp32 gradient only per sub-group during the step."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    P, N, largest = llama7b.params, 8, llama7b.largest_layer_params
    _, ds_gpu, ds_largest = estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=N, cpu_offload=False)
    s = zero_states(P, Job(seq_len=8), parse_strategy("zero3"), dp=N, hidden=4096, largest_layer=largest)
    ours_sharded = s.parameters + s.gradients + s.step_transient + s.master + s.optimizer
    assert ours_sharded - 2 * P / N == pytest.approx(ds_gpu - ds_largest, rel=1e-6)


def test_offload_moves_sixteen_bytes_per_parameter_to_host_ram_per_node(llama7b):
    hw = parse_hardware("8xA100-80GB")
    b = estimate_memory(llama7b, parse_strategy("zero2-offload"), Job(seq_len=1024), hw)
    # fp32 master 4 + Adam 8 + fp32 grads 4, over 8 ranks, 8 ranks per node.
    assert b.cpu_bytes_per_node == pytest.approx(16 * llama7b.params, rel=1e-6)


def test_more_gpus_shrink_zero3_but_not_ddp(llama7b):
    job = Job(seq_len=1024)
    z8 = estimate_memory(llama7b, parse_strategy("zero3"), job, parse_hardware("8xH100-80GB"))
    z16 = estimate_memory(llama7b, parse_strategy("zero3"), job, parse_hardware("2x8xH100-80GB"))
    d8 = estimate_memory(llama7b, parse_strategy("ddp"), job, parse_hardware("8xH100-80GB"))
    d16 = estimate_memory(llama7b, parse_strategy("ddp"), job, parse_hardware("2x8xH100-80GB"))
    assert z16.optimizer_bytes * 2 == pytest.approx(z8.optimizer_bytes, rel=1e-9)
    assert d16.peak_bytes == d8.peak_bytes


def test_required_adds_context_and_margin_to_the_peak(llama7b):
    b = estimate_memory(llama7b, parse_strategy("zero3"), Job(seq_len=2048), parse_hardware("8xH100-80GB"))
    assert b.required_bytes == b.peak_bytes + b.context_bytes + b.margin_bytes
    assert b.capacity_bytes == pytest.approx(79.1 * GIB, rel=0.01)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, no traceback


@pytest.mark.parametrize("argv, fragment", [
    (["no-such-model"], "unknown model"),
    (["gpt2", "--gpus", "8xFOO"], "unknown GPU"),
    (["gpt2", "--gpus", "0xH100-80GB"], "zero or negative"),
    (["gpt2", "--seq", "0"], "--seq must be a positive integer"),
    (["gpt2", "--micro-batch", "-2"], "--micro-batch must be a positive integer"),
    (["gpt2", "--strategy", "zero9"], "unknown strategy"),
    (["gpt2", "--precision", "fp8"], "--precision"),
    (["gpt2", "--seq", "4096"], "longer than gpt2 allows"),
    (["--layers", "32"], "needs --layers, --hidden and --heads"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    assert main(["estimate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err
    assert len(err.splitlines()) == 1


def test_malformed_config_json_is_refused(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    assert main(["estimate", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_bad_input_in_a_real_process_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "toolkit", "estimate", "gpt2", "--gpus", "8xFOO"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("error: unknown GPU 'FOO'")


@pytest.mark.parametrize("model_type, kwargs", [
    ("phi3", dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=500, pad_token_id=0)),
    ("gpt_neox", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      vocab_size=500)),
    ("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=500)),
    ("starcoder2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=500)),
    ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                       vocab_size=500)),
])
def test_parameter_count_is_exact_for_architectures_outside_the_catalog(tmp_path, model_type, kwargs):
    """Hand-written configs of other architectures: the meta-device count equals the real model's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **kwargs)
    (tmp_path / "config.json").write_text(config.to_json_string())
    spec = resolve_model(str(tmp_path))
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config)
    assert spec.params == sum(p.numel() for p in real.parameters())
    assert spec.num_layers == kwargs["num_hidden_layers"]


def test_checkpointing_is_spelled_the_same_in_every_command(capsys):
    """The bare `--checkpointing` (estimate's, profile's) and `--checkpointing on|off` (plan's, check's) work in
    each of them."""
    from toolkit.cli import main
    from toolkit.commands import build_parser

    parser = build_parser()
    for argv, expected in ((["estimate", "gpt2", "--checkpointing"], True),
                           (["estimate", "gpt2", "--checkpointing", "off"], False),
                           (["estimate", "gpt2", "--checkpointing", "on"], True), (["estimate", "gpt2"], False),
                           (["profile", "gpt2", "--checkpointing", "on"], True),
                           (["plan", "gpt2", "--checkpointing"], "on"), (["plan", "gpt2", "--checkpointing", "off"], "off"),
                           (["check", "x.json", "--checkpointing"], "on"),
                           # torchtitan's per-op selective policy: one word in every command (plan / check refuse it)
                           (["estimate", "gpt2", "--checkpointing", "op"], "op"),
                           (["profile", "gpt2", "--checkpointing", "op"], "op"),
                           (["plan", "gpt2", "--checkpointing", "op"], "op"),
                           (["check", "x.json", "--checkpointing", "op"], "op")):
        assert parser.parse_args(argv).checkpointing == expected, argv
    assert main(["estimate", "gpt2", "--checkpointing", "maybe"]) == 2
    assert "give on, off or op" in capsys.readouterr().err


def test_a_config_without_reduce_bucket_size_gets_deepspeeds_5e8_element_buffer(llama7b):
    """accelerate's inline deepspeed_config leaves reduce_bucket_size to DeepSpeed (DeepSpeedZeroConfig: 5e8), and
    ZeRO-3 allocates its IPG buffer of that many bf16 elements at engine start; the HF "auto" fill is h x h."""
    from toolkit.engines.readers import zero_default

    assert zero_default("reduce_bucket_size") == 500_000_000
    assert zero_default("stage3_prefetch_bucket_size") == 50_000_000  # by alias
    job = Job(seq_len=8)
    auto = zero_states(llama7b.params, job, parse_strategy("zero3"), dp=8, hidden=4096, largest_layer=0)
    inline = zero_states(llama7b.params, Job(seq_len=8, zero_reduce_bucket=500_000_000), parse_strategy("zero3"),
                         dp=8, hidden=4096, largest_layer=0)
    assert auto.buffers == 4096 * 4096 * 2
    assert inline.buffers == 500_000_000 * 2
    assert "5e+08-element reduce bucket" in inline.sources[0] and "h^2" in auto.sources[0]


def test_zero2_with_overlap_comm_holds_two_reduce_buckets_in_backward(llama7b):
    """overlap_comm makes DeepSpeed's setup_buckets allocate a second IPG buffer (next test, the engine itself):
    ms-swift's 2e8-element buckets are 0.37 GiB each in bf16."""
    strategy = parse_strategy("zero2")
    one = zero_states(llama7b.params, Job(seq_len=8, zero_reduce_bucket=200_000_000), strategy, dp=2, hidden=4096,
                      largest_layer=0)
    two = zero_states(llama7b.params, Job(seq_len=8, zero_reduce_bucket=200_000_000, zero_overlap_comm=True),
                      strategy, dp=2, hidden=4096, largest_layer=0)
    assert one.backward_buffers == 200_000_000 * 2
    assert two.backward_buffers == 2 * 200_000_000 * 2
    assert "two (overlap_comm) 2e+08-element reduce bucket(s)" in two.sources[0]


ONE_RANK_ZERO2_BUCKETS = """
import json, torch, deepspeed
deepspeed.init_distributed(dist_backend="gloo")
out = {}
for overlap in (False, True):
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "overlap_comm": overlap, "contiguous_gradients": True,
                                 "reduce_bucket_size": 4096},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    seen = []
    setup = engine.optimizer.setup_buckets
    def recorded():
        setup()
        seen.append([b.numel() for bucket in engine.optimizer.ipg_buckets.values() for b in bucket.buffer])
    engine.optimizer.setup_buckets = recorded
    engine.backward(engine(torch.randn(2, 64, dtype=torch.bfloat16)).float().pow(2).mean())
    engine.step()
    out[str(overlap)] = seen[-1]
print(json.dumps(out))
"""


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_deepspeed_zero2_allocates_a_second_reduce_bucket_under_overlap_comm():
    """DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py setup_buckets: one IPG buffer of reduce_bucket_size
    elements for backward, and a second beside it when overlap_comm is on ('double buffers')."""
    import os
    import subprocess
    import sys

    from toolkit.run.launcher import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", ONE_RANK_ZERO2_BUCKETS], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {"False": [4096], "True": [4096, 4096]}


def test_zero3_on_one_rank_gathers_nothing(llama7b):
    """A ZeRO-3 partition world of one: DeepSpeed points each parameter at its own partition instead of gathering
    (next test), so no gathered bytes; two ranks gather, and so does one rank offloading its parameters (the
    partition is copied from the CPU)."""
    P, largest = llama7b.params, llama7b.largest_layer_params
    one = zero_states(P, Job(seq_len=8), parse_strategy("zero3"), dp=1, hidden=4096, largest_layer=largest)
    two = zero_states(P, Job(seq_len=8), parse_strategy("zero3"), dp=2, hidden=4096, largest_layer=largest)
    off = zero_states(P, Job(seq_len=8), parse_strategy("zero3-offload"), dp=1, hidden=4096, largest_layer=largest)
    assert one.gathered == 0 and "nothing gathered (one rank)" in one.sources[0]
    # bf16: half a billion elements of reuse window, the largest layer and the prefetch bucket, 2 B each
    assert two.gathered == off.gathered == (0.5e9 + largest + 0.9 * 4096 * 4096) * 2


ONE_RANK_ZERO3 = """
import json, os, torch, deepspeed
from torch.profiler import ProfilerActivity, profile
deepspeed.init_distributed(dist_backend="gloo")
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
with deepspeed.zero.Init(config_dict_or_path=cfg):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
seen = []
def hook(module, args):
    for p in module.parameters(recurse=False):
        seen.append(p.data.untyped_storage().data_ptr() == p.ds_tensor.untyped_storage().data_ptr())
for m in engine.module:
    m.register_forward_pre_hook(hook)
def walk(nodes):
    for node in nodes:
        yield node
        yield from walk(node.children)
def sizes(prof):
    return [size for *_, size in sorted(
        (n.start_time_ns, i, n.extra_fields.alloc_size) for i, n in
        enumerate(walk(prof.profiler.kineto_results.experimental_event_tree()))
        if type(n.extra_fields).__name__ == "_ExtraFields_Allocation")]
loss = engine(torch.randn(2, 64, dtype=torch.bfloat16)).float().pow(2).mean()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as backward:
    engine.backward(loss)
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as step:
    engine.step()
print(json.dumps({"shares_partition": seen, "backward": sizes(backward), "step": sizes(step)}))
"""


@pytest.fixture(scope="module")
def one_rank_zero3() -> dict:
    """DeepSpeed 0.19.8's ZeRO-3 engine on one gloo rank, two Linear layers in bf16, one step (ONE_RANK_ZERO3):
    whether each parameter computes on its partition, and the CPU allocator's byte sizes (+ made, - freed) during
    engine.backward and engine.step (torch.profiler's allocation events, in order)."""
    import os
    import subprocess
    import sys

    from toolkit.run.launcher import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", ONE_RANK_ZERO3], env=env, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_deepspeed_zero3_on_one_rank_computes_on_the_partition_itself(one_rank_zero3):
    """DeepSpeed 0.19.8 (runtime/zero/partition_parameters.py all_gather_coalesced -> _no_gather_coalesced,
    NoGatherHandle): with a partition world of one, every parameter in forward is its partition's own storage, so
    ZeRO-3 on one GPU allocates no gathered copy (zero_states' rule above)."""
    assert one_rank_zero3["shares_partition"] == [True] * 4  # two Linear layers' weight and bias


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_zero3s_backward_and_step_allocate_as_the_replays_rules(one_rank_zero3):
    """The same run's allocations against toolkit.estimate.engineevents' ZeRO-3 rules. Backward: each parameter's
    whole bf16 gradient (the second layer's weight, 16,384 elements, and bias, then the first's weight), dropped
    once copied into the IPG buffer, then one cat buffer of the bucket (33,088 elements) for its reduction. Step:
    the gradient norms take each partition in fp64 one at a time, in the parameters' order, then the sub-group's
    bf16 flatten, its fp32 cast, and the flatten freed: the same signed sizes the rules replay."""
    from types import SimpleNamespace

    from toolkit.estimate.activations import RegionTrace
    from toolkit.estimate.reserved import StepSizes, step_events

    backward = [size for size in one_rank_zero3["backward"] if abs(size) >= 128]
    grads = [backward.index(32768), backward.index(128), backward.index(32768, backward.index(128))]
    assert grads == sorted(grads)
    cat = backward.index(33088 * 2)
    assert backward.count(-32768) == 2 and max(i for i, s in enumerate(backward) if s == -32768) < cat

    trace = RegionTrace(0, 0, 0, forward_events=(), backward_events=())
    regions = [SimpleNamespace(params=n, trace=trace) for n in (16384 + 256, 16384 + 64)]
    sizes = StepSizes(persistent=0, optimizer=0, gathered=0, reduce_buffers=0, reduce_stream=False,
                      step_gradients=0, backward_gradients=0, step_transient=4 * 33088, flat_partitions=(33088,),
                      tensors=((16384, 256), (16384, 64)), engine="zero3", param_bytes=2.0,
                      bucket_elements=500_000_000)
    events = step_events(regions, sizes, steps=1)
    sizes_of = {e[1]: e[2] for e in events if e[0] == "malloc"}
    start = next(i for i, e in enumerate(events) if e[0] == "malloc" and e[1][0] == "norm")
    ours = [sizes_of[e[1]] if e[0] == "malloc" else -sizes_of[e[1]] for e in events[start:start + 11]]
    real = [size for size in one_rank_zero3["step"] if abs(size) >= 512][:11]
    assert ours == real == [131072, -131072, 2048, -2048, 131072, -131072, 512, -512, 66176, 132352, -66176]

"""Tensor, context and sequence parallelism: the grid's composition rules, plan.json's degrees, and what the model's
own tp_plan shards (issue 17, planning side)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.errors import UserError
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.modelspec import resolve_model
from toolkit.inputs.strategy import parse_strategy

ROOT = Path(__file__).resolve().parent.parent


def _grid(strategy: str, gpus: int = 8, nodes: int = 1, **degrees) -> ParallelGrid:
    return ParallelGrid.for_strategy(parse_strategy(strategy), nodes=nodes, gpus_per_node=gpus, **degrees)


# --- the grid ----------------------------------------------------------------------------------------------------

def test_fsdp2_with_tensor_parallel_shards_the_rest_of_the_world_and_keeps_tp_in_a_node():
    g = _grid("fsdp2", tensor=4)
    assert (g.dp_shard, g.tensor, g.data_parallel, g.shard_group, g.world) == (2, 4, 2, 2, 8)
    hsdp = _grid("fsdp2-hybrid", nodes=2, tensor=4)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.tensor, hsdp.data_parallel) == (2, 2, 4, 4)
    with pytest.raises(UserError, match="does not divide the 8 GPUs of a node"):
        _grid("fsdp2", nodes=2, tensor=16)


def test_context_parallel_ranks_join_fsdp2s_shard_group_but_not_the_data_parallel_degree():
    g = _grid("fsdp2", context=4)
    assert (g.data_parallel, g.shard_group, g.seq_split) == (2, 8, 4)  # accelerate's dp_shard_cp mesh
    assert g.global_batch(micro_batch=1, grad_accum=3) == 6


def test_zero_under_ulysses_partitions_over_dp_times_sp():
    g = _grid("zero3", sequence=8)
    assert (g.data_parallel, g.shard_group, g.seq_split) == (1, 8, 8)


def test_zero3_under_ulysses_keeps_its_reduce_bucket_in_deepspeeds_fp32_sp_dtype():
    """DeepSpeed's engine reduces in seq_parallel_communication_data_type once SP is above one (engine.py
    _configure_distributed_model), and ZeRO-3 allocates its IPG bucket in it: fp32 by the installed DeepSpeed's own
    default (toolkit.inputs.spreduce reads constants.py without importing it; DeepSpeedConfig reads the same), which
    toolkit's JSON leaves in place. Qwen3-4B on 4 GPUs, accelerate's inline config (reduce_bucket_size 5e8):
    the bucket is 2.0 GB at SP 4, 1.0 GB in bf16 without SP."""
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    from toolkit.estimate.memory import states_for
    from toolkit.inputs.job import Job
    from toolkit.inputs.spreduce import sp_default_dtype, zero_reduce_bytes

    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                              "zero_optimization": {"stage": 3}}, mpu=None)
    assert config.seq_parallel_communication_data_type == torch.float32 and sp_default_dtype() == "fp32"
    assert (zero_reduce_bytes("bf16", 4), zero_reduce_bytes("bf16", 1)) == (4, 2)
    spec = resolve_model(str(ROOT / "benchmarks" / "data" / "models" / "qwen3-4b.json"))
    job = Job(seq_len=8192, precision="bf16", checkpointing=True, zero_reduce_bucket=500_000_000)
    zero3 = parse_strategy("zero3")
    buckets = [states_for(spec, zero3, job, _grid("zero3", gpus=4, **degrees), params=spec.params).buffers
               for degrees in ({"sequence": 4}, {})]
    assert buckets == [2e9, 1e9]


@pytest.mark.parametrize("strategy, degrees, fragment", [
    ("zero3", {"tensor": 2}, "tensor parallelism runs under FSDP2"),
    ("zero2", {"context": 2}, "context parallelism runs under FSDP2"),
    ("fsdp2", {"sequence": 2}, "sequence parallelism (Ulysses) runs under DeepSpeed ZeRO"),
    ("ddp", {"sequence": 2}, "runs under DeepSpeed ZeRO"),
    ("hybrid", {"sequence": 2}, "pipeline engine runs no tensor"),
    ("fsdp2", {"context": 2, "sequence": 2}, "sequence parallelism"),
    ("fsdp2", {"tensor": 8}, "leaves FSDP2 nothing to shard"),
    ("fsdp2", {"tensor": 3}, "does not divide the 8 GPUs"),
    ("fsdp2", {"context": 16}, "does not divide 8 GPUs"),
    ("fsdp2", {"tensor": 2, "context": 2}, "is not planned"),
])
def test_combinations_the_engines_refuse_are_refused_naming_the_knob(strategy, degrees, fragment):
    with pytest.raises(UserError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        _grid(strategy, **degrees)


def test_context_and_sequence_cannot_combine_even_on_a_grid_built_by_hand():
    with pytest.raises(UserError, match="cannot combine"):
        ParallelGrid(1, 8, dp_shard=2, context=2, sequence=2)


def test_the_sequence_must_split_over_sp_and_into_2cp_chunks_with_a_supported_attention():
    sp, cp = _grid("zero3", sequence=8), _grid("fsdp2", context=4)
    sp.check_sequence(8192, "sdpa")
    cp.check_sequence(8192, "sdpa")
    with pytest.raises(UserError, match="--seq 8191 does not split over sequence parallel 8.*use --seq 8184"):
        sp.check_sequence(8191, "sdpa")
    with pytest.raises(UserError, match="eager"):
        sp.check_sequence(8192, "eager")
    with pytest.raises(UserError, match="2 x context parallel = 8"):
        cp.check_sequence(8196, "sdpa")
    with pytest.raises(UserError, match="needs --attention sdpa"):
        cp.check_sequence(8192, "flash_attention_2")


def test_heads_must_split_over_tensor_and_sequence_degrees():
    spec = resolve_model("llama-3.1-8b")  # 32 heads, 8 KV heads
    _grid("zero3", sequence=8).check_model(spec)
    _grid("fsdp2", gpus=16, nodes=1, tensor=8).check_model(spec)
    with pytest.raises(UserError, match="does not divide llama-3.1-8b's 32 attention heads"):
        _grid("zero3", gpus=12, sequence=12).check_model(spec)
    with pytest.raises(UserError, match="does not divide llama-3.1-8b's 8 KV heads"):
        _grid("fsdp2", gpus=32, tensor=16).check_model(spec)
    with pytest.raises(UserError, match="no tp_plan"):
        _grid("fsdp2", tensor=2).check_model(resolve_model("gpt2"))


# --- plan.json -----------------------------------------------------------------------------------------------------

def _plan_data(**changes):
    data = json.loads((ROOT / "presets/sets/fsdp2-bf16/plan.json").read_text())
    data.update(changes)
    return data


def test_plan_json_carries_the_degrees_and_builds_its_grid_from_them():
    from toolkit.plan.schema import parse_plan

    base = parse_plan(_plan_data())  # Llama-2-7B fsdp2 on 8 GPUs, global batch 128 = 2 x 8 x 8
    assert (base.tensor_parallel, base.context_parallel, base.sequence_parallel) == (1, 1, 1)
    plan = parse_plan(_plan_data(tensor_parallel=2, grad_accum=16))
    assert (plan.grid.tensor, plan.grid.data_parallel, plan.data_parallel) == (2, 4, 4)
    with pytest.raises(UserError, match="batch does not multiply.*accumulation 16 makes it hold"):
        parse_plan(_plan_data(tensor_parallel=2))
    with pytest.raises(UserError, match="--seq 4095 does not split into 2 x context parallel = 4"):
        parse_plan(_plan_data(context_parallel=2, grad_accum=16, seq_len=4095))


def test_a_plan_with_degrees_the_engines_refuse_names_the_field():
    from toolkit.plan.schema import parse_plan

    with pytest.raises(UserError, match="sequence parallelism .Ulysses. runs under DeepSpeed ZeRO"):
        parse_plan(_plan_data(sequence_parallel=2))
    with pytest.raises(UserError, match="'tensor_parallel'"):
        parse_plan(_plan_data(tensor_parallel=0))


def test_plans_without_degrees_keep_their_prediction_key():
    from toolkit.plan.schema import parse_plan

    plan = parse_plan(_plan_data())
    assert not plan.prediction_is_stale


# --- the model's tp_plan ---------------------------------------------------------------------------------------

def test_tp_sharded_parameters_are_the_sum_over_the_tp_plans_modules():
    from toolkit.inputs.tensorplan import model_tp_plan, per_rank_spec, tensor_split

    spec = resolve_model("llama-3.1-8b")
    plan = model_tp_plan(spec)
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise" and plan["lm_head"] == "colwise_gather_output"
    split = tensor_split(spec, 4)
    h, kv, ffn = 4096, 8 * 128, 14336
    sharded = h * h * 2 + h * kv * 2 + 3 * h * ffn  # q, o; k, v; gate, up, down (no biases in Llama)
    assert split.layer_sharded_params == sharded
    assert split.layer_whole_params == 2 * h  # the two RMSNorms stay whole on every rank
    assert split.layer_sharded_params + split.layer_whole_params == spec.layer_params[0]
    assert split.rank_layer_params == sharded // 4 + 2 * h
    # embed_tokens (embedding_rowwise) and lm_head (colwise_gather_output) split the vocabulary; the norm stays whole
    assert split.rank_outside_params == 2 * (128256 // 4) * h + h
    rank = per_rank_spec(spec, 4)
    assert rank.params == spec.num_layers * split.rank_layer_params + split.rank_outside_params
    text = rank.hf_config()
    assert (text.num_attention_heads, text.num_key_value_heads, text.intermediate_size, text.head_dim) == \
        (8, 2, 3584, 128)


# --- memory per rank -------------------------------------------------------------------------------------------

def _small(kv_heads: int = 2, positions: int = 65536):
    """A Llama-shaped model small enough to trace in a second: 2 layers, hidden 256, 8 heads."""
    from toolkit.inputs.modelconfig import shape_config
    from toolkit.inputs.modelspec import build_spec

    return build_spec("small", shape_config(layers=2, hidden=256, heads=8, kv_heads=kv_heads, vocab=1000,
                                            max_positions=positions))


def test_sp_activations_at_seq_s_are_the_trace_at_s_over_sp_plus_ulysses_kv_replication():
    from toolkit.estimate.dimensions import kv_replication_bytes
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.traces import scaled_trace

    hw = parse_hardware("4xH100-80GB")
    strategy = parse_strategy("zero3")
    for kv_heads in (4, 2):  # 4 KV heads: split over sp 4; 2 KV heads: each rank holds one whole KV head
        spec = _small(kv_heads=kv_heads)
        job = Job(seq_len=8192, micro_batch=1)
        b = estimate_memory(spec, strategy, job, hw, grid=_grid("zero3", gpus=4, sequence=4))
        local = scaled_trace(spec, Job(seq_len=2048, micro_batch=1), strategy)
        traced = local.embedding.saved_bytes + sum(r.saved_bytes for r in local.layers) + local.head.saved_bytes
        replication = kv_replication_bytes(spec, job, 4)
        assert replication == (0 if kv_heads == 4 else 2 * 32 * 2 * (8192 - 2048 * 2))  # k, v x head_dim x bf16
        assert b.activations_bytes == traced + spec.num_layers * replication


def test_tp_parameters_per_rank_are_the_tp_plans_share_sharded_again_by_fsdp2():
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.tensorplan import per_rank_spec

    spec = _small(kv_heads=4)
    hw = parse_hardware("8xH100-80GB")
    job = Job(seq_len=2048, micro_batch=1)
    tp = estimate_memory(spec, parse_strategy("fsdp2"), job, hw, grid=_grid("fsdp2", tensor=4))
    plain = estimate_memory(spec, parse_strategy("fsdp2"), job, parse_hardware("2xH100-80GB"))
    rank = per_rank_spec(spec, 4)
    assert rank.params < spec.params / 3  # everything but the norms splits
    # fsdp2 over dp_shard 2: the same per-parameter bytes as plain FSDP2 on 2 GPUs, applied to one TP rank's share
    assert tp.optimizer_bytes == pytest.approx(plain.optimizer_bytes * rank.params / spec.params, rel=1e-6)


def test_tp_head_gathers_whole_logits_in_forward_and_fsdp2_keeps_only_the_fsdp_plans_tail():
    """benchmarks/results/dimension_memory.md: measured on 4 CPU processes, the FSDP2 x TP peak of the tiny Llama is
    the LM head's forward (colwise_gather_output's all-gather), with only the fsdp_plan's keep_full_weight tail
    unsharded (the layers and the embedding are resharded after forward)."""
    from toolkit.estimate.dimensions import apply_to_trace, logits_gather_bytes, rank_view
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.traces import scaled_trace
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.tensorplan import model_fsdp_plan, tensor_split

    spec = _small(kv_heads=4)
    split = tensor_split(spec, 2)
    assert split.head_style == "colwise_gather_output"
    assert model_fsdp_plan(spec)["model.norm"] == "keep_full_weight"
    # kept unsharded from the head's forward to its backward: the whole norm and half of the untied LM head
    assert split.rank_kept_outside_params == 256 + 1000 * 256 // 2 and not split.layers_kept
    job = Job(seq_len=128, micro_batch=2, precision="fp32", device_kind="cpu")
    strategy = parse_strategy("fsdp2")
    grid = _grid("fsdp2", gpus=4, tensor=2)
    view = rank_view(spec, job, grid)
    trace = scaled_trace(view.spec, view.job, strategy)
    logits = 2 * 128 * 1000 * 4
    assert trace.output_bytes == logits
    head = apply_to_trace(trace, view, False).head
    # the rank's half of the logits + the all-gather buffer + the gathered logits, before the fp32 log-softmax
    assert logits_gather_bytes(trace, trace.head, 2) == logits // 2 + 2 * logits - logits
    assert head.forward_extra_bytes == max(trace.head.forward_extra_bytes, logits // 2 + logits)
    b = estimate_memory(spec, strategy, job, parse_hardware("4xA100-80GB"), grid=grid)
    kept = split.rank_kept_outside_params * 4
    # one layer's unsharded gradients; the tail is unsharded from the head's forward (with its all-gather output)
    # to the end of the head's backward, then resharded (FSDP2's post_backward): the head's, not a constant
    assert b.buffers_bytes == view.spec.layer_params[0] * 4 and kept > 0


def test_cp_memory_is_the_trace_at_seq_over_cp_plus_the_gathered_kv():
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.traces import scaled_trace

    spec = _small(kv_heads=4)
    strategy = parse_strategy("fsdp2")
    b = estimate_memory(spec, strategy, Job(seq_len=8192), parse_hardware("4xH100-80GB"),
                        grid=_grid("fsdp2", gpus=4, context=4))
    local = scaled_trace(spec, Job(seq_len=2048), strategy)
    assert b.activations_bytes == local.embedding.saved_bytes + sum(r.saved_bytes for r in local.layers) \
        + local.head.saved_bytes
    gathered = next(t for t in b.terms if "all-gather" in t.name)
    assert gathered.bytes == 2 * 8192 * 4 * 32 * 2  # k and v of the whole sequence, bf16


def test_model_parallel_comm_terms_are_the_ring_and_all_to_all_volumes():
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.timing import tensor_parallel_comm_s, ulysses_comm_s

    spec = resolve_model("llama-3.1-8b")
    hw = parse_hardware("8xH100-80GB")
    job = Job(seq_len=8192, micro_batch=1, grad_accum=2)
    bw = hw.gpu.intra_node_gbps * 1e9
    tp = tensor_parallel_comm_s(spec, job, _grid("fsdp2", tensor=4), hw)
    assert tp == pytest.approx(2 * 4 * 32 * 2 * 3 / 4 * 8192 * 4096 * 2 / bw)
    sp = ulysses_comm_s(spec, job, _grid("zero3", sequence=8), hw)
    local = 1024 * 128 * 2
    assert sp == pytest.approx(2 * 32 * 2 * 7 / 8 * (local * (32 + 16) + local * 32) / bw)


# --- the planner and --seq max ---------------------------------------------------------------------------------

def test_llama_8b_at_128k_on_8_h100s_fits_only_by_splitting_the_sequence():
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import plan_candidates

    spec, hw = resolve_model("llama-3.1-8b"), parse_hardware("8xH100-80GB")
    cands = plan_candidates(spec, hw, Request(seq_len=131072, micro_batch=1, checkpointing=True, tiled=False,
                                              savers=False))
    feasible = [c for c in cands if c.feasible]
    assert feasible and all(c.grid.seq_split == 8 for c in feasible)
    assert {c.dimension for c in feasible} == {"cp", "sp"}
    assert any(c.name == "fsdp2 (dp=2 x tp=4)" and "needs" in c.reason for c in cands)
    assert all(c.reason for c in cands if not c.feasible)
    # By default the planner also tiles, or else tries Liger / activation offloading, where a row fits nothing
    # plain: ZeRO-3 then fits unsplit tiled (with its optimizer offloaded: in GPU memory alone its replayed reserved
    # memory leaves it inside the error band), and every unsplit row that fits needs tiling or a saver.
    auto = plan_candidates(spec, hw, Request(seq_len=131072, micro_batch=1, checkpointing=True))
    unsplit = [c for c in auto if c.feasible and c.grid.seq_split == 1]
    assert any(c.name == "zero3-offload-opt +tiled" for c in unsplit)
    assert all(c.job.tiled or c.job.liger or c.job.activation_offloading for c in unsplit)


def test_a_trace_between_two_powers_of_two_is_their_interpolation_and_equals_the_exact_trace():
    from dataclasses import asdict

    from toolkit.inputs.job import Job
    from toolkit.estimate.traces import activation_trace, traces_linear_in_seq

    spec = _small()
    strategy = parse_strategy("zero3")
    exact = activation_trace(spec, Job(seq_len=6144, checkpointing=True), strategy, 1)
    with traces_linear_in_seq():
        lerped = activation_trace(spec, Job(seq_len=6144, checkpointing=True), strategy, 1)
    assert asdict(lerped) == asdict(exact)


def test_seq_max_finds_the_longest_length_that_fits_and_the_next_granule_does_not():
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.estimate.longest import granule, longest_on_grid
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import evaluate

    spec = resolve_model("qwen2.5-7b")
    hw = parse_hardware("8xH100-80GB")
    grid = _grid("zero3", sequence=4)
    found = longest_on_grid(spec, hw, parse_strategy("zero3"), grid, Request(seq_len=1, micro_batch=1,
                                                                             checkpointing=True))
    g = granule(grid)
    assert 32768 < found.seq_len < spec.max_positions and found.seq_len % g == 0
    at = evaluate(spec, hw, parse_strategy("zero3"), Job(seq_len=found.seq_len, checkpointing=True), grid)
    over = evaluate(spec, hw, parse_strategy("zero3"), Job(seq_len=found.seq_len + g, checkpointing=True), grid)
    assert at.feasible and not over.feasible
    assert [s for s, _ in found.curve][:3] == [1024, 2048, 4096]
    # Required bytes hold the allocator replay's reserved memory: at short lengths it can dip by a few segments (the
    # activations' blocks fitting into segments others left), never by 128 MiB; from 4096 tokens on it only grows.
    assert all(b2 > b1 - (1 << 27) for (_, b1), (_, b2) in zip(found.curve, found.curve[1:]))
    assert all(b1 <= b2 for (_, b1), (_, b2) in zip(found.curve[2:], found.curve[3:]))


# --- emitted configs, judged by the engines ----------------------------------------------------------------------

@pytest.mark.parametrize("preset, changes, engine", [
    ("zero3-bf16", {"sequence_parallel": 8, "grad_accum": 64}, "deepspeed"),
    ("zero2-bf16", {"sequence_parallel": 8, "grad_accum": 64}, "deepspeed"),
    ("fsdp2-bf16", {"context_parallel": 4, "grad_accum": 32}, "fsdp2"),
])
def test_emitted_parallelism_passes_accelerates_and_deepspeeds_own_checks(preset, changes, engine, tmp_path):
    import yaml

    from toolkit.emit import emit_files
    from toolkit.engines.validate import (accelerate_launch_plugins, validate_ds_config_for_plan,
                                       validate_parallelism_config)
    from toolkit.plan.schema import parse_plan

    data = json.loads((ROOT / f"presets/sets/{preset}/plan.json").read_text())
    data.update(changes)
    plan = parse_plan(data)
    emit_files(plan, tmp_path / "p")
    block = yaml.safe_load((tmp_path / "p/accelerate_config.yaml").read_text())["parallelism_config"]
    args, plugin, env = accelerate_launch_plugins(tmp_path / "p/accelerate_config.yaml")
    settings = json.loads((tmp_path / "p/training_args.json").read_text())
    pc = validate_parallelism_config(settings["parallelism_config"], world_size=8, engine=engine)
    g = plan.grid
    assert (pc.tp_size, pc.cp_size, pc.sp_size, pc.dp_shard_size) == (g.tensor, g.context, g.sequence, g.dp_shard)
    assert env["PARALLELISM_CONFIG_DP_SHARD_SIZE"] == str(g.dp_shard)
    assert all(key.startswith("parallelism_config_") for key in block)
    plan_md = (tmp_path / "p/PLAN.md").read_text()
    assert "ParallelismConfig(**" in plan_md
    if engine == "deepspeed":
        ds = json.loads((tmp_path / "p/ds_config.json").read_text())
        # The Trainer-filled file leaves the key out (zero.Init would divide the Trainer's all-rank batch by it);
        # the concrete file, whose train_batch_size counts world / sp ranks, has it.
        assert "sequence_parallel_size" not in ds
        concrete = tmp_path / "p/ds_config.deepspeed.json"
        if concrete.is_file():
            assert json.loads(concrete.read_text())["sequence_parallel_size"] == 8
        parsed = validate_ds_config_for_plan(ds, plan)
        assert parsed.train_batch_size == 128 and parsed.gradient_accumulation_steps == 64
        if plan.zero_stage < 3:  # averaged over dp x sp = 8 ranks, not summed over the SP ranks (issue 32)
            assert (parsed.gradient_predivide_factor, parsed.zero_config.reduce_scatter) == (8, False)
        assert block["parallelism_config_sp_seq_length"] == plan.seq_len
        assert "UlyssesSPDataLoaderAdapter" in plan_md and "shift_labels" in plan_md


def test_tensor_parallel_plans_load_through_transformers_distributed_config(tmp_path):
    import yaml
    from transformers.distributed import DistributedConfig

    from toolkit.emit import emit_files
    from toolkit.engines.validate import accelerate_launch_plugins
    from toolkit.plan.schema import parse_plan

    data = json.loads((ROOT / "presets/sets/fsdp2-bf16/plan.json").read_text())
    data.update(tensor_parallel=2, grad_accum=16, checkpointing=True)
    plan = parse_plan(data)
    emit_files(plan, tmp_path / "p")
    config = yaml.safe_load((tmp_path / "p/accelerate_config.yaml").read_text())
    assert config["distributed_type"] == "MULTI_GPU" and "fsdp_config" not in config
    assert "parallelism_config" not in config
    args, plugin, env = accelerate_launch_plugins(tmp_path / "p/accelerate_config.yaml")
    assert args.num_processes == 8 and "ACCELERATE_USE_PARALLELISM_CONFIG" not in env
    settings = json.loads((tmp_path / "p/training_args.json").read_text())
    assert "parallelism_config" not in settings
    dist = DistributedConfig(**settings["distributed_config"])  # transformers' own checks
    assert (dist.tp_size, dist.fsdp_size, dist.fsdp_mixed_precision) == (2, 4, True)
    args_ = settings["training_arguments"]
    assert args_["save_only_model"] is True
    assert any(v is True for k, v in args_.items() if k.endswith("checkpointing"))  # no FSDP plugin to do it
    assert "DistributedConfig(**{'tp_size': 2, 'fsdp_size': 4" in (tmp_path / "p/PLAN.md").read_text()


def test_accelerate_refuses_what_our_validation_refuses():
    from toolkit.engines.validate import ConfigRejected, validate_parallelism_config

    with pytest.raises(ConfigRejected, match="mutually exclusive"):
        validate_parallelism_config({"dp_shard_size": 2, "cp_size": 2, "sp_size": 2}, world_size=8, engine="fsdp2")
    with pytest.raises(ConfigRejected, match="total_size"):
        validate_parallelism_config({"dp_shard_size": 2, "tp_size": 2}, world_size=8, engine="fsdp2")
    with pytest.raises(ConfigRejected, match="FSDP2"):
        validate_parallelism_config({"dp_shard_size": 4, "tp_size": 2}, world_size=8, engine="deepspeed")


# --- the command line: must-show answers and bad input -----------------------------------------------------------

def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("argv, fragment", [
    (["estimate", "llama-3.1-8b", "--gpus", "2x16xH100-80GB", "--strategy", "fsdp2", "--tensor-parallel", "16"],
     "does not divide llama-3.1-8b's 8 KV heads"),
    (["estimate", "llama-3.1-8b", "--strategy", "zero3", "--sequence-parallel", "8", "--seq", "4"],
     "--seq 4 does not split over sequence parallel 8"),
    (["estimate", "llama-3.1-8b", "--strategy", "fsdp2", "--context-parallel", "2", "--attention", "eager"],
     "context parallelism (torch ring attention) needs --attention sdpa"),
    (["plan", "llama-3.1-8b", "--strategies", "fsdp2", "--sequence-parallel", "2", "--seq", "4096",
      "--micro-batch", "1"], "--sequence-parallel 2 is planned under zero3, zero2, zero1 only (x SP), and --strategies "
                             "fsdp2 names none of them"),
    (["estimate", "gpt2", "--strategy", "fsdp2", "--tensor-parallel", "2"], "has no tp_plan"),
    (["estimate", "mistral-7b", "--strategy", "zero3", "--sequence-parallel", "2", "--seq", "8192"],
     "Ulysses drops the mask that holds its 4096-token sliding window; use --attention flash_attention_2"),
    (["plan", "phi-3-mini", "--gpus", "8xH100-80GB", "--context-parallel", "2", "--seq", "4096", "--micro-batch",
      "1"], "--context-parallel 2 cannot run phi-3-mini: its sliding_attention layers need their own mask"),
    # a fixed degree no strategy of the grid can run is bad input (issue 33): one line naming the rule, exit 2
    (["estimate", "tiny-positions", "--strategy", "zero3", "--seq", "max"], "stops at 64"),
    # 256 positions, but cp 3 splits only multiples of lcm(128, 2 x 3) = 384 tokens: no length to answer with.
    (["estimate", "tiny-positions", "--strategy", "fsdp2", "--gpus", "3xH100-80GB", "--context-parallel", "3", "--seq",
      "max"], "searches lengths in multiples of 384 tokens"),
])
def test_bad_degrees_get_one_line_and_exit_2(argv, fragment, capsys, tmp_path, monkeypatch):
    from toolkit.cli import main

    if "tiny-positions" in argv:
        from toolkit.inputs.modelconfig import shape_config

        cfg = shape_config(layers=2, hidden=64, heads=4, vocab=100,
                           max_positions=256 if "--context-parallel" in argv else 64)
        cfg.save_pretrained(tmp_path / "tiny-positions")
        monkeypatch.chdir(tmp_path)
    code = main(argv)
    assert code == 2
    assert fragment in _one_error_line(capsys)


@pytest.mark.parametrize("model", ["mistral-7b", "phi-3-mini"])
def test_context_parallel_refuses_a_windowed_model_whether_or_not_accelerate_checks(model, monkeypatch):
    """accelerate drops every layer's mask for is_causal; an accelerate that does not refuse a sliding-window model
    itself (an older one, or an import that failed) still would train it with full causal attention, so the probe
    reads the layer kinds from the config too, and both paths give the same reason."""
    import accelerate.big_modeling

    from toolkit.inputs import attention

    spec = resolve_model(model)
    with_check = attention._probe_context_parallel(spec)
    monkeypatch.setattr(accelerate.big_modeling, "_attach_context_parallel_hooks", lambda module: None)
    without = attention._probe_context_parallel(spec)
    assert with_check == without == ["its sliding_attention layers need their own mask, which accelerate's context "
                                     "parallelism drops (accelerate refuses such models)"]
    assert attention._probe_context_parallel(resolve_model("llama-3.1-8b")) == []


def test_plan_refuses_cp_and_sdpa_sp_for_a_sliding_window_model_once_per_row(capsys):
    """Mistral-7B (a 4096-token window on every layer): accelerate refuses its CP, and Ulysses with sdpa would drop
    the window past 4096 tokens; each refused row says so once, for every degree, while TP still plans."""
    from toolkit.cli import main

    assert main(["plan", "mistral-7b", "--gpus", "8xH100-80GB", "--seq", "8192", "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split(":", 1)[0].strip(): line for line in out.splitlines() if " x cp:" in line or " x sp:" in line}
    assert set(rows) == {"fsdp2 x cp", "zero1 x sp", "zero2 x sp", "zero3 x sp"}, rows
    assert "sliding_attention layers need their own mask" in rows["fsdp2 x cp"]
    assert "4096-token sliding window" in rows["zero3 x sp"]
    assert all(line.endswith("(the same for every degree tried: 2, 4, 8)") for line in rows.values()), rows
    assert "(dp=4 x tp=2)" in out


def test_seq_max_stops_ulysses_with_sdpa_at_the_sliding_window(capsys):
    """--seq max answers what a fixed --seq allows: past Mistral's 4096-token window Ulysses with sdpa is refused,
    so its longest sequence is the window, and the line says why and how to go further."""
    from toolkit.cli import main

    assert main(["estimate", "mistral-7b", "--gpus", "8xH100-80GB", "--strategy", "zero3", "--sequence-parallel", "2",
                 "--seq", "max"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "longest sequence 4,096 tokens (its 4096-token sliding window" in first
    assert "--attention flash_attention_2 keeps it" in first


def test_plan_at_8k_32k_128k_lists_tp_cp_sp_with_memory_and_time(capsys):
    from toolkit.cli import main

    for seq in (8192, 32768, 131072):
        main(["plan", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--seq", str(seq), "--micro-batch", "1", "--json"])
        out = json.loads(capsys.readouterr().out)
        rows = out["candidates"]
        for dim in ("tensor_parallel", "context_parallel", "sequence_parallel"):
            assert any(r[dim] > 1 for r in rows), (seq, dim)
        assert all(r["reason"] for r in rows if not r["feasible"])
        assert all(r["peak_bytes"] and r["tokens_per_s"] for r in rows if r["feasible"])
        if seq == 131072:
            assert out["chosen"]["context_parallel"] * out["chosen"]["sequence_parallel"] == 8


@pytest.mark.parametrize("degree, derived, comm", [
    ("--tensor-parallel 4", "tensor-parallel all-reduce buffer", "4 blocking all-reduces per layer"),
    ("--context-parallel 4", "context-parallel k, v all-gather", "k/v exchange hidden behind attention"),
    ("--sequence-parallel 4", "Ulysses all-to-all buffers", "4 blocking all-to-alls per layer"),
])
def test_explain_names_the_source_of_every_term(degree, derived, comm, capsys):
    """Each memory term of a TP / CP / SP estimate says where it comes from (traced, derived, assumed, the
    engine's rule), the derived buffer of the dimension is a term of its own, and the step time names the
    dimension's communication."""
    from toolkit.cli import main

    strategy = "zero2" if "sequence" in degree else "fsdp2"
    assert main(["estimate", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--strategy", strategy, *degree.split(),
                 "--seq", "8192", "--micro-batch", "1", "--explain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("per GPU")) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("peak (tensors)"))
    terms = lines[start:end:2]
    sources = [line.strip() for line in lines[start + 1:end:2]]
    assert len(terms) >= 9 and all(s.startswith("<- ") and len(s) > 12 and "()" not in s for s in sources), sources
    row = next(i for i, t in enumerate(terms) if t.strip().startswith(derived))
    assert sources[row].startswith("<- derived: ")
    assert any(comm in line for line in lines if line.strip().startswith("note:")), lines[end:]
    assert "exposed comm" in next(line for line in lines if line.startswith("predicted step"))


@pytest.mark.parametrize("model, gpus", [("llama-3.1-8b", "8xH100-80GB"), ("qwen2.5-7b", "1xA100-80GB")])
def test_seq_max_answers_and_writes_the_chart(model, gpus, tmp_path, capsys):
    import xml.etree.ElementTree as ET

    from toolkit.cli import main
    from toolkit.plan.schema import load_plan

    assert main(["plan", model, "--gpus", gpus, "--seq", "max", "--out", str(tmp_path / "p")]) == 0
    out, err = capsys.readouterr()
    assert "longest sequence" in out and "per-GPU GiB by sequence length" in out
    svg = ET.parse(tmp_path / "p/memory_vs_seq.svg").getroot()
    assert svg.tag.endswith("svg") and len(svg.findall("{http://www.w3.org/2000/svg}polyline")) >= 1
    plan = load_plan(tmp_path / "p")
    assert f"at seq {plan.seq_len:,}" in out
    # Tiling is searched only with --tiled: on one GPU no strategy reaches the positions untiled (35,712 tokens at
    # most) and a note says that tiling may; on 8 GPUs Ulysses SP reaches them untiled, no note. The lever table
    # below the rows still prices tiling, with DeepSpeed's checkpoint offload beside it (a4821e5), as a lever to pull.
    rows, _, levers = out.partition("levers on ")
    assert not plan.tiled and "+tiled" not in rows
    if gpus == "1xA100-80GB":
        assert "ALST tiling" in levers and "+tiled +act-offload; --tiled on" in levers
    assert ("may reach further with ALST tiling" in err) == (gpus == "1xA100-80GB"), err


# --- toolkit check on configs toolkit did not write -------------------------------------------------------------

REAL = Path(__file__).parent / "real_configs"

SP_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  zero3_save_16bit_model: true
mixed_precision: bf16
num_machines: 1
num_processes: 8
parallelism_config:
  parallelism_config_sp_size: {sp}
  parallelism_config_sp_backend: deepspeed
  parallelism_config_sp_seq_length_is_variable: true
  parallelism_config_sp_attn_implementation: sdpa
"""


def test_check_models_accelerates_own_cp_example_per_rank():
    from toolkit.check.fit import fit_findings

    found = fit_findings(str(REAL / "accelerate/examples/torch_native_parallelism/configs/cp.yaml"),
                         model="llama-3.1-8b", gpus="8xH100-80GB", seq_len=131072)
    assert any("parallelism_config: dp=1 x cp=8" in p.message for p in found)
    assert found[-1].severity == "note" and "fits" in found[-1].message


def test_check_judges_a_stock_ulysses_yaml_and_names_what_the_engines_refuse(tmp_path):
    from toolkit.check.folder import check_paths
    from toolkit.check.fit import Pins, fit_findings

    good = tmp_path / "sp.yaml"
    good.write_text(SP_YAML.format(sp=8))
    assert [p for p in check_paths([str(good)]) if p.severity == "error"] == []
    fit = fit_findings(str(good), model="llama-3.1-8b", gpus="8xH100-80GB", seq_len=65536,
                       pins=Pins(checkpointing=True))
    assert any("dp=1 x sp=8" in p.message for p in fit) and fit[-1].severity == "note"
    heads = fit_findings(str(good), model="qwen2.5-7b", gpus="8xH100-80GB", seq_len=65536)
    assert heads[-1].severity == "error" and "does not divide qwen2.5-7b's 28 attention heads" in heads[-1].message
    bad = tmp_path / "sp3.yaml"
    bad.write_text(SP_YAML.format(sp=3))
    errors = [p for p in check_paths([str(bad)]) if p.severity == "error"]
    assert len(errors) == 1 and "sp_size 3 needs DeepSpeed with dp_replicate x dp_shard x sp = 8" in errors[0].message


@pytest.mark.parametrize("degree", ["--sequence-parallel 8", "--context-parallel 4", "--tensor-parallel 2"])
def test_check_finds_nothing_wrong_in_the_folders_plan_writes(degree, tmp_path):
    from toolkit.check.folder import check_paths
    from toolkit.cli import main

    out = tmp_path / "p"
    assert main(["plan", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--seq", "16384", "--global-batch", "16",
                 *degree.split(), "--out", str(out)]) == 0
    assert check_paths([str(out)]) == []


def test_tp_head_and_embedding_make_only_their_shards_gradients():
    from toolkit.estimate.dimensions import apply_to_trace, rank_view
    from toolkit.estimate.traces import scaled_trace
    from toolkit.inputs.job import Job

    spec = _small(kv_heads=4)
    job = Job(seq_len=2048)
    view = rank_view(spec, job, _grid("fsdp2", tensor=2))
    strategy = parse_strategy("fsdp2")
    traced = scaled_trace(view.spec, view.job, strategy)
    rank = apply_to_trace(traced, view, checkpointing=False)
    assert traced.head.grad_bytes > 0
    assert rank.head.grad_bytes == int(traced.head.grad_bytes * view.spec.post_layer_params / spec.post_layer_params)
    assert view.spec.post_layer_params < 0.6 * spec.post_layer_params  # the vocabulary splits, the norm does not
    assert rank.head.saved_bytes == traced.head.saved_bytes  # the gathered logits are whole on every rank


def test_check_tells_trainer_scripts_how_to_run_accelerates_tp_example():
    from toolkit.check.findings import TRAINER
    from toolkit.check.folder import check_paths

    found = check_paths([str(REAL / "accelerate/examples/torch_native_parallelism/configs/tp_hsdp.yaml")])
    # A note, not an error: the file is made for accelerate's own example loop, which prepares model and optimizer
    # together and runs it; only a Trainer script cannot.
    about_tp = [p for p in found if "DistributedConfig" in p.message]
    assert len(about_tp) == 1 and about_tp[0].runner == TRAINER and about_tp[0].severity == "note"
    assert not [p for p in found if p.severity in ("warning", "error")]


def test_zero12_under_sp_counts_the_gradient_sp_times_unless_averaged_over_the_whole_group():
    """docs/ENGINE_FACTS.md "ZeRO-1/2 x Ulysses SP": what the engine's reduction leaves of transformers' SP loss
    gradient, 1 (one process's) or sp, read from the config the way stage_1_and_2.py / stage3.py take it."""
    from toolkit.emit.deepspeed import average_over_sp_ranks, sp_gradient_multiple

    def config(stage, **zero):
        return {"zero_optimization": {"stage": stage, **zero}}

    assert sp_gradient_multiple(config(2), sp=1, group_ranks=8) == 1
    assert sp_gradient_multiple(config(3), sp=4, group_ranks=8) == 1  # reduce-scatter divides by dp x sp
    assert sp_gradient_multiple(config(3, reduce_scatter=False), sp=4, group_ranks=8) == 4
    for stage in (1, 2):
        assert sp_gradient_multiple(config(stage), sp=4, group_ranks=8) == 4
        fixed = config(stage)
        average_over_sp_ranks(fixed, 8)
        assert sp_gradient_multiple(fixed, sp=4, group_ranks=8) == 1
        assert sp_gradient_multiple(fixed, sp=4, group_ranks=16) == 4  # planned for 8 ranks, run on 16
        assert sp_gradient_multiple({**fixed, "prescale_gradients": True}, sp=4, group_ranks=8) == 4
        no_contiguous = {**fixed, "zero_optimization": {**fixed["zero_optimization"], "contiguous_gradients": False}}
        assert sp_gradient_multiple(no_contiguous, sp=4, group_ranks=8) == 4  # allreduce_bucket: group / sp
    assert sp_gradient_multiple(config(0), sp=2, group_ranks=2) == 2


def test_plan_of_zero2_x_sp_says_which_json_keys_keep_a_users_script_on_one_process_gradient(tmp_path, capsys):
    """Issue 32: `toolkit plan`, PLAN.md and training_args.json say in one line that the JSON's two keys average the
    gradient over dp x sp, and that a config without them trains a Trainer / TRL script on sp x the gradient."""
    from toolkit.check.folder import check_paths
    from toolkit.cli import main

    out = tmp_path / "p"
    assert main(["plan", "llama-3.1-8b", "--gpus", "8xH100-80GB", "--seq", "16384", "--global-batch", "16",
                 "--sequence-parallel", "8", "--choose", "zero2", "--out", str(out)]) == 0
    line = ('ZeRO-2 x Ulysses SP 8: the DeepSpeed JSON\'s "gradient_predivide_factor": 8 and "zero_optimization": '
            '{"reduce_scatter": false} make DeepSpeed average the gradient over the 8 processes')
    said = [text for text in capsys.readouterr().out.splitlines() if line in text]
    assert len(said) == 1 and said[0].startswith("note: ") and "or it trains on 8 x the gradient" in said[0]
    assert line in (out / "PLAN.md").read_text()
    assert any(line in note for note in json.loads((out / "training_args.json").read_text())["notes"])
    assert json.loads((out / "ds_config.json").read_text())["gradient_predivide_factor"] == 8
    assert check_paths([str(out)]) == []


def test_check_warns_that_a_yamls_own_zero2_config_under_ulysses_sums_the_sp_ranks_gradient(tmp_path):
    """Issue 32: accelerate builds the DeepSpeed config from the YAML's deepspeed_config keys, none of which sets
    gradient_predivide_factor: ZeRO-2 x SP 8 is a warning naming the JSON to give instead; ZeRO-3 averages already."""
    from toolkit.check.folder import check_paths

    for stage, warned in ((2, True), (3, False)):
        yaml_file = tmp_path / f"sp-zero{stage}.yaml"
        yaml_file.write_text(SP_YAML.format(sp=8).replace("zero_stage: 3", f"zero_stage: {stage}"))
        found = [p for p in check_paths([str(yaml_file)]) if "Ulysses SP" in p.message]
        assert [p.severity for p in found] == (["warning"] if warned else [])
        if warned:
            assert found[0].message.startswith("ZeRO-2 x Ulysses SP 8: a Trainer / TRL script trains on 8 x the "
                                               "gradient")
            assert '"gradient_predivide_factor": 8 and "zero_optimization": {"reduce_scatter": false}' in \
                found[0].message


def test_zero12_price_their_gradient_reduction_as_deepspeeds_bucket_all_reduce():
    """DeepSpeed's ZeRO-1/2 all-reduce each gradient bucket (use_multi_rank_bucket_allreduce, its default; and with
    reduce_scatter false, as the plan's JSON sets under Ulysses SP): 2 (N - 1) / N of the gradient bytes a reduction,
    once a step for ZeRO-1, every micro-step for ZeRO-2, then the updated partitions' all-gather. Under SP the
    engine reduces in fp32 (seq_parallel_communication_data_type's default; gradient_reduction_w_predivide casts the
    bucket to it): twice the bf16 bytes."""
    from toolkit.estimate.collectives import group_bandwidth, ring_s
    from toolkit.estimate.timing import step_time, ulysses_comm_s
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job

    spec = resolve_model("llama-3.1-8b")
    hw = parse_hardware("8xH100-80GB")
    job = Job(seq_len=16384, micro_batch=1, grad_accum=3)
    grad = spec.params * 2
    bw = group_bandwidth(hw, 8)
    for stage, reduces in ((1, 1), (2, 3)):
        strategy = parse_strategy(f"zero{stage}")
        expected = reduces * ring_s(grad, 8, bw, 2) + ring_s(grad, 8, bw, 1)
        plain = step_time(spec, strategy, job, hw, grid=_grid(f"zero{stage}"), overlap=0.0)
        assert plain.communication_s == pytest.approx(expected)
        sp = _grid(f"zero{stage}", sequence=2)
        with_sp = step_time(spec, strategy, job, hw, grid=sp, overlap=0.0)
        fp32 = reduces * ring_s(2 * grad, 8, bw, 2) + ring_s(grad, 8, bw, 1)
        assert with_sp.communication_s == pytest.approx(fp32 + ulysses_comm_s(spec, job, sp, hw))

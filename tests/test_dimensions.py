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


@pytest.mark.parametrize("strategy, degrees, fragment", [
    ("zero3", {"tensor": 2}, "tensor parallelism runs under FSDP2"),
    ("zero2", {"context": 2}, "context parallelism runs under FSDP2"),
    ("fsdp2", {"sequence": 2}, "sequence parallelism (Ulysses) runs under DeepSpeed ZeRO"),
    ("ddp", {"sequence": 2}, "runs under DeepSpeed ZeRO"),
    ("hybrid", {"sequence": 2}, "pipeline engine runs no tensor"),
    ("fsdp2", {"context": 2, "sequence": 2}, "sequence parallelism"),
    ("fsdp2", {"tensor": 8}, "leaves FSDP2 nothing to shard"),
    ("fsdp2", {"tensor": 3}, "does not divide the 8 GPUs"),
    ("fsdp2", {"tensor": 4, "context": 4}, "does not divide 8 GPUs"),
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

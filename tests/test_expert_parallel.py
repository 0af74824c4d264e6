"""Expert parallelism on FSDP2 (transformers' DistributedConfig ep_size; issue 34): the grid's expert degree and its
composition rules, the refusals, and what EP changes in a rank's memory. No process starts here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from toolkit.cli import main
from toolkit.errors import UserError
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.strategy import parse_strategy

ARCH = Path(__file__).parent / "arch_configs"


def _spec(name: str):
    from toolkit.inputs.modelspec import spec_from_config_dict

    return spec_from_config_dict(json.loads((ARCH / f"{name}.json").read_text()), name=name)


def _grid(expert, *, tensor=1, strategy="fsdp2", nodes=1, gpus=8):
    return ParallelGrid.for_strategy(parse_strategy(strategy), nodes=nodes, gpus_per_node=gpus, tensor=tensor,
                                     expert=expert)


def test_expert_degree_reuses_the_shard_ranks():
    grid = _grid(8)
    assert (grid.dp_shard, grid.tensor, grid.expert, grid.world) == (8, 1, 8, 8)
    assert grid.describe() == "dp=8 x ep=8"


@pytest.mark.parametrize("kwargs, words", [
    (dict(expert=3), "--expert-parallel 3 does not fit fsdp 8 x tensor 1 (transformers' DistributedConfig: "
                     "`ep_size` must divide `fsdp_size * tp_size`); try --expert-parallel 2, 4 or 8"),
    (dict(expert=16), "try --expert-parallel 2, 4 or 8"),
    (dict(expert=2, tensor=4), "`ep_size` must be a multiple of `tp_size`"),
    (dict(expert=4, tensor=2), "--expert-parallel 4 with --tensor-parallel 2 is not modelled yet"),
    (dict(expert=2, strategy="zero3"), "expert parallelism is planned on fsdp2"),
])
def test_expert_degrees_that_do_not_compose_are_refused(kwargs, words):
    with pytest.raises(UserError, match=None) as err:
        _grid(**kwargs)
    assert words in str(err.value)


def test_expert_parallel_needs_an_moe_model_whose_experts_it_divides():
    with pytest.raises(UserError, match="qwen3-0.6b is dense"):
        _grid(2).check_model(_spec("qwen3-0.6b"))
    mixtral = _spec("mixtral-8x7b-v0.1")  # 8 experts
    _grid(8).check_model(mixtral)
    with pytest.raises(UserError, match="does not divide mixtral-8x7b-v0.1's 8 experts"):
        ParallelGrid.for_strategy(parse_strategy("fsdp2"), nodes=2, gpus_per_node=8, expert=16).check_model(mixtral)


@pytest.mark.parametrize("args, words", [
    (["qwen3-0.6b", "--expert-parallel", "2"], "is dense"),
    ([None, "--expert-parallel", "3"], "does not fit fsdp 8"),
    ([None, "--expert-parallel", "2", "--strategy", "zero3"], "planned on fsdp2"),
    ([None, "--expert-parallel", "2", "--trace-world"], "does not apply the model's ep_plan yet"),
    ([None, "--expert-parallel", "2", "--tensor-parallel", "2"], "not modelled yet"),
])
def test_estimate_refuses_bad_expert_parallel_in_one_line(args, words, tmp_path, capsys):
    folder = tmp_path / "q30"
    folder.mkdir()
    shutil.copy(ARCH / "qwen3-30b-a3b.json", folder / "config.json")
    args = [str(folder) if a is None else a for a in args]
    strategy = [] if "--strategy" in args else ["--strategy", "fsdp2"]
    assert main(["estimate", *args, *strategy, "--gpus", "8xH100-80GB", "--micro-batch", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_expert_parallel_memory_differs_by_the_unsharded_experts_and_the_dispatch_buffers():
    """ep splits the experts of the unsharded layer (and of its unsharded gradients in backward), not the sharded
    states: an expert shards over efsdp x ep = dp_shard ranks either way."""
    from toolkit.estimate.memory import states_for
    from toolkit.inputs.job import Job
    from toolkit.inputs.moe import expert_layer_params, expert_params

    spec = _spec("qwen3-30b-a3b")
    assert expert_params(spec) == 48 * 128 * 3 * 2048 * 768  # gate_up + down of every expert of 48 layers
    job = Job(seq_len=2048, micro_batch=1, grad_accum=1, precision="bf16", optimizer="adamw", checkpointing=True)
    strategy = parse_strategy("fsdp2")
    one = states_for(spec, strategy, job, _grid(1), params=spec.params)
    two = states_for(spec, strategy, job, _grid(2), params=spec.params)
    assert (one.parameters, one.step_gradients, one.optimizer) == (two.parameters, two.step_gradients, two.optimizer)
    half_layer_experts = expert_layer_params(spec) / 2 * 2  # half the experts, in bf16
    assert one.gathered - two.gathered == pytest.approx(2 * half_layer_experts, abs=8)  # 2 layers live (prefetch)
    assert one.backward_buffers - two.backward_buffers == pytest.approx(2 * half_layer_experts, abs=8)
    assert two.buffers - one.buffers == 2 * 2048 * 8 * 2048 * 2  # send + receive, tokens x top-8 x hidden, bf16


def test_expert_parallel_step_time_pays_all_to_alls_on_the_ep_link_and_is_unverified(capsys):
    """The token all-to-all grows with the tokens x top_k x hidden a rank sends and moves to the inter-node link
    once the ep group leaves the node; the expert gathers shrink to efsdp; the row's speed is unverified."""
    from toolkit.estimate.experttime import EP_ALL_TO_ALLS_PER_LAYER
    from toolkit.estimate.experttime import expert_exchange_s as expert_all_to_all_s
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job

    spec = _spec("qwen3-30b-a3b")
    job = Job(seq_len=2048, micro_batch=1, grad_accum=1, precision="bf16", optimizer="adamw", checkpointing=False)
    one_node, two_nodes = parse_hardware("8xH100-80GB"), parse_hardware("8xH100-80GB", nodes=2)
    assert expert_all_to_all_s(spec, job, _grid(1), one_node) == 0.0
    inside = expert_all_to_all_s(spec, job, _grid(8), one_node)
    sent = 2048 * 8 * 2048 * 2 * 7 / 8  # tokens x top-8 x hidden x bf16, 7/8 of it leaves the rank
    assert inside == pytest.approx(EP_ALL_TO_ALLS_PER_LAYER * 48 * sent / (one_node.gpu.intra_node_gbps * 1e9),
                                   rel=1e-9)
    across = expert_all_to_all_s(spec, job, _grid(16, nodes=2), two_nodes)
    assert across > inside


def test_estimate_of_an_expert_parallel_row_names_its_terms_and_stars_its_speed(tmp_path, capsys):
    folder = tmp_path / "q30"
    folder.mkdir()
    shutil.copy(ARCH / "qwen3-30b-a3b.json", folder / "config.json")
    assert main(["estimate", str(folder), "--strategy", "fsdp2", "--gpus", "8xH100-80GB", "--micro-batch", "1",
                 "--seq", "2048", "--expert-parallel", "8", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "| fsdp2 (dp=8 x ep=8) on 8xH100" in out
    assert "unsharded layer holds 16 of 128 experts" in out
    assert "all-to-all send + receive 2048 tokens x top-8 x hidden 2048" in out
    assert "4 blocking all-to-alls per MoE layer" in out and "on the node link" in out
    assert "the all-to-all terms are unverified" in out


def test_plan_of_an_moe_model_lists_its_expert_parallel_row_with_the_degrees_that_run(tmp_path, capsys):
    """Listed, not ranked: its speed is unverified; `plan --expert-parallel N` plans it (tests/test_moe.py)."""
    folder = tmp_path / "q30"
    folder.mkdir()
    shutil.copy(ARCH / "qwen3-30b-a3b.json", folder / "config.json")
    assert main(["plan", str(folder), "--gpus", "8xH100-80GB", "--seq", "2048", "--global-batch", "16",
                 "--strategies", "fsdp2,zero3", "--json"]) == 0
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    ep = rows["fsdp2 x ep"]
    assert not ep["feasible"]
    assert "expert parallelism (ep 2, 4, 8 of 128 experts) is not ranked yet" in ep["reason"]
    assert "--expert-parallel 8" in ep["reason"]

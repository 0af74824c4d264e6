"""What an expert-parallel step runs (issue 34; docs/ENGINE_FACTS.md, "What an expert-parallel step runs"): the
shared-batch layout TRL's guide trains (DistributedConfig(tp_size=ep, enable_expert_parallel=True)) against every
rank its own batch, the tokens and routed rows a rank computes, the token exchange the model's ep_plan picks, and
the buffers and states that follow from the config. Numbers from Qwen3-30B-A3B's config; no process starts here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.errors import UserError
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.strategy import parse_strategy

ARCH = Path(__file__).parent / "arch_configs"
MASKED_PLAN = {"layers.*.mlp.gate": "ep_router", "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
               "layers.*.mlp.experts.down_proj": "grouped_gemm", "layers.*.mlp.experts": "moe_tp_experts"}
QWEN3_EXPERTS = 48 * 128 * 3 * 2048 * 768  # layers x experts x (gate, up, down) x hidden x moe_intermediate
QWEN3_PARAMS = 30_532_122_624


def _spec(name="qwen3-30b-a3b", **overrides):
    from toolkit.inputs.modelspec import spec_from_config_dict

    return spec_from_config_dict({**json.loads((ARCH / f"{name}.json").read_text()), **overrides}, name=name)


def _grid(expert=8, *, shared, nodes=1):
    return ParallelGrid.for_strategy(parse_strategy("fsdp2"), nodes=nodes, gpus_per_node=8, expert=expert,
                                     expert_shared_batch=shared)


def _job(**kw):
    from toolkit.inputs.job import Job

    return Job(**{"seq_len": 2048, "micro_batch": 1, "grad_accum": 1, "precision": "bf16-pure",
                  "optimizer": "adamw", "checkpointing": True, "device_kind": "cuda", **kw})


def test_a_shared_batch_takes_the_expert_group_out_of_the_data_parallel_ranks():
    one = _grid(shared=True)
    assert (one.dp_shard, one.data_parallel, one.expert_shard_group, one.batch_sharers) == (1, 1, 1, 8)
    assert one.tokens_per_step(1, 1, 2048) == 2048
    assert one.describe() == "dp=1 x ep=8 sharing one batch"
    two = _grid(shared=True, nodes=2)  # TRL's "ep=8 x fsdp=2"
    assert (two.data_parallel, two.expert_shard_group, two.tokens_per_step(1, 1, 2048)) == (2, 2, 4096)
    own = _grid(shared=False)
    assert (own.data_parallel, own.expert_shard_group, own.tokens_per_step(1, 1, 2048)) == (8, 1, 16384)


def test_a_shared_batch_degree_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(UserError, match="give an expert degree that divides 8"):
        _grid(3, shared=True)


def test_the_expert_count_comes_from_the_config_exactly():
    from toolkit.inputs.moe import expert_params

    spec = _spec()
    assert spec.params == QWEN3_PARAMS
    assert expert_params(spec) == QWEN3_EXPERTS == 28_991_029_248


def test_rows_a_rank_s_experts_multiply_follow_the_layout():
    from toolkit.estimate.experttime import expert_rows_per_rank, tokens_per_rank

    spec, job = _spec(), _job()
    shared, own = _grid(shared=True), _grid(shared=False)
    assert tokens_per_rank(job, shared) == tokens_per_rank(job, own) == 2048
    assert expert_rows_per_rank(spec, job, shared) == 2048 * 8 / 8  # 1 / ep of the shared batch's routed rows
    assert expert_rows_per_rank(spec, job, own) == 2048 * 8  # as many received as sent
    # 16 local experts: 128 rows each on the shared batch, 1024 on the own batches.
    assert expert_rows_per_rank(spec, job, shared) / 16 == 128


def test_expert_flops_per_token_are_the_active_experts_forward_backward_and_recompute():
    from toolkit.estimate.efficiency import FULL_RECOMPUTE, NO_RECOMPUTE
    from toolkit.estimate.experttime import expert_flops_per_token

    active = QWEN3_EXPERTS * 8 // 128
    assert expert_flops_per_token(_spec(), NO_RECOMPUTE) == 6 * active
    assert expert_flops_per_token(_spec(), FULL_RECOMPUTE) == 8 * active == 14_495_514_624


def test_the_token_exchange_comes_from_the_model_s_ep_plan():
    from toolkit.inputs.moe import ep_token_exchange

    dispatch, masked = _spec(), _spec(base_model_ep_plan=MASKED_PLAN)
    assert ep_token_exchange(dispatch, shared_batch=True) == "all_to_all"  # ep_dispatch_experts: AllToAllEP
    assert ep_token_exchange(masked, shared_batch=True) == "all_reduce"  # ep_router + moe_tp_experts
    assert ep_token_exchange(masked, shared_batch=False) == "all_to_all"


def test_exchange_buffers_are_the_routed_rows_a_rank_sends_and_receives():
    from toolkit.inputs.moe import ep_exchange_buffer_bytes

    spec = _spec()
    assert ep_exchange_buffer_bytes(spec, 2048, 2) == 2 * 2048 * 8 * 2048 * 2 == 134_217_728
    assert ep_exchange_buffer_bytes(spec, 2048, 2, sharers=8) == 2 * 256 * 8 * 2048 * 2 == 16_777_216
    assert ep_exchange_buffer_bytes(spec, 2048, 2, route="all_reduce") == 2048 * 2048 * 2 == 8_388_608


def test_a_shared_batch_rank_holds_the_dense_modules_whole_and_an_eighth_of_the_experts():
    from toolkit.estimate.memory import states_for

    spec, job = _spec(), _job()
    per_rank = QWEN3_PARAMS - QWEN3_EXPERTS + QWEN3_EXPERTS // 8
    assert per_rank == 5_164_972_032
    shared = states_for(spec, parse_strategy("fsdp2"), job, _grid(shared=True), params=spec.params)
    assert shared.parameters == pytest.approx(per_rank * 2, abs=2)  # bf16
    assert shared.gathered == 0  # fsdp_size 1: transformers applies no FSDP
    own = states_for(spec, parse_strategy("fsdp2"), job, _grid(shared=False), params=spec.params)
    assert own.parameters == pytest.approx(QWEN3_PARAMS / 8 * 2, abs=2)
    # torch's foreach AdamW allocates one second-moment's worth of the rank's group in its step.
    foreach = states_for(spec, parse_strategy("fsdp2"), _job(optimizer_impl="foreach"), _grid(shared=True),
                         params=spec.params)
    assert foreach.step_transient == pytest.approx(per_rank * 2, abs=2)


def test_exchange_time_is_the_route_s_collectives_over_the_expert_group():
    from toolkit.estimate.collectives import all_to_all_s, ring_s
    from toolkit.estimate.experttime import expert_exchange_s
    from toolkit.inputs.hardware import parse_hardware

    hw = parse_hardware("8xH100-80GB")
    bw, job = hw.gpu.intra_node_gbps, _job()
    recompute = 1.5  # checkpointed layers exchange again in recompute
    masked = expert_exchange_s(_spec(base_model_ep_plan=MASKED_PLAN), job, _grid(shared=True), hw)
    assert masked == pytest.approx(48 * 2 * ring_s(2048 * 2048 * 2, 8, bw, 2) * recompute, rel=1e-12)
    sliced = expert_exchange_s(_spec(), job, _grid(shared=True), hw)
    assert sliced == pytest.approx(48 * recompute * (4 * all_to_all_s(256 * 8 * 2048 * 2, 8, bw)
                                                     + 2 * ring_s(2048 * 2048 * 2, 8, bw, 1)), rel=1e-12)
    own = expert_exchange_s(_spec(), job, _grid(shared=False), hw)
    assert own == pytest.approx(48 * recompute * 4 * all_to_all_s(2048 * 8 * 2048 * 2, 8, bw), rel=1e-12)


def test_a_shared_batch_fsdp_group_strides_over_the_expert_group_and_leaves_the_node():
    """transformers' dense mesh is (pp, dp_replicate, fsdp, tp), tp innermost: on a shared batch (tp = ep) the fsdp
    peers of rank r are r + ep, r + 2 ep, ...; at ep 8 x fsdp 2 on 2 nodes of 8 they sit on different nodes, one
    member a node, so the 8 pairs of a node split its network: each gathers and reduce-scatters at an eighth of it,
    as the experts' efsdp pairs (r, r + 8) do. Every rank its own batch, the dense group is 16 consecutive ranks (one
    ring through each node's network: all of it) and the efsdp pairs again an eighth. On one node, NVLink."""
    from toolkit.estimate.collectives import ring_s
    from toolkit.estimate.experttime import expert_parallel_fsdp_comm_s
    from toolkit.inputs.hardware import parse_hardware

    spec, hw = _spec(), parse_hardware("8xH100-80GB", nodes=2)
    assert hw.inter_node_gbps < hw.gpu.intra_node_gbps
    dense, experts = QWEN3_PARAMS - QWEN3_EXPERTS, QWEN3_EXPERTS
    shared = _grid(8, shared=True, nodes=2)
    assert (shared.shard_group, shared.expert_shard_group) == (2, 2)
    assert (shared.mesh_stride("fsdp"), shared.mesh_stride("efsdp"), shared.mesh_stride("ep")) == (8, 8, 1)
    pair = hw.inter_node_gbps / 8
    gathers = 2  # forward and backward, then one reduce-scatter of the gradients: 3 collectives each
    assert expert_parallel_fsdp_comm_s(spec, shared, hw, 2, gathers) == pytest.approx(
        3 * ring_s(dense * 2, 2, pair, 1) + 3 * ring_s(experts / 8 * 2, 2, pair, 1), rel=1e-12)
    own = _grid(8, shared=False, nodes=2)  # fsdp 16 consecutive ranks: spans both nodes, the whole network
    assert (own.mesh_stride("fsdp"), own.mesh_stride("efsdp")) == (1, 8)
    assert expert_parallel_fsdp_comm_s(spec, own, hw, 2, gathers) == pytest.approx(
        3 * ring_s(dense * 2, 16, hw.inter_node_gbps, 1) + 3 * ring_s(experts / 8 * 2, 2, pair, 1), rel=1e-12)
    one_node = parse_hardware("8xH100-80GB")
    inside = ParallelGrid.for_strategy(parse_strategy("fsdp2"), nodes=1, gpus_per_node=8, expert=4,
                                       expert_shared_batch=True)  # ep 4 x fsdp 2: one node
    assert expert_parallel_fsdp_comm_s(spec, inside, one_node, 2, gathers) == pytest.approx(
        3 * ring_s(dense * 2, 2, one_node.gpu.intra_node_gbps, 1)
        + 3 * ring_s(experts / 4 * 2, 2, one_node.gpu.intra_node_gbps, 1), rel=1e-12)


def test_a_group_leaving_its_node_shares_the_node_s_network_with_its_dimension_s_other_groups():
    """collectives.group_bandwidth from a group's size and stride: NVLink inside a node; across nodes each node's
    network split between the groups crossing it, by the members a node holds of each."""
    from toolkit.estimate.collectives import group_bandwidth
    from toolkit.inputs.hardware import parse_hardware

    hw = parse_hardware("8xH100-80GB", nodes=8, inter_node_gbps=400)
    nvlink = hw.gpu.intra_node_gbps
    assert group_bandwidth(hw, 8) == group_bandwidth(hw, 4, 2) == nvlink  # inside one node
    assert group_bandwidth(hw, 32) == min(nvlink, 400)  # 32 consecutive ranks: 8 a node, one ring a node
    assert group_bandwidth(hw, 2, 32) == 400 / 8  # GLM-4.5-Air's fsdp pairs: one member a node, 8 pairs a node
    assert group_bandwidth(hw, 4, 4) == 400 * 2 / 8  # members 4 apart: 2 a node, 4 groups a node


def test_a_shared_batch_step_prices_one_batch_and_splits_only_the_experts():
    from toolkit.estimate.timing import step_time
    from toolkit.inputs.hardware import parse_hardware

    spec, job, hw = _spec(), _job(), parse_hardware("8xH100-80GB")
    shared = step_time(spec, parse_strategy("fsdp2"), job, hw, grid=_grid(shared=True))
    own = step_time(spec, parse_strategy("fsdp2"), job, hw, grid=_grid(shared=False))
    assert shared.tokens_per_s == pytest.approx(2048 / shared.step_time_s)
    assert own.tokens_per_s == pytest.approx(16384 / own.step_time_s)
    assert any("share one batch of 2,048 tokens" in a and "128 rows per local expert" in a
               for a in shared.assumptions)
    assert any("*expert-parallel speed unverified" in a for a in shared.assumptions)
    # The experts' grouped GEMMs: 2048 tokens x 8 active experts' FLOPs / 8 ranks, at the efficiency of a
    # 128-row GEMM (rows per local expert), hidden 2048.
    from toolkit.estimate.efficiency import FULL_RECOMPUTE, matmul_efficiency
    from toolkit.estimate.experttime import expert_flops_per_token

    eff, _ = matmul_efficiency(hw.gpu, "bf16-pure", 128, 2048)
    peak = hw.gpu.peak_tflops("bf16-pure") * 1e12
    assert shared.experts_s == pytest.approx(2048 * expert_flops_per_token(spec, FULL_RECOMPUTE) / 8 / (peak * eff),
                                             rel=1e-12)
    assert 0 < shared.experts_s < shared.compute_s


def test_estimate_prices_the_shared_batch_layout_and_refuses_it_alone_in_one_line(tmp_path, capsys):
    import shutil

    from toolkit.cli import main

    folder = tmp_path / "q30"
    folder.mkdir()
    shutil.copy(ARCH / "qwen3-30b-a3b.json", folder / "config.json")
    base = ["estimate", str(folder), "--strategy", "fsdp2", "--gpus", "8xH100-80GB", "--seq", "2048"]
    assert main(base + ["--expert-parallel", "8", "--expert-shared-batch", "--precision", "bf16-pure",
                        "--explain"]) == 0
    out = capsys.readouterr().out
    assert "fsdp2 (dp=1 x ep=8 sharing one batch)" in out
    assert "5.16B parameters a rank, the dense modules whole" in out and "no FSDP (fsdp_size 1)" in out
    assert "all-to-all send + receive 256 tokens x top-8 x hidden 2048" in out
    assert main(base + ["--expert-shared-batch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --expert-shared-batch prices an expert-parallel row at one sequence length; give it with "
                   "--expert-parallel N and --seq N"]

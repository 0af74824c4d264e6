"""Expert parallelism on FSDP2 (transformers' DistributedConfig ep_size; issue 34): the grid's expert degree and its
composition rules, the refusals, and what EP changes in a rank's memory. No process starts here."""

from __future__ import annotations

import dataclasses
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
                     "`ep_size` must divide `fsdp_size * tp_size`); try --expert-parallel 2, 4, 8"),
    (dict(expert=16), "try --expert-parallel 2, 4, 8"),
    (dict(expert=2, tensor=4), "`ep_size` must be a multiple of `tp_size`"),
    (dict(expert=4, tensor=2), "--expert-parallel 4 with --tensor-parallel 2 is not modelled yet"),
    (dict(expert=2, strategy="zero3-offload"), "DeepSpeed AutoEP on zero3-offload is not planned"),
    (dict(expert=2, strategy="ddp"), "expert parallelism is planned on fsdp2"),
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
    ([None, "--expert-parallel", "2", "--strategy", "zero3-offload"], "DeepSpeed AutoEP on zero3-offload is not planned"),
    ([None, "--expert-parallel", "2", "--strategy", "ddp"], "planned on fsdp2"),
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
    assert two.buffers == one.buffers  # the exchange holds nothing between steps: it lives in the MoE layers
    assert two.layer_transient - one.layer_transient == 2 * 2048 * 8 * 2048 * 2  # send + receive, tokens x top-8 x h, bf16


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
    assert "not for expert parallelism" in out and "the expert-parallel speed and its terms are unverified" in out
    # routing imbalance, a stated assumption: memory (sources and band line) and the experts' GEMM time
    assert "busiest expert rank (routing)" in out and "1.88" in out
    assert "activations are priced at balanced routing (16,384 received rows a MoE layer, the all-to-all is " \
           "dropless); the busiest expert rank at 1.25x the mean rows (assumed) keeps this much more" in out
    assert "routing imbalance: the figures are the busiest expert rank's, at 1.25x the mean routed rows " \
           "(assumed): balanced " in out and " GiB peak + 1.88 GiB" in out
    assert "the busiest rank at 1.25x the mean rows (assumed; the all-to-all is dropless) adds 0.019 s" in out


def test_a_received_row_costs_what_the_experts_keep_for_backward():
    """Traced (the model's own experts module run as AllToAllEP runs it): Qwen3-30B-A3B's grouped_mm experts keep,
    per received row, the gathered input (hidden), the gate_up output (2 x width), the activated gate and the
    product (width each), in bf16, plus a few bytes of sort indices; 48 layers x 16,384 rows x 0.25 of that is the
    busiest rank's extra at the assumed 1.25x share (1.88 GiB)."""
    from toolkit.estimate.expertrows import received_row_bytes, worst_rank_extra_bytes
    from toolkit.inputs.job import Job

    spec = _spec("qwen3-30b-a3b")
    row = received_row_bytes(spec, "bfloat16")
    assert row == pytest.approx((2048 + 4 * 768) * 2, abs=32)
    job = Job(seq_len=2048, micro_batch=1, grad_accum=1, precision="bf16", optimizer="adamw", checkpointing=False)
    assert worst_rank_extra_bytes(spec, job, 2048 * 8) == int(0.25 * 2048 * 8 * 48 * row)
    recomputed = dataclasses.replace(job, checkpointing=True)  # one layer's rows live at a time
    assert worst_rank_extra_bytes(spec, recomputed, 2048 * 8) == int(0.25 * 2048 * 8 * row)


def test_an_expert_parallel_row_fits_only_where_its_busiest_rank_fits():
    """The memory limit holds on the rank that runs out first: the busiest expert rank's extra received rows (1.88
    GiB for Qwen3-30B-A3B at ep 8, no checkpointing) are in the peak and the required bytes, so a GPU with room for
    the balanced figure but not for the busiest rank's is refused, and one with room for the busiest rank's fits."""
    from toolkit.estimate.memory import BUSIEST_EXPERT_RANK, estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job

    spec = _spec("qwen3-30b-a3b")
    job = Job(seq_len=2048, micro_batch=1, grad_accum=1, precision="bf16", optimizer="adamw", checkpointing=False)
    strategy, hw = parse_strategy("fsdp2"), parse_hardware("8xH100-80GB")
    b = estimate_memory(spec, strategy, job, hw, grid=_grid(8))
    extra = next(t.bytes for t in b.terms if t.name == BUSIEST_EXPERT_RANK)
    assert extra == pytest.approx(0.25 * 2048 * 8 * 48 * (2048 + 4 * 768) * 2, rel=3e-3)  # 1.88 GiB, + sort indices
    balanced = b.required_bytes - extra

    def on(memory_bytes):
        gpu = dataclasses.replace(hw.gpu, memory_bytes=memory_bytes)
        return estimate_memory(spec, strategy, job, dataclasses.replace(hw, gpu=gpu), grid=_grid(8))

    assert not on(balanced + extra // 2).fits  # the balanced ranks would fit; the busiest one does not
    assert on(b.required_bytes).fits and not on(b.required_bytes - 1).fits
    assert on(b.required_bytes).required_bytes == b.required_bytes


def _plan_json(capsys, model, *args):
    assert main(["plan", str(model), "--seq", "2048", "--strategies", "fsdp2,zero3", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    return out, {c["name"]: c for c in out["candidates"]}


@pytest.fixture(scope="module")
def q30(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q30")
    shutil.copy(ARCH / "qwen3-30b-a3b.json", folder / "config.json")
    return folder


def test_plan_of_an_moe_model_ranks_its_fastest_expert_degree_first_beyond_the_band(q30, capsys):
    """An ordinary plan costs the EP degrees the grid admits (2, 4, 8 of 128 experts on 8 GPUs) and keeps the best as
    a real candidate with its degree and memory. ep 8 holds 1/8 of the experts per rank where ZeRO-3 / FSDP2 gather
    all 128 every layer: predicted faster than zero3 by more than the step-time band. Its two routes, FSDP2 x EP and
    DeepSpeed AutoEP on ZeRO-3, are within the band of each other; the AutoEP row resumes from its checkpoints, the
    FSDP2 one cannot, so AutoEP is #1 and the explanation says why (speed starred: unverified)."""
    out, rows = _plan_json(capsys, q30, "--gpus", "8xH100-80GB", "--global-batch", "16")
    ep = rows["fsdp2 (dp=8 x ep=8)"]
    assert ep["feasible"] and ep["expert_parallel"] == 8 and not ep["speed_evidenced"]
    assert 55 * 2**30 < ep["peak_bytes"] < ep["capacity_bytes"] < rows["zero3"]["capacity_bytes"] + 1
    assert ep["peak_bytes"] < rows["zero3"]["peak_bytes"] and ep["peak_bytes"] < rows["fsdp2"]["peak_bytes"]
    assert "expert parallelism" in ep["resume_problem"] and "cannot resume" in ep["resume_problem"]
    autoep = rows["zero3 (dp=8 x autoep=8)"]
    assert autoep["feasible"] and autoep["resume_problem"] is None and not autoep["speed_evidenced"]
    assert [c["name"] for c in out["candidates"][:3]] == ["zero3 (dp=8 x autoep=8)", "fsdp2 (dp=8 x ep=8)", "zero3"]
    assert out["chosen"]["name"] == "zero3 (dp=8 x autoep=8)"
    why = out["chosen_because"]
    assert why.startswith("#1: within the step-time band (+-9%) of #2, so robustness decides; it can resume from "
                          "its checkpoints (#2 cannot)")
    assert "Mixture of experts: ep=8 keeps 1/8 of each layer's experts on a rank" in why
    assert "ZeRO-3 / FSDP2 gather every expert on every rank each layer: #1 is " in why and "than #3 zero3" in why
    assert "its speed is unverified" in why
    assert not any(c["name"] == "fsdp2 x ep" for c in out["candidates"])  # costed, no longer a listed refusal


def test_expert_row_inside_the_band_goes_after_a_resumable_row_like_tensor_parallel_rows(q30, capsys):
    """At global batch 32 the FSDP2 x EP row is the fastest, predicted within the step-time band of the AutoEP row:
    a tie, and robustness decides it as it does for TP rows: the AutoEP row (ZeRO-3) resumes from its checkpoints,
    the FSDP2 x EP plan cannot (the Trainer does not save the optimizer of a model transformers shards at load).
    Plain fsdp2 is not in the tie: with its sharded gradients held in the reduce-scatter stream's own memory
    (toolkit.estimate.engineevents, read in torch 2.13's FSDP2) micro-batch 4 no longer fits, and at 1 it is slower."""
    out, rows = _plan_json(capsys, q30, "--gpus", "8xH100-80GB", "--global-batch", "32")
    names = [c["name"] for c in out["candidates"]]
    assert names[:2] == ["zero3 (dp=8 x autoep=8)", "fsdp2 (dp=8 x ep=8)"]
    assert rows["fsdp2 (dp=8 x ep=8)"]["tokens_per_s"] > rows["zero3 (dp=8 x autoep=8)"]["tokens_per_s"]
    assert rows["fsdp2 (dp=8 x ep=8)"]["resume_problem"] and not rows["zero3 (dp=8 x autoep=8)"]["resume_problem"]
    assert rows["fsdp2"]["micro_batch"] == 1 and rows["fsdp2"]["tokens_per_s"] < rows["zero3"]["tokens_per_s"]
    why = out["chosen_because"]
    assert why.startswith("#1: within the step-time band (+-9%) of #2, so robustness decides; it can resume from "
                          "its checkpoints (#2 cannot)")
    assert "#2 is predicted " in why and "faster, inside the band" in why
    assert "Mixture of experts: ep=8 keeps 1/8 of each layer's experts on a rank" in why


def test_two_node_plan_costs_the_expert_degrees_and_explains_against_them(capsys):
    """Mixtral-8x7B (catalog) on 2x8 H100: ep 2, 4 and 8 divide its 8 experts and the 16 GPUs; the best EP row of
    each route that fits (FSDP2 x EP, DeepSpeed AutoEP on ZeRO-3; ZeRO-1/2 AutoEP hold too many expert states) is a
    real candidate with memory and time, and #1's explanation compares it and the gathering rows."""
    out, rows = _plan_json(capsys, "mixtral-8x7b", "--gpus", "2x8xH100-80GB", "--global-batch", "32")
    ep = [c for c in out["candidates"] if c["expert_parallel"] > 1]
    assert sorted(c["strategy"] for c in ep) == ["fsdp2", "zero3"]
    for row in ep:
        assert row["feasible"] and row["expert_parallel"] in (2, 4, 8)
        assert row["peak_bytes"] < row["capacity_bytes"] and row["tokens_per_s"] > rows["zero3"]["tokens_per_s"]
    assert "Mixture of experts:" in out["chosen_because"]


def test_a_dense_model_gets_no_expert_parallel_rows(tmp_path, capsys):
    shutil.copy(ARCH / "qwen3-0.6b.json", tmp_path / "config.json")
    out, _ = _plan_json(capsys, tmp_path, "--gpus", "8xH100-80GB", "--global-batch", "16")
    assert all(c["expert_parallel"] == 1 and "ep" not in c["name"].split(" x ")[-1] for c in out["candidates"])
    assert "Mixture of experts" not in out["chosen_because"]


def test_a_lora_plan_of_an_moe_model_refuses_its_expert_row_and_says_why(q30, capsys):
    """EP is modelled for full fine-tuning only: a LoRA plan lists the fsdp2 x ep row as refused, with the reason,
    and #1's explanation names it."""
    out, rows = _plan_json(capsys, q30, "--gpus", "8xH100-80GB", "--global-batch", "16", "--method", "lora")
    assert not rows["fsdp2 x ep"]["feasible"]
    assert rows["fsdp2 x ep"]["reason"].startswith("expert parallelism is planned for full fine-tuning")
    assert not any(c["expert_parallel"] > 1 for c in out["candidates"])
    assert "Mixture of experts: expert parallelism (fsdp2 x ep) is not an option: expert parallelism is planned " \
           "for full fine-tuning" in out["chosen_because"]

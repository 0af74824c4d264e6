"""DeepSpeed AutoEP as a planned route (issue 34): the grid's expert degree under ZeRO-1/2/3, its refusals, a rank's
states, the planner's rows and the emitted JSON, checked by DeepSpeed's own validation and by `toolkit check`.
No process starts here."""

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


def _grid(expert, *, strategy="zero2", nodes=1, gpus=8):
    return ParallelGrid.for_strategy(parse_strategy(strategy), nodes=nodes, gpus_per_node=gpus, expert=expert)


def test_an_expert_degree_under_zero1_or_zero2_is_deepspeed_autoep():
    grid = _grid(8)
    assert (grid.autoep, grid.dp_shard, grid.expert, grid.expert_shard_group) == (True, 8, 8, 1)
    assert grid.describe() == "dp=8 x autoep=8"
    assert _grid(4, strategy="zero1", nodes=2).expert_shard_group == 4
    assert not _grid(8, strategy="fsdp2").autoep


@pytest.mark.parametrize("strategy, expert, words", [
    ("zero2-offload", 2, "DeepSpeed AutoEP on zero2-offload is not planned"),
    ("zero2", 3, "--expert-parallel 3 under DeepSpeed AutoEP needs every rank its own batch and an expert degree "
                 "dividing the 8 data-parallel ranks"),
])
def test_autoep_grids_deepspeed_does_not_run_or_toolkit_does_not_model_are_refused(strategy, expert, words):
    with pytest.raises(UserError) as err:
        _grid(expert, strategy=strategy)
    assert words in str(err.value)


@pytest.mark.parametrize("model, expert, words", [
    ("qwen3-0.6b", 2, "qwen3-0.6b is dense"),
    ("gpt-oss-20b", 2, "DeepSpeed AutoEP has no preset for model type gpt_oss"),
    ("mixtral-8x7b-v0.1", 16, "does not divide mixtral-8x7b-v0.1's 8 experts"),
])
def test_autoep_needs_an_moe_model_with_a_preset_whose_experts_it_divides(model, expert, words):
    with pytest.raises(UserError) as err:
        _grid(expert, nodes=2).check_model(_spec(model))
    assert words in str(err.value)
    _grid(8).check_model(_spec("mixtral-8x7b-v0.1"))
    _grid(8).check_model(_spec("qwen3-30b-a3b"))


def test_a_rank_holds_the_dense_parameters_and_its_share_of_the_experts():
    """Qwen3-30B-A3B, AutoEP 8 on 16 ranks: a rank's bf16 weights are the dense parameters plus 1/8 of the experts,
    exactly; ZeRO partitions the dense states over 16 ranks and the experts' over the 2 holding the same ones."""
    from toolkit.estimate.memory import states_for
    from toolkit.inputs.job import Job
    from toolkit.inputs.moe import expert_params

    spec = _spec("qwen3-30b-a3b")
    experts = expert_params(spec)
    dense = spec.params - experts
    job = Job(seq_len=2048, micro_batch=1, grad_accum=1, precision="bf16", optimizer="adamw", checkpointing=True)
    s = states_for(spec, parse_strategy("zero1"), job, _grid(8, strategy="zero1", nodes=2), params=spec.params)
    assert s.parameters == 2 * (dense + experts // 8)
    assert s.master == pytest.approx(4 * dense / 16 + 4 * experts / 8 / 2)
    assert s.optimizer == pytest.approx(8 * dense / 16 + 8 * experts / 8 / 2)
    assert s.buffers == 0  # ZeRO-1 keeps no bucket; the exchange lives only while a MoE layer runs:
    assert s.layer_transient == 2 * 2048 * 8 * 2048 * 2  # the all-to-all send and receive


def test_under_zero3_a_rank_holds_its_partition_of_each_group_as_measured():
    """ZeRO-3 AutoEP partitions each parameter over its own group: the tiny Qwen3-MoE of tests/test_moe.py at
    autoep_size 2 on 4 ranks held 47,328 elements a rank (91,008 dense / 4 + 98,304 expert / 2 / 2, measured in
    test_a_zero3_autoep_model_saves_for_transformers_where_the_engine_refuses); the states give that, and the
    gathered working set is one layer's dense part plus its local experts (the whole tiny model under the cap)."""
    from toolkit.estimate.memory import states_for
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import spec_from_config_dict
    from toolkit.inputs.moe import expert_params
    from toolkit.run.tiny import tiny_config

    spec = spec_from_config_dict(tiny_config("qwen3_moe", layers=2, hidden=64, experts=4).to_dict(), name="tiny")
    experts = expert_params(spec)
    assert (spec.params - experts, experts) == (91_008, 98_304)
    job = Job(seq_len=32, micro_batch=1, grad_accum=1, precision="fp32", optimizer="adamw", checkpointing=False)
    s = states_for(spec, parse_strategy("zero3"), job, _grid(2, strategy="zero3", gpus=4), params=spec.params)
    assert s.parameters == 47_328 * 4
    assert s.gradients == 47_328 * 4
    assert s.gathered == (91_008 + 98_304 // 2) * 4  # under the 1e9 cap: the rank's whole model stays gathered
    big = _spec("qwen3-30b-a3b")
    layer_experts = expert_params(big) / 48
    s = states_for(big, parse_strategy("zero3"), Job(seq_len=2048, micro_batch=1, grad_accum=1, precision="bf16",
                   optimizer="adamw", checkpointing=True), _grid(8, strategy="zero3", nodes=2), params=big.params)
    dense_layer = big.largest_layer_params - layer_experts
    assert s.gathered == pytest.approx(2 * (0.5e9 + dense_layer + layer_experts / 8 + 0.9 * big.hidden ** 2), abs=4)
    assert s.parameters == pytest.approx(2 * ((big.params - expert_params(big)) / 16 + expert_params(big) / 8 / 2))


def test_autoep_communication_reduces_experts_over_the_expert_data_parallel_group():
    from toolkit.estimate.experttime import autoep_zero_comm_s
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.moe import expert_params

    spec, hw = _spec("qwen3-30b-a3b"), parse_hardware("8xH100-80GB")
    dense = (spec.params - expert_params(spec)) * 2
    ring = 7 / 8 * dense / (hw.gpu.intra_node_gbps * 1e9)
    assert autoep_zero_comm_s(spec, _grid(8), hw, 2, 1, 1) == pytest.approx(2 * ring)  # experts: one rank each
    assert autoep_zero_comm_s(spec, _grid(8), hw, 2, 2, 4) == pytest.approx(5 * ring)  # ZeRO-2: every micro-step
    assert autoep_zero_comm_s(spec, _grid(4), hw, 2, 1, 1) > 2 * ring
    # ZeRO-3: gathered in forward and backward and reduce-scattered, every micro-step
    assert autoep_zero_comm_s(spec, _grid(8, strategy="zero3"), hw, 2, 3, 2) == pytest.approx(6 * ring)


@pytest.fixture(scope="module")
def q30(tmp_path_factory):
    folder = tmp_path_factory.mktemp("q30")
    shutil.copy(ARCH / "qwen3-30b-a3b.json", folder / "config.json")
    return folder


def test_plan_ranks_autoep_rows_and_emits_a_json_deepspeed_and_check_accept(q30, tmp_path, capsys):
    """Qwen3-30B-A3B on 2 x 8 H100 with ZeRO-1 / ZeRO-2 only: plain ZeRO-1/2 hold every expert's states and cannot
    fit; AutoEP rows do, and the plan emits the expert_parallel section with explicit clipping and DeepSpeed's own
    optimizer, which DeepSpeed's config model and AutoEP validation accept and `toolkit check` finds no fault in."""
    out = tmp_path / "plan"
    assert main(["plan", str(q30 / "config.json"), "--gpus", "2x8xH100-80GB", "--seq", "2048", "--global-batch", "32",
                 "--strategies", "zero1,zero2", "--out", str(out), "--json"]) == 0
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    autoep = [n for n, c in rows.items() if "autoep=" in n and c["feasible"]]
    assert autoep, rows.keys()
    assert rows["zero1"]["feasible"] is False
    plan = json.loads((out / "plan.json").read_text())
    assert plan["strategy"] in ("zero1", "zero2") and plan["expert_parallel"] > 1
    for name in ("ds_config.json", "ds_config.deepspeed.json"):
        ds = json.loads((out / name).read_text())
        assert ds["expert_parallel"] == {"enabled": True, "autoep_size": plan["expert_parallel"],
                                         "preset_model": "qwen3_moe"}
        assert ds["gradient_clipping"] == 1.0
        assert ds["optimizer"]["type"] == "AdamW"
    capsys.readouterr()
    assert main(["check", str(out)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "AutoEPSaves" in line]
    assert notes and all(": note: " in line for line in notes), notes  # how a script saves for transformers
    from toolkit.engines.validate import ConfigRejected, autoep_config_check, deepspeed_config_at

    concrete = json.loads((out / "ds_config.deepspeed.json").read_text())
    autoep_config_check(deepspeed_config_at(concrete, 16), 16)
    concrete["expert_parallel"]["autoep_size"] = 3  # does not tile 16 ranks: DeepSpeed's folding refuses it
    with pytest.raises(ConfigRejected, match="DeepSpeed AutoEP refuses"):
        autoep_config_check(deepspeed_config_at(concrete, 16), 16)


def test_plan_offers_zero3_autoep_rows_and_emits_a_json_deepspeed_and_check_accept(q30, tmp_path, capsys):
    """Qwen3-30B-A3B on 2 x 8 H100, --strategies zero3: the AutoEP rows are planned beside the leaf-module row
    (no longer refused), and the chosen one's JSON asks no 16-bit gather on save (the engine refuses it for AutoEP;
    toolkit.train saves through autoep_export) and names no leaf module (AutoEP swaps the MoE blocks before the
    engine applies them); DeepSpeed's AutoEP validation accepts it and check finds no fault."""
    out = tmp_path / "plan"
    assert main(["plan", str(q30 / "config.json"), "--gpus", "2x8xH100-80GB", "--seq", "2048", "--global-batch", "32",
                 "--strategies", "zero3", "--expert-parallel", "8", "--out", str(out), "--json"]) == 0
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert rows["zero3 (dp=16 x autoep=8)"]["feasible"], rows.keys()
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["strategy"], plan["expert_parallel"], plan.get("leaf_modules")) == ("zero3", 8, None)
    ds = json.loads((out / "ds_config.deepspeed.json").read_text())
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    assert "leaf_module" not in ds["zero_optimization"]
    from toolkit.engines.validate import autoep_config_check, deepspeed_config_at

    autoep_config_check(deepspeed_config_at(ds, 16), 16)
    capsys.readouterr()
    assert main(["check", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if ": error: " in line or ": warning: " in line]
    assert lines == []


def test_autoep_with_an_optimizer_deepspeed_cannot_build_is_refused_in_estimate_and_plan(q30, capsys):
    """An AutoEP plan trains with the optimizer the DeepSpeed JSON builds (toolkit writes AdamW's); with SGD the
    Trainer would hand DeepSpeed a client optimizer whose groups mark no MoE parameters, which it refuses at start.
    estimate and plan say so in one line (exit 2) before tracing anything."""
    args = [str(q30 / "config.json"), "--gpus", "8xH100-80GB", "--seq", "2048", "--optimizer", "sgd",
            "--expert-parallel", "8"]
    for command in (["estimate", *args, "--strategy", "zero1"],
                    ["plan", *args, "--global-batch", "8", "--strategies", "zero2"]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--optimizer sgd with DeepSpeed AutoEP" in err[0] and "--optimizer adamw" in err[0]


def test_plan_takes_a_fixed_expert_degree_on_zero1_or_zero2_alone(q30, capsys):
    """plan --strategies zero1 --expert-parallel 8 (no fsdp2 asked for) plans the AutoEP row at that degree; before,
    the fixed degree was checked by FSDP2's rules only and refused ("--strategies leaves out")."""
    assert main(["plan", str(q30 / "config.json"), "--gpus", "2x8xH100-80GB", "--seq", "2048", "--global-batch", "32",
                 "--strategies", "zero1", "--expert-parallel", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert [c["name"] for c in rows if c["feasible"]] == ["zero1 (dp=16 x autoep=8)"], rows


@pytest.mark.parametrize("stage, enabled", [(1, True), (2, True), (0, True), (2, False)])
def test_check_says_a_plain_trainer_saves_an_autoep_model_in_autoep_layout_and_names_the_fix(stage, enabled,
                                                                                              tmp_path, capsys):
    """A ZeRO-0/1/2 DeepSpeed JSON that turns AutoEP on: a user's own Trainer would save every checkpoint-N's model
    (and the final one) in AutoEP's layout, which from_pretrained fills at random (measured: tests/test_moe.py's
    AutoEP run before AutoEPSaves); check says so once, as a note (the file is right), naming
    toolkit.train.autoep_export's AutoEPSaves and save_autoep_model. AutoEP off: no such note."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**ZERO3_AUTOEP, "zero_optimization": {"stage": stage},
                              "expert_parallel": {**ZERO3_AUTOEP["expert_parallel"], "enabled": enabled}}))
    capsys.readouterr()
    assert main(["check", str(ds)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "AutoEP" in line]
    if not enabled:
        assert lines == []
        return
    assert len(lines) == 1 and ": note: [every runner] DeepSpeed AutoEP: a plain Trainer's save_model" in lines[0]
    assert "class MyTrainer(AutoEPSaves, Trainer)" in lines[0] and "autoep_export.save_autoep_model(" in lines[0]


ZERO3_AUTOEP = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
                "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}}


SAVES_DS_ONLY = ("note: [HF Trainer, accelerate script] DeepSpeed AutoEP with ZeRO-3: a plain HF Trainer's saves "
                 "hold the DeepSpeed checkpoint only")


@pytest.mark.parametrize("zero, extra, found", [
    # the HF save gathers 16-bit weights, which DeepSpeed refuses for AutoEP's expert partitions (measured: 2 gloo
    # ranks, tiny Qwen3-MoE, 3 steps at the single-process losses, then NotImplementedError at the first save)
    ({"stage3_gather_16bit_weights_on_model_save": True}, {},
     ["warning: [HF Trainer, accelerate script] DeepSpeed AutoEP with ZeRO-3 and "
      "stage3_gather_16bit_weights_on_model_save true: it trains, but"]),
    # without the gather the Trainer's checkpoint-N holds global_stepN alone (measured, same run)
    ({}, {}, [SAVES_DS_ONLY]),
    # deepspeed.initialize's own stage-3 AutoEP refusals (runtime/engine.py _validate_zero3_moe_compatibility)
    ({"zero_quantized_gradients": True}, {}, ["error: [every runner] DeepSpeed AutoEP with ZeRO-3: "
                                              "deepspeed.initialize refuses zero_quantized_gradients", SAVES_DS_ONLY]),
    ({"zero_hpz_partition_size": 2}, {}, ["deepspeed.initialize refuses zero_hpz_partition_size 2", SAVES_DS_ONLY]),
    ({}, {"sequence_parallel_size": 2}, ["deepspeed.initialize refuses sequence_parallel_size 2", SAVES_DS_ONLY]),
    # AutoEP off: ZeRO-3's own save advice, no AutoEP finding
    ({"stage3_gather_16bit_weights_on_model_save": True}, {"expert_parallel": {"enabled": False}}, []),
])
def test_check_finds_what_deepspeed_refuses_of_autoep_under_zero3(zero, extra, found, tmp_path, capsys):
    """A DeepSpeed JSON asking AutoEP under ZeRO-3: check names each refusal the engine would raise at start or at
    the first save, one line each; a lone JSON is enough (no model needed)."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**ZERO3_AUTOEP, "zero_optimization": {"stage": 3, **zero}, **extra}))
    capsys.readouterr()
    main(["check", str(ds)])
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "AutoEP" in line]
    assert len(lines) == len(found), lines
    for words in found:
        assert sum(words in line for line in lines) == 1, (words, lines)
    saves = [line for line in lines if "saves hold" in line or "first checkpoint ends the run" in line]
    assert all("class MyTrainer(AutoEPSaves, Trainer)" in line for line in saves), saves  # the fix, measured

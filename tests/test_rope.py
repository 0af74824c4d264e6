"""RoPE scaling as part of the job (issue 32, Deliver 1): --rope-scaling / --rope-factor reach the positions
estimate and plan allow, the config the estimate traces, plan.json / training_args.json / PLAN.md, and the model
toolkit.train builds; bad values are refused in one line."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from toolkit.cli import main
from toolkit.errors import UserError
from toolkit.inputs.rope import RopeScaling, rope_scaling_from_flags, scaled_config

YARN2 = ["--rope-scaling", "yarn", "--rope-factor", "2"]


def _json(capsys, argv):
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_yarn_lets_estimate_go_past_the_positions_with_the_same_memory(tiny_llama_dir, capsys):
    model = str(tiny_llama_dir)  # 256 positions
    code, _, err = _json(capsys, ["estimate", model, "--seq", "512", "--gpus", "1xH100-80GB"])
    assert code == 2 and "or scale its RoPE (--rope-scaling yarn --rope-factor 2)" in err
    code, out, _ = _json(capsys, ["estimate", model, "--seq", "512", "--gpus", "1xH100-80GB", "--json", *YARN2])
    assert code == 0
    scaled = json.loads(out)
    assert scaled["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0, "positions": 512}
    # RoPE scaling moves no activation bytes: the same length within the positions, with and without it.
    at_256 = [json.loads(_json(capsys, ["estimate", model, "--seq", "256", "--gpus", "1xH100-80GB", "--json",
                                        *extra])[1])["per_gpu"] for extra in ([], YARN2)]
    assert at_256[0]["peak_bytes"] == at_256[1]["peak_bytes"]


def test_dynamic_ntk_is_estimated_though_its_forward_depends_on_the_data(tiny_llama_dir, capsys):
    """dynamic_rope_update branches on max(position_ids), which the fake-tensor trace cannot follow: the estimate
    traces it as linear scaling of the same factor (traceable_config), with the same bytes."""
    runs = [json.loads(_json(capsys, ["estimate", str(tiny_llama_dir), "--seq", "512", "--gpus", "1xH100-80GB",
                                      "--json", "--rope-scaling", kind, "--rope-factor", "2"])[1])
            for kind in ("dynamic", "linear")]
    assert runs[0]["rope_scaling"]["positions"] == runs[1]["rope_scaling"]["positions"] == 512
    assert runs[0]["per_gpu"]["peak_bytes"] == runs[1]["per_gpu"]["peak_bytes"]


def test_seq_max_reaches_the_scaled_positions(tiny_llama_dir, capsys):
    code, out, _ = _json(capsys, ["estimate", str(tiny_llama_dir), "--seq", "max", "--gpus", "1xH100-80GB",
                                  "--json", "--rope-scaling", "yarn", "--rope-factor", "4"])
    found = json.loads(out)
    assert code == 0 and found["longest_seq"] == 1024 and found["capped_by_positions"]


def test_plan_writes_the_config_change_for_every_route(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "plan"
    code, _, err = _json(capsys, ["plan", str(tiny_llama_dir), "--seq", "512", "--gpus", "1xH100-80GB",
                                  "--micro-batch", "1", "--strategies", "ddp", "--out", str(out), *YARN2])
    assert code == 0, err
    plan = json.loads((out / "plan.json").read_text())
    rope = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "original_max_position_embeddings": 256}
    assert plan["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0}
    assert plan["model_config"]["rope_parameters"] == rope and plan["model_config"]["max_position_embeddings"] == 512
    overrides = json.loads((out / "training_args.json").read_text())["model_config_overrides"]
    assert overrides == {"rope_parameters": rope, "max_position_embeddings": 512}
    assert f"from_pretrained(MODEL, rope_parameters={rope!r}, max_position_embeddings=512)" in \
        (out / "PLAN.md").read_text()
    code, stdout, _ = _json(capsys, ["check", str(out)])
    assert code == 0 and "no findings" in stdout
    args = json.loads((out / "training_args.json").read_text())
    del args["model_config_overrides"]  # a script would load the model as it ships: 256 positions
    (out / "training_args.json").write_text(json.dumps(args))
    code, stdout, err = _json(capsys, ["check", str(out)])
    assert code == 1 and "model_config_overrides {} but plan.json plans" in stdout + err


def test_check_names_a_plan_past_the_positions_without_rope_scaling(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", str(tiny_llama_dir), "--seq", "512", "--gpus", "1xH100-80GB", "--micro-batch", "1",
                 "--strategies", "ddp", "--out", str(out), *YARN2]) == 0
    data = json.loads((out / "plan.json").read_text())
    data.pop("rope_scaling")
    data["model_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    data["model_config"]["max_position_embeddings"] = 256
    (out / "plan.json").write_text(json.dumps(data))
    code, stdout, err = _json(capsys, ["check", str(out)])
    findings = [line for line in (stdout + err).splitlines() if "longer than model" in line]
    assert code != 0 and len(findings) == 1 and "--rope-scaling yarn --rope-factor 2" in findings[0]


def test_dynamic_keeps_the_trained_length_and_linear_states_the_scaled_one(tiny_llama_dir):
    from toolkit.inputs.modelconfig import model_positions
    from toolkit.train.model import load_config

    config = load_config(str(tiny_llama_dir))
    dynamic = scaled_config(config, RopeScaling("dynamic", 4), "tiny")
    assert dynamic.max_position_embeddings == 256 and model_positions(dynamic) == 1024
    linear = scaled_config(config, RopeScaling("linear", 4, 128), "tiny")
    assert linear.max_position_embeddings == 512 and model_positions(linear) == 512
    assert config.rope_parameters["rope_type"] == "default"  # the model's own config is left as it was


def test_llama3_takes_its_frequency_factors_from_the_model():
    from toolkit.inputs.modelconfig import load_config, model_positions

    config = load_config("llama-3.1-8b")
    scaled = scaled_config(config, RopeScaling("llama3", 2, 8192), "llama-3.1-8b")
    assert scaled.rope_parameters["low_freq_factor"] == config.rope_parameters["low_freq_factor"]
    assert model_positions(scaled) == 16384


@pytest.mark.parametrize("factor", [0, -1, math.nan, math.inf, 0.5])
def test_a_factor_transformers_would_not_scale_by_is_refused(factor):
    with pytest.raises(UserError, match="--rope-factor must be a finite number of at least 1"):
        RopeScaling("yarn", factor)


def test_flags_that_do_not_make_a_scaling_are_refused():
    with pytest.raises(UserError, match="no --rope-scaling type"):
        rope_scaling_from_flags(None, 2.0, None)
    with pytest.raises(UserError, match="needs --rope-factor"):
        rope_scaling_from_flags("yarn", None, None)
    with pytest.raises(UserError, match="not known"):
        RopeScaling("longrope", 2)
    assert rope_scaling_from_flags(None, None, None) is None


def test_a_plan_whose_rope_scaling_disagrees_with_its_config_does_not_load(tiny_llama_dir, tmp_path, capsys):
    from toolkit.plan.schema import load_plan

    out = tmp_path / "plan"
    assert main(["plan", str(tiny_llama_dir), "--seq", "512", "--gpus", "1xH100-80GB", "--micro-batch", "1",
                 "--strategies", "ddp", "--out", str(out), *YARN2]) == 0
    data = json.loads((out / "plan.json").read_text())
    data["rope_scaling"]["factor"] = 4.0
    (out / "plan.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="rope_scaling"):
        load_plan(out / "plan.json")


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_training_applies_yarn_past_the_positions(tiny_llama_dir, corpus_dir, run_training):
    """One process on the CPU: the plan's YaRN x2 is set on the loaded config, the run trains at 512 tokens (the
    tiny Llama has 256 positions), and at one length both runs take, its loss is not the unscaled model's."""
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.rope import scaled_spec
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.model import load_config

    spec = scaled_spec(build_spec(str(tiny_llama_dir), load_config(str(tiny_llama_dir))), RopeScaling("yarn", 2))
    losses = {}
    for name, seq, rope in (("plain", 256, False), ("yarn", 256, True), ("yarn-long", 512, True)):
        plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=1, seq_len=256)
        if rope:
            plan = replace(plan, model_config=json.loads(json.dumps(spec.config_dict())),
                           rope_scaling=spec.rope_scaling, seq_len=seq)
        run = run_training(plan, f"rope-{name}", "--data", str(corpus_dir), "--max-steps", "2",
                           "--logging-steps", "1", "--seed", "0").check()
        losses[name] = run.losses()
        if rope:
            saved = json.loads(next(run.output.rglob("config.json")).read_text())
            assert saved["rope_parameters"]["rope_type"] == "yarn" and saved["rope_parameters"]["factor"] == 2.0
    assert all(math.isfinite(v) for run in losses.values() for v in run.values())
    assert losses["yarn"][1] != losses["plain"][1]


@pytest.mark.multiprocess
def test_yarn_under_sequence_parallelism_gives_one_process_losses(tiny_llama_dir, corpus_dir, runs_side_by_side):
    """Issue 32's must-show: YaRN under Ulysses SP on 2 processes. The tiny Llama (256 positions) scaled YaRN x2 and
    trained at 512 tokens: ZeRO-3 x SP 2 (each rank 256 tokens, positions 256..511 on rank 1: the adapter shards the
    position_ids, so rank 1 rotates by the gathered sequence's positions) at micro 2 x accumulation 2 against one
    process at micro 4, fp32: the same losses within 1e-3 and gradient norms within 0.1%."""
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.rope import scaled_spec
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.model import load_config

    spec = scaled_spec(build_spec(str(tiny_llama_dir), load_config(str(tiny_llama_dir))), RopeScaling("yarn", 2))
    yarn = dict(model_config=json.loads(json.dumps(spec.config_dict())), rope_scaling=spec.rope_scaling, seq_len=512)
    one = replace(plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=4, seq_len=256), **yarn)
    sp = replace(plan_for_model(tiny_llama_dir, "zero3", gpus_per_node=2, micro_batch=2, grad_accum=2, seq_len=256,
                                sequence=2), **yarn)
    argv = ("--data", str(corpus_dir), "--max-steps", "3", "--logging-steps", "1", "--save-steps", "3", "--lr",
            "3e-3", "--lr-scheduler", "constant", "--seed", "7", "--max-eval-blocks", "1", "--no-save-final")
    runs = runs_side_by_side({"one": (one, "yarn-one", *argv), "sp": (sp, "yarn-sp2", *argv)}, timeout=600)
    one, sp = runs["one"].check(), runs["sp"].check()
    assert len(one.losses()) == 3
    saved = json.loads(next(sp.output.rglob("config.json")).read_text())  # the checkpoint of step 3
    assert saved["rope_parameters"]["rope_type"] == "yarn" and saved["max_position_embeddings"] == 512
    for rank in range(2):
        assert sp.losses(rank) == pytest.approx(one.losses(), abs=1e-3), (rank, sp.losses(rank), one.losses())
        assert sp.grad_norms(rank) == pytest.approx(one.grad_norms(), rel=1e-3), rank

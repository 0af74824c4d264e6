"""Which attention a model runs comes from transformers' own class flags (toolkit.inputs.attention.attention_support,
docs/ENGINE_FACTS.md "Which attention a model class runs"): an explicit kernel the class cannot run is refused in one
line (exit 2, nothing written) by estimate, plan, emit and toolkit.train, and is an error finding of check (plan.json's
attention, or the sp_attn_implementation training_args.json hands to Ulysses: exit 1, as every finding); with no
--attention the job runs what transformers picks (sdpa, or eager where the class has none), and the memory trace, the
time model, the printed header and plan.json all say that kernel. Real transformers classes, tiny configs, no hub."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_hostile import run_cli

# transformers' MptForCausalLM sets neither _supports_sdpa nor _supports_flash_attn: eager only.
MPT = {"model_type": "mpt", "d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 4, "max_seq_len": 256,
       "vocab_size": 256}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 256, "vocab_size": 256}
JOB = ["--gpus", "2xA100-80GB", "--seq", "128"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("attention_models")
    out = {}
    for name, config in (("mpt", MPT), ("gpt2", GPT2)):
        (root / f"{name}.json").write_text(json.dumps(config))
        out[name] = str(root / f"{name}.json")
    return out


def _refusal(code: int, out: str, err: str, kernel: str) -> str:
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "MptForCausalLM" in lines[0] and f"cannot run {kernel}" in lines[0], lines[0]
    assert "runs eager only" in lines[0] and "use --attention eager" in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("kernel", ["sdpa", "flash_attention_2"])
def test_estimate_and_plan_refuse_a_kernel_the_model_class_cannot_run_before_writing(models, kernel, tmp_path):
    _refusal(*run_cli(["estimate", models["mpt"], *JOB, "--strategy", "fsdp2", "--attention", kernel]), kernel)
    _refusal(*run_cli(["estimate", models["mpt"], "--gpus", "2xA100-80GB", "--seq", "max", "--strategy", "ddp",
                       "--attention", kernel]), kernel)
    out = tmp_path / "plan"
    _refusal(*run_cli(["plan", models["mpt"], *JOB, "--global-batch", "4", "--attention", kernel, "--out", str(out)]),
             kernel)
    assert not out.exists()


def test_without_attention_the_model_runs_transformers_pick_and_memory_equals_an_explicit_run(models):
    code, out, err = run_cli(["estimate", models["mpt"], *JOB, "--strategy", "ddp", "--json"])
    assert code == 0, err
    default = json.loads(out)
    code, out, err = run_cli(["estimate", models["mpt"], *JOB, "--strategy", "ddp", "--json", "--attention", "eager"])
    eager = json.loads(out)
    assert default["job"]["attention"] == eager["job"]["attention"] == "eager"
    assert default["per_gpu"] == eager["per_gpu"] and default["timing"] == eager["timing"]
    # The time model sees eager too (efficiency.py says so when it prices eager attention).
    assert any("eager attention" in n for n in default["notes"])
    code, out, err = run_cli(["estimate", models["mpt"], *JOB, "--strategy", "ddp"])
    assert code == 0 and "adamw, eager attention" in out.splitlines()[0], out


def test_gpt2_and_llama_keep_sdpa_and_take_flash_when_asked(models):
    code, out, err = run_cli(["estimate", models["gpt2"], *JOB, "--strategy", "ddp"])
    assert code == 0 and "sdpa attention" in out.splitlines()[0], err
    code, out, err = run_cli(["estimate", models["gpt2"], *JOB, "--strategy", "ddp", "--attention",
                              "flash_attention_2", "--json"])
    assert code == 0 and json.loads(out)["job"]["attention"] == "flash_attention_2", err
    code, out, err = run_cli(["estimate", "--params", "1B", *JOB, "--strategy", "ddp", "--json"])
    assert code == 0 and json.loads(out)["job"]["attention"] == "sdpa", err


def test_a_plan_records_the_models_kernel_and_emit_and_check_refuse_an_edit_it_cannot_run(models, tmp_path):
    folder = tmp_path / "plan"
    code, out, err = run_cli(["plan", models["mpt"], *JOB, "--global-batch", "4", "--strategies", "ddp",
                              "--out", str(folder)])
    assert code == 0, err
    assert "adamw, eager attention" in out.splitlines()[0], out
    plan = json.loads((folder / "plan.json").read_text())
    assert plan["attention"] == "eager"
    code, out, err = run_cli(["check", str(folder)])
    assert code == 0, out + err
    args_file = folder / "training_args.json"
    clean = args_file.read_text()
    args_file.write_text(json.dumps({**json.loads(clean), "parallelism_config": {
        "sp_size": 2, "sp_handler": {"sp_attn_implementation": "sdpa"}}}))
    code, out, err = run_cli(["check", str(folder)])
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert code == 1 and len(errors) == 1 and errors[0].startswith(str(args_file)), err
    assert "MptForCausalLM" in errors[0] and "cannot run sdpa" in errors[0], err
    args_file.write_text(clean)
    plan["attention"] = "flash_attention_2"
    (folder / "plan.json").write_text(json.dumps(plan))
    other = tmp_path / "other"
    _refusal(*run_cli(["emit", str(folder), "--out", str(other)]), "flash_attention_2")
    assert not other.exists()
    code, out, err = run_cli(["check", str(folder)])
    assert code == 1
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert len(errors) == 1 and "MptForCausalLM" in errors[0] and "cannot run flash_attention_2" in errors[0], err
    # With --model the fit check meets the same refusal: said once, on plan.json, not again by the fit check.
    code, out, err = run_cli(["check", str(folder), "--model", models["mpt"], "--gpus", "2xA100-80GB"])
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert code == 1 and len(errors) == 1 and "cannot run flash_attention_2" in errors[0], err


def test_toolkit_train_refuses_the_plans_kernel_before_loading_the_model(models, tmp_path):
    """check_matches_plan runs in the launch preflight (before any process) and in both runners, before the load;
    on a CPU a flash plan runs the class's default kernel (eager for a flash-only class such as Gemma-2)."""
    from transformers import AutoConfig

    from toolkit.errors import UserError
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.model import check_matches_plan

    folder = tmp_path / "mpt"
    folder.mkdir()
    (folder / "config.json").write_text(Path(models["mpt"]).read_text())
    plan = plan_for_model(folder, "ddp")
    assert plan.attention == "eager"  # no attention asked: transformers' pick
    config = AutoConfig.from_pretrained(folder)
    check_matches_plan(config, plan, str(folder))
    for kernel in ("sdpa", "flash_attention_2"):
        with pytest.raises(UserError, match=f"MptForCausalLM .* cannot run {kernel}"):
            check_matches_plan(config, replace(plan, attention=kernel), str(folder))
    gemma = tmp_path / "gemma2"
    AutoConfig.for_model("gemma2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=256).save_pretrained(gemma)
    flash = replace(plan_for_model(gemma, "ddp"), attention="flash_attention_2")
    from toolkit.train import cpu, hf_runner

    if cpu.on_cpu():
        assert hf_runner._attention(flash) == "eager"  # Gemma2ForCausalLM: flash, no sdpa

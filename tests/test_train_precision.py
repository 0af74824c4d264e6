"""Precision: bf16 really runs (DeepSpeed and FSDP2 on CPU processes), fp16 plans are validated, not run."""

from __future__ import annotations

import json

import pytest
import torch

from toolkit.run.rehearsal import plan_for_model

STEPS = 6
ARGS = ("--max-steps", str(STEPS), "--logging-steps", "1", "--save-steps", "6", "--lr", "3e-3",
        "--lr-scheduler", "constant", "--max-eval-blocks", "4")


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["zero2", "fsdp2"])
def test_bf16_trains_in_bf16_and_saves_a_loadable_model(strategy, run_training, tiny_llama_dir, corpus_dir):
    plan = plan_for_model(tiny_llama_dir, strategy, micro_batch=2, seq_len=32, precision="bf16")
    run = run_training(plan, f"bf16-{strategy}", "--data", str(corpus_dir), *ARGS).check()
    assert all(rank["train_layer_output_dtype"] == "torch.bfloat16" for rank in run.ranks)
    losses = run.losses()
    assert (losses[5] + losses[6]) / 2 < losses[1] - 0.1
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run.output).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(run.ranks[0]["probe_input_ids"])).logits.float()
    # bf16 weights (DeepSpeed saves its bf16 module) or fp32 masters (FSDP2): equal up to bf16 rounding.
    torch.testing.assert_close(logits, torch.tensor(run.ranks[0]["probe_logits"]), atol=0.05, rtol=0.02)


def test_fp16_plan_is_refused_on_cpu_with_one_line(train_in_process, tiny_llama_dir, corpus_dir):
    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=2, seq_len=32, precision="fp16")
    run = train_in_process(plan, "fp16-cpu", "--data", str(corpus_dir), "--max-steps", "2")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("error: fp16 cannot run on a CPU")


@pytest.mark.parametrize("strategy", ["zero2", "zero3-offload", "zero1"])
def test_fp16_deepspeed_config_validates(strategy, tiny_llama_dir, tmp_path):
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import _validate_real_configs

    plan = plan_for_model(tiny_llama_dir, strategy, micro_batch=2, grad_accum=4, seq_len=32, precision="fp16")
    plan_dir = emit_plan_files(plan, tmp_path / "plan")
    ds = json.loads((plan_dir / "ds_config.json").read_text())
    concrete = json.loads((plan_dir / "ds_config.deepspeed.json").read_text())
    # The runner decides precision in the file it fills ("auto"); DeepSpeed's own launcher gets it stated.
    assert ds["fp16"]["enabled"] == "auto" and concrete["fp16"]["enabled"] is True
    assert ds["fp16"]["loss_scale"] == concrete["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert _validate_real_configs(plan, plan_dir) == []


def test_rehearsal_runs_fp16_plans_as_bf16(tiny_llama_dir):
    from toolkit.run.rehearsal import rehearsal_plan

    plan = plan_for_model(tiny_llama_dir, "zero3", gpus_per_node=8, micro_batch=8, grad_accum=16, seq_len=256,
                          precision="fp16", attention="flash_attention_2")
    small, said = rehearsal_plan(plan, tiny_llama_dir)
    assert (small.precision, small.attention, small.world_size, small.strategy) == ("bf16", "sdpa", 2, "zero3")
    assert small.grad_accum == 2 and small.micro_batch == 2 and small.seq_len == 64
    assert any("fp16" in line for line in said)

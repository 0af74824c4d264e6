"""LoRA through toolkit.train: real 2-process runs (gloo) of DDP, ZeRO-3 and FSDP2 against one single-process run,
the adapter saved in PEFT format reloading with PeftModel.from_pretrained to the trained logits, the merged model,
and an exact resume. Same tiny Llama, corpus and schedule as tests/test_train_engines.py (fp32, global batch 4)."""

from __future__ import annotations

import pytest
import torch

from toolkit.inputs.lora import Adapter
from toolkit.run.rehearsal import plan_for_model

STEPS = 6
SEQ = 32
LOSS_TOLERANCE = 2e-4
ADAPTER = Adapter(method="lora", r=4, alpha=8, dropout=0.0, targets="all-linear")
COMMON = ("--max-steps", str(STEPS), "--logging-steps", "1", "--save-steps", "3", "--lr", "2e-2",
          "--lr-scheduler", "constant", "--seed", "7", "--max-eval-blocks", "8")


def _plan(model_dir, strategy, *, world=2, micro=2):
    plan = plan_for_model(model_dir, strategy, gpus_per_node=world, micro_batch=micro, seq_len=SEQ,
                          precision="fp32")
    return plan.replace(method="lora", adapter=ADAPTER.to_dict())


def _run(model_dir, corpus_dir, name):
    """run_training's arguments for "ref" (one process, micro 4, the adapter also merged) or an engine's 2 ranks."""
    if name == "ref":
        return (_plan(model_dir, "ddp", world=1, micro=4), "lora-ref", "--data", str(corpus_dir), *COMMON,
                "--merge-final")
    return _plan(model_dir, name), f"lora-{name}", "--data", str(corpus_dir), *COMMON


@pytest.fixture(scope="module")
def lora_runs(runs_by_name, tiny_llama_dir, corpus_dir):
    """Each run once, by name: the one-process reference ("ref") starts beside DDP's 2 ranks."""
    return runs_by_name(lambda name: _run(tiny_llama_dir, corpus_dir, name), together=[("ref", "ddp")])


@pytest.fixture(scope="module")
def lora_reference(lora_runs):
    return lora_runs("ref")


def _probe_logits_of_saved_adapter(base_dir, run) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(run.output)).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(run.ranks[0]["probe_input_ids"])).logits


@pytest.mark.multiprocess
def test_lora_single_process_trains_only_the_adapter_and_merges(lora_reference, tiny_llama_dir):
    import json

    from transformers import AutoModelForCausalLM

    losses = lora_reference.losses()
    assert len(losses) == STEPS and (losses[5] + losses[6]) / 2 < losses[1] - 0.05
    config = json.loads((lora_reference.output / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert not (lora_reference.output / "model.safetensors").exists()  # the adapter, not a full model
    trained = torch.tensor(lora_reference.ranks[0]["probe_logits"])
    torch.testing.assert_close(_probe_logits_of_saved_adapter(tiny_llama_dir, lora_reference), trained,
                               atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(lora_reference.output / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in base.parameters())
    with torch.no_grad():
        logits = merged(input_ids=torch.tensor(lora_reference.ranks[0]["probe_input_ids"])).logits
    torch.testing.assert_close(logits, trained, atol=1e-4, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["ddp", "zero2", "zero3", "fsdp2"])
def test_lora_engines_match_single_process_and_adapter_reloads(engine, lora_runs, lora_reference, tiny_llama_dir):
    run = lora_runs(engine)
    assert len(run.ranks) == 2
    ref, got = lora_reference.losses(), run.losses()
    assert got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=LOSS_TOLERANCE), (engine, step, got, ref)
    trained = torch.tensor(run.ranks[0]["probe_logits"])
    torch.testing.assert_close(torch.tensor(run.ranks[1]["probe_logits"]), trained, atol=1e-6, rtol=0)
    torch.testing.assert_close(_probe_logits_of_saved_adapter(tiny_llama_dir, run), trained, atol=1e-5, rtol=0)


@pytest.mark.multiprocess
def test_lora_zero3_resume_is_exact(run_training, lora_runs, tiny_llama_dir, corpus_dir, tmp_path):
    import shutil

    full = lora_runs("zero3")
    output = tmp_path / "resumed"
    shutil.copytree(full.output / "checkpoint-3", output / "checkpoint-3")
    resumed = run_training(_plan(tiny_llama_dir, "zero3"), "lora-zero3-resume", "--data", str(corpus_dir), *COMMON,
                           "--resume", "--no-save-final", output=output).check()
    got, want = resumed.losses(), full.losses()
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], abs=1e-6), (step, got, want)


def test_rehearsal_plan_keeps_the_method(tiny_llama_dir):
    from toolkit.run.rehearsal import rehearsal_plan

    plan = _plan(tiny_llama_dir, "fsdp2").replace(method="qlora", adapter={**ADAPTER.to_dict(), "method": "qlora"})
    small, _ = rehearsal_plan(plan, tiny_llama_dir)
    assert (small.method, small.adapter) == ("qlora", plan.adapter)


def test_train_flags_choose_the_adapter(tiny_llama_dir):
    from toolkit.errors import UserError
    from toolkit.inputs.job import adapter_problem
    from toolkit.train.adapters import adapter_for_run
    from toolkit.train.args import parse_train_args

    full = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, seq_len=SEQ)
    base = ["--plan", "p", "--data", "d", "--output", "o"]
    assert adapter_for_run(full, parse_train_args(base)) is None
    chosen = adapter_for_run(full, parse_train_args([*base, "--lora", "--lora-r", "32", "--lora-targets", "q_proj"]))
    assert (chosen.method, chosen.r, chosen.targets) == ("lora", 32, "q_proj")
    lora_plan = _plan(tiny_llama_dir, "ddp", world=1)
    assert adapter_for_run(lora_plan, parse_train_args(base)) == ADAPTER
    with pytest.raises(UserError, match="--lora or --qlora"):
        adapter_for_run(full, parse_train_args([*base, "--lora-r", "8"]))
    with pytest.raises(UserError, match="--lora-dropout"):
        adapter_for_run(full, parse_train_args([*base, "--lora", "--lora-dropout", "2"]))
    zero3 = plan_for_model(tiny_llama_dir, "zero3", seq_len=SEQ)
    with pytest.raises(UserError) as refused:
        adapter_for_run(zero3, parse_train_args([*base, "--qlora"]))
    # The planner's reason for its "not possible" zero3 rows, word for word (one rule: adapter_problem).
    assert str(refused.value) == adapter_problem(Adapter(method="qlora"), zero3.strategy_spec)
    bf16_plan = zero3.replace(method="qlora", adapter=Adapter(method="qlora", quant_storage="bfloat16").to_dict())
    assert adapter_for_run(bf16_plan, parse_train_args(base)).quant_storage == "bfloat16"


@pytest.mark.multiprocess
def test_qlora_trains_on_cpu_with_ddp_and_reloads_on_the_4bit_base(run_training, tiny_llama_dir, corpus_dir):
    """bitsandbytes >= 0.46 runs 4-bit Linear4bit forward and backward on CPU: QLoRA (NF4, double quantisation)
    trains over gloo like LoRA, and the saved adapter on a freshly quantised base gives the trained logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from toolkit.train.adapters import quantization_config

    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=2, micro_batch=2, seq_len=SEQ, precision="fp32")
    run = run_training(plan, "qlora-ddp", "--data", str(corpus_dir), *COMMON, "--qlora", "--lora-r", "4",
                       "--lora-dropout", "0").check()
    losses = run.losses()
    assert (losses[5] + losses[6]) / 2 < losses[1] - 0.02
    assert run.losses(1) == losses
    qlora = Adapter(method="qlora", r=4, dropout=0.0)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=quantization_config(qlora),
                                                dtype=torch.float32)
    assert type(base.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    model = PeftModel.from_pretrained(base, str(run.output)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(run.ranks[0]["probe_input_ids"])).logits
    # bf16 compute (bnb_4bit_compute_dtype): a fresh process rounds a few logits differently; training moved
    # them by ~1e-1.
    torch.testing.assert_close(logits.float(), torch.tensor(run.ranks[0]["probe_logits"]), atol=1e-3, rtol=0)


@pytest.mark.multiprocess
def test_fsdp2_qlora_with_uint8_storage_trains_with_the_codes_whole_on_every_rank(run_training, tiny_llama_dir,
                                                                                   corpus_dir):
    """The planner offers FSDP2 for QLoRA with uint8 storage and budgets the 4-bit codes whole on every GPU
    (toolkit.inputs.lora.quantized_base_sharded False): toolkit.train runs it, accelerate leaves the Params4bit out
    of fully_shard (the rest is sharded), and it trains. With bfloat16 storage the codes are halved over 2 ranks
    (checked by hand: 18,432 of 36,864 elements per rank). Under bf16 mixed precision accelerate upcasts no
    trainable parameter of a model holding Params4bit: the lm_head copy (modules_to_save) stays bf16 beside the fp32
    adapters, and each rank's AdamW states are the plan's optimizer_bytes (2 x 2 B a copy parameter, not 2 x 4 B)."""
    from toolkit.estimate.search import predict_plan
    from toolkit.inputs.lora import quantized_base_sharded

    adapter = Adapter(method="qlora", r=4, dropout=0.0, modules_to_save="lm_head")
    assert not quantized_base_sharded(adapter)
    plan = plan_for_model(tiny_llama_dir, "fsdp2", gpus_per_node=2, micro_batch=2, seq_len=SEQ, precision="bf16")
    plan = plan.replace(method="qlora", adapter=adapter.to_dict())
    run = run_training(plan, "qlora-fsdp2-uint8", "--data", str(corpus_dir), *COMMON).check()
    local, whole = run.ranks[0]["four_bit_numel"]
    assert whole > 0 and [r["four_bit_numel"] for r in run.ranks] == [[whole, whole]] * 2
    losses = run.losses()
    assert (losses[5] + losses[6]) / 2 < losses[1] - 0.02
    predicted = predict_plan(plan.replace(gpu="H100-SXM-80GB")).predicted
    for rank in run.ranks:
        assert rank["trained_param_dtypes"] == ["torch.bfloat16", "torch.float32"], rank["rank"]
        assert rank["optimizer_bytes"] == pytest.approx(predicted["optimizer_bytes"], rel=0.01), (rank, predicted)


def test_train_lora_on_a_full_moe_plan_takes_peft_dropout_rule(tmp_path):
    """Issue 33: `toolkit.train --lora` on a full fine-tuning plan of an MoE model gets PEFT's dropout rule at
    argument time (dropout 0 where PEFT wraps expert parameters), not PEFT's refusal after the model loads; an
    explicit non-zero dropout is one UserError naming the fix."""
    from toolkit.errors import UserError
    from toolkit.run.tiny import tiny_config
    from toolkit.train.adapters import adapter_for_run
    from toolkit.train.args import parse_train_args

    tiny_config("qwen3_moe", layers=2, hidden=64, vocab_size=512).save_pretrained(tmp_path)
    full = plan_for_model(tmp_path, "ddp", gpus_per_node=1, seq_len=SEQ)
    base = ["--plan", "p", "--data", "d", "--output", "o"]
    assert adapter_for_run(full, parse_train_args([*base, "--lora"])).dropout == 0.0
    with pytest.raises(UserError, match="--lora-dropout 0"):
        adapter_for_run(full, parse_train_args([*base, "--lora", "--lora-dropout", "0.1"]))


@pytest.mark.multiprocess
def test_a_qlora_zero3_plan_of_a_gqa_model_rehearses(tmp_path, capfd):
    """Llama-2-70B QLoRA on 2 x 24 GB with ZeRO-3 (bf16 quant storage, the layout DeepSpeed shards): its CPU
    rehearsal trains, checkpoints, saves and reloads. Before, three things stopped it: the random checkpoint was
    written from ZeRO-3's empty placeholders, toolkit.train asked a quantised model to be born partitioned (transformers
    builds it on meta), and bitsandbytes' packed CPU kernel refused the tiny model's 16-wide KV projections at
    evaluation and the bf16 storage at save."""
    from toolkit.cli import main
    from toolkit.commands.launch import launch_main

    plan_dir = tmp_path / "p"
    assert main(["plan", "llama-2-70b", "--gpus", "2xRTX-4090", "--method", "qlora", "--qlora-quant-storage",
                 "bfloat16", "--micro-batch", "1", "--seq", "2048", "--strategies", "zero3-offload",
                 "--out", str(plan_dir)]) == 0
    capfd.readouterr()
    assert launch_main(plan_dir, [], rehearse=True) == 0
    out = capfd.readouterr().out
    assert "rehearsal passed: zero3-offload trained" in out and "bitsandbytes' packed CPU kernel off" in out, out

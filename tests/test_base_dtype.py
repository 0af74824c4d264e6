"""LoRA's --base-dtype (issue 28, Deliver 3): the frozen base loaded in fp32 under bf16 autocast, as published LoRA
examples load it. The traced step against a real CPU step, the bytes it moves, the refusals, and toolkit.train."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from toolkit.inputs.lora import Adapter


def _tiny():
    from toolkit.run.tiny import tiny_config

    return tiny_config("llama", vocab_size=1000, max_positions=256, hidden=128, layers=3, heads=4, kv_heads=2,
                       ffn=344)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["full", "ckpt"])
def test_fp32_base_step_peak_matches_a_real_cpu_step(checkpointing):
    """The fake step builds the base in fp32 (autocast copies each weight to bf16 for its matmul, and the copy is
    saved for the input's gradient): the traced whole-step peak is a real PEFT step's on CPU within 1%, and above
    the bf16 base's by more than the fp32 weights' extra bytes (the saved bf16 copies)."""
    from toolkit.estimate.profile import measure_step, predict_step
    from toolkit.inputs.lora import adapter_counts

    config = _tiny()
    kwargs = dict(seq_len=128, micro_batch=2, precision="bf16", checkpointing=checkpointing)
    peaks = {}
    for base in ("auto", "fp32"):
        adapter = Adapter(method="lora", r=8, alpha=16, dropout=0.1, targets="all-linear", base_dtype=base)
        measured = measure_step(config, steps=1, adapter=adapter, **kwargs)
        predicted = predict_step(config, device_kind="cpu", adapter=adapter, **kwargs)
        assert predicted["peak_bytes"] == pytest.approx(measured.peak_bytes, rel=0.01)
        peaks[base] = measured.peak_bytes
    frozen = adapter_counts(config, Adapter(method="lora", r=8, alpha=16, dropout=0.1)).frozen_params
    assert peaks["fp32"] - peaks["auto"] > 2 * frozen


def test_fp32_base_moves_the_parameters_by_exactly_the_weight_bytes():
    """estimate's parameters term of an fp32 base is the bf16 base's plus 2 bytes per frozen parameter, and its
    trace holds the bf16 copies autocast makes of the frozen weights; host RAM at load counts 4 B per parameter."""
    from toolkit.estimate.hostram import host_ram
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.lora import adapter_counts
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    config = _tiny()
    spec = build_spec("llama", config)
    out = {}
    for base in ("auto", "fp32"):
        adapter = Adapter(method="lora", r=8, alpha=16, dropout=0.0, base_dtype=base)
        job = Job(seq_len=128, micro_batch=2, precision="bf16", adapter=adapter)
        out[base] = estimate_memory(spec, parse_strategy("ddp"), job, parse_hardware("1xH200"))
        ram = host_ram(job=job, params=1000, largest_layer_params=100, strategy=parse_strategy("ddp"),
                       gpus_per_node=1, world=1, resident_bytes_per_node=0)
        assert ram.load_bytes_per_node == 1000 * {"auto": 2, "fp32": 4}[base]
    frozen = adapter_counts(config, Adapter(method="lora", r=8, alpha=16, dropout=0.0)).frozen_params
    assert out["fp32"].parameters_bytes - out["auto"].parameters_bytes == 2 * frozen
    # Every adapted linear's bf16 weight copy is saved for backward (the input's gradient needs it), beside the
    # bf16 copies of the fp32 norms' outputs the adapters read.
    linears = sum(m.weight.numel() for m in _linear_modules(config))
    assert out["fp32"].autocast_copy_bytes - out["auto"].autocast_copy_bytes >= 2 * linears


def _linear_modules(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]


@pytest.mark.parametrize("argv,words", [
    (["--strategy", "zero2", "--method", "lora", "--base-dtype", "fp32"], "DeepSpeed's bf16 mode casts"),
    (["--strategy", "zero3", "--method", "lora", "--base-dtype", "fp32"], "use ddp"),
    (["--method", "qlora", "--base-dtype", "fp32"], "QLoRA base is 4-bit"),
    (["--base-dtype", "fp32"], "--method is full"),
    (["--method", "lora", "--precision", "bf16-pure", "--base-dtype", "fp32"], "with --precision bf16 or fp16"),
    (["--method", "lora", "--base-dtype", "fp16"], "the base computes in bfloat16"),
    (["--method", "lora", "--base-dtype", "fp64"], "choose one of: auto, fp32, bf16, fp16"),
], ids=["zero2", "zero3", "qlora", "full", "bf16-pure", "fp16-under-bf16", "unknown"])
def test_base_dtype_refusals_are_one_line(capsys, argv, words):
    from toolkit.cli import main

    base = ["estimate", "llama-3.1-8b", "--gpus", "2xH100-80GB", "--seq", "2048"]
    argv = argv if "--strategy" in argv else [*argv, "--strategy", "ddp"]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_plan_files_carry_the_base_dtype(tmp_path, tiny_llama_dir):
    """plan.json's adapter, training_args.json's model_dtype and PLAN.md say float32; auto leaves plan.json's adapter
    as before (no base_dtype key)."""
    import json

    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=2, seq_len=32, precision="bf16")
    for base, dtype in (("auto", "bfloat16"), ("fp32", "float32")):
        adapter = Adapter(method="lora", r=4, alpha=8, dropout=0.0, base_dtype=base)
        folder = emit_plan_files(plan.replace(method="lora", adapter=adapter.to_dict()), tmp_path / base)
        stored = json.loads((folder / "plan.json").read_text())["adapter"]
        assert stored.get("base_dtype") == (None if base == "auto" else "fp32")
        args = json.loads((folder / "training_args.json").read_text())
        assert json.dumps(args).count(f'"model_dtype": "{dtype}"') >= 1
        assert f"in {dtype}" in (folder / "PLAN.md").read_text()


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_train_with_an_fp32_base_trains_and_holds_the_base_in_fp32(run_training, tiny_llama_dir, corpus_dir):
    """toolkit.train, one process on CPU, bf16 autocast: the frozen base is held in fp32, the adapters in fp32,
    the matmuls compute in bf16 while the residual stream (a layer's output) stays fp32, and the adapters train
    (lora_B starts at zero and is not zero after 4 steps)."""
    import math

    from safetensors.torch import load_file

    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=2, seq_len=32, precision="bf16")
    adapter = Adapter(method="lora", r=4, alpha=8, dropout=0.0, base_dtype="fp32")
    run = run_training(plan.replace(method="lora", adapter=adapter.to_dict()), "fp32-base", "--data", str(corpus_dir),
                       "--max-steps", "4", "--logging-steps", "1", "--save-steps", "4", "--lr", "2e-2",
                       "--lr-scheduler", "constant", "--seed", "7", "--max-eval-blocks", "4").check()
    rank = run.ranks[0]
    assert rank["frozen_param_dtypes"] == ["torch.float32"] and rank["trained_param_dtypes"] == ["torch.float32"]
    assert (rank["train_linear_output_dtype"], rank["train_layer_output_dtype"]) == ("torch.bfloat16", "torch.float32")
    losses = run.losses()
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses.values())
    saved = load_file(run.output / "adapter_model.safetensors")
    lora_b = [t for name, t in saved.items() if "lora_B" in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)


def test_plan_offers_fp32_base_on_ddp_only_and_check_refuses_an_edited_plan(capsys, tmp_path, tiny_llama_dir):
    """The planner lists zero2 under "not possible" with base_dtype_problem's reason, offers ddp and fsdp2 (fp32
    shards gathered in bf16), and writes the fp32 base into plan.json; check refuses the plan edited to zero2 with
    the same reason."""
    import json

    from toolkit.cli import main
    from toolkit.inputs.job import base_dtype_problem
    from toolkit.inputs.strategy import parse_strategy

    adapter = Adapter(method="lora", base_dtype="fp32")
    job = ["plan", str(tiny_llama_dir), "--method", "lora", "--base-dtype", "fp32", "--gpus", "2xH100-80GB",
           "--seq", "64", "--global-batch", "16", "--strategies", "ddp,zero2,fsdp2"]
    assert main([*job, "--json"]) == 0
    rows = {c["strategy"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    reason = base_dtype_problem(adapter, "bf16", parse_strategy("zero2"))
    assert not rows["zero2"]["feasible"] and rows["zero2"]["reason"] == reason
    assert rows["ddp"]["feasible"] and rows["fsdp2"]["feasible"]
    folder = tmp_path / "plan"
    # ddp's row by name: a tiny job's step is the host's dispatch on every row, so the rows tie within the band
    # and the ranking's robustness rules choose among them.
    assert main([*job, "--choose", "ddp", "--out", str(folder)]) == 0
    capsys.readouterr()
    plan = json.loads((folder / "plan.json").read_text())
    assert (plan["strategy"], plan["adapter"]["base_dtype"]) == ("ddp", "fp32")
    plan["strategy"] = "zero2"
    (folder / "plan.json").write_text(json.dumps(plan))
    assert main(["check", str(folder)]) == 1
    assert base_dtype_problem(adapter, "bf16", parse_strategy("zero2")) in capsys.readouterr().err


def _fsdp2_estimates():
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    spec = build_spec("llama", _tiny())
    return {base: estimate_memory(spec, parse_strategy("fsdp2"), Job(seq_len=128, micro_batch=2, precision="bf16",
                                  adapter=Adapter(method="lora", r=8, alpha=16, dropout=0.0, base_dtype=base)),
                                  parse_hardware("2xH200")) for base in ("auto", "fp32")}


def test_fsdp2_fp32_base_adds_fp32_shards_and_gathers_the_same_bf16_bytes():
    """FSDP2 on 2 GPUs: an fp32 base's shards take 2 B more per frozen parameter / 2 ranks; the all-gathered
    (unsharded) parameters, the activations and the gather time are the bf16 base's, since FSDP2 casts each shard to
    MixedPrecisionPolicy's param_dtype before the all-gather. The peak moves by the shards' bytes alone."""
    from toolkit.inputs.lora import adapter_counts

    frozen = adapter_counts(_tiny(), Adapter(method="lora", r=8, alpha=16, dropout=0.0)).frozen_params
    out = _fsdp2_estimates()
    assert out["fp32"].parameters_bytes - out["auto"].parameters_bytes == 2 * frozen // 2
    for field in ("buffers_bytes", "activations_bytes", "gradients_bytes", "optimizer_bytes", "autocast_copy_bytes"):
        assert getattr(out["fp32"], field) == getattr(out["auto"], field), field
    assert out["fp32"].peak_bytes - out["auto"].peak_bytes == 2 * frozen // 2


def test_fsdp2_holds_an_fp32_base_in_fp32_shards_and_computes_it_in_bf16():
    """The real engine, in this process (torch's fake process group at world 2, wrapped as toolkit.estimate.fakeworld
    wraps a run: fully_shard per decoder layer and the root, accelerate's MixedPrecisionPolicy): a PEFT model on an
    fp32 base keeps every local shard in fp32, its frozen Linear computes with a bf16 unsharded weight, and the
    shards' bytes are the estimate's parameters term for fsdp2 on 2 GPUs, to the byte."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.estimate.fakeworld import _fake_world, _local, _wrap
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.strategy import parse_strategy

    adapter = Adapter(method="lora", r=8, alpha=16, dropout=0.0, base_dtype="fp32")
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(_tiny(), dtype=torch.float32), adapter.lora_config())
    strategy = parse_strategy("fsdp2")
    seen = {}
    with _fake_world(2):
        _wrap(model, strategy, ParallelGrid.for_strategy(strategy, nodes=1, gpus_per_node=2), torch.bfloat16, "bf16")
        shards = [_local(p) for p in model.parameters()]
        q_proj = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
        q_proj.register_forward_pre_hook(lambda m, args: seen.update(weight=m.weight.dtype))
        with torch.no_grad():
            model(input_ids=torch.randint(0, 1000, (1, 16)))
    assert {t.dtype for t in shards} == {torch.float32}
    assert seen["weight"] == torch.bfloat16
    assert sum(t.numel() * t.element_size() for t in shards) == _fsdp2_estimates()["fp32"].parameters_bytes


def test_fsdp2_plan_with_an_fp32_base_emits_and_checks(capsys, tmp_path, tiny_llama_dir):
    """plan --strategies fsdp2 --out: plan.json carries the fp32 base, training_args.json loads it in float32,
    accelerate's FSDP2 config computes in bf16 (the gathered dtype), and check passes the folder."""
    import json

    from toolkit.cli import main

    folder = tmp_path / "plan"
    assert main(["plan", str(tiny_llama_dir), "--method", "lora", "--base-dtype", "fp32", "--gpus", "2xH100-80GB",
                 "--seq", "64", "--global-batch", "16", "--strategies", "fsdp2", "--out", str(folder)]) == 0
    plan = json.loads((folder / "plan.json").read_text())
    assert (plan["strategy"], plan["adapter"]["base_dtype"]) == ("fsdp2", "fp32")
    assert '"model_dtype": "float32"' in (folder / "training_args.json").read_text()
    assert "mixed_precision: bf16" in (folder / "accelerate_config.yaml").read_text()
    capsys.readouterr()
    assert main(["check", str(folder)]) == 0, capsys.readouterr().err


FSDP2_STEPS = ("--max-steps", "4", "--logging-steps", "1", "--save-steps", "4", "--lr", "2e-2", "--lr-scheduler",
               "constant", "--seed", "7", "--max-eval-blocks", "4")


@pytest.fixture(scope="module")
def fsdp2_fp32_base_runs(runs_side_by_side, tiny_llama_dir, corpus_dir):
    """FSDP2 LoRA on an fp32 base under bf16 mixed precision: 2 gloo ranks (micro-batch 2) and the same plan in one
    process (micro-batch 4: the same global batch), started side by side. Returns (2-rank plan, 1-process run,
    2-rank run)."""
    from toolkit.run.rehearsal import plan_for_model

    adapter = Adapter(method="lora", r=4, alpha=8, dropout=0.0, base_dtype="fp32").to_dict()
    plans = {world: plan_for_model(tiny_llama_dir, "fsdp2", gpus_per_node=world, micro_batch=4 // world, seq_len=32,
                                   precision="bf16").replace(method="lora", adapter=adapter) for world in (1, 2)}
    runs = runs_side_by_side({world: (plans[world], f"fsdp2-fp32-base-{world}", "--data", str(corpus_dir),
                                      *FSDP2_STEPS) for world in (1, 2)})
    return plans[2], runs[1].check(), runs[2].check()


@pytest.mark.multiprocess
def test_fsdp2_fp32_base_on_two_ranks_trains_as_one_process(fsdp2_fp32_base_runs):
    """The 2-rank run's losses are the 1-process run's within 1e-3 (bf16 compute and a bf16 gradient reduce;
    measured: at most 2.0e-4 apart over the 4 steps)."""
    _, one, two = fsdp2_fp32_base_runs
    ref, got = one.losses(), two.losses()
    assert len(ref) == 4 and got.keys() == ref.keys()
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-3), (step, got, ref)


@pytest.mark.multiprocess
def test_fsdp2_fp32_base_ranks_hold_the_plans_parameter_and_optimizer_bytes(fsdp2_fp32_base_runs):
    """Each rank's local shards (fp32 base and adapters: a bf16 base would hold half) are the plan's per-rank
    parameters_bytes to the byte, and AdamW's moments its optimizer_bytes (the step counters, 4 B a tensor, are the
    rest). Measured: 295,552 B of shards a rank, half the one-process run's 591,104."""
    from toolkit.estimate.search import predict_plan

    plan, _, two = fsdp2_fp32_base_runs
    predicted = predict_plan(plan.replace(gpu="H100-SXM-80GB")).predicted
    for rank in two.ranks:
        assert (rank["frozen_param_dtypes"], rank["trained_param_dtypes"]) == (["torch.float32"], ["torch.float32"])
        assert rank["param_bytes"] == predicted["parameters_bytes"], (rank["rank"], predicted)
        assert rank["optimizer_bytes"] == pytest.approx(predicted["optimizer_bytes"], rel=0.01), (rank["rank"],
                                                                                                 predicted)

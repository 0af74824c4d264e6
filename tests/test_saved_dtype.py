"""LoRA's --modules-to-save-dtype (issue 28, Deliver 3): the dtype the trainable modules_to_save copies train in.
PEFT deep-copies them in the base's load dtype (auto); toolkit.train casts them after wrapping. The traced step
against a real CPU step, the bytes each engine moves, the refusals, the plan files and toolkit.train's model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from toolkit.inputs.lora import Adapter

SAVED = "lm_head,embed_tokens"


def _tiny():
    from toolkit.run.tiny import tiny_config

    return tiny_config("llama", vocab_size=1000, max_positions=256, hidden=128, layers=3, heads=4, kv_heads=2,
                       ffn=344)


def _adapter(saved_dtype: str, method: str = "lora") -> Adapter:
    return Adapter(method=method, r=8, alpha=16, dropout=0.1, targets="all-linear", modules_to_save=SAVED,
                   saved_dtype=saved_dtype)


def test_saved_copies_step_peak_matches_a_real_cpu_step():
    """bf16 autocast on a bf16 base: the copies in bf16 (auto, as PEFT makes them) and cast to fp32 both trace the
    whole-step peak of a real PEFT step on CPU (Adam included) within 1%; fp32 copies cost more."""
    from toolkit.estimate.profile import measure_step, predict_step

    kwargs = dict(seq_len=128, micro_batch=2, precision="bf16", checkpointing=False)
    peaks = {}
    for saved in ("auto", "fp32"):
        measured = measure_step(_tiny(), steps=1, adapter=_adapter(saved), **kwargs)
        predicted = predict_step(_tiny(), device_kind="cpu", adapter=_adapter(saved), **kwargs)
        assert predicted["peak_bytes"] == pytest.approx(measured.peak_bytes, rel=0.01)
        peaks[saved] = measured.peak_bytes
    assert peaks["fp32"] > peaks["auto"]


def _estimates(strategy: str, gpus: str, method: str = "lora"):
    from toolkit.estimate.memory import estimate_memory
    from toolkit.inputs.hardware import parse_hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import build_spec
    from toolkit.inputs.strategy import parse_strategy

    spec = build_spec("llama", _tiny())
    return {saved: estimate_memory(spec, parse_strategy(strategy),
                                   Job(seq_len=128, micro_batch=2, precision="bf16", adapter=_adapter(saved, method)),
                                   parse_hardware(gpus)) for saved in ("auto", "fp32")}


def test_fp32_copies_move_ddp_states_by_exactly_their_bytes():
    """DDP on 2 GPUs: fp32 copies instead of bf16 add 2 B per saved parameter to the weights, 2 B to the
    gradients, 2 B to the Reducer's buckets and 4 B to AdamW's two states (held in the parameter's dtype)."""
    from toolkit.inputs.lora import adapter_counts

    saved = adapter_counts(_tiny(), _adapter("auto")).saved_module_params
    assert saved == 2 * 1000 * 128  # untied embed_tokens and lm_head, copied whole
    out = _estimates("ddp", "2xH200")
    assert out["fp32"].parameters_bytes - out["auto"].parameters_bytes == 2 * saved
    assert out["fp32"].gradients_bytes - out["auto"].gradients_bytes == 2 * saved
    assert out["fp32"].optimizer_bytes - out["auto"].optimizer_bytes == 4 * saved
    assert out["fp32"].buffers_bytes - out["auto"].buffers_bytes == 2 * saved


def test_fsdp2_trains_the_copies_in_fp32_either_way():
    """LoRA: accelerate upcasts every trainable parameter to fp32 for FSDP2 (fsdp2_prepare_model): fp32 copies are what
    auto already trains, so the states and the peak do not move."""
    out = _estimates("fsdp2", "2xH200")
    for field in ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "buffers_bytes", "peak_bytes"):
        assert getattr(out["fp32"], field) == getattr(out["auto"], field), field


def test_fsdp2_beside_a_4bit_base_keeps_auto_copies_in_bf16():
    """QLoRA: accelerate upcasts no trainable parameter of a model holding Params4bit (fsdp2_prepare_model), so
    auto's bf16 copies stay bf16 under FSDP2 on 2 GPUs: fp32 copies add 2 B per saved parameter / 2 ranks to the
    weights and to the gradients, 4 B / 2 to AdamW's states; the gathered (bf16) parameters do not move."""
    from toolkit.inputs.lora import adapter_counts

    saved = adapter_counts(_tiny(), _adapter("auto", "qlora")).saved_module_params
    out = _estimates("fsdp2", "2xH200", "qlora")
    assert out["fp32"].parameters_bytes - out["auto"].parameters_bytes == 2 * saved // 2
    assert out["fp32"].gradients_bytes - out["auto"].gradients_bytes == 2 * saved // 2
    assert out["fp32"].optimizer_bytes - out["auto"].optimizer_bytes == 4 * saved // 2
    assert out["fp32"].buffers_bytes == out["auto"].buffers_bytes


@pytest.mark.parametrize("argv,words", [
    (["--strategy", "zero2", "--lora-modules-to-save", "lm_head", "--modules-to-save-dtype", "fp32"],
     "DeepSpeed's bf16 mode casts every parameter"),
    (["--strategy", "fsdp2", "--lora-modules-to-save", "lm_head", "--modules-to-save-dtype", "bf16"],
     "accelerate upcasts every trainable parameter to fp32"),
    (["--modules-to-save-dtype", "fp32"], "none are named"),
    (["--precision", "bf16-pure", "--lora-modules-to-save", "lm_head", "--modules-to-save-dtype", "fp32"],
     "the copies compute in bfloat16"),
    (["--lora-modules-to-save", "lm_head", "--modules-to-save-dtype", "fp16"], "give fp32 or the compute dtype"),
    (["--lora-modules-to-save", "lm_head", "--modules-to-save-dtype", "fp64"], "choose one of: auto, fp32"),
], ids=["zero2", "fsdp2-bf16", "none-named", "bf16-pure", "fp16-under-bf16", "unknown"])
def test_saved_dtype_refusals_are_one_line(capsys, argv, words):
    from toolkit.cli import main

    base = ["estimate", "llama-3.1-8b", "--gpus", "2xH100-80GB", "--seq", "2048", "--method", "lora"]
    argv = argv if "--strategy" in argv else [*argv, "--strategy", "ddp"]
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_full_fine_tuning_refuses_the_flag(capsys):
    from toolkit.cli import main

    assert main(["estimate", "llama-3.1-8b", "--gpus", "2xH100-80GB", "--seq", "2048", "--strategy", "ddp",
                 "--modules-to-save-dtype", "fp32"]) == 2
    assert "--method is full" in capsys.readouterr().err


def test_plan_files_carry_the_saved_dtype(tmp_path, tiny_llama_dir):
    """plan.json's adapter, training_args.json's adapter settings and PLAN.md say float32; auto leaves plan.json's
    adapter as before (no saved_dtype key)."""
    import json

    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=2, seq_len=32, precision="bf16")
    for saved in ("auto", "fp32"):
        adapter = Adapter(method="lora", r=4, alpha=8, dropout=0.0, modules_to_save="lm_head", saved_dtype=saved)
        folder = emit_plan_files(plan.replace(method="lora", adapter=adapter.to_dict()), tmp_path / saved)
        stored = json.loads((folder / "plan.json").read_text())["adapter"]
        assert stored.get("saved_dtype") == (None if saved == "auto" else "fp32")
        settings = json.loads((folder / "training_args.json").read_text())
        assert json.dumps(settings).count('"modules_to_save_dtype": "float32"') == (saved == "fp32")
        assert ("modules_to_save (lm_head) train in float32" in (folder / "PLAN.md").read_text()) == (saved == "fp32")


def test_toolkit_train_model_holds_the_copies_in_the_plan_dtype(tiny_llama_dir):
    """toolkit.train's wrap_model on a real bf16 base: the trainable lm_head copy is fp32 (and trains: it requires
    grad), the frozen original stays bf16, and the adapters are fp32 as PEFT makes them."""
    import torch

    from toolkit.inputs.modelconfig import load_pretrained
    from toolkit.train.adapters import wrap_model

    adapter = Adapter(method="lora", r=4, alpha=8, dropout=0.0, modules_to_save="lm_head", saved_dtype="fp32")
    model = wrap_model(load_pretrained(str(tiny_llama_dir), dtype=torch.bfloat16), adapter, checkpointing=False)
    dtypes = {name: (p.dtype, p.requires_grad) for name, p in model.named_parameters() if "lm_head" in name}
    assert dtypes == {"base_model.model.lm_head.original_module.weight": (torch.bfloat16, False),
                      "base_model.model.lm_head.modules_to_save.default.weight": (torch.float32, True)}
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}


def test_a_users_script_gets_the_copies_in_the_plan_dtype_from_the_helper(tmp_path, tiny_llama_dir, monkeypatch):
    """A user's script run as `toolkit launch` runs it (toolkit.train.own_script.run_script, in this process, one
    rank) on a plan folder with --modules-to-save-dtype fp32: the base loaded with model_kwargs() in bf16 and wrapped
    with peft_model() holds the trainable lm_head copy in fp32, the frozen original in bf16, as toolkit.train does."""
    import json
    import sys

    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.own_script import PLAN_DIR_ENV, run_script

    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=2, seq_len=32, precision="bf16")
    adapter = Adapter(method="lora", r=4, alpha=8, dropout=0.0, modules_to_save="lm_head", saved_dtype="fp32")
    folder = emit_plan_files(plan.replace(method="lora", adapter=adapter.to_dict()), tmp_path / "plan")
    script = tmp_path / "my_train.py"
    script.write_text(
        "import json, sys\nfrom transformers import AutoModelForCausalLM\n"
        "from toolkit.train.own_script import model_kwargs, peft_model\n"
        "model = peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[1], **model_kwargs()))\n"
        "dtypes = {n: [str(p.dtype), p.requires_grad] for n, p in model.named_parameters() if 'lm_head' in n}\n"
        "open(sys.argv[2], 'w').write(json.dumps(dtypes))\n")
    monkeypatch.setenv(PLAN_DIR_ENV, str(folder))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name in ("path", "argv", "stderr"):
        monkeypatch.setattr(sys, name, list(getattr(sys, name)) if name != "stderr" else sys.stderr)
    assert run_script([str(script), str(tiny_llama_dir), str(tmp_path / "dtypes.json")]) == 0
    assert json.loads((tmp_path / "dtypes.json").read_text()) == {
        "base_model.model.lm_head.original_module.weight": ["torch.bfloat16", False],
        "base_model.model.lm_head.modules_to_save.default.weight": ["torch.float32", True]}

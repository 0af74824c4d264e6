"""Single-process pieces of the training entry: arguments, data packing, checkpoint bookkeeping, model checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.errors import UserError


# --- arguments -------------------------------------------------------------------------------------------------

def test_train_args_defaults_and_flags():
    from toolkit.train.args import parse_train_args

    args = parse_train_args(["--plan", "p", "--data", "d", "--output", "o", "--max-steps", "5", "--resume",
                             "--save-total-limit", "2", "--lr-scheduler", "linear"])
    assert (args.plan, args.data, args.output, args.max_steps, args.resume) == ("p", "d", "o", 5, True)
    assert args.save_total_limit == 2 and args.lr_scheduler == "linear" and args.model is None


@pytest.mark.parametrize("argv, message", [
    (["--plan", "p"], "required"),
    (["--plan", "p", "--data", "d", "--output", "o", "--max-steps", "0"], "--max-steps"),
    (["--plan", "p", "--data", "d", "--output", "o", "--eval-fraction", "1.5"], "--eval-fraction"),
    (["--plan", "p", "--data", "d", "--output", "o", "--bogus"], "unrecognized"),
])
def test_bad_train_args_are_user_errors(argv, message):
    from toolkit.train.args import parse_train_args

    with pytest.raises(UserError, match=message):
        parse_train_args(argv)


def test_bitsandbytes_deepspeed_and_peft_are_left_out_of_a_run_that_cannot_use_them(tiny_llama_dir, tmp_path):
    """The training process marks bitsandbytes absent for a full fine-tune with AdamW (its import costs ~1.3 s of
    CPU a rank), and keeps it for QLoRA (the plan's method or --qlora) and adamw-8bit; it marks DeepSpeed absent
    for a DDP or FSDP2 run (~0.5 s a rank) and keeps it for ZeRO, the pipeline, tiling and Ulysses SP; it marks PEFT
    absent for a run without an adapter (the plan's method, --lora or --qlora). A run that keeps DeepSpeed imports
    its Muon module uncompiled unless the DeepSpeed JSON asks for Muon."""
    import importlib.util
    import sys
    from types import SimpleNamespace

    from toolkit.inputs.strategy import Engine
    from toolkit.plan.files import DS_CONFIG, PLAN_JSON
    from toolkit.run.launcher import emit_plan_files
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.__main__ import (bitsandbytes_unused, deepspeed_unused, leave_out_unused, muon_unused,
                                        peft_unused)

    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1)
    assert bitsandbytes_unused(plan, False)
    assert not bitsandbytes_unused(plan, True)
    assert not bitsandbytes_unused(SimpleNamespace(method="qlora", optimizer="adamw"), False)
    assert not bitsandbytes_unused(SimpleNamespace(method="full", optimizer="adamw-8bit"), False)
    assert bitsandbytes_unused(SimpleNamespace(method="lora", optimizer="sgd"), False)
    assert peft_unused(plan, False) and not peft_unused(plan, True)
    assert not peft_unused(SimpleNamespace(method="lora"), False)
    assert not peft_unused(SimpleNamespace(method="qlora"), False)
    assert deepspeed_unused(plan)
    assert deepspeed_unused(plan_for_model(tiny_llama_dir, "fsdp2", gpus_per_node=2))
    zero1 = plan_for_model(tiny_llama_dir, "zero1", gpus_per_node=2)
    assert zero1.engine == Engine.DEEPSPEED and not deepspeed_unused(zero1)
    assert not deepspeed_unused(plan_for_model(tiny_llama_dir, "pipeline", gpus_per_node=2, pipeline_stages=2))
    assert not deepspeed_unused(plan.replace(tiled=True))  # DeepSpeed's TiledMLP
    assert not deepspeed_unused(SimpleNamespace(engine=Engine.FSDP2, tiled=False, sequence_parallel=2))
    plan_json = str(emit_plan_files(plan, tmp_path / "plan") / PLAN_JSON)
    zero1_dir = emit_plan_files(zero1, tmp_path / "zero1")
    zero1_json = str(zero1_dir / PLAN_JSON)
    assert muon_unused(zero1_dir / PLAN_JSON) and muon_unused(zero1_dir)
    muon_dir = emit_plan_files(zero1, tmp_path / "muon")
    ds_config = json.loads((muon_dir / DS_CONFIG).read_text())
    (muon_dir / DS_CONFIG).write_text(json.dumps({**ds_config, "optimizer": {"type": "Muon", "params": {}}}))
    assert not muon_unused(muon_dir)
    (muon_dir / DS_CONFIG).write_text("{")
    assert not muon_unused(muon_dir)  # unreadable: left as DeepSpeed has it (the runner reports the JSON)
    absent = object()
    before = {name: sys.modules.pop(name, absent) for name in ("bitsandbytes", "deepspeed", "peft")}
    finders = list(sys.meta_path)
    try:
        assert leave_out_unused(["--plan", str(tmp_path / "missing.json")]) == []
        run = ["--data", "d", "--output", "o"]
        assert leave_out_unused(["--plan", zero1_json, *run, "--qlora"]) == []
        assert not {"bitsandbytes", "deepspeed", "peft"} & set(sys.modules)
        assert leave_out_unused(["--plan", zero1_json, *run, "--lora"]) == ["bitsandbytes"]
        assert "deepspeed" not in sys.modules and "peft" not in sys.modules
        assert leave_out_unused(["--plan", zero1_json, *run]) == ["peft"]  # bitsandbytes: already decided
        assert "deepspeed" not in sys.modules
        # each ZeRO run's hooks: DeepSpeed's Muon module, py-cpuinfo (unless imported already)
        assert len(sys.meta_path) == len(finders) + 3 * (2 - ("cpuinfo.cpuinfo" in sys.modules))
        assert leave_out_unused(["--plan", plan_json, *run]) == ["deepspeed"]
        assert len(sys.meta_path) == len(finders) + 3 * (2 - ("cpuinfo.cpuinfo" in sys.modules))  # DDP: none
        for name in ("bitsandbytes", "deepspeed", "peft"):
            assert sys.modules[name] is None and importlib.util.find_spec(name) is None
        from accelerate.utils import is_deepspeed_available, is_peft_available
        from transformers.integrations.deepspeed import is_deepspeed_available as transformers_sees
        from transformers.utils import is_peft_available as transformers_sees_peft

        assert not is_deepspeed_available() and not transformers_sees()
        # transformers caches its answer (lru_cache): a rank asks first after the entry; here the check it makes
        assert not is_peft_available() and not transformers_sees_peft.__wrapped__()
    finally:
        sys.meta_path[:] = finders
        for name, module in before.items():
            sys.modules.pop(name, None)
            if module is not absent:
                sys.modules[name] = module


def test_a_deepspeed_rank_imports_muon_uncompiled_and_leaves_torch_compile_as_it_was():
    """compile_muon_never: DeepSpeed's Muon module, imported by every ZeRO optimizer's set-up, runs its torch.compile
    decorators with TORCHDYNAMO_DISABLE=1 (the kernels stay plain functions, no inductor backend resolved), for that
    import only: the variable is as before afterwards, the hook is gone, and torch.compile still compiles."""
    import importlib
    import os
    import sys

    import torch

    from toolkit.train.__main__ import MUON_MODULE, compile_muon_never

    saved = sys.modules.pop(MUON_MODULE, None)
    finders = list(sys.meta_path)
    try:
        compile_muon_never()
        assert len(sys.meta_path) == len(finders) + 1
        muon = importlib.import_module(MUON_MODULE)
        assert sys.meta_path == finders and "TORCHDYNAMO_DISABLE" not in os.environ
        for kernel in (muon.zeropower_via_newtonschulz5, muon.zeropower_via_gram_newtonschulz):
            assert not hasattr(kernel, "_torchdynamo_orig_callable") and kernel.__module__ == MUON_MODULE
        assert muon.__spec__.origin.endswith("deepspeed/runtime/zero/muon/original_muon.py")
        compiled = torch.compile(lambda x: x + 1, backend="eager")  # after the import: compiled as before
        assert hasattr(compiled, "_torchdynamo_orig_callable")
        assert compiled(torch.ones(2)).tolist() == [2.0, 2.0]
    finally:
        sys.meta_path[:] = finders
        sys.modules.pop(MUON_MODULE, None)
        if saved is not None:
            sys.modules[MUON_MODULE] = saved


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_a_deepspeed_rank_asks_py_cpuinfo_once():
    """ask_cpuinfo_once: py-cpuinfo's get_cpu_info starts an interpreter at every call; after the hook a second call
    starts none and gives an equal dict of its own. Counted as the processes this one reaps."""
    import importlib
    import resource
    import sys

    from toolkit.train.__main__ import CPUINFO_MODULE, ask_cpuinfo_once

    saved = {name: sys.modules.pop(name) for name in ("cpuinfo", CPUINFO_MODULE) if name in sys.modules}
    finders = list(sys.meta_path)

    def reaped() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    try:
        ask_cpuinfo_once()
        from cpuinfo import get_cpu_info

        assert sys.meta_path == finders
        before = reaped()
        first = get_cpu_info()
        between = reaped()
        second = get_cpu_info()
        assert between > before and reaped() == between  # the first call ran `python cpuinfo.py --json`, not the second
        assert first == second and first is not second and first["arch"]
        del sys.modules["cpuinfo"], sys.modules[CPUINFO_MODULE]
        plain = importlib.import_module("cpuinfo")
        assert not hasattr(plain.cpuinfo.get_cpu_info_json, "cache_info")  # without the hook: as py-cpuinfo has it
    finally:
        sys.meta_path[:] = finders
        for name in ("cpuinfo", CPUINFO_MODULE):
            sys.modules.pop(name, None)
        sys.modules.update(saved)


# --- data ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_blocks_are_exactly_seq_len_with_eos_between_documents(tokenizer, tmp_path):
    from toolkit.train.data import build_datasets

    docs = [f"document number {i} says something about packing." for i in range(40)]
    (tmp_path / "d.txt").write_text("\n\n".join(docs) + "\n")
    train, evaluation = build_datasets(str(tmp_path / "d.txt"), tokenizer, 16, eval_fraction=0.0, seed=0)
    assert evaluation is None
    assert all(len(ids) == 16 for ids in train["input_ids"])
    assert train["input_ids"] == train["labels"]
    flat = [t for ids in train["input_ids"] for t in ids]
    eos = tokenizer.eos_token_id
    ends = [i for i, t in enumerate(flat) if t == eos]
    pieces = [flat[a + 1:b] for a, b in zip([-1, *ends], ends)]
    assert [tokenizer.decode(p) for p in pieces] == docs[:len(pieces)]  # in order, one EOS after each
    assert len(pieces) >= len(docs) - 1  # only the tail shorter than a block is dropped


def test_folder_with_validation_file_uses_it_for_eval(tokenizer, corpus_dir):
    from toolkit.train.data import build_datasets

    train, evaluation = build_datasets(str(corpus_dir), tokenizer, 32, eval_fraction=0.5, seed=0)
    whole, _ = build_datasets(str(corpus_dir / "train.txt"), tokenizer, 32, eval_fraction=0.0, seed=0)
    assert len(train) == len(whole) and evaluation is not None and len(evaluation) > 0


def test_eval_fraction_holds_out_blocks(tokenizer, corpus_dir):
    from toolkit.train.data import build_datasets

    train, evaluation = build_datasets(str(corpus_dir / "train.txt"), tokenizer, 32, eval_fraction=0.1, seed=0)
    assert len(evaluation) == round((len(train) + len(evaluation)) * 0.1)


def test_jsonl_with_another_text_column(tokenizer, tmp_path):
    from toolkit.train.data import build_datasets

    rows = [{"id": i, "body": "some words in a json line " * 5} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _ = build_datasets(str(tmp_path / "d.jsonl"), tokenizer, 16, eval_fraction=0.0, seed=0)
    assert len(train) > 0
    (tmp_path / "two.jsonl").write_text("".join(json.dumps({"a": "x" * 50, "b": "y" * 50}) + "\n" for _ in range(5)))
    with pytest.raises(UserError, match="no 'text' column"):
        build_datasets(str(tmp_path / "two.jsonl"), tokenizer, 16, eval_fraction=0.0, seed=0)


def test_hub_name_offline_is_one_user_error(tokenizer, monkeypatch):
    from toolkit.train.data import build_datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(UserError, match="loading it as a hub dataset failed"):
        build_datasets("someone/some-dataset-that-is-not-here", tokenizer, 16, eval_fraction=0.0, seed=0)


# --- checkpoints -----------------------------------------------------------------------------------------------

def _checkpoint(root, step, complete=True):
    from toolkit.train.checkpoints import mark_complete

    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
        mark_complete(path)
    return path


def test_resume_takes_the_newest_complete_checkpoint(tmp_path):
    from toolkit.train.checkpoints import last_complete_checkpoint

    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 20)
    _checkpoint(tmp_path, 30, complete=False)  # killed while writing
    assert last_complete_checkpoint(tmp_path).name == "checkpoint-20"


def test_rotation_never_deletes_the_last_complete_checkpoint(tmp_path):
    from toolkit.train.checkpoints import checkpoint_dirs, rotate

    _checkpoint(tmp_path, 5, complete=False)
    for step in (10, 20, 30):
        _checkpoint(tmp_path, step)
    _checkpoint(tmp_path, 40, complete=False)  # being written right now
    rotate(tmp_path, keep=1)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-30", "checkpoint-40"]


def test_rotation_keeps_three_complete_checkpoints_by_default_as_plan_md_says(tmp_path):
    from toolkit.emit.explain import launch_section
    from toolkit.run.rehearsal import plan_for_model
    from toolkit.train.args import parse_train_args
    from toolkit.train.checkpoints import checkpoint_dirs, rotate

    keep = parse_train_args(["--plan", "p", "--data", "d", "--output", "o"]).save_total_limit
    assert keep == 3
    for step in (10, 20, 30, 40, 50):
        _checkpoint(tmp_path, step)
    rotate(tmp_path, keep)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-30", "checkpoint-40", "checkpoint-50"]
    plan = plan_for_model(str(Path(__file__).parents[1] / "toolkit" / "catalog" / "models" / "gpt2.json"), "ddp")
    assert "keeps the newest 3 complete ones (`--save-total-limit`)" in "\n".join(launch_section(plan, None))


# --- model against plan ----------------------------------------------------------------------------------------

def test_model_checks(tiny_llama_dir, tiny_gpt2_dir):
    from toolkit.train.model import check_matches_plan, load_config
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(tiny_llama_dir, "ddp", seq_len=32)
    check_matches_plan(load_config(str(tiny_llama_dir)), plan, "m")
    check_matches_plan(load_config(str(tiny_llama_dir / "config.json")), plan, "m")
    with pytest.raises(UserError, match="model_type gpt2 vs llama"):
        check_matches_plan(load_config(str(tiny_gpt2_dir)), plan, "m")
    with pytest.raises(UserError, match="longer than model"):
        check_matches_plan(load_config(str(tiny_llama_dir)), plan.replace(seq_len=4096), "m")


def test_time_left_holds_the_measured_step_against_the_plans_band():
    from toolkit.train.callbacks import time_left

    fields, warning = time_left(2.0, 100, None, None)  # no prediction that applies (a CPU run): measured only
    assert fields == {"step_time_s": 2.0, "time_left_s": 200.0} and warning is None
    fields, warning = time_left(2.2, 100, 2.0, 0.11)  # +10%: inside a +-11% band
    assert fields["time_left_predicted_s"] == 200.0 and fields["step_time_vs_predicted"] == pytest.approx(0.1)
    assert warning is None
    fields, warning = time_left(2.5, 100, 2.0, 0.11)  # +25%: outside it
    assert fields["time_left_s"] == 250.0 and "+25% off the plan's predicted 2.000 s" in warning
    assert "outside its +-11% band" in warning
    assert time_left(9.0, 100, 2.0, None)[1] is None  # an unverified prediction is held to no band


def test_the_prediction_is_compared_only_on_the_planned_gpus():
    """torch's names and total memories of real parts against the catalog: an H100 SXM's name has no SXM in it, a
    PCIe H100 has the SXM's memory, an A100 40 GB the 80 GB's name, an L40S the L4's model word as a prefix."""
    from toolkit.inputs.hardware import find_gpu
    from toolkit.train.callbacks import is_catalog_gpu, off_planned_hardware

    h100, pcie, a100, l4 = (find_gpu(n) for n in ("H100-SXM-80GB", "H100-PCIe-80GB", "A100-80GB", "L4"))
    assert is_catalog_gpu(h100, "NVIDIA H100 80GB HBM3", h100.memory_bytes)
    assert not is_catalog_gpu(h100, "NVIDIA H100 PCIe", pcie.memory_bytes)
    assert is_catalog_gpu(pcie, "NVIDIA H100 PCIe", pcie.memory_bytes)
    assert is_catalog_gpu(a100, "NVIDIA A100-SXM4-80GB", a100.memory_bytes)
    assert not is_catalog_gpu(a100, "NVIDIA A100-SXM4-40GB", find_gpu("A100-40GB").memory_bytes)
    assert not is_catalog_gpu(l4, "NVIDIA L40S", l4.memory_bytes)
    assert not is_catalog_gpu(h100, "NVIDIA H200", find_gpu("H200").memory_bytes)
    assert off_planned_hardware(h100, 8, ("NVIDIA H100 80GB HBM3", h100.memory_bytes), 8) is None
    assert off_planned_hardware(h100, 8, None, 2) == "this run is on CPU"
    assert off_planned_hardware(h100, 8, ("NVIDIA H100 80GB HBM3", h100.memory_bytes), 4) == \
        "this run is on 4 of them"
    assert off_planned_hardware(h100, 8, ("NVIDIA H200", find_gpu("H200").memory_bytes), 8) == \
        "this run is on 8x NVIDIA H200 (139.8 GiB)"


def test_a_cpu_plan_is_compared_on_the_cpu_and_process_count_it_was_measured_for(tiny_llama_dir):
    """A plan for `2xcpu` records the CPU its rates were measured on and the thread count; a CPU run of 2 processes
    on that CPU at that thread count is on its planned hardware (its step is held to the prediction); another CPU
    model, thread count or process count, a plan without the record, and a CUDA run are not."""
    from toolkit import api
    from toolkit.inputs.hardware import find_gpu
    from toolkit.train.callbacks import cpu_here, off_planned_hardware

    plan = api.plan(str(tiny_llama_dir), "2xcpu", seq_len=64, global_batch=8, device_kind="cpu").to_plan()
    here = cpu_here()
    planned = (plan.predicted["cpu_model"], plan.predicted["cpu_threads"])
    assert planned == here and plan.predicted["step_time_s"] > 0
    cpu = find_gpu("cpu")
    assert off_planned_hardware(cpu, 2, None, 2, planned_cpu=planned, cpu=here) is None
    assert off_planned_hardware(cpu, 2, None, 4, planned_cpu=planned, cpu=here) == "this run is on 4 of them"
    assert off_planned_hardware(cpu, 2, None, 2, planned_cpu=planned, cpu=("Other CPU 9000", here[1])) == \
        f"this run is on Other CPU 9000 at {here[1]} thread(s), the prediction was measured on {here[0]} at {here[1]}"
    assert "at 7 thread(s)" in off_planned_hardware(cpu, 2, None, 2, planned_cpu=planned, cpu=(here[0], 7))
    assert off_planned_hardware(cpu, 2, None, 2, planned_cpu=(None, None), cpu=here) == \
        "the plan does not record the CPU it was measured on (re-plan it)"
    assert off_planned_hardware(cpu, 2, ("NVIDIA H100 80GB HBM3", find_gpu("H100-SXM-80GB").memory_bytes), 2,
                                planned_cpu=planned) == "this run is on 2x NVIDIA H100 80GB HBM3 (79.1 GiB)"

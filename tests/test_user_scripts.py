"""A plan folder carries into a user's own training: an HF Trainer script, a TRL SFTTrainer script on chat data and a
custom accelerate loop (examples/own_script/) each train with a ZeRO-2, a ZeRO-3 and an FSDP2 plan folder, on 2 CPU
processes over gloo, through plain `accelerate launch --config_file PLAN/accelerate_config.yaml SCRIPT`.

Each plan folder is emitted, copied to another directory, and launched from a third one: nothing in it may name a
path of the place it was emitted in. The scripts read only PLAN/training_args.json for the plan's numbers.
ZeRO-3 and FSDP2 plans checkpoint activations (through TrainingArguments, resp. the YAML's
fsdp_activation_checkpointing); ZeRO-2 accumulates 2 micro-batches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.quick_launch import ACCELERATE_LAUNCH
from toolkit.emit import emit_files
from toolkit.run.rehearsal import plan_for_model
from toolkit.train.hf_runner import read_rank_summaries

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "examples" / "own_script"
STEPS = 8
SEQ = 64
PLANS = {  # strategy: (micro-batch, accumulation, checkpointing)
    "zero2": (1, 2, False), "zero3": (2, 1, True), "fsdp2": (2, 1, True),
}


def accelerate_launch() -> list[str]:
    """`accelerate launch` of this environment (a venv used without activating it included), started as
    tests/quick_launch.py says: accelerate's launch function with the same arguments, without the CLI's extra
    imports and teardown."""
    return list(ACCELERATE_LAUNCH)


@pytest.fixture(scope="module")
def copied_plans(tmp_path_factory, tiny_llama_dir):
    """strategy -> the plan folder, emitted in one directory and used from a copy in another."""
    base = tmp_path_factory.mktemp("user-plans")
    copied = {}
    for strategy, (micro, accum, checkpointing) in PLANS.items():
        plan = plan_for_model(tiny_llama_dir, strategy, micro_batch=micro, grad_accum=accum, seq_len=SEQ,
                              checkpointing=checkpointing)
        emit_files(plan, base / "emitted" / strategy)
        copied[strategy] = Path(shutil.copytree(base / "emitted" / strategy, base / "copied" / strategy))
    shutil.rmtree(base / "emitted")  # a path into the first folder would now fail
    return copied


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    from toolkit.run import tiny

    return tiny.write_chat_corpus(tmp_path_factory.mktemp("chat"), max_chars=60_000) / "train.jsonl"


def _launch(plan_dir: Path, script: str, args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, list]:
    third = tmp_path / "third"
    third.mkdir()
    reports = tmp_path / "reports"
    command = [*accelerate_launch(), "--config_file", str(plan_dir / "accelerate_config.yaml"), str(SCRIPTS / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REPORT_DIR": str(reports), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, cwd=third, env=env, capture_output=True, text=True, timeout=600)
    ranks = read_rank_summaries(reports)
    return proc, ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", sorted(PLANS))
@pytest.mark.parametrize("script", ["trainer_script.py", "sft_script.py", "accelerate_loop.py"])
def test_user_script_trains_with_a_copied_plan_folder(script, strategy, copied_plans, tiny_llama_dir, corpus_dir,
                                                      chat_data, tmp_path):
    if script == "sft_script.py":
        pytest.importorskip("trl")
    plan_dir = copied_plans[strategy]
    args = ["--plan", str(plan_dir), "--model", str(tiny_llama_dir), "--max_steps", str(STEPS)]
    args += ["--data", str(chat_data if script == "sft_script.py" else corpus_dir)]
    if script != "accelerate_loop.py":
        args += ["--output", str(tmp_path / "out")]
    proc, ranks = _launch(plan_dir, script, args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert len(ranks) == 2
    losses = ranks[0]["losses"]
    assert len(losses) == STEPS
    assert sum(losses[-2:]) / 2 < losses[0] - 0.1, losses
    # Ranks agree: the same logged losses, and the same trained model (a forward of a fixed probe).
    assert ranks[1]["losses"] == pytest.approx(losses, abs=1e-6)
    import torch

    difference = (torch.tensor(ranks[1]["probe_logits"]) - torch.tensor(ranks[0]["probe_logits"])).abs().max()
    assert float(difference) < 1e-5


def test_trainer_deepspeed_route_accepts_the_listed_arguments(tmp_path, tiny_llama_dir):
    """`--deepspeed ds_config.json` with the TrainingArguments training_args.json lists: the Trainer fills every
    "auto" (no mismatch), with a learning rate, clipping and precision of the user's choosing."""
    from transformers import TrainingArguments

    for strategy, precision in (("zero2", "bf16"), ("zero3-offload", "bf16"), ("zero3", "fp32")):
        plan = plan_for_model(tiny_llama_dir, strategy, gpus_per_node=1, micro_batch=2, grad_accum=4, seq_len=SEQ,
                              precision=precision)
        folder = tmp_path / strategy
        emit_files(plan, folder)
        listed = json.loads((folder / "training_args.json").read_text())["training_arguments"]
        args = TrainingArguments(output_dir=str(tmp_path / "o"), deepspeed=str(folder / "ds_config.json"),
                                 learning_rate=2e-4, use_cpu=True, **{**listed, "max_grad_norm": 0.3})
        filled = args.hf_deepspeed_config.config
        assert filled["train_micro_batch_size_per_gpu"] == 2 and filled["gradient_accumulation_steps"] == 4
        assert filled["train_batch_size"] == 8 and filled["gradient_clipping"] == 0.3
        assert filled["bf16"]["enabled"] is (precision == "bf16")
        if "optimizer" in filled:
            assert filled["optimizer"]["params"]["lr"] == 2e-4
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


def test_offload_plans_tell_a_custom_loop_to_use_dummy_optim(tmp_path, tiny_llama_dir):
    plan = plan_for_model(tiny_llama_dir, "zero2-offload", micro_batch=2, seq_len=SEQ)
    emit_files(plan, tmp_path)
    settings = json.loads((tmp_path / "training_args.json").read_text())
    assert settings["accelerate_loop"]["use_dummy_optim"] is True
    assert any("DummyOptim" in note for note in settings["notes"])
    assert "DummyOptim" in (tmp_path / "PLAN.md").read_text()
    assert "optimizer" in json.loads((tmp_path / "ds_config.json").read_text())
    plain = plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=SEQ)
    emit_files(plain, tmp_path / "plain")
    plain_settings = json.loads((tmp_path / "plain" / "training_args.json").read_text())
    assert plain_settings["accelerate_loop"]["use_dummy_optim"] is False
    # The rest of what a user's script needs: the launch line, and TRL's keys on top of the Trainer's.
    assert plain_settings["accelerate_launch"].startswith("accelerate launch --config_file ")
    assert plain_settings["sft_config"]["max_length"] == SEQ
    assert plain_settings["sft_config"]["per_device_train_batch_size"] == 2
    assert plain_settings["sft_config"]["packing"] is False  # sdpa: packed conversations would see each other
    md = (tmp_path / "plain" / "PLAN.md").read_text()
    assert plain_settings["accelerate_launch"] in md and "per_device_train_batch_size=2," in md


def test_checkpointing_is_written_where_each_route_reads_it(tmp_path, tiny_llama_dir):
    import yaml

    from toolkit.emit.user_settings import checkpointing_name

    name = checkpointing_name()
    for strategy in ("fsdp2", "zero3"):
        emit_files(plan_for_model(tiny_llama_dir, strategy, seq_len=SEQ, checkpointing=True), tmp_path / strategy)
        settings = json.loads((tmp_path / strategy / "training_args.json").read_text())
        config = yaml.safe_load((tmp_path / strategy / "accelerate_config.yaml").read_text())
        if strategy == "fsdp2":  # accelerate applies it for every script; the Trainer flag must then stay off
            assert config["fsdp_config"]["fsdp_activation_checkpointing"] is True
            assert settings["training_arguments"][name] is False
        else:
            assert settings["training_arguments"][name] is True
            assert settings["accelerate_loop"]["gradient_checkpointing"] is True


def test_the_checkpointing_name_read_from_transformers_source_is_the_signatures():
    import inspect

    from transformers import TrainingArguments

    from toolkit.emit.user_settings import _checkpointing_name

    parameters = inspect.signature(TrainingArguments).parameters
    assert _checkpointing_name() in parameters
    assert ("activation_checkpointing" in parameters) == (_checkpointing_name() == "activation_checkpointing")


@pytest.mark.multiprocess
def test_local_folder_plan_launch_sh_trains_as_printed(copied_plans, tiny_llama_dir, corpus_dir, tmp_path):
    plan_dir = copied_plans["zero2"]
    text = (plan_dir / "launch.sh").read_text()
    assert f"MODEL={tiny_llama_dir.resolve()}" in text  # the local folder, by absolute path
    assert "./launch.sh --data DATA --output OUT" in (plan_dir / "PLAN.md").read_text()
    third = tmp_path / "third"
    third.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(plan_dir / "launch.sh"), "--data", str(corpus_dir), "--output",
                           str(tmp_path / "out"), "--max-steps", "2", "--save-steps", "2", "--no-save-final"],
                          cwd=third, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2

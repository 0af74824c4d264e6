"""toolkit.train takes every TrainingArguments flag (transformers' HfArgumentParser); the plan's numbers win."""

from __future__ import annotations

import pytest

from toolkit.errors import UserError
from toolkit.train.args import parse_train_args


def test_trainer_flags_reach_the_trainer_and_the_plan_wins(tiny_llama_dir, tmp_path, capsys):
    from toolkit.train.hf_runner import _training_arguments
    from toolkit.run.rehearsal import plan_for_model

    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=2, grad_accum=3, seq_len=32)
    args = parse_train_args(["--plan", "p", "--data", "d", "--output", str(tmp_path), "--report_to", "tensorboard",
                             "--adam_beta2", "0.95", "--per_device_train_batch_size", "9", "--save_only_model",
                             "--max-steps", "5"])
    assert args.max_steps == 5
    assert args.trainer_flags == {"report_to": "tensorboard", "adam_beta2": 0.95, "per_device_train_batch_size": 9,
                                  "save_only_model": True}
    from toolkit.train.cpu import configure_cpu_state

    configure_cpu_state("ddp")  # one process: accelerate's CPU state, as train_hf makes it before the arguments
    training = _training_arguments(plan, args, tmp_path, on_cpu=True)
    assert training.report_to == ["tensorboard"] and training.adam_beta2 == 0.95 and training.save_only_model
    assert training.per_device_train_batch_size == 2 and training.gradient_accumulation_steps == 3
    out = capsys.readouterr().out
    assert "--per_device_train_batch_size 9 ignored: the plan sets per_device_train_batch_size=2" in out


def test_unknown_flags_are_one_clear_error():
    with pytest.raises(UserError, match="unrecognized arguments: --bogus"):
        parse_train_args(["--plan", "p", "--data", "d", "--output", "o", "--bogus", "1"])

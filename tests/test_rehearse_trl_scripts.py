"""A user's own TRL DPO and GRPO scripts, rehearsed (issue 29): `toolkit launch PLAN --rehearse -- script.py` hands
the script the tiny data of the plan's method, in the format TRL's trainers take: preference pairs (prompt / chosen /
rejected) for a DPO plan, prompts for a GRPO plan, text for supervised fine-tuning; and a GRPO plan is rehearsed
with generation in the training process, short completions and whole groups of generations in the small batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.inputs.grpo import Grpo
from toolkit.inputs.preference import Dpo
from toolkit.run.rehearsal import (REHEARSAL_COMPLETION, REHEARSAL_SEQ_LEN, plan_for_model, rehearsal_data,
                                   rehearsal_plan)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_dpo_plans_rehearsal_data_is_trls_preference_pairs(tiny_llama_dir, tmp_path):
    from datasets import load_dataset

    plan = plan_for_model(tiny_llama_dir, "zero2", seq_len=32).replace(dpo=Dpo().to_dict())
    data = rehearsal_data(plan, tmp_path / "data", chat=True)
    assert sorted(p.name for p in data.iterdir()) == ["train.jsonl", "validation.jsonl"]
    pairs = load_dataset("json", data_files=str(data / "train.jsonl"))["train"]
    assert pairs.column_names == ["prompt", "chosen", "rejected"] and len(pairs) > 100
    assert all(row["chosen"] != row["rejected"] for row in pairs)
    held_out = {row["prompt"] + row["chosen"] for row in _rows(data / "validation.jsonl")}
    assert held_out and not held_out & {row["prompt"] + row["chosen"] for row in pairs}


def test_a_grpo_plans_rehearsal_data_is_trls_prompt_only_rows(tiny_llama_dir, tmp_path):
    from trl.data_utils import is_conversational

    plan = plan_for_model(tiny_llama_dir, "ddp", seq_len=64).replace(grpo=Grpo(max_prompt_length=32,
                                                                            max_completion_length=32).to_dict())
    data = rehearsal_data(plan, tmp_path / "data", chat=True)
    rows = _rows(data / "train.jsonl")
    assert {tuple(row) for row in rows} == {("prompt",)} and len(rows) > 100
    assert not is_conversational(rows[0])  # TRL's standard (string) prompt format
    assert not (data / "train.txt").exists()


def test_an_sft_plans_rehearsal_data_is_text_and_for_a_script_conversations(tiny_llama_dir, tmp_path):
    plan = plan_for_model(tiny_llama_dir, "ddp", seq_len=32)
    assert sorted(p.name for p in rehearsal_data(plan, tmp_path / "run").iterdir()) == ["train.txt",
                                                                                        "validation.txt"]
    script = rehearsal_data(plan, tmp_path / "script", chat=True)
    assert sorted(p.name for p in script.iterdir()) == ["train.jsonl", "train.txt", "validation.jsonl",
                                                        "validation.txt"]
    assert set(_rows(script / "train.jsonl")[0]) == {"messages"}


def test_chat_pairs_and_prompts_ask_the_same_question_of_a_paragraph(tmp_path):
    """One source for the tiny data: the user's turn of a conversation is the prompt of a pair and of GRPO."""
    from toolkit.run import tiny

    chat = _rows(tiny.write_chat_corpus(tmp_path / "chat", max_chars=5_000) / "train.jsonl")
    pairs = _rows(tiny.write_preference_corpus(tmp_path / "pairs", max_chars=5_000) / "train.jsonl")
    prompts = _rows(tiny.write_prompt_corpus(tmp_path / "prompts", max_chars=5_000) / "train.jsonl")
    assert chat[0]["messages"][0]["content"] + "\n" == pairs[0]["prompt"] == prompts[0]["prompt"]
    assert pairs[0]["chosen"].split()[:2] == chat[0]["messages"][1]["content"].split()[:2]


def test_a_vllm_grpo_plan_is_rehearsed_generating_in_process_with_whole_groups(tiny_llama_dir):
    from toolkit.emit.user_settings import settings
    from toolkit.engines.validate import validate_grpo_config

    grpo = Grpo(num_generations=8, max_prompt_length=512, max_completion_length=1024, use_vllm=True, beta=0.04,
                vllm_gpu_memory_utilization=0.4)
    plan = plan_for_model(tiny_llama_dir, "zero2", gpus_per_node=8, micro_batch=4, grad_accum=1,
                          seq_len=grpo.seq_len).replace(grpo=grpo.to_dict())
    small, said = rehearsal_plan(plan, tiny_llama_dir)
    got = small.grpo_spec
    assert (small.micro_batch, small.world_size, small.grad_accum) == (2, 2, 1)  # a generation batch of 4
    assert (got.use_vllm, got.num_generations, got.beta) == (False, 4, 0.04)
    assert got.max_completion_length == REHEARSAL_COMPLETION and small.seq_len == got.seq_len <= 64
    assert grpo.generating_in_process()[1] in said  # the smaller box's line (toolkit.run.smaller_box), one helper
    assert any("GRPO rehearses 4 generations per prompt (the plan: 8)" in line for line in said)
    config = validate_grpo_config(settings(small)["grpo_config"])  # TRL takes it: whole groups, no vLLM
    assert (config.generation_batch_size, config.use_vllm) == (4, False)


def test_a_grpo_plan_that_fits_the_small_batch_keeps_its_generations_and_takes_the_rehearsals_prompts(
        tiny_llama_dir, tmp_path):
    """The rehearsal's prompts are its own (up to 36 tokens): the plan's prompt length does not limit them."""
    from transformers import AutoTokenizer

    grpo = Grpo(num_generations=2, max_prompt_length=8, max_completion_length=8, beta=0.1)
    plan = plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=16).replace(grpo=grpo.to_dict())
    small, said = rehearsal_plan(plan, tiny_llama_dir)
    got = small.grpo_spec
    assert (got.num_generations, got.max_completion_length, got.beta, said) == (2, 8, 0.1, [])
    assert small.seq_len == got.seq_len == REHEARSAL_SEQ_LEN
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = _rows(rehearsal_data(small, tmp_path / "data") / "train.jsonl")
    assert max(len(tokenizer(row["prompt"])["input_ids"]) for row in prompts) <= got.max_prompt_length


def test_processes_with_rehearse_is_refused_for_a_model_parallel_plan_in_one_line(tiny_llama_dir, tmp_path,
                                                                                   capsys):
    from toolkit.cli import main
    from toolkit.emit import emit_files

    plan = plan_for_model(tiny_llama_dir, "fsdp2", gpus_per_node=4, tensor=2, seq_len=32)
    emit_files(plan, tmp_path / "plan")
    code = main(["launch", str(tmp_path / "plan"), "--rehearse", "--processes", "1", "--", "my_train.py"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.endswith("--processes 1: the rehearsal of this fsdp2 dp=2 x tp=2 plan runs on its 4 processes (each "
                        "model-parallel degree at 2); drop --processes\n")
    small, _ = rehearsal_plan(plan_for_model(tiny_llama_dir, "zero2", gpus_per_node=8, seq_len=32), tiny_llama_dir,
                              processes=1)
    assert (small.world_size, small.strategy) == (1, "zero2")


# The scripts as a user writes them: TRL's trainers, the plan's settings from toolkit.train.own_script, and the
# rehearsal's model and data from its environment variables; each writes its Trainer's log history to a report.
DPO_SCRIPT = '''\
import json, os, sys

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from toolkit.train.own_script import dpo_config

model_dir, data_dir = os.environ["TOOLKIT_REHEARSAL_MODEL"], os.environ["TOOLKIT_REHEARSAL_DATA"]
output, report = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
pairs = load_dataset("json", data_files=os.path.join(data_dir, "train.jsonl"))["train"]
args = DPOConfig(**{**dpo_config(), "output_dir": output, "max_steps": 3, "logging_steps": 1, "report_to": []})
trainer = DPOTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
trainer.train()
if trainer.is_world_process_zero():
    json.dump(trainer.state.log_history, open(report, "w"))
'''

GRPO_SCRIPT = '''\
import json, os, sys

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from toolkit.train.own_script import grpo_config


def brevity(completions, **kwargs):
    return [-len(completion) / 100 for completion in completions]


model_dir, data_dir = os.environ["TOOLKIT_REHEARSAL_MODEL"], os.environ["TOOLKIT_REHEARSAL_DATA"]
output, report = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir)
prompts = load_dataset("json", data_files=os.path.join(data_dir, "train.jsonl"))["train"]
args = GRPOConfig(**{**grpo_config(), "output_dir": output, "max_steps": 2, "logging_steps": 1, "report_to": []})
trainer = GRPOTrainer(model=model, reward_funcs=brevity, args=args, train_dataset=prompts, processing_class=tokenizer)
trainer.train()
if trainer.is_world_process_zero():
    json.dump(trainer.state.log_history, open(report, "w"))
'''

TEXT_SCRIPT = '''\
import os

from datasets import load_dataset
from transformers import TrainingArguments

from toolkit.train.own_script import training_arguments

args = TrainingArguments(output_dir="out", report_to=[], **training_arguments())
text = load_dataset("text", data_files=os.path.join(os.environ["TOOLKIT_REHEARSAL_DATA"], "train.txt"))["train"]
'''


def _rehearse(toolkit_in_process, plan, tmp_path: Path, script: str, *extra: str):
    """`toolkit launch PLAN --rehearse EXTRA -- my_train.py OUT REPORT` from tmp_path, in this process
    (tests/conftest.py toolkit_here: its own interpreter took 3.7 CPU-s before the script ran, 0.3 here)."""
    from toolkit.emit import emit_files

    emit_files(plan, tmp_path / "plan")
    (tmp_path / "my_train.py").write_text(script)
    return toolkit_in_process("launch", str(tmp_path / "plan"), "--rehearse", *extra, "--", "my_train.py",
                              str(tmp_path / "out"), str(tmp_path / "report.json"), cwd=tmp_path)


def _losses(tmp_path: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in json.loads((tmp_path / "report.json").read_text()) if "loss" in e}


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy,processes", [("zero2", None),
                                                pytest.param("ddp", "1", marks=pytest.mark.one_core)])
def test_a_users_trl_dpo_script_rehearses_from_ln2(tiny_llama_dir, tmp_path, strategy, processes,
                                                   toolkit_in_process):
    """At step 1 the policy is the reference: every pair's log-ratio is 0 and the sigmoid loss is ln 2."""
    import math

    plan = plan_for_model(tiny_llama_dir, strategy, gpus_per_node=4, micro_batch=2, seq_len=64).replace(
        dpo=Dpo().to_dict())
    done = _rehearse(toolkit_in_process, plan, tmp_path, DPO_SCRIPT, *(("--processes", processes) if processes else ()))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert ("on 1 CPU process over gloo" if processes == "1" else "on 2 CPU processes over gloo") in done.stdout
    assert "rehearsal passed: your script with" in done.stdout
    losses = _losses(tmp_path)
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(loss) for loss in losses.values())
    assert losses[1] == pytest.approx(math.log(2), abs=1e-3)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_a_users_trl_grpo_script_with_its_own_reward_rehearses_generating_in_process(tiny_llama_dir, tmp_path,
                                                                                      toolkit_in_process):
    import math

    grpo = Grpo(num_generations=8, max_prompt_length=256, max_completion_length=512, use_vllm=True)
    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=8, micro_batch=4,
                          seq_len=grpo.seq_len).replace(grpo=grpo.to_dict())
    done = _rehearse(toolkit_in_process, plan, tmp_path, GRPO_SCRIPT, "--processes", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "note: vLLM (colocate) needs a GPU" in done.stdout
    history = json.loads((tmp_path / "report.json").read_text())
    steps = [e for e in history if "loss" in e]
    assert len(steps) == 2 and all(math.isfinite(e["loss"]) and math.isfinite(e["reward"]) for e in steps)
    assert all(0 < e["completions/mean_length"] <= REHEARSAL_COMPLETION for e in steps)


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_a_script_expecting_text_in_a_dpo_rehearsal_fails_with_its_own_error_in_one_line(tiny_llama_dir, tmp_path,
                                                                                          toolkit_in_process):
    plan = plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=64).replace(dpo=Dpo().to_dict())
    done = _rehearse(toolkit_in_process, plan, tmp_path, TEXT_SCRIPT, "--processes", "1")
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert "failed: FileNotFoundError: Unable to find" in errors[0] and "train.txt" in errors[0]
    assert "(full log: " in errors[0] and "rehearsal FAILED (exit code 1)" in done.stdout


def test_a_grpo_rehearsal_of_toolkit_train_keeps_the_runs_rewards_or_uses_the_length_reward(tiny_llama_dir, tmp_path,
                                                                                           capsys):
    from toolkit.cli import main
    from toolkit.emit import emit_files
    from toolkit.run.rehearsal import rehearsal_argv

    kept = rehearsal_argv(tmp_path / "d", tmp_path / "o", ["--data", "x", "--reward", "my.py:score", "--reward=length"])
    assert kept[-3:] == ["--reward", "my.py:score", "--reward=length"] and "x" not in kept
    plan = plan_for_model(tiny_llama_dir, "ddp", seq_len=16).replace(grpo=Grpo(
        num_generations=2, max_prompt_length=8, max_completion_length=8).to_dict())
    emit_files(plan, tmp_path / "plan")
    assert main(["launch", str(tmp_path / "plan"), "--rehearse", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "note: no --reward given: the GRPO rehearsal scores completions with the built-in length reward" in out
    assert out.splitlines()[-1].startswith("$ accelerate launch ") and out.endswith(" --reward length\n")

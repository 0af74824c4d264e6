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
from toolkit.run.rehearsal import REHEARSAL_COMPLETION, plan_for_model, rehearsal_data, rehearsal_plan


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
    assert any("vLLM (colocate) needs a GPU" in line for line in said)
    assert any("GRPO rehearses 4 generations per prompt (the plan: 8)" in line for line in said)
    config = validate_grpo_config(settings(small)["grpo_config"])  # TRL takes it: whole groups, no vLLM
    assert (config.generation_batch_size, config.use_vllm) == (4, False)


def test_a_grpo_plan_that_fits_the_small_batch_keeps_its_generations(tiny_llama_dir):
    grpo = Grpo(num_generations=2, max_prompt_length=8, max_completion_length=8)
    plan = plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=16).replace(grpo=grpo.to_dict())
    small, said = rehearsal_plan(plan, tiny_llama_dir)
    assert small.grpo_spec == grpo and small.seq_len == 16 and said == []

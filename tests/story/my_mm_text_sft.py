"""A user's TRL SFT script for a multimodal-class checkpoint (Gemma-3 or Qwen2.5-VL with its vision tower) fine-tuned
on text alone: the only toolkit import is the documented helper; the tower is frozen as PLAN.md's snippet does when
plan.json says `vision_tower: freeze`. AUTO_CLASS is the transformers auto class the user loads the checkpoint with
(the class the plan's notes name: AutoModelForCausalLM loads Gemma-3's whole class, and has no class for
Qwen2.5-VL, which AutoModelForImageTextToText loads).

    toolkit launch PLAN --processes N --cpu -- my_mm_text_sft.py MODEL CHAT.jsonl OUT REPORT [AUTO_CLASS]

The report (rank 0) says what trained: the logged losses, the class loaded, its trainable parameters, and how many
of the tower's and the language model's tensors moved.
"""
import json
import os
import sys
from pathlib import Path

import torch
import transformers
from datasets import load_dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer

from toolkit.train.own_script import model_kwargs, sft_config

model_dir, data, out, report = sys.argv[1:5]
auto_class = getattr(transformers, sys.argv[5] if len(sys.argv) > 5 else "AutoModelForCausalLM")
plan = json.loads((Path(os.environ["TOOLKIT_PLAN_DIR"]) / "plan.json").read_text())
config = SFTConfig(output_dir=out, max_steps=3, learning_rate=2e-2, logging_steps=1, save_strategy="no",
                   report_to=[], **sft_config())
model = auto_class.from_pretrained(model_dir, **model_kwargs())
tower_paths = tuple(plan["model_parts"]["vision_modules"])
if plan.get("vision_tower") == "freeze":  # plan.json leaves out the default, "train"
    for path in tower_paths:
        model.get_submodule(path).requires_grad_(False)
before = {n: p.detach().clone() for n, p in model.named_parameters()}
trainer = SFTTrainer(model=model, args=config, processing_class=AutoTokenizer.from_pretrained(model_dir),
                     train_dataset=load_dataset("json", data_files=data, split="train").select(range(16)))
trainer.train()
after = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in trainer.model.named_parameters()}
after = {n.removeprefix("module."): p for n, p in after.items()}
compared = [n for n in before if n in after and before[n].numel() and after[n].shape == before[n].shape]
# ZeRO-3 loads into empty placeholders (zero.Init): nothing of it is compared


def moved(names):
    return [sum(not torch.equal(before[n], after[n].detach().to(before[n].device)) for n in names), len(names)]


if config.process_index == 0:
    Path(report).write_text(json.dumps({
        "world": config.world_size, "micro_batch": config.per_device_train_batch_size,
        "accumulation": config.gradient_accumulation_steps, "steps": trainer.state.global_step,
        "class": type(model).__name__, "trainable": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()
                                                   if p.requires_grad),  # ZeRO-3: the whole, not the partition
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "tower_moved": moved([n for n in compared if n.startswith(tower_paths)]),
        "language_moved": moved([n for n in compared if not n.startswith(tower_paths)]),
    }))

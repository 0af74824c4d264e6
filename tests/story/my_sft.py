"""A user's TRL SFTTrainer LoRA script: the only toolkit import is the documented helper.

    toolkit launch PLAN --processes 2 --cpu -- my_sft.py MODEL CHAT.jsonl OUT REPORT
"""
import json
import sys
from pathlib import Path

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from toolkit.train.own_script import lora_config, model_kwargs, sft_config

model_dir, data, out, report = sys.argv[1:5]
config = SFTConfig(output_dir=out, max_steps=1, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                   report_to=[], **sft_config())
model = AutoModelForCausalLM.from_pretrained(model_dir, **model_kwargs())
tokenizer = AutoTokenizer.from_pretrained(model_dir)
trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer, peft_config=lora_config(),
                     train_dataset=load_dataset("json", data_files=data, split="train").select(range(64)))
trainer.train()
if config.process_index == 0:
    quantised = sorted({type(m).__name__ for m in trainer.model.modules() if "4bit" in type(m).__name__})
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    Path(report).write_text(json.dumps({
        "micro_batch": config.per_device_train_batch_size, "accumulation": config.gradient_accumulation_steps,
        "world": config.world_size, "bf16": config.bf16, "steps": trainer.state.global_step,
        "checkpointing": config.gradient_checkpointing, "max_length": config.max_length, "quantised": quantised,
        "trainable": trainable, "total": sum(p.numel() for p in trainer.model.parameters()),
    }))

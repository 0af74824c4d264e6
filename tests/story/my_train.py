"""A user's plain HF Trainer script: the only toolkit import is the documented helper (toolkit.train.own_script).

    toolkit launch PLAN --processes 2 --cpu -- my_train.py MODEL DATA_DIR OUT REPORT
"""
import json
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

from toolkit.train.own_script import training_arguments

model_dir, data_dir, out, report = sys.argv[1:5]
args = TrainingArguments(output_dir=out, max_steps=1, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                         report_to=[], **training_arguments())
model = AutoModelForCausalLM.from_pretrained(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
ids = tokenizer(Path(data_dir, "train.txt").read_text())["input_ids"]
blocks = [ids[i:i + 32] for i in range(0, 32 * 64, 32)]
trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": blocks, "labels": blocks}),
                  data_collator=default_data_collator)
trainer.train()
wrapped = [type(m).__name__ for m in trainer.model_wrapped.modules()]
if args.process_index == 0:
    Path(report).write_text(json.dumps({
        "micro_batch": args.per_device_train_batch_size, "accumulation": args.gradient_accumulation_steps,
        "world": args.world_size, "bf16": args.bf16, "steps": trainer.state.global_step,
        # FSDP2 plans checkpoint through the accelerate config (the layers come back wrapped); others through
        # TrainingArguments.
        "checkpointing": args.gradient_checkpointing or any("CheckpointWrapper" in name for name in wrapped),
        "fsdp2": type(trainer.model).__name__.startswith("FSDP"),
    }))

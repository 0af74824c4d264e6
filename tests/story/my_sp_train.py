"""A user's plain HF Trainer script for a long-context plan (the plan's ZeRO x Ulysses SP from the accelerate YAML the
launch uses): the only toolkit import is the documented helper, and the batches carry position_ids as SP needs.

    toolkit launch PLAN --cpu -- my_sp_train.py MODEL DATA_DIR OUT REPORT SEQ STEPS
"""
import json
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

from toolkit.train.own_script import training_arguments

model_dir, data_dir, out, report, seq, steps = sys.argv[1:7]
seq, steps = int(seq), int(steps)
args = TrainingArguments(output_dir=out, max_steps=steps, learning_rate=3e-3, lr_scheduler_type="constant",
                         logging_steps=1, save_strategy="no", report_to=[], seed=7, **training_arguments())
model = AutoModelForCausalLM.from_pretrained(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
ids = tokenizer(Path(data_dir, "train.txt").read_text())["input_ids"]
blocks = [ids[i:i + seq] for i in range(0, seq * 16, seq)]
data = Dataset.from_dict({"input_ids": blocks, "labels": blocks, "position_ids": [list(range(seq))] * len(blocks)})
trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
trainer.train()
if args.process_index == 0:
    Path(report).write_text(json.dumps({"world": args.world_size, "micro_batch": args.per_device_train_batch_size,
                                        "log_history": trainer.state.log_history}))

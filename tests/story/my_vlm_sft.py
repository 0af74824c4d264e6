"""A user's TRL VLM SFT script (images and text): the only toolkit import is the documented helper.

    toolkit launch PLAN --processes 2 --cpu -- my_vlm_sft.py MODEL DATA_FOLDER OUT REPORT

DATA_FOLDER holds train.jsonl rows {"messages": [...], "images": ["images/0-0.png", ...]} (TRL's VLM format).
In a rehearsal: toolkit launch PLAN --rehearse -- my_vlm_sft.py '$TOOLKIT_REHEARSAL_MODEL' '$TOOLKIT_REHEARSAL_DATA'
OUT REPORT. The report says what one row became (its image tokens, the pixels' shape) and how many of the vision
tower's tensors training moved.
"""
import json
import sys
from pathlib import Path

import torch
from datasets import Image, Sequence, load_dataset
from transformers import AutoModelForImageTextToText, AutoProcessor
from trl import SFTConfig, SFTTrainer

from toolkit.train.own_script import model_kwargs, sft_config

model_dir, data, out, report = sys.argv[1:5]
config = SFTConfig(output_dir=out, max_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                   report_to=[], **sft_config())
processor = AutoProcessor.from_pretrained(model_dir)
model = AutoModelForImageTextToText.from_pretrained(model_dir, **model_kwargs())
tower = {n: p.detach().clone() for n, p in model.named_parameters() if ".visual." in n or ".vision_tower." in n}
dataset = load_dataset("json", data_files=str(Path(data) / "train.jsonl"), split="train")
dataset = dataset.map(lambda row: {"images": [str(Path(data) / p) for p in row["images"]]})
dataset = dataset.cast_column("images", Sequence(Image()))
trainer = SFTTrainer(model=model, args=config, processing_class=processor, train_dataset=dataset)
trainer.train()
row = trainer.data_collator([dataset[0]])  # what the first row became
after = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in trainer.model.named_parameters()
         if n in tower}  # FSDP2's shards gathered (every rank); ZeRO-3's empty placeholders are not compared
compared = [n for n, p in after.items() if p.shape == tower[n].shape]
if config.process_index == 0:
    Path(report).write_text(json.dumps({
        "micro_batch": config.per_device_train_batch_size, "accumulation": config.gradient_accumulation_steps,
        "world": config.world_size, "steps": trainer.state.global_step, "vision": trainer._is_vision_dataset,
        "pad_to_multiple_of": config.pad_to_multiple_of, "max_length": config.max_length,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "image_tokens": int((row["input_ids"] == model.config.image_token_id).sum()), "images": len(dataset[0]["images"]),
        "pixel_values": list(row["pixel_values"].shape),
        "tower_moved": [sum(not torch.equal(tower[n], after[n].detach().to(tower[n].device)) for n in compared),
                        len(compared)],
    }))

"""A user's plain accelerate loop (no Trainer) for a long-context plan, written from PLAN.md's sequence-parallel
lines: the only toolkit import is the documented helper; the batches carry position_ids; under Ulysses SP the loader
that accelerator.prepare returns hands each rank its shard of the sequence with the labels already shifted
(`shift_labels`), so the loop computes the loss per shard and averages it over the SP group, token-weighted.

    toolkit launch PLAN --cpu -- my_sp_loop.py MODEL DATA_DIR REPORT SEQ STEPS
"""
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

from toolkit.train.own_script import accelerate_loop

model_dir, data_dir, report, seq, steps = sys.argv[1:6]
seq, steps = int(seq), int(steps)
loop = accelerate_loop()  # before the Accelerator: on a machine without a GPU, the gloo set-up
accelerator = Accelerator(gradient_accumulation_steps=loop["gradient_accumulation_steps"],
                          mixed_precision=loop["mixed_precision"])
torch.manual_seed(7)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, loop["model_dtype"]))
tokenizer = AutoTokenizer.from_pretrained(model_dir)
ids = tokenizer(Path(data_dir, "train.txt").read_text())["input_ids"]
blocks = [ids[i:i + seq] for i in range(0, seq * 16, seq)]
data = Dataset.from_dict({"input_ids": blocks, "labels": blocks, "position_ids": [list(range(seq))] * len(blocks)})
loader = torch.utils.data.DataLoader(data, batch_size=loop["dataloader_batch_size"], shuffle=False,
                                     collate_fn=default_data_collator, drop_last=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
pc = accelerator.parallelism_config
sequence_parallel = pc is not None and pc.sp_enabled


def sp_loss(batch):
    """The mean over the whole sequence: each shard's summed loss and token count, all-gathered over the SP group
    with torch's differentiable all_gather (as transformers' Trainer does under SP)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    shift_labels = batch.pop("shift_labels")
    logits = model(**batch).logits
    summed = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), shift_labels.view(-1), ignore_index=-100,
                             reduction="sum")
    tokens = (shift_labels != -100).sum()
    group = parallel_state_sp.get_sequence_parallel_group()
    summed_all = torch.distributed.nn.functional.all_gather(summed, group=group)
    tokens_all = torch.distributed.nn.functional.all_gather(tokens, group=group)
    return torch.stack(summed_all).sum() / torch.stack(tokens_all).sum()


model.train()
losses, norms, running, step = [], [], [], 0
for batch in loader:
    with accelerator.accumulate(model):
        loss = sp_loss(batch) if sequence_parallel else model(**batch).loss
        accelerator.backward(loss)
        running.append(float(loss))
        if accelerator.sync_gradients:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), loop["max_grad_norm"])))
        optimizer.step()
        optimizer.zero_grad()
    if accelerator.sync_gradients:
        step += 1
        losses.append(sum(running) / len(running))
        running = []
        if step == steps:
            break
if accelerator.is_main_process:
    Path(report).write_text(json.dumps({"world": accelerator.num_processes, "sp": sequence_parallel,
                                        "micro_batch": loop["dataloader_batch_size"], "losses": losses,
                                        "grad_norms": norms}))

"""Launched by tests/test_pipeline.py: the 2-stage pipeline forward of a saved HF model, logits written by the
last stage (torch.save) to argv[3]. Usage: pipeline_forward.py MODEL_DIR IDS_FILE OUT_FILE."""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig

from toolkit.train.pipeline.convert import Source, build_pipeline

model_dir, ids_file, out_file = sys.argv[1:4]
deepspeed.init_distributed()
config = AutoConfig.from_pretrained(model_dir)
layers = config.num_hidden_layers
pipe = build_pipeline(Source(config, model_dir), [0, layers // 2, layers])
engine, *_ = deepspeed.initialize(model=pipe, config={"train_micro_batch_size_per_gpu": 2,
                                                      "gradient_accumulation_steps": 1, "train_batch_size": 2,
                                                      "zero_optimization": {"stage": 0}})
ids = torch.load(ids_file)
_, logits = engine.eval_batch(iter([(ids, ids)]), return_logits=True, num_micro_batches=1)
if engine.is_last_stage():
    torch.save(logits.detach().cpu(), out_file)
dist.barrier()
dist.destroy_process_group()

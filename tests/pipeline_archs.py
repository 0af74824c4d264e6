"""Launched by tests/test_pipeline_archs.py under torchrun with 2 processes: for each model folder given, a 2-stage
DeepSpeed pipeline built by toolkit.train.pipeline.convert trains STEPS steps on fixed random batches (2 micro-batches of
2 sequences per step, torch AdamW, no clipping, fp32); the last stage writes the losses to OUT_FILE as {folder: [losses]}.

One launch serves every architecture (imports and process-group start-up are most of a launch's cost).
Usage: pipeline_archs.py OUT_FILE MODEL_DIR [MODEL_DIR ...]."""

import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoConfig

from toolkit.train.pipeline.convert import Source, build_pipeline

STEPS, MICRO, ACCUM, SEQ, LR = 3, 2, 2, 32, 1e-3


def batches(vocab: int, step: int):
    """The micro-batches of one step; the same on every rank and in the single-process reference, and the same
    every step, so that the loss falls (a test of moving numbers, not of a flat line)."""
    g = torch.Generator().manual_seed(1000)
    for _ in range(ACCUM):
        ids = torch.randint(0, vocab, (MICRO, SEQ), generator=g)
        yield ids, ids


if __name__ == "__main__":
    out_file, *model_dirs = sys.argv[1:]
    deepspeed.init_distributed()
    results = {}
    for model_dir in model_dirs:
        config = AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(0)
        pipe = build_pipeline(Source(config, model_dir), [0, config.get_text_config().num_hidden_layers // 2,
                                                          config.get_text_config().num_hidden_layers])
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR, weight_decay=0.0)
        engine, *_ = deepspeed.initialize(model=pipe, optimizer=optimizer, config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
            "train_batch_size": MICRO * ACCUM, "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9,
            "gradient_clipping": 0.0})  # DeepSpeed 0.19 clips at 1.0 unless told (runtime/constants.py)
        vocab = config.get_text_config().vocab_size
        results[model_dir] = [engine.train_batch(batches(vocab, step)).item() for step in range(STEPS)]
        dist.barrier()
    if dist.get_rank() == dist.get_world_size() - 1:
        with open(out_file, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()

"""Trainer hooks: throughput and per-rank peak memory in the logs, and complete-checkpoint markers."""

from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback

from toolkit.train import checkpoints
from toolkit.train.cpu import peak_memory_bytes

from toolkit.inputs.choices import GIB


class ThroughputLog:
    """tokens/s since the previous training log line, and every rank's peak memory (a collective: every rank logs
    at the same steps in the Trainer, so every rank calls this)."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.last_step = None
        self.last_time = None

    def add_to(self, logs: dict, trainer) -> None:
        now, step = time.perf_counter(), trainer.state.global_step
        if "loss" in logs and self.last_step is not None and step > self.last_step:
            logs["tokens_per_s"] = round(self.tokens_per_step * (step - self.last_step) / (now - self.last_time), 1)
        if "loss" in logs or self.last_step is None:
            self.last_step, self.last_time = step, now
        peaks = _gather_peaks(trainer)
        logs["peak_mem_gib_max"] = round(max(peaks) / GIB, 3)
        for rank, peak in enumerate(peaks):
            logs[f"peak_mem_gib/rank{rank}"] = round(peak / GIB, 3)


def _gather_peaks(trainer) -> list[int]:
    import torch

    accelerator = trainer.accelerator
    mine = torch.tensor([peak_memory_bytes()], dtype=torch.int64, device=accelerator.device)
    if accelerator.num_processes == 1:
        return [int(mine.item())]
    return [int(v) for v in accelerator.gather(mine).tolist()]


class CheckpointMarker(TrainerCallback):
    """After every rank has written checkpoint-N, mark it complete (rank 0), then rotate old ones."""

    def __init__(self, output: str, keep: int | None):
        self.output = Path(output)
        self.keep = keep

    def on_save(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if state.is_world_process_zero:
            checkpoints.mark_complete(self.output / f"checkpoint-{state.global_step}")
            checkpoints.rotate(self.output, self.keep)
        return control

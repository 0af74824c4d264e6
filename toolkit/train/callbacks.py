"""Trainer hooks: throughput and per-rank peak memory in the logs, complete-checkpoint markers, and the rank
summaries' probe of each checkpoint's model."""

from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback

from toolkit.train import checkpoints
from toolkit.train.cpu import peak_memory_bytes
from toolkit.train.probe import probe_record

from toolkit.inputs.choices import GIB


class ThroughputLog:
    """tokens/s since the previous training log line, the time left at the measured step time (beside the plan's
    predicted one where the run is on the GPUs it was planned for), and every rank's peak memory (a collective:
    every rank logs at the same steps in the Trainer, so every rank calls this)."""

    def __init__(self, tokens_per_step: int, predicted_step_s: float | None = None, band: float | None = None):
        self.tokens_per_step = tokens_per_step
        self.predicted_step_s = predicted_step_s
        self.band = band
        self.last_step = None
        self.last_time = None
        self.first_step = None  # the first logged step: the steps before it (warm-up, compilation) are not timed
        self.first_time = None
        self.warned = False

    def add_to(self, logs: dict, trainer) -> None:
        now, step = time.perf_counter(), trainer.state.global_step
        if "loss" in logs and self.last_step is not None and step > self.last_step:
            logs["tokens_per_s"] = round(self.tokens_per_step * (step - self.last_step) / (now - self.last_time), 1)
        if "loss" in logs and self.first_step is not None and step > self.first_step:
            measured = (now - self.first_time) / (step - self.first_step)
            fields, warning = time_left(measured, max(0, trainer.state.max_steps - step), self.predicted_step_s,
                                        self.band)
            logs.update(fields)
            if warning and not self.warned and trainer.is_world_process_zero():
                print(f"warning: {warning}", flush=True)
                self.warned = True
        if "loss" in logs and self.first_step is None:
            self.first_step, self.first_time = step, now
        if "loss" in logs or self.last_step is None:
            self.last_step, self.last_time = step, now
        peaks, reserved = _gather_peaks(trainer)
        logs["peak_mem_gib_max"] = round(max(peaks) / GIB, 3)
        for rank, peak in enumerate(peaks):
            logs[f"peak_mem_gib/rank{rank}"] = round(peak / GIB, 3)
        probe_record(logs, step, peaks, trainer.is_world_process_zero(), reserved)


def time_left(measured_s: float, steps_left: int, predicted_s: float | None,
              band: float | None) -> tuple[dict, str | None]:
    """The log fields of the time to finish: at the measured mean step time, and, when the plan's predicted step
    applies to this run, at the predicted one with the measured step's offset from it; and a warning when that
    offset passes the prediction's band (None: an unverified prediction, held to no band)."""
    fields = {"step_time_s": round(measured_s, 4), "time_left_s": round(steps_left * measured_s, 1)}
    if not predicted_s:
        return fields, None
    offset = measured_s / predicted_s - 1
    fields.update(time_left_predicted_s=round(steps_left * predicted_s, 1), step_time_vs_predicted=round(offset, 3))
    if band is None or abs(offset) <= band:
        return fields, None
    return fields, (f"the measured step ({measured_s:.3f} s) is {offset:+.0%} off the plan's predicted "
                    f"{predicted_s:.3f} s, outside its +-{band:.0%} band: the predicted time to finish does not hold "
                    f"for this run (time left at the measured step: {steps_left * measured_s / 3600:,.2f} h)")


def device_here() -> tuple[str, int] | None:
    """This rank's CUDA device as (torch's name, total memory in bytes); None on CPU."""
    from toolkit.train import cpu

    if cpu.on_cpu():
        return None
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, int(props.total_memory)


def is_catalog_gpu(gpu, name: str, total_memory: int) -> bool:
    """Whether a CUDA device (torch's name and total memory) is the catalog's `gpu`: the GPU's model word ("H100",
    "A10G", "4090") is a word of the device's name, its variant words PCIe / NVL appear in both or neither (an H100
    PCIe and an SXM have the same memory), and the memory is the catalog's within 2% (the catalog's memory_bytes is
    torch's total_memory: 40 and 80 GB parts share a name)."""
    import re

    words = {w.upper() for w in re.split(r"[\s\-_]+", name) if w}
    catalog = [w.upper() for w in gpu.name.split("-")]
    model = next((w for w in catalog if any(ch.isdigit() for ch in w) and not w.endswith("GB")), catalog[0])
    variants = {"PCIE", "NVL"}
    return (model in words and variants & words == variants & set(catalog)
            and abs(total_memory - gpu.memory_bytes) <= 0.02 * gpu.memory_bytes)


def cpu_here() -> tuple[str, int]:
    """This machine's CPU as a CPU plan's prediction records it: (model, torch threads per process)."""
    import torch

    from toolkit.inputs.cpudevice import cpu_model

    return cpu_model(), torch.get_num_threads()


def off_planned_hardware(gpu, world_size: int, device: tuple[str, int] | None, processes: int, *,
                         planned_cpu: tuple | None = None, cpu: tuple[str, int] | None = None) -> str | None:
    """Why a run is not on the hardware its plan predicts for (`world_size` x `gpu`), in words; None when it is.
    `device`: device_here(); `processes`: the run's world size. A plan for CPU processes (`--gpus 2xcpu`) holds on
    the CPU its rates were measured on at the same thread count: `planned_cpu` (the plan's predicted cpu_model,
    cpu_threads) against `cpu` (cpu_here(), on a CPU run)."""
    from toolkit.inputs.cpudevice import CPU_NAME

    if device is None and gpu.name != CPU_NAME:
        return "this run is on CPU"
    if device is None and tuple(planned_cpu or ()) != tuple(cpu or ()):
        if not planned_cpu or not planned_cpu[0]:
            return "the plan does not record the CPU it was measured on (re-plan it)"
        return (f"this run is on {cpu[0]} at {cpu[1]} thread(s), the prediction was measured on {planned_cpu[0]} at "
                f"{planned_cpu[1]}")
    if device is not None and not is_catalog_gpu(gpu, *device):
        return f"this run is on {processes}x {device[0]} ({device[1] / GIB:.1f} GiB)"
    if processes != world_size:
        return f"this run is on {processes} of them"
    return None


def _gather_peaks(trainer) -> tuple[list[int], list[int] | None]:
    """Every rank's peak (peak_memory_bytes) and, on CUDA, its torch.cuda.max_memory_reserved (None on CPU)."""
    import torch

    accelerator = trainer.accelerator
    mine = [peak_memory_bytes()] + ([int(torch.cuda.max_memory_reserved())] if torch.cuda.is_available() else [])
    rows = [mine] if accelerator.num_processes == 1 else \
        accelerator.gather(torch.tensor([mine], dtype=torch.int64, device=accelerator.device)).tolist()
    return [int(r[0]) for r in rows], ([int(r[1]) for r in rows] if len(mine) > 1 else None)


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


def probe_logits(model, device) -> tuple[list, list]:
    """The rank summaries' probe (toolkit.train.hf_runner._write_rank_summary): the model's logits on tokens 1-16,
    in eval mode without gradients, as (input ids, logits) lists. Every rank runs it: ZeRO-3 and FSDP2 gather
    parameters, and AutoEP exchanges tokens, collectively."""
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        probe = torch.arange(1, 17, device=device).unsqueeze(0)
        logits = model(input_ids=probe).logits.float().cpu()
    model.train(was_training)
    return probe.cpu().tolist(), logits.tolist()


class ProbeAtSave(TrainerCallback):
    """Test hook, added where TOOLKIT_RANK_SUMMARY_DIR is set: the probe's logits of the live model at each step a
    checkpoint-N is written (`logits[N]`), so a test can load checkpoint-N and compare."""

    def __init__(self):
        self.logits: dict[int, list] = {}

    def on_save(self, args, state, control, model=None, **kwargs):
        self.logits[state.global_step] = probe_logits(model, args.device)[1]
        return control

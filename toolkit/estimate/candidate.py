"""One costed configuration of the planner (Candidate: a strategy, a job and a grid, with its memory and step time,
or the reason it cannot run), and the facts about one candidate the ranking (toolkit.estimate.ranking) and the
emitted rows both read: its memory headroom in error bands, and whether it can resume from its checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from toolkit.estimate.errorband import band_for, time_band
from toolkit.estimate.memory import Breakdown
from toolkit.estimate.timing import Timing
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.hardware import Gpu
from toolkit.inputs.job import Job
from toolkit.inputs.strategy import Strategy


@dataclass(frozen=True, eq=False)
class Candidate:
    strategy: Strategy
    job: Job
    pipeline_stages: int
    data_parallel: int
    global_batch: int
    partition: list[int] | None = None
    memory: Breakdown | None = None
    timing: Timing | None = None
    reason: str | None = None
    """Why it cannot run (None: feasible)."""
    grid: ParallelGrid | None = None
    """The grid it was costed on (None for a refusal before any grid)."""
    dimension: str | None = None
    """"tp", "cp" or "sp" for a model-parallel candidate (its row's family), else None."""
    gpu: Gpu | None = None
    """The GPU it was costed for: its generation picks the error bands (toolkit.estimate.errorband)."""

    @property
    def feasible(self) -> bool:
        return self.reason is None

    @property
    def speed_evidenced(self) -> bool:
        """Whether published runs of this engine at this scale back the predicted speed (toolkit.estimate.errorband
        .time_band); a tensor / context / sequence dimension has none yet, nor has a mixture of experts (its one
        scored row, benchmarks/results/moe_ep.md, lies outside the band; its host dispatch is priced: Timing.host_s)."""
        gpus = self.pipeline_stages * self.data_parallel
        moe_host = bool(self.timing and self.timing.host_s and self.timing.moe)
        expert = self.grid is not None and self.grid.expert > 1 or moe_host
        return self.dimension is None and not expert and self.time_band.covers(self.strategy.name, gpus)

    @property
    def time_band(self):
        """The step-time band of this candidate's GPU generation (errorband.time_band)."""
        gpus = self.grid.world if self.grid is not None else self.pipeline_stages * self.data_parallel
        return time_band(self.gpu, strategy=self.strategy.name, gpus=gpus)

    @property
    def peak_band(self):
        """The peak error band of this candidate's engine, checkpointing and GPU generation (errorband.band_for)."""
        return band_for(self.strategy.engine, self.job.checkpointing, gpu=self.gpu)

    @property
    def degrees(self) -> tuple[int, int, int]:
        """(tensor, context, sequence) degrees."""
        g = self.grid
        return (g.tensor, g.context, g.sequence) if g is not None else (1, 1, 1)

    @property
    def name(self) -> str:
        job = getattr(self, "job", None)
        if job is None:
            return self._base_name
        return self._base_name + "".join(tag for tag, on in (
            (" +compile", job.compile), (" +tiled", job.tiled), (" +liger", job.liger),
            (" +act-offload", job.activation_offloading)) if on)

    @property
    def _base_name(self) -> str:
        if self.strategy.is_pipeline and (self.grid is not None or self.reason is None):
            return f"{self.strategy.name} (pp={self.pipeline_stages} x dp={self.data_parallel})"
        if self.grid is not None and (self.grid.model_parallel > 1 or self.grid.expert > 1):
            return f"{self.strategy.name} ({self.grid.describe()})"
        if self.dimension:
            return f"{self.strategy.name} x {self.dimension}"
        return self.strategy.name

    def row(self) -> dict[str, Any]:
        """The plain-dict view the emitters' PLAN.md chart and --json output use."""
        return {
            "name": self.name, "strategy": self.strategy.name, "feasible": self.feasible, "reason": self.reason,
            "micro_batch": self.job.micro_batch, "grad_accum": self.job.grad_accum,
            "checkpointing": self.job.checkpointing, "tiled": self.job.tiled, "pipeline_stages": self.pipeline_stages,
            "data_parallel": self.data_parallel, "global_batch": self.global_batch,
            "tensor_parallel": self.degrees[0], "context_parallel": self.degrees[1],
            "sequence_parallel": self.degrees[2], "expert_parallel": self.grid.expert if self.grid else 1,
            "peak_bytes": self.memory.required_bytes if self.memory else None,
            "capacity_bytes": self.memory.capacity_bytes if self.memory else None,
            "cpu_bytes_per_node": self.memory.cpu_bytes_per_node if self.memory else None,
            "host_peak_bytes_per_node": self.memory.host.peak_bytes_per_node if self.memory else None,
            "error_band": self.peak_band.text(),
            "step_time_s": self.timing.step_time_s if self.timing else None,
            "tokens_per_s": self.timing.tokens_per_s if self.timing else None,
            "speed_evidenced": self.speed_evidenced,
            "speed_unmodelled": list(self.timing.unmodelled) if self.timing else [],
            "liger": self.job.liger, "activation_offloading": self.job.activation_offloading,
            "headroom_bands": _finite(round(headroom_bands(self), 2)) if self.feasible else None,
            "resume_problem": resume_problem(self) if self.feasible else None,
        }


def _finite(x: float) -> float | None:
    """JSON has no infinity: an unmeasured headroom is null."""
    return x if x == x and abs(x) != float("inf") else None



def headroom_bands(c: Candidate) -> float:
    """GPU memory left beyond the error band the planner keeps, in units of that band: (capacity - required - band)
    / band. 0: at the refusal line; 1: an estimate off by twice its band still fits. inf when the band is unknown
    (no published case scored) or the row is not costed."""
    if c.memory is None:
        return math.inf
    band = c.peak_band.headroom_bytes(c.memory.peak_bytes)
    if band <= 0:
        return math.inf
    return (c.memory.capacity_bytes - c.memory.required_bytes - band) / band


def resume_problem(c: Candidate) -> str | None:
    """Why this plan cannot resume from its own checkpoints, or None: the grid's rule
    (toolkit.inputs.grid.ParallelGrid.resume_problem; a refusal has no grid and is never ranked)."""
    return c.grid.resume_problem() if c.grid is not None else None

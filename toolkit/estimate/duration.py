"""The whole run: optimizer steps, wall time, GPU-hours and cost for a dataset of a given size, from a candidate's
predicted step time (toolkit.estimate.timing), with the step-time band where published runs back the engine.

The data is taken as packed into sequences of the job's length (TRL's packing, or pre-tokenized fixed-length
blocks): a step consumes global batch x sequence tokens, the same count the step time was computed for, and the
last partial step counts as a whole one. Padding, evaluation, checkpoint saves and start-up are not in it (said in
the output)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunSize:
    """What the user trains on (estimate / plan --dataset-tokens or --data, --epochs, --gpu-hour-price)."""

    dataset_tokens: int
    epochs: float = 1.0
    gpu_hour_price: float | None = None
    """Price of one GPU for one hour, in the user's currency (None: no cost printed)."""
    source: str = "given"
    """Where dataset_tokens comes from: "given" (--dataset-tokens), "counted" (--data, every record tokenized) or
    "sampled" (--data, a sample tokenized and scaled by the record count: toolkit.run.data_tokens)."""
    source_detail: str = ""
    """For --data: the data, and how many records were tokenized of how many."""


@dataclass(frozen=True)
class Duration:
    run: RunSize
    tokens_per_step: int
    steps: int
    step_time_s: float
    gpus: int
    band: float | None
    """The step-time band (fraction) where published runs back this engine at this scale; None: unverified."""
    precompute_s: float = 0.0
    """DPO with precomputed reference log-probs: the reference's pass over the dataset before training (once,
    whatever the epochs; toolkit.estimate.preference)."""

    @property
    def seconds(self) -> float:
        return self.steps * self.step_time_s + self.precompute_s

    @property
    def gpu_hours(self) -> float:
        return self.seconds / 3600 * self.gpus

    @property
    def cost(self) -> float | None:
        return None if self.run.gpu_hour_price is None else self.gpu_hours * self.run.gpu_hour_price

    def hours_range(self) -> tuple[float, float] | None:
        if self.band is None:
            return None
        hours = self.seconds / 3600
        return hours * (1 - self.band), hours * (1 + self.band)

    def to_dict(self) -> dict[str, Any]:
        span = self.hours_range()
        return {"dataset_tokens": self.run.dataset_tokens, "dataset_tokens_source": self.run.source,
                **({"dataset_tokens_detail": self.run.source_detail} if self.run.source_detail else {}),
                "epochs": self.run.epochs,
                "tokens_per_step": self.tokens_per_step, "steps": self.steps, "seconds": self.seconds,
                "hours": self.seconds / 3600, "hours_band": list(span) if span else None,
                "band": self.band, "gpus": self.gpus, "gpu_hours": self.gpu_hours,
                "gpu_hour_price": self.run.gpu_hour_price, "cost": self.cost,
                **({"precompute_seconds": self.precompute_s} if self.precompute_s else {})}

    def text(self) -> str:
        run = self.run
        hours = self.seconds / 3600
        span = self.hours_range()
        band = (f"{span[0]:,.2f}-{span[1]:,.2f} h at the +-{self.band:.0%} step-time band" if span else
                "no band: no published run backs this engine's speed at this scale")
        cost = (f", {self.cost:,.2f} at {run.gpu_hour_price:,.2f} per GPU-hour" if self.cost is not None else "")
        counted = f" ({run.source_detail})" if run.source_detail else f" ({run.source})"
        return (f"time to train: {run.dataset_tokens:,} tokens{counted} x {run.epochs:g} epoch{'s' if run.epochs != 1 else ''}"
                f" = {self.steps:,} steps of {self.tokens_per_step:,} tokens: {hours:,.2f} h ({band}), "
                f"{self.gpu_hours:,.1f} GPU-hours on {self.gpus} GPU{'s' if self.gpus != 1 else ''}{cost}"
                + (f", with the DPO reference's precompute pass before training ({self.precompute_s / 3600:,.2f} h)"
                   if self.precompute_s else "")
                + "; packed sequences, no evaluation, saving or start-up")


def step_time_band(candidate) -> float | None:
    """The band (fraction) around a candidate's predicted step time: the published runs' band where they back its
    engine at its scale on its GPU generation, else None (unverified, or no published run on the generation)."""
    from toolkit.estimate.errorband import time_band

    band = candidate.time_band if hasattr(candidate, "time_band") else time_band(getattr(candidate, "gpu", None))
    return band.fraction if candidate.speed_evidenced and band.rows and band.known else None


def duration(run: RunSize, candidate, gpus: int) -> Duration:
    """`run` on a costed candidate (toolkit.estimate.candidate.Candidate) using `gpus` GPUs (billed whole)."""
    t = candidate.timing
    tokens_per_step = round(t.tokens_per_s * t.step_time_s)  # the count the step time was computed for
    steps = max(1, math.ceil(run.dataset_tokens * run.epochs / tokens_per_step))
    band = step_time_band(candidate)
    # One reference pass over the dataset, before the first epoch (DPOTrainer.__init__ _precompute_ref_logps).
    precompute = math.ceil(run.dataset_tokens / tokens_per_step) * getattr(t, "precompute_s", 0.0)
    return Duration(run=run, tokens_per_step=tokens_per_step, steps=steps, step_time_s=t.step_time_s, gpus=gpus,
                    band=band, precompute_s=precompute)

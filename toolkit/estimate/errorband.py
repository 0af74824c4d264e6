"""How far the peak estimate and the step time may be off on a GPU, from the published GPU cases NEAREST the job.

Nearest means the same GPU generation first (the catalog's `architecture`: volta, turing, ampere, ada, hopper, ...;
toolkit/catalog/gpus.json), then the same kind of job. A generation the corpus has no published run on gets no
borrowed band: the step-time band is UNKNOWN (and the planner calls no speed difference a win), the peak band is
WIDENED by the rule below and says so.

benchmarks/published.py re-estimates published GPU runs (torchtitan, torchtune, accelerate) and writes the tensor-peak
errors of the rows whose techniques we model, each with its GPU and generation, to gpu_error_band.json beside this
module. A job's peak band is the largest |error| among the cases of its generation and kind (engine,
checkpointing); with none of its kind, among its generation's cases; with no case on its generation, WIDENED to
PEAK_WIDEN x the largest |error| of all cases (the tensors are the same on every GPU, the kernels' workspaces and
attention backends are not). The planner keeps the band as headroom: a candidate whose required bytes plus band x
peak exceed the GPU is not chosen.

The step-time band comes from benchmarks/throughput.py (time_error_band.json beside this module): the held-out
published runs' 90th-percentile |error| of tokens/s on the job's GPU generation. With fewer than MIN_HELD_OUT
held-out runs on it the band is WIDENED to the larger of the whole corpus's band and the generation's worst |error|;
with no modelled run on it the band is UNKNOWN. The planner treats candidates whose predicted speeds are closer than
the band as ties (all of them when it is unknown) and orders them by robustness (toolkit.estimate.ranking).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

BAND_FILE = Path(__file__).parent / "gpu_error_band.json"

PEAK_WIDEN = 2.0
"""A GPU generation with no published memory case gets this many times the largest |error| of all cases."""

MIN_HELD_OUT = 5
"""Fewer held-out published runs than this on a generation widen its step-time band (TimeBand, module docstring)."""


def generation_words(gpu) -> str:
    """'V100-32GB (Volta)': the GPU and the generation the bands are chosen by."""
    return f"{gpu.name} ({gpu.architecture.capitalize()})" if gpu.architecture else gpu.name


@dataclass(frozen=True)
class ErrorBand:
    fraction: float
    """Largest |predicted / measured - 1| of the tensor peak among the cases (times PEAK_WIDEN when widened)."""
    cases: int
    kind: str
    """Which cases: "fsdp2, no checkpointing", or "all kinds (none of this kind)"."""
    widened: str = ""
    """Why the band is wider than its cases' largest error ("" when it is not)."""

    def text(self) -> str:
        if not self.cases:
            return "peak error band unknown: no published GPU case scored yet"
        base = f"{self.cases} GPU case{'s' if self.cases != 1 else ''} ({self.kind})"
        if self.widened:
            return f"peak +-{self.fraction:.0%}, widened: {self.widened}; from {base}"
        return f"peak +-{self.fraction:.0%}, from {base}"

    def headroom_bytes(self, peak_bytes: int) -> int:
        return int(peak_bytes * self.fraction)

    def to_dict(self) -> dict:
        return {"fraction": self.fraction, "cases": self.cases, "kind": self.kind,
                **({"widened": self.widened} if self.widened else {}), "text": self.text()}


@lru_cache(maxsize=1)
def _cases() -> tuple[dict, ...]:
    if not BAND_FILE.is_file():
        return ()
    return tuple(json.loads(BAND_FILE.read_text())["cases"])


def band_for(engine: str, checkpointing: bool, cases: tuple[dict, ...] | None = None, *, gpu=None) -> ErrorBand:
    """The peak band of a job of this engine and checkpointing on `gpu` (module docstring: its generation's cases,
    else widened); without a GPU, from the cases of every generation."""
    cases = _cases() if cases is None else cases
    kind = f"{engine}, {'checkpointing' if checkpointing else 'no checkpointing'}"
    if gpu is not None and cases:
        arch = gpu.architecture
        mine = [c for c in cases if c.get("architecture") == arch]
        if not mine:
            seen = sorted({c.get("architecture", "?").capitalize() for c in cases})
            return ErrorBand(PEAK_WIDEN * max(abs(c["error"]) for c in cases), len(cases),
                             f"other generations: {', '.join(seen)}",
                             f"no published memory case on {generation_words(gpu)}, so {PEAK_WIDEN:g} x the largest "
                             "error on other generations")
        cases, kind = tuple(mine), f"{kind}, {arch.capitalize()}"
    same = [c for c in cases if c["engine"] == engine and c["checkpointing"] == checkpointing]
    if same:
        return ErrorBand(max(abs(c["error"]) for c in same), len(same), kind)
    if cases:
        return ErrorBand(max(abs(c["error"]) for c in cases), len(cases), f"all kinds; none yet for {kind}")
    return ErrorBand(0.0, 0, kind)


TIME_BAND_FILE = Path(__file__).parent / "time_error_band.json"


@dataclass(frozen=True)
class TimeBand:
    """How far a predicted step time may be off, from the held-out published runs (benchmarks/throughput.py) on the
    job's GPU generation; unknown (fraction inf) where the corpus has no run on it."""

    fraction: float
    """90th-percentile |predicted / published tokens/s - 1| over the held-out rows; math.inf: unknown."""
    rows: int
    covered: tuple[tuple[str, int], ...]
    """(strategy, most GPUs) the corpus's modelled rows ran; other engines' communication / offload / bubble terms
    are unverified."""
    scope: str = ""
    """Where the rows ran: "on Hopper (H100-SXM-80GB, ...)"; "" for the whole corpus."""
    reason: str = ""
    """Why the band is unknown or widened ("" when it is neither)."""

    @property
    def known(self) -> bool:
        return math.isfinite(self.fraction)

    def width(self) -> str:
        """'+-11%', or 'unknown: no published run on V100-32GB (Volta)'."""
        return f"+-{self.fraction:.0%}" if self.known else f"unknown: {self.reason}"

    def text(self) -> str:
        if not self.known:
            return (f"step time band unknown: {self.reason}, so no predicted speed difference is a win "
                    "(the planner orders such candidates by robustness)")
        if not self.rows:
            return "step time error band unknown: no held-out published run scored yet"
        kinds = ", ".join(f"{name}{' on 1 GPU' if gpus == 1 else ''}" for name, gpus in self.covered)
        return (f"step time +-{self.fraction:.0%}" + (f", widened: {self.reason}" if self.reason else "")
                + f", from {self.rows} held-out published GPU run{'s' if self.rows != 1 else ''}"
                + (f" {self.scope}" if self.scope else "") + (f" ({kinds})" if kinds else ""))

    def covers(self, strategy_name: str, gpus: int) -> bool:
        """Whether published runs of this strategy at this scale (or larger) on this generation match its predicted
        speed within the band (benchmarks/throughput.py writes the list)."""
        return self.known and any(name == strategy_name and gpus <= most for name, most in self.covered)

    def ties(self, faster_tokens_per_s: float, slower_tokens_per_s: float) -> bool:
        """Whether two predicted speeds are closer than the model can tell apart (always, when the band is
        unknown)."""
        if slower_tokens_per_s <= 0:
            return False
        return faster_tokens_per_s / slower_tokens_per_s - 1 < self.fraction

    def to_dict(self) -> dict:
        return {"fraction": self.fraction if self.known else None, "known": self.known,
                **({"reason": self.reason} if self.reason else {}), **({"scope": self.scope} if self.scope else {}),
                "held_out_rows": self.rows,
                "evidenced": [{"strategy": n, "max_gpus": g} for n, g in self.covered], "text": self.text()}


@lru_cache(maxsize=1)
def _time_data() -> dict:
    return json.loads(TIME_BAND_FILE.read_text()) if TIME_BAND_FILE.is_file() else {}


def _evidenced(entries: list[dict]) -> tuple[tuple[str, int], ...]:
    return tuple((e["strategy"], int(e["max_gpus"])) for e in entries)


MEASURED_TIME_BAND_FILE = Path(__file__).parent / "measured_time_band.json"
"""Steps measured on our own GPU day, per engine at its GPU count (benchmarks/gpu_derive.py writes it from
benchmarks/results/gpu_timing.json): the evidence nearest a job of that generation, engine and GPU count."""


@lru_cache(maxsize=1)
def _measured_data() -> dict:
    return json.loads(MEASURED_TIME_BAND_FILE.read_text()) if MEASURED_TIME_BAND_FILE.is_file() else {}


def time_band(gpu=None, data: dict | None = None, *, strategy: str | None = None, gpus: int | None = None,
              measured: dict | None = None) -> TimeBand:
    """The step-time band of a job on `gpu` (module docstring: its generation's held-out runs, widened with few,
    unknown with none); without a GPU, the whole corpus's band. With the job's `strategy` and `gpus`: widened to
    the p90 error of our own measured steps of that engine at that GPU count on that generation, where they are
    wider (MEASURED_TIME_BAND_FILE)."""
    band = _published_time_band(gpu, data)
    m = _measured_data() if measured is None else measured
    entry = m.get("engines", {}).get(strategy) if m else None
    if (entry is None or gpu is None or not band.known or gpus != m["gpus"]
            or gpu.architecture != m["generation"] or entry["p90_abs_error"] <= band.fraction):
        return band
    said = (f"{entry['rows']} step{'s' if entry['rows'] != 1 else ''} of {strategy} measured on {m['gpus']} "
            f"{m['gpu']} ({m['date']}, benchmarks/results/gpu_timing_derived.md) off by up to "
            f"{entry['p90_abs_error']:.0%} (p90)")
    return replace(band, fraction=float(entry["p90_abs_error"]),
                   reason=f"{band.reason}; {said}" if band.reason else said)


def _published_time_band(gpu=None, data: dict | None = None) -> TimeBand:
    d = _time_data() if data is None else data
    if not d:
        return TimeBand(0.0, 0, ())
    whole = float(d["band"])
    if gpu is None:
        return TimeBand(whole, int(d["held_out"]["rows"]), _evidenced(d["evidenced"]))
    gens = d.get("generations", {})
    g = gens.get(gpu.architecture)
    if g is None:
        have = ", ".join(f"{a.capitalize()} ({', '.join(v['gpus'])})" for a, v in sorted(gens.items()))
        return TimeBand(math.inf, 0, (), reason=f"no published run on {generation_words(gpu)} in the step-time "
                                                f"corpus (it has {have or 'none'})")
    scope = f"on {gpu.architecture.capitalize()} ({', '.join(g['gpus'])})"
    if g["held_out_rows"] < MIN_HELD_OUT:
        widened = max(whole, float(g["worst_abs_error"]))
        return TimeBand(widened, g["held_out_rows"], _evidenced(g["evidenced"]), scope,
                        f"only {g['modelled_rows']} published run{'s' if g['modelled_rows'] != 1 else ''} "
                        f"on {gpu.architecture.capitalize()}, so the larger of the corpus's band and their worst "
                        "error")
    return TimeBand(float(g["band"]), g["held_out_rows"], _evidenced(g["evidenced"]), scope)

"""How far the peak estimate and the step time may be off on a GPU, from the published GPU cases they were scored on.

benchmarks/published.py re-estimates published GPU runs (torchtitan, torchtune, accelerate) and writes the tensor-peak
errors of the rows whose techniques we model to gpu_error_band.json beside this module. A job's band is the largest
|error| among the cases of its kind (engine, checkpointing); with none of its kind, among all cases, said so. The
planner keeps the band as headroom: a candidate whose required bytes plus band x peak exceed the GPU is not chosen.

The step-time band comes from benchmarks/throughput.py (time_error_band.json beside this module): the held-out
published runs' 90th-percentile |error| of tokens/s. The planner treats candidates whose predicted speeds are closer
than it as ties and orders them by robustness (toolkit.estimate.ranking).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

BAND_FILE = Path(__file__).parent / "gpu_error_band.json"


@dataclass(frozen=True)
class ErrorBand:
    fraction: float
    """Largest |predicted / measured - 1| of the tensor peak among the cases."""
    cases: int
    kind: str
    """Which cases: "fsdp2, no checkpointing", or "all kinds (none of this kind)"."""

    def text(self) -> str:
        if not self.cases:
            return "peak error band unknown: no published GPU case scored yet"
        return f"peak +-{self.fraction:.0%}, from {self.cases} GPU case{'s' if self.cases != 1 else ''} ({self.kind})"

    def headroom_bytes(self, peak_bytes: int) -> int:
        return int(peak_bytes * self.fraction)


@lru_cache(maxsize=1)
def _cases() -> tuple[dict, ...]:
    if not BAND_FILE.is_file():
        return ()
    return tuple(json.loads(BAND_FILE.read_text())["cases"])


def band_for(engine: str, checkpointing: bool, cases: tuple[dict, ...] | None = None) -> ErrorBand:
    cases = _cases() if cases is None else cases
    kind = f"{engine}, {'checkpointing' if checkpointing else 'no checkpointing'}"
    same = [c for c in cases if c["engine"] == engine and c["checkpointing"] == checkpointing]
    if same:
        return ErrorBand(max(abs(c["error"]) for c in same), len(same), kind)
    if cases:
        return ErrorBand(max(abs(c["error"]) for c in cases), len(cases), f"all kinds; none yet for {kind}")
    return ErrorBand(0.0, 0, kind)


TIME_BAND_FILE = Path(__file__).parent / "time_error_band.json"


@dataclass(frozen=True)
class TimeBand:
    """How far a predicted step time may be off, from the held-out published runs (benchmarks/throughput.py)."""

    fraction: float
    """90th-percentile |predicted / published tokens/s - 1| over the held-out rows."""
    rows: int
    covered: tuple[tuple[str, int], ...]
    """(strategy, most GPUs) the corpus's modelled rows ran; other engines' communication / offload / bubble terms
    are unverified."""

    def text(self) -> str:
        if not self.rows:
            return "step time error band unknown: no held-out published run scored yet"
        kinds = ", ".join(f"{name}{' on 1 GPU' if gpus == 1 else ''}" for name, gpus in self.covered)
        return (f"step time +-{self.fraction:.0%}, from {self.rows} held-out published GPU run"
                f"{'s' if self.rows != 1 else ''} ({kinds})")

    def covers(self, strategy_name: str, gpus: int) -> bool:
        """Whether published runs of this strategy at this scale (or larger) match its predicted speed within the
        band (benchmarks/throughput.py writes the list)."""
        return any(name == strategy_name and gpus <= most for name, most in self.covered)

    def ties(self, faster_tokens_per_s: float, slower_tokens_per_s: float) -> bool:
        """Whether two predicted speeds are closer than the model can tell apart."""
        if slower_tokens_per_s <= 0:
            return False
        return faster_tokens_per_s / slower_tokens_per_s - 1 < self.fraction

    def to_dict(self) -> dict:
        return {"fraction": self.fraction, "held_out_rows": self.rows,
                "evidenced": [{"strategy": n, "max_gpus": g} for n, g in self.covered], "text": self.text()}


@lru_cache(maxsize=1)
def time_band() -> TimeBand:
    if not TIME_BAND_FILE.is_file():
        return TimeBand(0.0, 0, ())
    d = json.loads(TIME_BAND_FILE.read_text())
    return TimeBand(float(d["band"]), int(d["held_out"]["rows"]),
                    tuple((e["strategy"], int(e["max_gpus"])) for e in d["evidenced"]))

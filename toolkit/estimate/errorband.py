"""How far the peak estimate may be off on a GPU, from the published GPU cases it was scored on.

benchmarks/published.py re-estimates published GPU runs (torchtitan, torchtune, accelerate) and writes the tensor-peak
errors of the rows whose techniques we model to gpu_error_band.json beside this module. A job's band is the largest
|error| among the cases of its kind (engine, checkpointing); with none of its kind, among all cases, said so. The
planner keeps the band as headroom: a candidate whose required bytes plus band x peak exceed the GPU is not chosen.
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

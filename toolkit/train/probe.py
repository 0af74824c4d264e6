"""What a rank of `toolkit tune`'s probe (toolkit.run.tune) records and when it stops: read from the environment
the probe sets, so a real run (neither variable set) is untouched. Imports nothing heavy: the probe reads the names."""

from __future__ import annotations

import json
import os
import time

from toolkit.errors import UserError
from toolkit.inputs.choices import GIB


PROBE_METRICS_ENV = "TOOLKIT_PROBE_METRICS"
"""`toolkit tune` (toolkit.run.tune): rank 0 appends every log line, with its wall clock and the exact per-rank
peaks, as one JSON line to this file."""
PROBE_MEMORY_LIMIT_ENV = "TOOLKIT_PROBE_MEMORY_LIMIT_BYTES"
"""`toolkit tune`: every rank stops the run (one line, exit 2) at the first log line whose largest per-rank peak is
past this many bytes; the peaks are gathered, so every rank sees the same and stops at the same step."""


def probe_record(logs: dict, step: int, peaks: list[int], rank_zero: bool, reserved: list[int] | None = None) -> None:
    """The probe's record of one log line, and its memory stop (no-ops outside `toolkit tune`). `reserved`: every
    rank's torch.cuda.max_memory_reserved on CUDA (recorded, not a stop criterion)."""
    path = os.environ.get(PROBE_METRICS_ENV)
    limit = int(os.environ.get(PROBE_MEMORY_LIMIT_ENV) or 0)
    over = limit and max(peaks) > limit
    if path and rank_zero:
        record = {"step": step, "wall_s": time.time(), "peak_bytes": peaks,
                  **({"reserved_bytes": reserved} if reserved else {}),
                  **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        if over:
            record["stopped_over_bytes"] = limit
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    if over:
        rank = peaks.index(max(peaks))
        raise UserError(f"stopped at step {step}: rank {rank}'s peak memory {max(peaks) / GIB:.3f} GiB passed the "
                        f"probe's limit {limit / GIB:.3f} GiB")


"""A calibration that sticks (issue 30, Deliver 2): what `toolkit tune` measured against what the step-time model
predicted, stored for this machine in the user's cache and applied by later `estimate` / `plan` on the same key.

The key: the device the prediction was made for (a catalog GPU, or `cpu`: toolkit.inputs.cpudevice), the model of
the device measured (torch's CUDA device name, or /proc/cpuinfo's CPU model), the process count, the interconnect
(the catalog's link name, or gloo), and the torch / deepspeed / transformers versions. A different key is another
machine: its calibration is not applied.

What is measured: the compute term's ratio, and a fixed cost per step. For each measured candidate, the model's
communication, bubble, offload and other terms are taken as predicted and the rest of the measured step is its
compute time: ratio = (measured step - predicted non-compute) / predicted compute. Where the stored runs span at
least two compute sizes (predicted compute terms DISTINCT_COMPUTE apart or more, as different models give), one ratio
cannot hold them all: a fixed per-step cost (the optimizer step's and the loop's Python, the launch of many small
kernels) is the same seconds for a small model as for a large one, so the small model's ratio comes out larger. Then
measured = compute_ratio x predicted compute + step_overhead_s + predicted non-compute is fitted over every stored
run (fit_terms: least squares of the relative error, so a fast run weighs as much as a slow one). Runs of one size
(one probe's candidates, whose compute terms differ by a few per cent) cannot separate the two, so there the ratio
alone is kept (step_overhead_s 0): the candidates' ratios are combined by their geometric mean, and a later probe on
the same key folds its runs in (weighted by runs). The record keeps each run's prediction and measurement
(`measurements`), so a folder of shared calibrations can be read as published rows (benchmarks/calibrations.py
holds each run out of its own calibration). Applied, the step-time model divides its matmul efficiency by the ratio
(toolkit.estimate.efficiency), so the compute term moves by that factor and MFU with it, and adds step_overhead_s to
every step (toolkit.estimate.timing: the `calibrated fixed cost` term). NOT measured, so left as the model has them:
communication overlap, offload bandwidth, allocator overhead (on CPU a rank's peak is its RSS, which holds the
interpreter and libraries; on a GPU tune records reserved peaks but does not store a ratio for them yet). Memory
predictions never move.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path

from toolkit.errors import UserError

CALIBRATION_VERSION = 1
DISTINCT_COMPUTE = 1.5
"""Runs whose predicted compute terms differ by this factor or more are of distinct sizes: the fixed per-step cost
is fitted only over runs that span it (one probe's candidates differ by a few per cent, different models by more)."""
NOT_MEASURED = ("communication overlap", "offload bandwidth", "allocator overhead")
LIBRARIES = ("torch", "deepspeed", "transformers")


@dataclass(frozen=True)
class Calibration:
    """One machine's calibration (module docstring)."""

    device: str
    """The device the predictions were for: a catalog GPU name, or `cpu`."""
    device_model: str
    """The device measured: torch.cuda.get_device_name, or the CPU model string."""
    count: int
    """Processes (GPUs) per run."""
    interconnect: str
    versions: dict[str, str]
    compute_ratio: float
    """Measured over predicted compute time (module docstring)."""
    runs: int
    """Candidates measured into the ratio, over every probe on this key."""
    date: str
    """The day of the last probe (ISO)."""
    not_measured: tuple[str, ...] = NOT_MEASURED
    version: int = CALIBRATION_VERSION
    measurements: tuple[dict, ...] = ()
    """One per run folded in (records written before it have none): MEASUREMENT_FIELDS."""
    step_overhead_s: float = 0.0
    """Seconds every step takes beside the model's terms, fitted with compute_ratio where the runs span two compute
    sizes (fit_terms); 0: the ratio alone (one size, or a record written before it)."""

    @property
    def key(self) -> tuple:
        return (self.device, self.device_model, self.count, self.interconnect,
                tuple(sorted(self.versions.items())))

    def words(self) -> str:
        return f"calibrated on this machine, {self.date}, {self.runs} run{'s' if self.runs != 1 else ''}"

    def terms_words(self) -> str:
        """What it does to a step: `compute time x R`, and `+ N ms a step` where a fixed cost was fitted."""
        fixed = f" + {self.step_overhead_s * 1e3:.3g} ms a step" if self.step_overhead_s else ""
        return f"compute time x {self.compute_ratio:.3g}{fixed}"

    def to_dict(self) -> dict:
        return {**asdict(self), "not_measured": list(self.not_measured), "measurements": list(self.measurements)}


MEASUREMENT_FIELDS = {"probe": "which probe of this record measured it (1, 2, ...)",
                      "model": "the model probed", "candidate": "the plan row measured (strategy name)",
                      "predicted_step_s": "the step-time model's step, uncalibrated",
                      "predicted_compute_s": "its compute term",
                      "measured_step_s": "the measured step, warm-up dropped",
                      "compute_ratio": "compute_ratio() of the two"}
"""What a calibration keeps of each run (`measurements`)."""


def library_versions() -> dict[str, str]:
    from toolkit.cache import installed_version

    return {name: installed_version(name) or "none" for name in LIBRARIES}


def this_device_model(device: str) -> str:
    from toolkit.inputs.cpudevice import CPU_NAME, cpu_model

    if device == CPU_NAME:
        return cpu_model()
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"


def this_machine(gpu, count: int) -> tuple:
    """The key a calibration for `count` x `gpu` measured on this machine would have."""
    return (gpu.name, this_device_model(gpu.name), count, gpu.interconnect, tuple(sorted(library_versions().items())))


def store_dir() -> Path:
    from toolkit.cache import cache_dir

    return cache_dir() / "calibration"


def store_path(device: str, count: int) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-._" else "_" for ch in device)
    return store_dir() / f"{count}x{safe}.json"


def from_dict(data, where: str) -> Calibration:
    """A calibration read from JSON, checked; UserError naming `where` and the problem otherwise."""
    if not isinstance(data, dict):
        raise UserError(f"{where} is no calibration (a JSON object written by `toolkit tune`)")
    try:
        got = Calibration(**{**data, "not_measured": tuple(data.get("not_measured", NOT_MEASURED)),
                             "measurements": tuple(data.get("measurements") or ())})
    except TypeError as exc:
        raise UserError(f"{where} is no calibration: {exc}") from None
    if not all(_is_measurement(m) for m in got.measurements) or len(got.measurements) > got.runs:
        raise UserError(f"{where} is corrupted (a measurement lacks {', '.join(MEASUREMENT_FIELDS)}, or holds more "
                        "runs than it counts)")
    if got.version != CALIBRATION_VERSION:
        raise UserError(f"{where} is calibration version {got.version!r}; this toolkit reads {CALIBRATION_VERSION}")
    ratio_ok = isinstance(got.compute_ratio, (int, float)) and math.isfinite(got.compute_ratio) \
        and got.compute_ratio > 0 and isinstance(got.step_overhead_s, (int, float)) \
        and math.isfinite(got.step_overhead_s) and got.step_overhead_s >= 0
    if not ratio_ok or not isinstance(got.runs, int) or got.runs < 1 or not isinstance(got.count, int) \
            or got.count < 1 or not isinstance(got.versions, dict):
        raise UserError(f"{where} is corrupted (compute_ratio, step_overhead_s, runs, count or versions out of "
                        "range)")
    try:
        date.fromisoformat(got.date)
    except (TypeError, ValueError):
        raise UserError(f"{where} is corrupted (date {got.date!r} is no ISO date)") from None
    return got


def _is_measurement(m) -> bool:
    if not isinstance(m, dict) or set(m) != set(MEASUREMENT_FIELDS) or not isinstance(m["probe"], int):
        return False
    times = [m[k] for k in ("predicted_step_s", "predicted_compute_s", "measured_step_s", "compute_ratio")]
    return all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in times)


def read_file(path: Path) -> Calibration:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise UserError(f"cannot read calibration {path}: {exc.strerror or exc}") from None
    except ValueError:
        raise UserError(f"calibration {path} is corrupted (not JSON)") from None
    return from_dict(data, f"calibration {path}")


def stored(gpu, count: int, warn=None) -> Calibration | None:
    """The stored calibration of this machine for `count` x `gpu`, or None: none stored, or stored for another key
    (other versions, another device model). A corrupted one is ignored with a warning (`warn`: stderr)."""
    path = store_path(gpu.name, count)
    if not path.is_file():
        return None
    try:
        got = read_file(path)
    except UserError as exc:
        (warn or _warn)(f"warning: ignoring the stored calibration: {exc}; run `toolkit tune` again to replace it")
        return None
    return got if got.key == this_machine(gpu, count) else None


def _warn(text: str) -> None:
    print(text, file=sys.stderr)


def imported(path: Path, gpu, count: int) -> Calibration:
    """A shared calibration file for `count` x `gpu`: refused (one line) when it was measured for another device or
    count. Versions and device model may differ (it was measured elsewhere); they travel in the record."""
    got = read_file(path)
    if (got.device, got.count) != (gpu.name, count):
        raise UserError(f"calibration {path} was measured for {got.count}x{got.device}, not {count}x{gpu.name}; "
                        f"give --gpus {got.count}x{got.device} or another calibration file")
    return got


def apply(gpu, calibration: Calibration | None):
    """`gpu` with the calibration's compute ratio and fixed per-step cost (unchanged without one)."""
    return gpu if calibration is None else replace(gpu, compute_ratio=calibration.compute_ratio,
                                                   step_overhead_s=calibration.step_overhead_s)


def compute_ratio(measured_step_s: float, predicted: dict) -> float | None:
    """One candidate's measured over predicted compute time (module docstring), None where the measured step is no
    longer than the predicted non-compute terms (nothing left to attribute)."""
    step, compute = predicted.get("step_time_s"), predicted.get("compute_s")
    if not step or not compute or not measured_step_s:
        return None
    rest = measured_step_s - (step - compute)
    return rest / compute if rest > 0 else None


def fit_terms(measurements) -> tuple[float, float] | None:
    """(compute_ratio, step_overhead_s) of measured = ratio x predicted compute + overhead + predicted non-compute,
    fitted over `measurements` (MEASUREMENT_FIELDS) by least squares of the relative error; None where their
    predicted compute terms span less than DISTINCT_COMPUTE (nothing tells a fixed cost from a ratio there) or the
    fit is not physical (a ratio or a cost below zero): the ratio alone holds then (module docstring)."""
    xs = [m["predicted_compute_s"] for m in measurements]
    ys = [m["measured_step_s"] - (m["predicted_step_s"] - m["predicted_compute_s"]) for m in measurements]
    if len(xs) < 2 or max(xs) < DISTINCT_COMPUTE * min(xs) or min(ys) <= 0:
        return None
    # minimise sum((ratio x + overhead - y) / y)^2: with u = x / y and v = 1 / y, the normal equations of u, v -> 1
    us, vs = [x / y for x, y in zip(xs, ys)], [1 / y for y in ys]
    uu, uv, vv = sum(u * u for u in us), sum(u * v for u, v in zip(us, vs)), sum(v * v for v in vs)
    det = uu * vv - uv * uv
    if det <= 0:
        return None
    ratio, overhead = (sum(us) * vv - sum(vs) * uv) / det, (sum(vs) * uu - sum(us) * uv) / det
    return (ratio, overhead) if ratio > 0 and overhead >= 0 else None


def combine(gpu, count: int, ratios: list[float], previous: Calibration | None, today: str | None = None,
            measurements: list[dict] | None = None) -> Calibration | None:
    """The calibration of `ratios` (one per measured candidate), folded into `previous` of the same key: the ratio
    and fixed cost fitted over every run kept where they span two compute sizes (fit_terms), else the ratios'
    geometric mean. `measurements`: the runs behind the ratios (MEASUREMENT_FIELDS less `probe`, which is numbered
    here)."""
    if not ratios:
        return previous
    probe = 1 + max((m["probe"] for m in previous.measurements), default=0) if previous else 1
    kept = (previous.measurements if previous else ()) + tuple({"probe": probe, **m} for m in measurements or ())
    logs = [math.log(r) for r in ratios]
    runs = len(ratios)
    if previous is not None:  # the earlier probes' runs, each at their combined ratio
        logs.append(math.log(previous.compute_ratio) * previous.runs)
        runs += previous.runs
    ratio, overhead = fit_terms(kept) or (math.exp(sum(logs) / runs), 0.0)
    device, model, count, link, versions = this_machine(gpu, count)
    return Calibration(device=device, device_model=model, count=count, interconnect=link, versions=dict(versions),
                       compute_ratio=ratio, runs=runs, date=today or date.today().isoformat(),
                       measurements=kept, step_overhead_s=overhead)


def store(calibration: Calibration) -> Path:
    from toolkit.fileio import write_atomic

    path = store_path(calibration.device, calibration.count)
    write_atomic(path, json.dumps(calibration.to_dict(), indent=2) + "\n")
    return path


def export(calibration: Calibration, path: Path) -> None:
    from toolkit.fileio import write_atomic

    write_atomic(path, json.dumps(calibration.to_dict(), indent=2) + "\n")


STORED = "stored for this machine"
"""Where an applied calibration came from when no --calibration FILE gave it (--json's `source`)."""


@dataclass(frozen=True)
class Applied:
    """What hardware_of applied (None: nothing), and from where, for the command's output."""

    calibration: Calibration | None = None
    file: str | None = None
    """The --calibration FILE it was read from; None: the one stored for this machine."""

    @property
    def source(self) -> str:
        return "" if self.calibration is None else self.file or STORED

    def words(self) -> str | None:
        """The line that says a calibration moved the step time, or None."""
        c = self.calibration
        if c is None:
            return None
        where = c.words() if self.file is None else (
            f"calibrated by {self.file} ({c.device_model}), {c.date}, {c.runs} run{'s' if c.runs != 1 else ''}")
        return f"{where}: {c.terms_words()} (measured / predicted; {', '.join(c.not_measured)} not measured)"

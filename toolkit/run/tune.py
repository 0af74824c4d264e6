"""`toolkit tune PLAN_DIR`: the plan's top candidates, each run for a few steps on this machine under the launcher
and runner a real run uses (toolkit.run.launcher, toolkit.train), measured, and re-ranked by measured step time.

plan.json holds the chosen row only, so the candidates come from the planner's search again, from the plan's own
model, hardware and job (toolkit.plan.job.plan_job): the strategy and the batch split are searched as `toolkit plan`
searches them, the global batch, sequence, precision, checkpointing and method are the plan's. Each candidate is
emitted for this box (toolkit.run.smaller_box: N processes, CPU processes over gloo with cpu) into a folder of its
own and trained from the standard-library corpus (the rehearsal's data) for warm-up + measured steps, one log line
per step. toolkit.train's rank 0 writes every log line to the probe's metrics file (toolkit.train.callbacks): the
wall clock of each step gives the step time with the warm-up steps dropped, and the per-rank peaks are the ones
toolkit.train logs (allocated device memory on a GPU, the RSS high-water mark on CPU, which is the rank's host RAM).

A candidate whose largest per-rank peak passes its limit is stopped by its own ranks at that step (one line, exit
2), recorded as stopped, and the probe goes on. The limit: on a GPU the candidate's predicted peak plus its error
band; --memory-limit-gib replaces it (on CPU the RSS holds the interpreter and libraries, which the device
prediction leaves out, so there the limit is --memory-limit-gib alone). A candidate that would start after the
budget (minutes since the probe began, or since `tune MODEL` began planning) is skipped and recorded, and so is one
whose predicted probe would end past it (budget_skip): start-up (the mean measured on the earlier candidates) + warm-up and measured steps at its
predicted step time scaled by the earlier candidates' median measured / predicted ratio (on CPU, where the predicted
step is a GPU's, none is predicted before a first candidate was measured).

Where the budget goes (measure_order): the candidates whose predicted step time lies within the step-time band of
the fastest predicted one are measured first, in the planner's order; the prediction cannot tell them apart, so the
measurement decides between them. The others follow, in the planner's order, with the budget left over: for one of
them to win, the model would have to be off by more than its band. An unknown band (no published run on the GPU's
generation) puts every candidate inside it. So when the budget cannot cover every candidate, the ones outside the
band are the ones it leaves out, and their skip reason says what the band says of them.

MFU: measured tokens/s x the model FLOPs per token (no recompute, toolkit.estimate.timing.flops_per_token, the count
the planner's MFU divides) / (the planned GPU's dense peak at the plan's precision x processes). On CPU the peak is
the one the CPU cost model prices a step with: this CPU's measured torch.mm rate at the box's precision
(toolkit.inputs.cpudevice) x processes, a measured matmul rate rather than a datasheet peak. It holds per process
only where it was measured at the ranks' thread count and the ranks have a core per thread; otherwise MFU is null
and `mfu_basis` says why.

On CPU (--cpu) the rows' predictions are the CPU cost model's (toolkit.inputs.cpudevice: `--gpus Nxcpu`) for the
plan as it runs here (toolkit.run.smaller_box), not the planned GPU's, which would say nothing about a CPU step.
Each measured row's compute ratio (toolkit.inputs.calibration) is folded into this machine's stored calibration,
which later estimate / plan for the same device and count apply (store_calibration).

--emit DIR: the measured winner's plan folder, written by the emitter as `toolkit plan --out` writes a chosen row
(toolkit.emit.emit_files: staged and swapped in whole), with the planner's table and the plan's time to train.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pdataclass

from toolkit.errors import UserError
from toolkit.inputs.calibration import compute_ratio
from toolkit.inputs.choices import GIB
from toolkit.plan.schema import Plan

TUNE_JSON = "tune.json"
TUNE_VERSION = 1
WARMUP_STEPS = 2
"""Steps run before the timed ones (first allocations, the engines' first collectives), dropped from the time."""
TUNED_HEADING = "## Tuned"

MEASURED, STOPPED, FAILED, SKIPPED = "measured", "stopped", "failed", "skipped"
STATUSES = (MEASURED, STOPPED, FAILED, SKIPPED)


@dataclass
class TuneRow:
    """One candidate of the probe: what the planner predicted, and what this machine measured."""

    name: str
    strategy: str
    predicted_rank: int
    micro_batch: int
    grad_accum: int
    predicted_step_s: float | None
    predicted_tokens_per_s: float | None
    predicted_peak_bytes: int | None
    peak_band: float | None
    status: Literal[STATUSES] = SKIPPED  # type: ignore[valid-type]
    reason: str | None = None
    memory_limit_bytes: int | None = None
    measured_step_s: float | None = None
    measured_tokens_per_s: float | None = None
    timed_steps: int = 0
    peak_bytes_per_rank: list[int] = field(default_factory=list)
    host_ram_bytes: int | None = None
    wall_s: float = 0.0
    measured_rank: int | None = None
    within_band: bool = True
    """Predicted step time within the step-time band of the fastest predicted candidate (measure_order)."""
    model_flops_per_token: float | None = None
    mfu: float | None = None
    reserved_bytes_per_rank: list[int] = field(default_factory=list)
    """torch.cuda.max_memory_reserved per rank (empty on CPU)."""
    predicted_compute_s: float | None = None
    """The compute term of predicted_step_s: what the calibration's ratio measures (toolkit.inputs.calibration)."""
    compute_ratio: float | None = None
    """Measured over predicted compute time (toolkit.inputs.calibration.compute_ratio); None when not measured."""
    predicted_probe_s: float | None = None
    """Seconds its probe was predicted to take when it was due (budget_skip; None: no prediction yet)."""
    startup_s: float | None = None
    """Measured: its probe's wall time less its steps at the measured step time (launch, load, engine set-up)."""

    @property
    def step_ratio(self) -> float | None:
        if self.measured_step_s and self.predicted_step_s:
            return self.measured_step_s / self.predicted_step_s
        return None


def plan_candidates_again(plan: Plan) -> tuple[list, Any, Any]:
    """Every row of the planner's search for this plan's job, ranked (the plan's own row among them), with the
    model and hardware they were ranked for."""
    from toolkit.estimate.request import REQUEST_JOB_FIELDS, Request
    from toolkit.estimate.search import plan_candidates
    from toolkit.plan.job import plan_job

    spec, hw, job = plan_job(plan)
    req = Request(**{name: getattr(job, name) for name in REQUEST_JOB_FIELDS}, global_batch=plan.global_batch,
                  checkpointing=job.checkpointing, tiled=job.tiled)
    ranked = plan_candidates(spec, hw, req)
    if not any(c.feasible for c in ranked):
        raise UserError("the planner finds no row that fits for this plan's job; re-plan with `toolkit plan`")
    return ranked, spec, hw


def measure_order(ranked: list) -> list[tuple[Any, bool]]:
    """The feasible candidates of `ranked` (the planner's order) in the order the probe measures them, each with
    whether its predicted step time lies within the step-time band of the fastest predicted one
    (toolkit.estimate.ranking.speed_ties): those first, then the rest, each group in the planner's order."""
    from toolkit.estimate.ranking import speed_ties

    feasible = [c for c in ranked if c.feasible]
    inside = {id(c) for c in speed_ties(feasible)}
    return [(c, True) for c in feasible if id(c) in inside] + [(c, False) for c in feasible if id(c) not in inside]


def model_flops_per_token(spec, c) -> float:
    """The model FLOPs of one trained token for candidate `c` (no recompute): what the planner's MFU divides."""
    from toolkit.estimate.timing import flops_per_token

    trainable = None
    if c.job.adapter.is_adapter:
        from toolkit.inputs.lora import counts_for_spec

        trainable = counts_for_spec(spec, c.job.adapter).trainable_params
    return flops_per_token(spec, c.job.seq_len, c.job.checkpointing, trainable)[1]


def mfu_peak(hw, precision: str, *, cpu: bool, processes: int) -> tuple[float | None, str]:
    """FLOP/s the probe's MFU divides by, and the sentence tune.json keeps as `mfu_basis`."""
    if cpu:
        return cpu_mfu_peak(precision, processes, rank_threads=launch_threads(), cores=usable_cores())
    peak = hw.gpu.peak_tflops(precision) or hw.gpu.fp32_tflops
    import torch

    here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return peak * 1e12 * processes, (f"the planned {hw.gpu.name}'s dense {precision} peak, {peak:g} TFLOPS x "
                                     f"{processes} process{'es' if processes != 1 else ''} (GPU here: {here})")


def cpu_mfu_peak(precision: str, processes: int, *, rank_threads: int, cores: int) -> tuple[float | None, str]:
    """On CPU: the measured torch.mm rate at `precision` (the CPU cost model's peak) x processes, where that rate
    holds for each rank: measured at the ranks' thread count, and processes x threads within this machine's cores
    (ranks that share a core each get part of it). None and why otherwise."""
    from toolkit.inputs.cpudevice import cpu_rates
    from toolkit.inputs.hardware import cpu_gpu

    rates = cpu_rates()
    if rates.threads != rank_threads:
        return None, (f"null on CPU: this CPU's matmul rate was measured at {rates.threads} thread(s) and the ranks "
                      f"run at {rank_threads} (OMP_NUM_THREADS); run tune with OMP_NUM_THREADS={rank_threads} to "
                      "measure it at theirs")
    if processes * rank_threads > cores:
        return None, (f"null on CPU: {processes} processes x {rank_threads} thread(s) share {cores} core(s), so "
                      "the rate one process measured alone is no rank's peak")
    peak = cpu_gpu().peak_tflops(precision)
    return peak * 1e12 * processes, (
        f"this CPU's measured {precision} torch.mm rate, the CPU cost model's peak (toolkit.inputs.cpudevice: "
        f"{rates.model} at {rank_threads} thread(s)), {peak * 1e3:.1f} GFLOP/s x {processes} "
        f"process{'es' if processes != 1 else ''}: a measured matmul rate, not a datasheet peak")


def launch_threads() -> int:
    """The torch threads per rank of a CPU launch: OMP_NUM_THREADS, which toolkit.run.launcher sets to 1 when unset."""
    import os

    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def usable_cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def memory_limit(row: TuneRow, *, cpu: bool, limit_gib: float | None) -> int | None:
    """Bytes per rank past which the candidate is stopped (None: no stop)."""
    if limit_gib is not None:
        return int(limit_gib * GIB)
    if cpu or not row.predicted_peak_bytes:
        return None
    return int(row.predicted_peak_bytes * (1 + (row.peak_band or 0)))


def read_metrics(path: Path, warmup: int, tokens_per_step: int) -> dict[str, Any]:
    """Step time (warm-up steps dropped), tokens/s and peaks from the probe's metrics file."""
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        records = []
    steps = [r for r in records if "loss" in r or "stopped_over_bytes" in r]
    out: dict[str, Any] = {"peak_bytes_per_rank": [], "measured_step_s": None, "measured_tokens_per_s": None,
                           "timed_steps": 0, "reserved_bytes_per_rank": []}
    for key, name in (("peak_bytes_per_rank", "peak_bytes"), ("reserved_bytes_per_rank", "reserved_bytes")):
        held = [r[name] for r in records if r.get(name)]
        if held:
            out[key] = [max(per_rank) for per_rank in zip(*held)]
    start = next((r for r in steps if r["step"] >= warmup), None)
    end = steps[-1] if steps else None
    if start is not None and end is not None and end["step"] > start["step"]:
        step_s = (end["wall_s"] - start["wall_s"]) / (end["step"] - start["step"])
        out.update(measured_step_s=step_s, measured_tokens_per_s=tokens_per_step / step_s,
                   timed_steps=end["step"] - start["step"])
    return out


def probe_seconds(row: TuneRow, steps: int, earlier: list[TuneRow], *, cpu: bool) -> tuple[float | None, str]:
    """Predicted seconds of `row`'s probe, and how they were put together: the mean start-up measured on the
    `earlier` candidates (0 before any) + warm-up and measured steps at its predicted step time x the earlier
    candidates' median measured / predicted ratio (1 on a GPU before any; on CPU none before any: the prediction is
    a GPU's step)."""
    from statistics import mean, median

    ratios = [r.step_ratio for r in earlier if r.status == MEASURED and r.step_ratio]
    startups = [r.startup_s for r in earlier if r.startup_s is not None]
    if not row.predicted_step_s or (cpu and not ratios):
        return None, "no prediction (the predicted step is a GPU's, and no candidate was measured yet)"
    ratio = median(ratios) if ratios else 1.0
    startup = mean(startups) if startups else 0.0
    step_s = row.predicted_step_s * ratio
    total = WARMUP_STEPS + steps
    how = (f"start-up {startup:.0f} s" + ("" if startups else " (none measured yet)") + f" + {total} steps x "
           f"{step_s:.3g} s" + (f" (predicted {row.predicted_step_s:.3g} s x {ratio:.3g}, the measured ratio so far)"
                               if ratios else " (predicted)"))
    return startup + total * step_s, how


def budget_skip(row: TuneRow, steps: int, earlier: list[TuneRow], *, cpu: bool, elapsed_s: float,
                budget_min: float) -> str | None:
    """Why `row` is skipped (None: it runs): the budget is spent, or its predicted probe (probe_seconds) would end
    past it. Records the prediction on the row."""
    budget_s = budget_min * 60
    outside = "" if row.within_band else ("; outside the fastest prediction's band: the prediction already ranks "
                                          "it lower")
    if elapsed_s >= budget_s:
        return f"budget spent ({elapsed_s / 60:.1f} of {budget_min:g} min){outside}"
    seconds, how = probe_seconds(row, steps, earlier, cpu=cpu)
    row.predicted_probe_s = None if seconds is None else round(seconds, 1)
    if seconds is None or elapsed_s + seconds <= budget_s:
        return None
    return (f"would end past the budget: predicted {seconds:.0f} s ({how}) with {budget_s - elapsed_s:.0f} s of "
            f"{budget_min:g} min left{outside}")


def priced_boxes(plans: list[Plan], *, processes: int, cpu: bool) -> list[Plan]:
    """Each candidate's plan as it runs here (toolkit.run.smaller_box: `processes` processes, on CPU when `cpu`),
    priced as it runs: on CPU by the CPU cost model, on GPUs for the plan's GPU at this process count. The box
    leaves smaller_box without a prediction, and the calibration's compute ratio is measured over the box's
    predicted compute (a GPU probe once kept the empty one: every ratio None, nothing stored or exported)."""
    from toolkit.estimate.search import predict_plan
    from toolkit.run.smaller_box import box_plan

    return [predict_plan(box_plan(p, processes=processes, cpu=cpu)[0]) for p in plans]


def probe(plan: Plan, plan_dir: Path, *, count: int, budget_min: float, steps: int, processes: int, cpu: bool,
          limit_gib: float | None, emit_dir: Path | None = None, planning_s: float | None = None,
          say=print) -> dict[str, Any]:
    """Run the probe; returns tune.json's content (written by write_results). `emit_dir`: where the measured
    winner's plan folder is written (emit_winner), nothing when no candidate was measured. `planning_s`: the seconds
    `tune MODEL` spent planning the folder first, already spent of the budget (None: tune PLAN_DIR)."""
    from toolkit.estimate.search import to_plan
    from toolkit.run.launcher import emit_plan_files, launch_command, processes_phrase, run
    from toolkit.run.rehearsal import rehearsal_data
    from toolkit.train.probe import PROBE_MEMORY_LIMIT_ENV, PROBE_METRICS_ENV

    began = time.monotonic() - (planning_s or 0.0)
    ranked, spec, hw = plan_candidates_again(plan)
    feasible = [c for c in ranked if c.feasible]
    order = measure_order(ranked)[:count]
    candidates = [c for c, _ in order]
    plans = [to_plan(c, spec, hw, plan.model) for c in candidates]
    boxes = priced_boxes(plans, processes=processes, cpu=cpu)  # refused before any process starts
    rows = [_row(feasible.index(c) + 1, c, b, inside, model_flops_per_token(spec, c))
            for (c, inside), b in zip(order, boxes)]
    peak, mfu_basis = mfu_peak(hw, (boxes[0] if cpu else plan).precision, cpu=cpu, processes=processes)
    where = processes_phrase(processes, cpu=cpu)
    in_band = sum(r.within_band for r in rows)
    say(f"tuning {len(rows)} candidate{'s' if len(rows) != 1 else ''} of {plan_dir} on {where}: {WARMUP_STEPS} "
        f"warm-up + {steps} measured step{'s' if steps != 1 else ''} each, budget {budget_min:g} min"
        f"{'' if planning_s is None else f' (planning spent {planning_s:.1f} s of it)'}; {in_band} "
        f"within the step-time band of the fastest prediction, measured first")
    if cpu and limit_gib is None:
        say("note: on CPU a rank's peak is its RSS (interpreter and libraries included), which the device "
            "prediction leaves out: no memory stop without --memory-limit-gib")
    work = Path(tempfile.mkdtemp(prefix="toolkit-tune-"))
    try:
        data = rehearsal_data(boxes[0], work / "data")
        for i, (row, box) in enumerate(zip(rows, boxes)):
            why = budget_skip(row, steps, rows[:i], cpu=cpu, elapsed_s=time.monotonic() - began,
                              budget_min=budget_min)
            if why:
                row.status, row.reason = SKIPPED, why
                say(f"[{i + 1}/{len(rows)}] {row.name}: skipped, {row.reason}")
                continue
            row.memory_limit_bytes = memory_limit(row, cpu=cpu, limit_gib=limit_gib)
            folder = work / f"candidate-{i + 1}"
            box_dir = emit_plan_files(box, folder / "plan")
            metrics = folder / "metrics.jsonl"
            argv = ["--data", str(data), "--output", str(folder / "out"), "--max-steps", str(WARMUP_STEPS + steps),
                    "--logging-steps", "1", "--save-steps", str(10 ** 6), "--no-save-final", "--max-eval-blocks", "1"]
            env = {PROBE_METRICS_ENV: str(metrics), "TOOLKIT_PLAN_DIR": str(box_dir.resolve())}
            if row.memory_limit_bytes:
                env[PROBE_MEMORY_LIMIT_ENV] = str(row.memory_limit_bytes)
            if cpu:
                env["CUDA_VISIBLE_DEVICES"] = ""
            say(f"[{i + 1}/{len(rows)}] {row.name}: micro-batch {box.micro_batch} x accumulation {box.grad_accum}, "
                f"running ...")
            started = time.monotonic()
            code = run(launch_command(box_dir, argv), env=env, output=folder / "out")
            row.wall_s = round(time.monotonic() - started, 1)
            got = read_metrics(metrics, WARMUP_STEPS, box.global_batch * box.seq_len)
            for key, value in got.items():
                setattr(row, key, value)
            if row.measured_step_s:
                row.startup_s = round(max(0.0, row.wall_s - (WARMUP_STEPS + row.timed_steps) * row.measured_step_s), 1)
            if peak and row.measured_tokens_per_s:
                row.mfu = row.measured_tokens_per_s * row.model_flops_per_token / peak
            row.host_ram_bytes = sum(row.peak_bytes_per_rank) if cpu and row.peak_bytes_per_rank else None
            stopped = _stopped(metrics)
            if stopped:
                row.status = STOPPED
                row.reason = (f"peak {max(row.peak_bytes_per_rank) / GIB:.3f} GiB passed the limit "
                              f"{stopped / GIB:.3f} GiB")
            elif code != 0 or row.measured_step_s is None:
                row.status, row.reason = FAILED, f"exit code {code} (no timed step)" if code == 0 else \
                    f"exit code {code}"
            else:
                row.status = MEASURED
                row.compute_ratio = compute_ratio(row.measured_step_s, box.predicted)
            say(f"[{i + 1}/{len(rows)}] {row.name}: {_progress(row)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    measured = sorted((r for r in rows if r.status == MEASURED), key=lambda r: r.measured_step_s)
    calibration = store_calibration(boxes[0], processes, [r for r in measured if r.compute_ratio], say)
    for rank, row in enumerate(measured, 1):
        row.measured_rank = rank
    emitted = None
    if emit_dir is not None and measured:
        winner = candidates[rows.index(measured[0])]
        try:  # a failure here (a folder filled meanwhile, a full disk) loses no measurement: tune.json follows
            emit_winner(plan, winner, ranked, spec, hw, emit_dir, why=f"fastest measured by `toolkit tune` on "
                        f"{where}: {measured[0].measured_step_s:.3f} s/step, #{measured[0].predicted_rank} of the "
                        "planner's ranking")
            emitted = str(emit_dir)
        except UserError as exc:
            say(f"--emit: {exc}")
    return {"version": TUNE_VERSION, "plan": str(plan_dir), "model": plan.model, "planned_for":
            f"{plan.world_size}x {plan.gpu}", "where": where, "cpu": cpu, "processes": processes,
            "warmup_steps": WARMUP_STEPS, "measured_steps": steps, "budget_min": budget_min,
            "planning_s": None if planning_s is None else round(planning_s, 3),
            "spent_min": round((time.monotonic() - began) / 60, 2), "memory_limit_gib": limit_gib,
            "mfu_basis": mfu_basis, "candidates": [{**asdict(r), "step_ratio": r.step_ratio} for r in rows],
            "ranking": [r.name for r in measured], "emitted": emitted,
            "predicted_on": f"{processes}x{boxes[0].gpu}" + (": the CPU cost model (toolkit.inputs.cpudevice)" if cpu
                                                            else ""),
            "calibration": calibration.to_dict() if calibration else None}


def store_calibration(box: Plan, processes: int, rows: list[TuneRow], say=print):
    """The compute ratios of `rows` (measured, each with its ratio) folded into this machine's stored calibration
    (toolkit.inputs.calibration) with the runs behind them, for `processes` x the device the box runs on; None when
    nothing was measured. A stored calibration that is corrupted is replaced (with its warning)."""
    from toolkit.inputs import calibration as cal
    from toolkit.inputs.hardware import find_gpu

    gpu = find_gpu(box.gpu)
    ratios = [r.compute_ratio for r in rows]
    model = Path(box.model).name if Path(box.model).is_dir() else box.model  # no local path in a shared file
    runs = [{"model": model, "candidate": r.name, "predicted_step_s": r.predicted_step_s,
             "predicted_compute_s": r.predicted_compute_s, "measured_step_s": r.measured_step_s,
             "compute_ratio": r.compute_ratio} for r in rows]
    combined = cal.combine(gpu, processes, ratios, cal.stored(gpu, processes, warn=say), measurements=runs)
    if combined is None or not ratios:
        return combined
    path = cal.store(combined)
    say(f"calibration: {combined.terms_words()} of the prediction over {combined.runs} "
        f"run{'s' if combined.runs != 1 else ''}, stored in {path}; later estimate / plan for "
        f"--gpus {processes}x{gpu.name} use it")
    return combined


def plan_run(plan: Plan):
    """The data the plan was timed for (plan --dataset-tokens / --data: predicted["time_to_train"]) as the
    RunSize that timed it, or None."""
    from toolkit.estimate.duration import RunSize

    t = plan.predicted.get("time_to_train")
    if not t:
        return None
    return RunSize(dataset_tokens=t["dataset_tokens"], epochs=t["epochs"], gpu_hour_price=t["gpu_hour_price"],
                   source=t.get("dataset_tokens_source", "given"), source_detail=t.get("dataset_tokens_detail", ""))


def emit_winner(plan: Plan, winner, ranked: list, spec, hw, out: Path, *, why: str) -> list[Path]:
    """The winner's plan folder, as `toolkit plan --out` writes a chosen row: the same Plan builder and emitter,
    the planner's whole table in PLAN.md, the time to train of the plan's data; never over existing files."""
    from toolkit.emit import emit_files
    from toolkit.estimate.duration import duration
    from toolkit.estimate.search import to_plan

    run = plan_run(plan)

    def row(c) -> dict[str, Any]:
        out_row = c.row()
        if run is not None and c.feasible:
            out_row["time_to_train"] = duration(run, c, hw.world_size).to_dict()
        return out_row

    chosen = to_plan(winner, spec, hw, plan.model, why=why, run=run)
    return emit_files(chosen, out, candidates=[row(c) for c in ranked])


def _row(rank: int, c, plan: Plan, inside: bool, flops: float) -> TuneRow:
    predicted = plan.predicted
    return TuneRow(name=c.name, strategy=c.strategy.name, predicted_rank=rank, within_band=inside,
                   model_flops_per_token=flops, micro_batch=plan.micro_batch,
                   grad_accum=plan.grad_accum, predicted_step_s=predicted.get("step_time_s"),
                   predicted_tokens_per_s=predicted.get("tokens_per_s"),
                   predicted_peak_bytes=predicted.get("peak_bytes"), predicted_compute_s=predicted.get("compute_s"),
                   peak_band=c.peak_band.fraction if c.memory else None)


def _stopped(metrics: Path) -> int | None:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        record = json.loads(line)
        if "stopped_over_bytes" in record:
            return record["stopped_over_bytes"]
    return None


def _progress(row: TuneRow) -> str:
    if row.status != MEASURED:
        return f"{row.status}: {row.reason}"
    ratio = f" ({row.step_ratio:,.1f}x the predicted {row.predicted_step_s:.3g} s)" if row.step_ratio else ""
    return (f"measured {row.measured_step_s:.3f} s/step{ratio}, {row.measured_tokens_per_s:,.0f} tokens/s, "
            f"peak {max(row.peak_bytes_per_rank) / GIB:.3f} GiB/rank, {row.wall_s:.0f} s")


def table(result: dict[str, Any]) -> list[str]:
    """Predicted against measured per candidate, in measured order (then the ones not measured)."""
    rows = sorted(result["candidates"], key=lambda r: (r["measured_rank"] is None, r["measured_rank"] or 0,
                                                       r["predicted_rank"]))
    lines = [f"{'measured #':>10} {'planned #':>9}  {'candidate':<28}{'pred step s':>12}{'meas step s':>12}"
             f"{'meas tok/s':>11}{'MFU':>7}{'pred GiB':>9}{'meas GiB':>9}  status"]
    for r in rows:
        pred_s = f"{r['predicted_step_s']:.3g}" if r["predicted_step_s"] else "-"
        meas_s = f"{r['measured_step_s']:.3f}" if r["measured_step_s"] else "-"
        tok = f"{r['measured_tokens_per_s']:,.0f}" if r["measured_tokens_per_s"] else "-"
        pred_m = f"{r['predicted_peak_bytes'] / GIB:.3f}" if r["predicted_peak_bytes"] else "-"
        meas_m = f"{max(r['peak_bytes_per_rank']) / GIB:.3f}" if r["peak_bytes_per_rank"] else "-"
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        status = r["status"] + (f": {r['reason']}" if r["reason"] else "") + \
            ("" if r["within_band"] else " (outside the fastest prediction's band)")
        lines.append(f"{r['measured_rank'] or '-':>10} {r['predicted_rank']:>9}  {r['name']:<28}{pred_s:>12}"
                     f"{meas_s:>12}{tok:>11}{mfu:>7}{pred_m:>9}{meas_m:>9}  {status}")
    return lines


def write_results(result: dict[str, Any], plan_dir: Path, order_rule: str) -> list[Path]:
    """tune.json (checked against its schema, written atomically) and PLAN.md's Tuned section (replaced, not
    stacked, by a later probe), which states `order_rule` (measure_order's rule as the command's help words it)."""
    from toolkit.fileio import write_atomic
    from toolkit.plan.files import PLAN_MD

    TuneFile(**result)  # the schema: a row that does not fit it is a bug here, never a file written
    write_atomic(plan_dir / TUNE_JSON, json.dumps(result, indent=2) + "\n")
    md = plan_dir / PLAN_MD
    text = md.read_text() if md.is_file() else ""
    if TUNED_HEADING in text:
        text = text[:text.index(TUNED_HEADING)].rstrip() + "\n"
    section = [TUNED_HEADING, "", f"Measured by `toolkit tune` on {result['where']} ({result['warmup_steps']} warm-up "
               f"+ {result['measured_steps']} measured steps per candidate, {result['spent_min']} of "
               f"{result['budget_min']:g} min{_planning_words(result)}); ranked by measured step time. Predictions are for "
               f"{result['planned_for']}. {order_rule} MFU: {result['mfu_basis']}.", "", "```", *table(result),
               "```", ""]
    write_atomic(md, (text + "\n" if text else "") + "\n".join(section))
    return [plan_dir / TUNE_JSON, md]


def _planning_words(result: dict[str, Any]) -> str:
    planning_s = result.get("planning_s")
    return "" if planning_s is None else f", planning included: {planning_s:g} s"


_STRICT = ConfigDict(extra="forbid")


@pdataclass(config=_STRICT)
class _Row(TuneRow):
    """A tune.json row: TuneRow's fields, checked (status one of STATUSES), and its step ratio."""

    step_ratio: float | None = None


@pdataclass(config=_STRICT)
class TuneFile:
    """tune.json: every field named and typed; write_results checks the content against it before writing."""

    version: Literal[1]
    plan: str
    model: str
    planned_for: str
    where: str
    cpu: bool
    processes: int
    warmup_steps: int
    measured_steps: int
    budget_min: float
    spent_min: float
    memory_limit_gib: float | None
    mfu_basis: str
    candidates: list[_Row]
    ranking: list[str]
    emitted: str | None
    predicted_on: str = ""
    """The hardware the rows' predictions are for: the plan's, or on CPU this machine's CPU processes."""
    planning_s: float | None = None
    """Seconds `tune MODEL` spent planning before the probe, counted in spent_min (None: a plan folder given)."""
    calibration: dict | None = None
    """This machine's calibration after the probe (toolkit.inputs.calibration), None when nothing was measured."""

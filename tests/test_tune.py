"""`toolkit tune PLAN_DIR --cpu`: the plan's top candidates run for a few steps on 2 CPU processes over gloo, under
`toolkit launch`'s launcher and toolkit.train, measured, re-ranked by measured step time; a candidate past its
memory limit is stopped and the probe goes on; bad input is one line before any process starts.

One probe (module scope) serves every multi-process assertion. Its model is a llama of 8 layers, hidden 1024 (29 M
parameters) rather than the session's tiny one, so that DDP's full fp32 replica, gradients and Adam states make a
rank's RSS far larger than ZeRO-1 / ZeRO-2's: measured on the dev box 1.319 GB for DDP against 1.071 / 1.028 GB
(a gap of 248 MB; predicted peaks 612 / 353 / 323 MB).

The memory limit is derived, not tuned: BASELINE_BYTES (what a CPU rank's RSS holds beside the plan's predicted
tensor peak: interpreter, torch, deepspeed, transformers, the rank's own model load) plus the midpoint between
DDP's predicted peak and the larger ZeRO one. The measured RSS minus the prediction was 707 / 718 / 705 MB for the
three candidates on the dev box, so the midpoint sits ~125 MB from each measured peak: the limit survives a shift
of the process baseline of well over +-50 MB on another machine (a shift moves every candidate's RSS alike).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import shared_tiny_model, toolkit_here
from toolkit.inputs.choices import GIB

BASELINE_BYTES = 710 * 10**6
"""A CPU rank's RSS beside its predicted tensor peak (measured 705-718 MB here; module docstring)."""


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[Path, float]:
    """The plan folder, and the probe's memory limit in GiB: BASELINE_BYTES + the midpoint of DDP's and the larger
    ZeRO candidate's predicted peak (module docstring)."""
    from toolkit import api

    base = tmp_path_factory.mktemp("tune")
    # At one path per version of the code that makes it (tests/conftest.py): made once on this machine (4.2 CPU-s,
    # 15 s wall on a loaded box), and its plan's traces found in the on-disk cache by the next session.
    model = shared_tiny_model("llama", layers=8, hidden=1024, corpus_chars=100_000)
    result = api.plan(str(model), "2xA100-80GB", seq_len=64, global_batch=8, device_kind="cpu")
    assert [c.name for c in result.feasible[:3]] == ["ddp", "zero1", "zero2"]
    api.emit(result, base / "plan")
    ddp, zero = result.feasible[0].memory.peak_bytes, max(c.memory.peak_bytes for c in result.feasible[1:3])
    assert ddp - zero > 200 * 10**6, (ddp, zero)  # the gap the limit splits
    return base / "plan", round((BASELINE_BYTES + (ddp + zero) / 2) / GIB, 3)


@pytest.fixture(scope="module")
def plan_dir(planned) -> Path:
    return planned[0]


@pytest.fixture(scope="module")
def limit_gib(planned) -> float:
    return planned[1]


@pytest.fixture(scope="module")
def cache(plan_dir) -> Path:
    """The user cache the probe stores its calibration in (TOOLKIT_CACHE_DIR), never the real one."""
    return plan_dir.parent / "cache"


@pytest.fixture(scope="module")
def tuned(plan_dir, limit_gib, cache) -> tuple[subprocess.CompletedProcess, dict, str]:
    """`toolkit tune PLAN --cpu --processes 2` of 3 candidates, run in this process (toolkit_here: its probes are
    launches of their own), its calibration stored in `cache`. The CPU's matmul rate it measures here is at one
    torch thread, the ranks' (OMP_NUM_THREADS=1), as an interpreter of its own started with that measured it."""
    import torch

    argv = ["tune", str(plan_dir), "--cpu", "--processes", "2", "--steps", "1", "--candidates", "3",
            "--memory-limit-gib", str(limit_gib), "--emit", str(plan_dir.parent / "winner"),
            "--export-calibration", str(plan_dir.parent / "calibration.json")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code, out, err = toolkit_here(argv, TOOLKIT_CACHE_DIR=str(cache),
                                      PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err[-3000:]
    done = subprocess.CompletedProcess(["toolkit", *argv], code, out, err)
    return done, json.loads((plan_dir / "tune.json").read_text()), (plan_dir / "PLAN.md").read_text()


@pytest.mark.multiprocess
def test_measured_rows_hold_real_numbers_beside_the_prediction(tuned, limit_gib):
    _, result, _ = tuned
    rows = {r["name"]: r for r in result["candidates"]}
    assert list(rows) == ["ddp", "zero1", "zero2"] and [r["predicted_rank"] for r in rows.values()] == [1, 2, 3]
    for name in ("zero1", "zero2"):
        r = rows[name]
        assert r["status"] == "measured", r
        assert r["measured_step_s"] > 0 and r["measured_tokens_per_s"] > 0 and r["timed_steps"] == 1
        assert r["measured_tokens_per_s"] == pytest.approx(8 * 64 / r["measured_step_s"])
        assert r["predicted_step_s"] > 0 and r["predicted_peak_bytes"] > 0 and r["peak_band"] > 0
        assert len(r["peak_bytes_per_rank"]) == 2 and min(r["peak_bytes_per_rank"]) > 0
        assert max(r["peak_bytes_per_rank"]) <= limit_gib * GIB
        assert r["host_ram_bytes"] == sum(r["peak_bytes_per_rank"])  # on CPU a rank's peak is its host RAM
        assert r["step_ratio"] == pytest.approx(r["measured_step_s"] / r["predicted_step_s"])


@pytest.mark.multiprocess
def test_re_ranked_by_measured_step_time(tuned):
    done, result, _ = tuned
    measured = [r for r in result["candidates"] if r["status"] == "measured"]
    by_time = [r["name"] for r in sorted(measured, key=lambda r: r["measured_step_s"])]
    assert result["ranking"] == by_time and len(by_time) == 2
    assert [r["measured_rank"] for r in sorted(measured, key=lambda r: r["measured_step_s"])] == [1, 2]
    assert f"fastest measured: {by_time[0]}" in done.stdout


@pytest.mark.multiprocess
def test_a_candidate_past_its_memory_limit_is_stopped_and_the_rest_run(tuned, limit_gib):
    _, result, _ = tuned
    ddp = result["candidates"][0]
    assert ddp["name"] == "ddp" and ddp["status"] == "stopped", ddp
    assert ddp["memory_limit_bytes"] == int(limit_gib * GIB) and max(ddp["peak_bytes_per_rank"]) > limit_gib * GIB
    assert ddp["measured_rank"] is None and "passed the limit" in ddp["reason"]
    # the biggest predicted peak is the one stopped: the prediction orders what the limit cuts
    assert ddp["predicted_peak_bytes"] > max(r["predicted_peak_bytes"] for r in result["candidates"][1:])
    assert [r["status"] for r in result["candidates"][1:]] == ["measured", "measured"]


@pytest.mark.multiprocess
def test_progress_table_schema_and_plan_md(tuned, plan_dir):
    from toolkit.run.tune import TuneFile

    done, result, plan_md = tuned
    for i, name in enumerate(("ddp", "zero1", "zero2"), 1):
        assert f"[{i}/3] {name}: micro-batch 4 x accumulation 1, running ..." in done.stdout
    assert "pred step s" in done.stdout and "meas step s" in done.stdout
    TuneFile(**result)
    assert plan_md.count("## Tuned") == 1 and "stopped: peak" in plan_md
    assert result["where"] == "2 CPU processes over gloo" and result["spent_min"] <= result["budget_min"]


@pytest.mark.multiprocess
def test_rows_carry_model_flops_and_mfu_against_the_cpu_measured_peak(tuned):
    """29 M-parameter llama, seq 64: model FLOPs per token are the planner's count (6 x the matmul parameters, the
    embedding lookup being none, + causal attention's: 176.2 M here, 5.996 x params); on CPU MFU divides by the CPU
    cost model's peak (this CPU's measured torch.mm rate at the box's precision x 2 processes, each at 1 thread on a
    core of its own here), and the file says so."""
    from toolkit import api
    from toolkit.estimate.timing import flops_per_token

    done, result, plan_md = tuned
    spec = api.model(result["model"])
    expected = flops_per_token(spec, 64, False)[1]
    assert 5.5 * spec.params < expected < 6.5 * spec.params
    # the probe measured this CPU in its own cache (TOOLKIT_CACHE_DIR): its rate is the one mfu_basis states
    gflops = float(re.search(r"([0-9.]+) GFLOP/s x 2 processes", result["mfu_basis"]).group(1))
    peak = gflops * 1e9 * 2
    for r in result["candidates"]:
        assert r["model_flops_per_token"] == pytest.approx(expected)
        assert r["reserved_bytes_per_rank"] == []  # no CUDA here
        assert r["within_band"] is True  # ddp / zero1 / zero2 predictions lie within the A100 band of each other
        if r["status"] == "measured":
            assert 0 < r["mfu"] == pytest.approx(r["measured_tokens_per_s"] * expected / peak, rel=1e-3)
    assert "measured" in result["mfu_basis"] and "torch.mm rate" in plan_md
    assert "Order: the candidates whose predicted step time lies within the step-time band" in plan_md


@pytest.mark.multiprocess
def test_emit_writes_the_winner_folder_as_plan_out_writes_that_row(tuned, plan_dir, tmp_path):
    """--emit DIR: the measured winner's folder is the emitter's own output for that row (plan.json, the engine
    configs, the launch scripts byte for byte); only the ranking note and PLAN.md's reason for the choice differ."""
    from toolkit import api
    from toolkit.emit import emit_files
    from toolkit.plan.files import PLAN_JSON, PLAN_MD

    done, result, _ = tuned
    winner_dir = plan_dir.parent / "winner"
    assert result["emitted"] == str(winner_dir) and f"wrote the plan folder of {result['ranking'][0]}" in done.stdout
    planned = api.load_plan(plan_dir)
    again = api.plan(planned.model, "2xA100-80GB", seq_len=64, global_batch=8, device_kind="cpu")
    reference = tmp_path / "reference"
    emit_files(again.to_plan(result["ranking"][0]), reference, candidates=again.rows())
    ours = sorted(p.name for p in winner_dir.iterdir())
    assert ours == sorted(p.name for p in reference.iterdir()) and PLAN_JSON in ours
    for name in ours:
        if name not in (PLAN_JSON, PLAN_MD):
            assert (winner_dir / name).read_bytes() == (reference / name).read_bytes(), name
    mine, theirs = api.load_plan(winner_dir).to_dict(), api.load_plan(reference).to_dict()
    our_notes, their_notes = mine.pop("notes"), theirs.pop("notes")
    assert mine == theirs and mine["strategy"] == result["ranking"][0]
    assert [n for n in our_notes if not n.startswith("ranking:")] == their_notes
    row = next(r for r in result["candidates"] if r["name"] == result["ranking"][0])
    assert [n for n in our_notes if n.startswith("ranking:")] == [
        f"ranking: fastest measured by `toolkit tune` on 2 CPU processes over gloo: {row['measured_step_s']:.3f} "
        f"s/step, #{row['predicted_rank']} of the planner's ranking"]
    differ = set((winner_dir / PLAN_MD).read_text().splitlines()) ^ set((reference / PLAN_MD).read_text().splitlines())
    assert all("fastest measured" in line for line in differ), differ


def test_emit_into_a_folder_that_is_not_empty_is_one_line_before_anything(plan_dir, tmp_path, capsys):
    from toolkit.cli import main

    folder = tmp_path / "plan"
    shutil.copytree(plan_dir, folder, ignore=shutil.ignore_patterns("tune.json"))
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["tune", str(folder), "--cpu", "--processes", "2", "--emit", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--emit" in err and "is not empty" in err and "\n" not in err
    assert not (folder / "tune.json").exists() and [p.name for p in out.iterdir()] == ["mine.txt"]
    (tmp_path / "file").write_text("x")
    assert main(["tune", str(folder), "--cpu", "--emit", str(tmp_path / "file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_measure_order_puts_the_band_of_the_fastest_prediction_first():
    """Llama-3.1-8B on 8 x H100 (Hopper band 9.3%): given in reverse, the candidates within the band of the fastest
    predicted step come first, in the order given, and the ones outside it (pipelines, 0.62-0.68 s against 0.44 s)
    last; nothing is launched."""
    from toolkit import api
    from toolkit.estimate.ranking import band_of
    from toolkit.run.tune import measure_order

    result = api.plan("llama-3.1-8b", "8xH100-80GB", seq_len=2048, global_batch=16)
    feasible = result.feasible
    order = measure_order(list(reversed(result.candidates)))
    assert sorted(id(c) for c, _ in order) == sorted(id(c) for c in feasible)
    flags = [inside for _, inside in order]
    assert flags == sorted(flags, reverse=True) and 0 < flags.count(False) < len(flags)
    fastest = min(c.timing.step_time_s for c in feasible)
    band = band_of(feasible).fraction
    assert 0.05 < band < 0.2
    for c, inside in order:
        assert inside == (c.timing.step_time_s <= fastest * (1 + band) * 1.001), (c.name, c.timing.step_time_s)
    inside = [c for c, i in order if i]
    assert inside == [c for c in reversed(feasible) if id(c) in {id(x) for x in inside}]  # the order given
    assert "zero1" in [c.name for c in inside] and "pipeline (pp=8 x dp=1)" not in [c.name for c in inside]


def test_on_gpus_each_box_carries_the_prediction_its_compute_ratio_is_measured_over():
    """The GPU day (benchmarks/data/gpu_day_2026-12-04): on one H200 the probe measured every candidate, then stored
    and exported no calibration, because the box a candidate runs as (toolkit.run.smaller_box) leaves without a
    prediction and on GPUs nothing priced it again: every compute ratio was None. Each box now carries its own, for
    the plan's GPU at the probe's process count: Llama-3.1-8B on 2 x H100 probed on those 2 GPUs keeps the plan's
    step and compute, and on 1 of them (double accumulation) a step about twice as long; the ratio of a measured
    step follows from it."""
    from toolkit import api
    from toolkit.inputs.calibration import compute_ratio
    from toolkit.run.tune import priced_boxes

    result = api.plan("qwen2.5-0.5b", "2xH100-80GB", seq_len=2048, global_batch=16)
    plan = result.to_plan(next(c for c in result.feasible if "=" not in c.name))  # no sequence-parallel degree
    [same] = priced_boxes([plan], processes=2, cpu=False)
    [half] = priced_boxes([plan], processes=1, cpu=False)
    assert same.predicted["step_time_s"] == pytest.approx(plan.predicted["step_time_s"], rel=1e-9)
    assert same.predicted["compute_s"] == pytest.approx(plan.predicted["compute_s"], rel=1e-9)
    assert half.grad_accum == 2 * same.grad_accum
    assert 1.8 < half.predicted["compute_s"] / same.predicted["compute_s"] < 2.2
    ratio = compute_ratio(2 * same.predicted["step_time_s"], same.predicted)
    assert ratio is not None and ratio > 2


def test_a_candidate_past_the_budget_is_skipped_and_recorded(plan_dir, tmp_path, capsys):
    """Planning alone outlasts a budget of 0.006 s: every candidate is skipped before any process starts."""
    from toolkit.cli import main

    folder = tmp_path / "plan"
    shutil.copytree(plan_dir, folder, ignore=shutil.ignore_patterns("tune.json"))
    never = tmp_path / "winner"
    assert main(["tune", str(folder), "--cpu", "--processes", "2", "--budget-min", "0.0001", "--emit",
                 str(never)]) == 1  # asked for a winner's folder and got none
    out, err = capsys.readouterr()
    assert not never.exists() and "no candidate was measured" in out and "--emit: no candidate was measured" in err
    result = json.loads((folder / "tune.json").read_text())
    assert [r["status"] for r in result["candidates"]] == ["skipped"] * 3
    assert all(r["reason"].startswith("budget spent") and r["measured_step_s"] is None for r in result["candidates"])
    assert result["ranking"] == [] and result["emitted"] is None


@pytest.mark.parametrize("argv, words", [
    (["--budget-min", "0"], "--budget-min must be positive"),
    (["--budget-min", "-5"], "--budget-min must be positive"),
    (["--candidates", "0"], "--candidates must be a positive integer"),
    (["--memory-limit-gib", "0"], "--memory-limit-gib must be positive"),
])
def test_bad_numbers_are_one_line(tmp_path, argv, words, capsys):
    from toolkit.cli import main

    assert main(["tune", str(tmp_path), "--cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_a_folder_that_is_no_plan_is_one_line(tmp_path, capsys):
    from toolkit.cli import main

    assert main(["tune", str(tmp_path), "--cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is no plan folder" in err and "\n" not in err and not (tmp_path / "tune.json").exists()
    (tmp_path / "plan.json").write_text("{not json")
    assert main(["tune", str(tmp_path), "--cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "plan.json" in err and not (tmp_path / "tune.json").exists()


def _estimate_json(model: str, capsys, *extra: str) -> dict:
    from toolkit.cli import main

    assert main(["estimate", model, "--gpus", "2xcpu", "--seq", "64", "--micro-batch", "4", "--strategy", "zero1",
                 "--device-kind", "cpu", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.multiprocess
def test_the_probe_stores_a_calibration_that_moves_a_later_estimate(tuned, cache, plan_dir, monkeypatch, capsys):
    """The probe's compute ratio (measured step less the predicted non-compute terms, over the predicted compute,
    of the two measured candidates) is stored under TOOLKIT_CACHE_DIR; a later estimate for 2xcpu here takes it,
    says so, and --no-calibration gives the figures of an empty cache exactly."""
    from datetime import date

    from toolkit.cli import main

    done, result, _ = tuned
    measured = [r for r in result["candidates"] if r["status"] == "measured"]
    ratios = [r["compute_ratio"] for r in measured]
    assert all(r and r > 0 for r in ratios) and result["predicted_on"].startswith("2xcpu: the CPU cost model")
    for r in measured:  # predicted on the CPU cost model: the ratio is the measured step's compute over its own
        rest = r["measured_step_s"] - (r["predicted_step_s"] - r["predicted_compute_s"])
        assert r["compute_ratio"] == pytest.approx(rest / r["predicted_compute_s"])
    stored = json.loads((cache / "calibration" / "2xcpu.json").read_text())
    assert stored["runs"] == 2 and stored["date"] == date.today().isoformat() and stored["count"] == 2
    assert stored["compute_ratio"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)
    assert json.loads((plan_dir.parent / "calibration.json").read_text()) == stored == result["calibration"]
    assert "stored in" in done.stdout and "wrote this machine's calibration to" in done.stdout

    model = result["model"]
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(plan_dir.parent / "empty-cache"))
    plain = _estimate_json(model, capsys)
    assert plain["calibration"] is None
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(cache))
    calibrated = _estimate_json(model, capsys)
    words = f"calibrated on this machine, {stored['date']}, 2 runs"
    assert calibrated["calibration"]["words"].startswith(words)
    assert calibrated["timing"]["compute_s"] == pytest.approx(plain["timing"]["compute_s"] * stored["compute_ratio"])
    assert calibrated["timing"]["step_time_s"] != plain["timing"]["step_time_s"]
    assert calibrated["per_gpu"] == plain["per_gpu"]  # memory never moves
    assert _estimate_json(model, capsys, "--no-calibration") == plain
    assert main(["estimate", model, "--gpus", "2xcpu", "--seq", "64", "--strategy", "zero1", "--device-kind",
                 "cpu"]) == 0
    assert words in capsys.readouterr().out
    # a shared file for another device: one line, exit 2
    assert main(["estimate", model, "--gpus", "2xH100-80GB", "--seq", "64", "--calibration",
                 str(plan_dir.parent / "calibration.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "was measured for 2xcpu, not 2xH100-SXM-80GB" in err and "\n" not in err


def _calibration(gpu_name: str, count: int, ratio: float):
    from toolkit.inputs import calibration as cal
    from toolkit.inputs.hardware import find_gpu

    return cal.combine(find_gpu(gpu_name), count, [ratio], None)


def test_a_stored_calibration_moves_only_its_own_key_and_no_calibration_restores_it(tiny_llama_dir, tmp_path,
                                                                                     monkeypatch, capsys):
    """A calibration stored for 2 x H100 here (compute x 1.5) moves that estimate's compute term by exactly 1.5 and
    says so; 4 x H100 (another count) and --no-calibration give the uncalibrated figures exactly (with nothing
    stored for 4 x H100, --no-calibration is a no-op that says so in a note)."""
    from toolkit.inputs import calibration as cal

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    argv = [str(tiny_llama_dir), "--seq", "64", "--json"]
    from toolkit.cli import main

    def estimate(*extra):
        assert main(["estimate", *argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plain2, plain4 = estimate("--gpus", "2xH100-80GB"), estimate("--gpus", "4xH100-80GB")
    cal.store(_calibration("H100-SXM-80GB", 2, 1.5))
    moved = estimate("--gpus", "2xH100-80GB")
    assert moved["timing"]["compute_s"] == pytest.approx(plain2["timing"]["compute_s"] * 1.5)
    assert moved["calibration"]["runs"] == 1 and "calibrated on this machine" in moved["calibration"]["words"]
    assert estimate("--gpus", "2xH100-80GB", "--no-calibration") == plain2
    assert estimate("--gpus", "4xH100-80GB") == plain4
    assert main(["estimate", *argv, "--gpus", "4xH100-80GB", "--no-calibration"]) == 0  # nothing stored: a no-op
    out, err = capsys.readouterr()
    assert json.loads(out) == plain4 and "note: --no-calibration: no calibration is stored for 4x" in err


def test_a_corrupted_stored_calibration_is_ignored_with_a_warning(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from toolkit.cli import main
    from toolkit.inputs import calibration as cal

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["estimate", str(tiny_llama_dir), "--seq", "64", "--gpus", "2xH100-80GB", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    path = cal.store(_calibration("H100-SXM-80GB", 2, 1.5))
    for corrupt in ("{not json", json.dumps({**json.loads(path.read_text()), "compute_ratio": -1})):
        path.write_text(corrupt)
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert json.loads(out) == plain
        assert err.count("warning: ignoring the stored calibration") == 1 and "is corrupted" in err


@pytest.mark.parametrize("content, words", [
    ("{not json", "is corrupted (not JSON)"),
    ('{"device": "cpu"}', "is no calibration"),
    (None, "was measured for 2xH100-SXM-80GB, not 2xA100-80GB"),
])
def test_a_bad_calibration_file_is_one_line(tiny_llama_dir, tmp_path, content, words, capsys):
    from toolkit.cli import main
    from toolkit.inputs import calibration as cal

    path = tmp_path / "calibration.json"
    if content is None:
        cal.export(_calibration("H100-SXM-80GB", 2, 1.5), path)
    else:
        path.write_text(content)
    assert main(["plan", str(tiny_llama_dir), "--seq", "64", "--gpus", "2xA100-80GB", "--calibration",
                 str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def _row(name: str, step_s: float, *, inside: bool = True, **measured):
    from toolkit.run.tune import TuneRow

    return TuneRow(name=name, strategy=name, predicted_rank=1, micro_batch=1, grad_accum=1, predicted_step_s=step_s,
                   predicted_tokens_per_s=None, predicted_peak_bytes=None, peak_band=None, within_band=inside,
                   **measured)


def test_a_candidate_whose_predicted_probe_ends_past_the_budget_is_skipped_before_it_starts():
    """On a GPU: 3 measured + 2 warm-up steps of 10 s predicted = 50 s, no start-up measured yet; fits 60 s left,
    not 40 s. After a measured candidate (start-up 20 s, measured 2x its prediction) the next one's 5 x 10 s x 2 +
    20 s = 120 s ends past 100 s left; the reason states the sum, and an out-of-band one says the band ranks it
    lower."""
    from toolkit.run.tune import MEASURED, budget_skip, probe_seconds

    first = _row("ddp", 10.0)
    assert probe_seconds(first, 3, [], cpu=False)[0] == pytest.approx(50.0)
    assert budget_skip(first, 3, [], cpu=False, elapsed_s=0, budget_min=1.0) is None
    assert first.predicted_probe_s == 50.0
    assert "predicted 50 s" in budget_skip(first, 3, [], cpu=False, elapsed_s=20, budget_min=1.0)
    done = _row("zero1", 5.0, status=MEASURED, measured_step_s=10.0, startup_s=20.0)
    second = _row("zero2", 10.0)
    assert probe_seconds(second, 3, [done], cpu=False)[0] == pytest.approx(120.0)
    assert budget_skip(second, 3, [done], cpu=False, elapsed_s=0, budget_min=2.0) is None
    why = budget_skip(second, 3, [done], cpu=False, elapsed_s=20, budget_min=2.0)
    assert why.startswith("would end past the budget: predicted 120 s (start-up 20 s + 5 steps x 20 s") and \
        "100 s of 2 min left" in why and "band" not in why
    outside = _row("pipeline", 10.0, inside=False)
    assert "outside the fastest prediction's band" in budget_skip(outside, 3, [done], cpu=False, elapsed_s=20,
                                                                    budget_min=2.0)
    assert "outside the fastest prediction's band" in budget_skip(outside, 3, [], cpu=False, elapsed_s=120,
                                                                    budget_min=2.0)


def test_on_cpu_the_gpu_prediction_times_a_probe_only_after_a_measured_candidate():
    """On CPU the predicted step is a GPU's: no probe time before a candidate was measured (it runs while budget is
    left); after one measured at 1,000x its prediction, the next is predicted at that ratio."""
    from toolkit.run.tune import MEASURED, budget_skip, probe_seconds

    first = _row("ddp", 0.001)
    assert probe_seconds(first, 3, [], cpu=True)[0] is None
    assert budget_skip(first, 3, [], cpu=True, elapsed_s=59, budget_min=1.0) is None and first.predicted_probe_s is None
    done = _row("ddp", 0.001, status=MEASURED, measured_step_s=1.0, startup_s=30.0)
    second = _row("zero1", 0.002)
    assert probe_seconds(second, 3, [done], cpu=True)[0] == pytest.approx(30 + 5 * 2.0)
    assert budget_skip(second, 3, [done], cpu=True, elapsed_s=20, budget_min=1.0) is None
    assert budget_skip(second, 3, [done], cpu=True, elapsed_s=21, budget_min=1.0).startswith("would end past")


def test_tune_model_plans_first_into_a_kept_folder_then_probes_it(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """`tune MODEL --gpus ...` plans as `toolkit plan MODEL --out` does (same flags, same folder) into a new folder
    under the temporary directory, then probes it: here a budget planning alone spends, so every candidate is
    skipped and no process starts; tune.json and the Tuned section land in that folder."""
    import tempfile

    from toolkit import api
    from toolkit.cli import main
    from toolkit.run.tune import measure_order

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    words = ["--gpus", "2xA100-80GB", "--seq", "64", "--global-batch", "8"]
    assert main(["tune", str(tiny_llama_dir), *words, "--cpu", "--processes", "2", "--budget-min", "0.0001"]) == 0
    out = capsys.readouterr().out
    [folder] = [p for p in tmp_path.iterdir() if p.name.startswith("toolkit-tune-")]
    assert f"planned into {folder}" in out and "chosen: " in out
    assert main(["plan", str(tiny_llama_dir), *words, "--out", str(tmp_path / "reference")]) == 0
    assert api.load_plan(folder).to_dict() == api.load_plan(tmp_path / "reference").to_dict()
    result = json.loads((folder / "tune.json").read_text())
    expected = measure_order(api.plan(str(tiny_llama_dir), "2xA100-80GB", seq_len=64, global_batch=8).candidates)
    assert [r["name"] for r in result["candidates"]] == [c.name for c, _ in expected[:3]]
    assert [r["status"] for r in result["candidates"]] == ["skipped"] * 3 and result["plan"] == str(folder)
    assert all(r["reason"].startswith("budget spent") for r in result["candidates"])
    # the planning is spent of the budget, counted in spent_min and said so
    assert result["planning_s"] > 0 and result["spent_min"] * 60 >= result["planning_s"] - 0.6
    assert f"(planning spent {result['planning_s']:.1f} s of it)" in out
    assert f"planning included: {result['planning_s']:g} s" in (folder / "PLAN.md").read_text()


def test_tune_model_refuses_bad_input_as_plan_does_before_any_folder(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    import tempfile

    from toolkit.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for argv, words in ((["--seq", "64", "--strategies", "zero9"], "zero9"), (["--seq", "64", "--gpus", "2xB999"],
                                                                            "B999"),
                        (["--seq", "max"], "--seq N"), (["--seq", "64", "--gpus", "2x2xA100-80GB"], "one node"),
                        (["--seq", "64", "--images-per-sample", "max", "--image-size", "448x448"], "max searches")):
        capsys.readouterr()
        assert main(["tune", str(tiny_llama_dir), "--global-batch", "8", *argv, "--cpu"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, (argv, err)
    assert list(tmp_path.iterdir()) == []


def test_a_plan_folder_refuses_the_planning_flags_in_one_line(plan_dir, tmp_path, capsys):
    from toolkit.cli import main

    folder = tmp_path / "plan"
    shutil.copytree(plan_dir, folder, ignore=shutil.ignore_patterns("tune.json"))
    assert main(["tune", str(folder), "--cpu", "--seq", "128", "--gpus", "4xH100-80GB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --gpus --seq:") and "is a plan folder" in err and "\n" not in err
    assert not (folder / "tune.json").exists()


def test_cpu_mfu_divides_by_the_measured_peak_only_where_it_holds_per_rank():
    """The CPU cost model's peak (measured torch.mm rate x processes) where it was measured at the ranks' thread
    count with a core per thread; null, saying why, when the threads differ or the ranks share cores."""
    from toolkit.inputs.cpudevice import cpu_rates
    from toolkit.inputs.hardware import cpu_gpu
    from toolkit.run.tune import cpu_mfu_peak

    threads = cpu_rates().threads
    peak, basis = cpu_mfu_peak("fp32", 2, rank_threads=threads, cores=2 * threads)
    assert peak == pytest.approx(cpu_gpu().fp32_tflops * 1e12 * 2) and peak == pytest.approx(
        cpu_rates().fp32_tflops * 2e12)
    assert "measured fp32 torch.mm rate" in basis and "x 2 processes" in basis
    assert cpu_mfu_peak("bf16", 2, rank_threads=threads, cores=2 * threads)[0] == \
        pytest.approx(cpu_rates().bf16_tflops * 2e12)
    none, why = cpu_mfu_peak("fp32", 2, rank_threads=threads + 1, cores=64)
    assert none is None and f"ranks run at {threads + 1}" in why
    none, why = cpu_mfu_peak("fp32", 4, rank_threads=threads, cores=2 * threads)
    assert none is None and f"share {2 * threads} core(s)" in why

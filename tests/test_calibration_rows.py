"""A calibration keeps the runs behind its ratio (toolkit.inputs.calibration `measurements`), so a folder of shared
calibrations reads as published rows: benchmarks/calibrations.py scores each run against a calibration it had no
part in."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import calibrations  # noqa: E402  (benchmarks/ is not a package)


def _run(candidate: str, predicted: float, compute: float, measured: float) -> dict:
    from toolkit.inputs.calibration import compute_ratio

    ratio = compute_ratio(measured, {"step_time_s": predicted, "compute_s": compute})
    return {"model": "tiny", "candidate": candidate, "predicted_step_s": predicted, "predicted_compute_s": compute,
            "measured_step_s": measured, "compute_ratio": ratio}


def _probe(previous, *runs):
    from toolkit.inputs import calibration as cal
    from toolkit.inputs.hardware import find_gpu

    return cal.combine(find_gpu("H100-SXM-80GB"), 2, [r["compute_ratio"] for r in runs], previous, "2026-12-03",
                       measurements=list(runs))


def test_a_calibration_keeps_each_run_numbered_by_probe_and_reads_back(tmp_path):
    from toolkit.inputs import calibration as cal

    first = _probe(None, _run("zero1", 1.0, 0.5, 1.5), _run("zero2", 1.0, 0.5, 1.0))
    both = _probe(first, _run("zero1", 1.0, 0.5, 2.0))
    assert [m["compute_ratio"] for m in both.measurements] == [2.0, 1.0, 3.0]
    assert [m["probe"] for m in both.measurements] == [1, 1, 2] and both.runs == 3
    assert both.compute_ratio == pytest.approx(6 ** (1 / 3))
    cal.export(both, tmp_path / "c.json")
    assert cal.read_file(tmp_path / "c.json") == both
    older = {k: v for k, v in both.to_dict().items() if k != "measurements"}  # written before the field: reads
    (tmp_path / "old.json").write_text(json.dumps(older))
    assert cal.read_file(tmp_path / "old.json").measurements == ()
    bad = both.to_dict()
    bad["measurements"][0]["measured_step_s"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(Exception, match="is corrupted \\(a measurement lacks"):
        cal.read_file(tmp_path / "bad.json")


def test_each_run_is_scored_against_the_other_probes_of_its_key(tmp_path):
    """Two files of 2 x H100: probe A's run measured its compute 2x the prediction, probe B's 8x (compute 0.5 of a
    1.0 s step). Held out, A's run is predicted with B's ratio 8 (0.5 + 0.5 x 8 = 4.5 s against 1.5 s measured:
    +200%), B's with A's 2 (1.5 s against 4.5 s: -66.7%); before, -33.3% and -77.8%. A third file of another
    key has no other probe: it is listed, not scored."""
    from toolkit.inputs import calibration as cal
    from toolkit.inputs.hardware import find_gpu

    cal.export(_probe(None, _run("zero1", 1.0, 0.5, 1.5)), tmp_path / "a.json")
    cal.export(_probe(None, _run("zero1", 1.0, 0.5, 4.5)), tmp_path / "b.json")
    other = cal.combine(find_gpu("A100-80GB"), 2, [2.0], None, "2026-12-03",
                        measurements=[_run("ddp", 1.0, 0.5, 1.5)])
    cal.export(other, tmp_path / "c.json")
    rows = calibrations.held_out_rows(calibrations.load(tmp_path))
    a, b, c = rows
    assert a["held_out_ratio"] == pytest.approx(8.0) and a["calibrated_step_s"] == pytest.approx(4.5)
    assert a["error_before"] == pytest.approx(-1 / 3) and a["error_after"] == pytest.approx(2.0)
    assert b["held_out_ratio"] == pytest.approx(2.0) and b["error_after"] == pytest.approx(1.5 / 4.5 - 1)
    assert c["held_out_ratio"] is None and c["error_after"] is None
    summ = calibrations.summary(rows)
    assert summ["scored"] == 2 and summ["median_abs_error_after"] == pytest.approx((2.0 + 2 / 3) / 2)
    text = calibrations.page(calibrations.load(tmp_path), rows, summ, "today")
    assert "No GPU calibration" not in text and "| a.json | 2xH100-SXM-80GB" in text and "+200.0%" in text


def _sized(candidate: str, compute: float, ratio: float, fixed: float, rest: float = 0.1) -> dict:
    """A run whose measured step is exactly ratio x compute + fixed + the predicted rest."""
    return _run(candidate, rest + compute, compute, rest + ratio * compute + fixed)


def test_runs_of_two_compute_sizes_fit_a_ratio_and_a_fixed_cost_one_size_keeps_the_ratio():
    """Measured = 3 x compute + 0.2 s + rest: one probe (compute 0.5 and 0.52, one size) keeps the geometric mean of
    its ratios and no fixed cost; a second probe at compute 2.0 spans two sizes, and the fit over the three runs
    finds 3 and 0.2 s exactly; a fit that would need a cost below zero keeps the ratio alone."""
    from toolkit.inputs import calibration as cal

    small = [_sized("zero1", 0.5, 3.0, 0.2), _sized("zero2", 0.52, 3.0, 0.2)]
    one = _probe(None, *small)
    assert one.step_overhead_s == 0.0
    assert one.compute_ratio == pytest.approx((small[0]["compute_ratio"] * small[1]["compute_ratio"]) ** 0.5)
    assert one.compute_ratio == pytest.approx(3.0 + 0.2 / 0.51, rel=0.01)  # the fixed cost folded into the ratio
    two = _probe(one, _sized("zero1", 2.0, 3.0, 0.2))
    assert (two.compute_ratio, two.step_overhead_s, two.runs) == (pytest.approx(3.0), pytest.approx(0.2), 3)
    assert "compute time x 3 + 200 ms a step" in cal.Applied(two).words()
    assert cal.fit_terms([_sized("a", 0.5, 2.0, 0.0), _sized("b", 2.0, 3.0, 0.0)]) is None  # cost < 0: ratio alone
    assert cal.fit_terms(small) is None


def test_the_held_out_fit_predicts_a_third_size_the_ratio_alone_does_not(tmp_path):
    """Three probes of one machine at compute 0.01, 0.04 and 0.16 s, each measured as 3 x compute + 0.2 s + 0.1 s:
    each held out, the other two span two sizes and their fit predicts it exactly; the ratio alone of the other two
    is off (the small probe's ratio, 23, carries the fixed cost into the large one)."""
    from toolkit.inputs import calibration as cal

    for name, compute in (("s", 0.01), ("m", 0.04), ("l", 0.16)):
        cal.export(_probe(None, _sized("ddp", compute, 3.0, 0.2)), tmp_path / f"{name}.json")
    rows = calibrations.held_out_rows(calibrations.load(tmp_path))
    for row in rows:
        assert row["held_out_ratio"] == pytest.approx(3.0) and row["held_out_overhead_s"] == pytest.approx(0.2)
        assert row["error_after"] == pytest.approx(0.0, abs=1e-9)
    large = next(r for r in rows if r["file"] == "l.json")
    ratios = (3.0 + 0.2 / 0.01, 3.0 + 0.2 / 0.04)
    assert large["ratio_only"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)
    assert large["error_ratio_only"] == pytest.approx((0.1 + 0.16 * large["ratio_only"]) / 0.78 - 1)
    summ = calibrations.summary(rows)
    assert summ["fixed_cost_fitted"] == 3 and summ["median_abs_error_after"] < summ["median_abs_error_ratio_only"]
    text = calibrations.page(calibrations.load(tmp_path), rows, summ, "today")
    assert "the fixed per-step cost reduced it against the ratio alone" in text
    assert "do not grow with the model" not in text  # 0.33 < 0.42 < 0.78 s measured: in the models' order
    steps = {"s.json": 0.78, "m.json": 0.42, "l.json": 0.33}  # the smallest model measured slowest
    swapped = [{**r, "model": r["file"][0], "measured_step_s": steps[r["file"]]} for r in rows]
    assert "smallest predicted first: s 0.780 s, m 0.420 s, l 0.330 s" in " ".join(calibrations._size_order(swapped))


def test_a_fitted_fixed_cost_moves_a_later_estimate_by_exactly_itself(tiny_llama_dir, tmp_path, monkeypatch,
                                                                       capsys):
    """A calibration stored for 2 x H100 with compute x 1.5 + 20 ms a step: the estimate's compute term moves by
    1.5, its step by that plus 0.02 s (the `calibrated fixed cost` term, in --json's timing as fixed_s), and the
    table says both; --no-calibration restores the figures exactly. On a job the device bounds (Llama-3.1-8B at
    4,096 tokens under ZeRO-3): a tiny model's step is the host's dispatch (timing.py's floor), which a calibration
    of the device's terms does not move."""
    from dataclasses import replace

    from toolkit.cli import main
    from toolkit.inputs import calibration as cal
    from toolkit.inputs.hardware import find_gpu

    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["estimate", "llama-3.1-8b", "--seq", "4096", "--gpus", "2xH100-80GB", "--strategy", "zero3"]

    def estimate(*extra):
        assert main([*argv, "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plain = estimate()
    assert plain["timing"].get("host_s", 0) < plain["timing"]["step_time_s"] / 4  # the device's step, not the host's
    cal.store(replace(cal.combine(find_gpu("H100-SXM-80GB"), 2, [1.5], None), step_overhead_s=0.02))
    moved = estimate()
    t, p = moved["timing"], plain["timing"]
    assert t["compute_s"] == pytest.approx(p["compute_s"] * 1.5) and t["fixed_s"] == pytest.approx(0.02)
    assert t["step_time_s"] == pytest.approx(p["step_time_s"] + p["compute_s"] * 0.5 + 0.02)
    assert "compute time x 1.5 + 20 ms a step" in moved["calibration"]["words"]
    assert estimate("--no-calibration") == plain
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "calibrated fixed cost 0.020 s" in out and "compute time x 1.5 + 20 ms a step" in out

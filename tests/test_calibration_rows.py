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

"""Error bands from the published rows nearest the job (toolkit.estimate.errorband): a GPU generation the corpus has
no published run on gets an unknown step-time band and a widened peak band, each with its reason, never another
generation's band; the planner calls no speed difference inside an unknown band a win."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from toolkit.cli import main
from toolkit.estimate.errorband import BAND_FILE, PEAK_WIDEN, TIME_BAND_FILE, band_for, time_band
from toolkit.inputs.hardware import find_gpu, parse_hardware

V100, T4, H100 = find_gpu("V100-32GB"), find_gpu("T4"), find_gpu("H100-80GB")


def estimate(capsys, gpus: str, strategy: str, *extra: str) -> tuple[dict, str]:
    argv = ["estimate", "gpt2", "--gpus", gpus, "--strategy", strategy, "--seq", "1024", "--micro-batch", "1",
            "--precision", "fp16", *extra]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    return out, capsys.readouterr().out


def test_the_generations_come_from_the_gpu_catalog_and_the_corpus_has_none_on_volta_or_turing():
    gens = json.loads(TIME_BAND_FILE.read_text())["generations"]
    assert (V100.architecture, T4.architecture, H100.architecture) == ("volta", "turing", "hopper")
    assert "hopper" in gens and "volta" not in gens and "turing" not in gens
    assert {c["architecture"] for c in json.loads(BAND_FILE.read_text())["cases"]} <= set(gens) | {"cdna3",
                                                                                                   "blackwell"}


@pytest.mark.parametrize("gpus, words", [("8xV100-32GB", "V100-32GB (Volta)"), ("4xT4", "T4 (Turing)")])
def test_an_off_map_job_prints_an_unknown_time_band_and_a_widened_peak_band_with_the_reason(capsys, gpus, words):
    out, text = estimate(capsys, gpus, "zero3")
    band = out["time_error_band"]
    assert band["known"] is False and band["fraction"] is None and band["evidenced_here"] is False
    assert band["reason"].startswith(f"no published run on {words}")
    assert f"time band: step time band unknown: no published run on {words}" in text
    assert "+-11%" not in text and "held-out published GPU runs" not in text  # no other job's band
    cases = json.loads(BAND_FILE.read_text())["cases"]
    peak = out["error_band"]
    assert peak["fraction"] == pytest.approx(PEAK_WIDEN * max(abs(c["error"]) for c in cases))
    assert peak["widened"].startswith(f"no published memory case on {words}")
    assert f"error band: peak +-{peak['fraction']:.0%}, widened: no published memory case on {words}" in text
    assert out["timing"].get("step_time_s") and out.get("time_to_train") is None


def test_an_h100_job_keeps_the_band_of_the_published_hopper_runs(capsys):
    out, text = estimate(capsys, "8xH100-80GB", "fsdp2")
    hopper = json.loads(TIME_BAND_FILE.read_text())["generations"]["hopper"]
    band = out["time_error_band"]
    assert band["known"] is True and band["fraction"] == hopper["band"] > 0
    assert band["held_out_rows"] == hopper["held_out_rows"] >= 5 and band["evidenced_here"] is True
    assert f"time band: step time +-{hopper['band']:.0%}, from {hopper['held_out_rows']} held-out published GPU " \
           "runs on Hopper (H100-SXM-80GB" in text
    hopper_cases = [c for c in json.loads(BAND_FILE.read_text())["cases"]
                    if c["architecture"] == "hopper" and c["engine"] == "fsdp2" and not c["checkpointing"]]
    assert out["error_band"]["fraction"] == max(abs(c["error"]) for c in hopper_cases)
    assert "widened" not in out["error_band"]


def test_a_generation_with_few_held_out_runs_is_widened_by_the_stated_rule():
    data = {"band": 0.11, "held_out": {"rows": 70}, "evidenced": [],
            "generations": {"volta": {"gpus": ["V100-32GB"], "modelled_rows": 3, "held_out_rows": 1, "band": 0.05,
                                      "worst_abs_error": 0.6, "evidenced": []}}}
    band = time_band(V100, data)
    assert band.known and band.fraction == 0.6  # the larger of the corpus's 11% and the generation's worst 60%
    assert "widened: only 3 published runs on Volta" in band.text()
    assert not time_band(T4, data).known and math.isinf(time_band(T4, data).fraction)
    assert band_for("ddp", False, (), gpu=V100).cases == 0  # no case at all: unknown, not invented


def _two_apart(gpu_spec: str, speedup: float):
    """Two feasible candidates of the same small plan, the tighter one made `speedup` x faster than the roomier."""
    from toolkit.estimate.candidate import headroom_bands
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import plan_candidates
    from toolkit.inputs.modelspec import resolve_model

    cands = [c for c in plan_candidates(resolve_model("gpt2"), parse_hardware(gpu_spec),
                                        Request(seq_len=1024, global_batch=8, precision="fp16",
                                                strategies=("zero2", "zero3-offload"), sequence_parallel=1))
             if c.feasible]
    assert len(cands) == 2, [c.name for c in cands]
    a, b = cands
    simple, complex_ = (a, b) if a.strategy.name == "zero2" else (b, a)
    fast = replace(complex_, timing=replace(complex_.timing, tokens_per_s=simple.timing.tokens_per_s * speedup,
                                            step_time_s=simple.timing.step_time_s / speedup))
    return simple, fast, headroom_bands


def test_a_plan_on_an_off_map_gpu_calls_candidates_a_few_percent_apart_a_tie():
    from toolkit.estimate.ranking import rank, speed_ties, why_first

    simple, fast, _ = _two_apart("2xV100-32GB", 1.04)
    assert rank([fast, simple]) == [simple, fast]  # 4% faster decides nothing: robustness (no offload) does
    assert {id(c) for c in speed_ties([fast, simple])} == {id(simple), id(fast)}
    why = why_first(rank([fast, simple]))
    assert why.startswith("#1: the step-time band is unknown: no published run on V100-32GB (Volta)")
    assert "no predicted speed difference is a win over #2, so robustness decides" in why
    assert "#2 is predicted 4.0% faster, not a win with the band unknown" in why
    simple, fast, _ = _two_apart("2xV100-32GB", 1.5)
    assert rank([fast, simple])[0] is simple  # unknown: even 50% is not a win


def test_the_same_pair_on_h100_is_decided_by_speed_beyond_the_hopper_band():
    from toolkit.estimate.ranking import rank, why_first

    band = time_band(H100).fraction
    simple, fast, _ = _two_apart("2xH100-80GB", 1 + 2 * band)
    assert rank([simple, fast])[0] is fast
    assert f"more than the step-time band (+-{band:.0%})" in why_first(rank([simple, fast]))
    simple, fast, _ = _two_apart("2xH100-80GB", 1 + band / 2)
    assert rank([fast, simple])[0] is simple


def test_plan_json_and_plan_md_say_the_band_is_unknown_off_the_map(tmp_path, capsys):
    argv = ["plan", "gpt2", "--gpus", "2xV100-32GB", "--seq", "1024", "--global-batch", "8", "--precision", "fp16",
            "--strategies", "zero2,zero3-offload", "--out", str(tmp_path / "p")]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["time_error_band"]["known"] is False
    assert sorted(out["speed_ties"]) == sorted(c["name"] for c in out["candidates"] if c["feasible"])
    assert "no predicted speed difference is a win" in out["chosen_because"]
    assert out["chosen"]["strategy"] == "zero2"  # the simpler one, whatever the predicted speeds
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["predicted"]["step_time_band"] is None
    notes = "\n".join(plan["notes"])
    assert "step-time band: step time band unknown: no published run on V100-32GB (Volta)" in notes
    assert "peak error band: peak +-" in notes and "widened: no published memory case on V100-32GB" in notes
    md = (tmp_path / "p" / "PLAN.md").read_text()
    assert "step time band unknown: no published run on V100-32GB (Volta)" in md


def test_a_one_gpu_hopper_job_takes_the_band_of_the_gpu_days_measured_steps_of_its_engine():
    """Issue 28 Deliver 4: the evidence nearest a one-GPU Hopper DDP job is the GPU day's 11 clean DDP steps on an
    H200 (toolkit/estimate/measured_time_band.json, gpu_derive.py): p90 34.7%, wider than the published corpus's
    Hopper band (9.3%), so the band widens to it and says why; other GPU counts and generations keep theirs."""
    from toolkit.estimate.errorband import time_band
    from toolkit.inputs.hardware import parse_hardware

    h100, a100 = parse_hardware("1xH100-80GB").gpu, parse_hardware("1xA100-80GB").gpu
    ddp = time_band(h100, strategy="ddp", gpus=1)
    assert ddp.fraction == pytest.approx(0.3465, abs=0.001)
    assert time_band(h100).fraction == pytest.approx(0.093, abs=0.001)
    assert "widened: 11 steps of ddp measured on 1 H200-141GB (2026-12-04" in ddp.text()
    assert ddp.covers("ddp", 1)
    zero3 = time_band(h100, strategy="zero3", gpus=1)
    assert zero3.fraction == pytest.approx(3.318, abs=0.001) and not zero3.covers("zero3", 1)
    assert time_band(h100, strategy="ddp", gpus=8) == time_band(h100)
    assert time_band(a100, strategy="ddp", gpus=1) == time_band(a100)

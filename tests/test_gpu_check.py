"""benchmarks/gpu_check.py rehearsed on CPU with tiny shapes (every engine path it will run on the GPU), and the
derive step's arithmetic on recorded numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINES = "ddp llama-1b bf16,zero2 llama-1b bf16 ckpt,zero3 llama-1b bf16,fsdp2 llama-3b bf16 ckpt," \
          "lora llama-8b bf16-pure,ddp llama-1b bf16 liger"
TIMING = "pipe ddp llama-1b s2048 mb1 M1,pipe pipeline1 llama-1b s2048 mb1 M1"
REHEARSAL = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
import gpu_check
out, codes = sys.argv[2], {}
for name, argv in (("memory_edge", ["--memory-edge"]),  # first: its parent starts the child from a clean environment
                   ("engines", ["--only", sys.argv[3]]), ("timing", ["--timing", "--only", sys.argv[4]])):
    try:
        codes[name] = gpu_check.main(["--device", "cpu", "--quick", "--out", out, *argv])
    except Exception:
        codes[name] = traceback.format_exc()
import argparse  # the GPU's path: one case in a process of its own (case_in_child), here on CPU
case = next(c for c in gpu_check.cases() if c.label == "ddp llama-1b bf16")
codes["child"] = gpu_check.case_in_child(case, argparse.Namespace(device="cpu", gpu="H200", quick=True, timing=False))
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """One interpreter runs the three CPU rehearsals (--memory-edge, the engine set, the timing set) for the tests
    below, each with its own exit code: gpu_check builds a world of one over gloo in its own process, so it runs apart
    from pytest, but once. One process at a time on one thread (the memory-edge child while its parent waits), so the
    tests are one_core and share a worker (xdist_group) for this one run; its world of one rendezvous on a free port
    (gpu_check's own default, 29533, may be taken by a run beside it)."""
    from toolkit.run.launcher import free_port

    out = tmp_path_factory.mktemp("gpu-check")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", REHEARSAL, str(ROOT / "benchmarks"), str(out), ENGINES, TIMING],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), out


@pytest.mark.multiprocess
@pytest.mark.one_core
@pytest.mark.xdist_group("gpu-check")
def test_gpu_check_rehearses_every_engine_on_cpu(rehearsal):
    codes, out = rehearsal
    assert codes["engines"] == 0, codes["engines"]
    rows = {r["label"]: r for r in json.loads((out / "gpu_check.json").read_text())["rows"]}
    assert set(rows) == set(ENGINES.split(","))
    for label in ("ddp llama-1b bf16", "zero2 llama-1b bf16 ckpt", "zero3 llama-1b bf16", "fsdp2 llama-3b bf16 ckpt",
                  "lora llama-8b bf16-pure"):
        r = rows[label]
        assert "error" not in r and "predict_error" not in r, r
        assert r["step_measured_s"] > 0 and r["allocated_predicted"] > 0
        assert r["reserved_predicted"] > r["allocated_predicted"]
    assert "Triton" in rows["ddp llama-1b bf16 liger"]["skipped"]
    child = codes["child"]  # the same case in a process of its own gives the same prediction, and a measured step
    assert child["own_process"] and "error" not in child, child
    assert child["allocated_predicted"] == rows["ddp llama-1b bf16"]["allocated_predicted"]
    assert child["step_measured_s"] > 0


def test_derive_reads_allocator_ratio_and_errors():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_derive import derive

    gib = 2**30
    results = {"meta": {"device": "NVIDIA H200", "context_bytes": int(0.6 * gib)}, "rows": [
        {"label": "a", "isolated": True, "strategy": "fsdp2", "checkpointing": False, "allocated_measured": 40 * gib,
         "reserved_measured": 44 * gib, "allocated_predicted": 42 * gib, "reserved_predicted": 44 * gib,
         "step_measured_s": 2.0, "step_predicted_s": 1.0, "mfu_predicted": 0.45},
        {"label": "b", "isolated": True, "strategy": "fsdp2", "checkpointing": True, "allocated_measured": 20 * gib,
         "reserved_measured": 24 * gib, "allocated_predicted": 19 * gib, "reserved_predicted": 20 * gib,
         "step_measured_s": 1.0, "step_predicted_s": 1.0, "mfu_predicted": 0.45},
        {"label": "c", "skipped": "peft is not installed"}]}
    d = derive(results)
    e = d["engines"]["fsdp2"]
    assert e["cases"] == 2
    assert abs(e["reserved_over_allocated_median"] - (1.1 + 1.2) / 2) < 1e-9
    assert abs(e["peak_error_worst"] - 0.05) < 1e-9
    assert abs(e["mfu_measured_median"] - (0.225 + 0.45) / 2) < 1e-9
    assert d["context_bytes"] == int(0.6 * gib)


@pytest.mark.multiprocess
@pytest.mark.one_core
@pytest.mark.xdist_group("gpu-check")
def test_timing_set_rehearses_the_pipeline_engine_beside_ddp_on_cpu(rehearsal):
    codes, out = rehearsal
    assert codes["timing"] == 0, codes["timing"]
    rows = {r["label"]: r for r in json.loads((out / "gpu_timing.json").read_text())["rows"]}
    assert set(rows) == set(TIMING.split(","))
    for r in rows.values():
        assert "error" not in r, r
        assert r["step_measured_s"] > 0 and r["step_predicted_s"] > 0 and r["accum"] == 1


def test_derive_timing_reads_efficiency_engine_and_pipeline_overheads():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_derive import derive_timing

    def row(label, strategy, step, accum=1, predicted=1.0, mb=2, seq=2048):
        return {"label": label, "strategy": strategy, "step_measured_s": step, "step_predicted_s": predicted,
                "accum": accum, "micro_batch": mb, "seq_len": seq, "hidden": 2048, "isolated": True}

    d = derive_timing({"meta": {"device": "NVIDIA H200"}, "rows": [
        row("eff ddp llama-1b s2048 mb2", "ddp", 2.0),
        row("engine ddp llama-1b s2048 mb2", "ddp", 1.0), row("engine zero3 llama-1b s2048 mb2", "zero3", 1.25),
        row("pipe ddp llama-1b s2048 mb1 M8", "ddp", 4.0, accum=8),
        row("pipe pipeline1 llama-1b s2048 mb1 M8", "pipeline1", 4.8, accum=8),
        {"label": "x", "error": "OOM"}]})
    assert d["efficiency"][0]["step_ratio"] == 0.5 and d["efficiency"][0]["tokens_per_micro_step"] == 4096
    assert abs(d["engine_overhead"]["zero3"] - 0.25) < 1e-9
    assert abs(d["pipeline"]["8"]["per_micro_batch_s"] - 0.1) < 1e-9
    assert abs(d["pipeline"]["8"]["per_micro_batch_fraction"] - 0.2) < 1e-9


def test_derive_timing_prefers_isolated_rows_where_the_shared_process_is_contaminated():
    """Synthetic rows (not a measurement): after the first non-DDP case of a shared process the rows are
    contaminated; zero3's is replaced by its isolated row, the late DDP row by the clean row of the same job, and
    a late row with neither is left out and named."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_derive import derive_timing, render_timing

    def row(label, strategy, step, mb=2, accum=1, **extra):
        return {"label": label, "strategy": strategy, "step_measured_s": step, "step_predicted_s": 1.0,
                "accum": accum, "micro_batch": mb, "seq_len": 2048, "hidden": 2048, **extra}

    shared = {"meta": {"device": "NVIDIA H200"}, "rows": [
        row("eff ddp llama-1b s2048 mb1", "ddp", 1.0, mb=1), row("engine ddp llama-1b s2048 mb2", "ddp", 2.0),
        row("engine zero2 llama-1b s2048 mb2", "zero2", 3.0), row("engine zero3 llama-1b s2048 mb2", "zero3", 9.0),
        row("pipe ddp llama-1b s2048 mb1 M1", "ddp", 1.5, mb=1), row("pipe ddp llama-1b s2048 mb1 M8", "ddp", 9.0,
                                                                    mb=1, accum=8),
        row("pipe pipeline1 llama-1b s2048 mb1 M1", "pipeline1", 1.8, mb=1)]}
    isolated = {"rows": [row("engine zero3 llama-1b s2048 mb2", "zero3", 6.0, source="gpu_timing.json",
                             isolated=True),
                         row("engine zero3 llama-1b s2048 mb2", "zero3", 99.0, source="gpu_check.json",
                             isolated=True)]}
    d = derive_timing(shared, isolated, "gpu_timing.json")
    assert abs(d["engine_overhead"]["zero2"] - 0.5) < 1e-9  # the first non-DDP case is itself clean
    assert abs(d["engine_overhead"]["zero3"] - 2.0) < 1e-9  # 6.0 alone, not 9.0 shared nor gpu_check's 99.0
    # M1: the pipeline row (late, no isolated row) is left out; the DDP partner is the clean eff row's 1.0 s.
    assert d["pipeline"] == {}
    sources = {r["label"]: r for r in d["rows"]}
    assert sources["pipe ddp llama-1b s2048 mb1 M1"]["from"] == "same job: eff ddp llama-1b s2048 mb1"
    assert not sources["pipe ddp llama-1b s2048 mb1 M8"]["clean"]
    text = render_timing(d)
    assert "`pipe ddp llama-1b s2048 mb1 M8`, `pipe pipeline1 llama-1b s2048 mb1 M1`" in text
    assert "zero3" not in derive_timing(shared)["engine_overhead"]  # contaminated and nothing to replace it


def test_derive_timing_scores_the_model_now_per_engine_as_the_published_rows_are_scored():
    """Synthetic rows (not a measurement): with a predictor, each clean row's error is measured / predicted - 1 (our
    tokens/s over the measured), stats per engine; a row standing in for a contaminated one counts once."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_derive import derive_timing

    def row(label, strategy, step, mb=2):
        return {"label": label, "strategy": strategy, "step_measured_s": step, "step_predicted_s": 1.0,
                "accum": 1, "micro_batch": mb, "seq_len": 2048, "hidden": 2048}

    shared = {"meta": {}, "rows": [row("eff ddp a", "ddp", 1.2, mb=1), row("eff ddp b", "ddp", 0.9),
                                   row("engine fsdp2", "fsdp2", 3.0), row("pipe ddp M1", "ddp", 5.0, mb=1)]}
    d = derive_timing(shared, predict=lambda r: 1.0)
    assert [e["label"] for e in d["model_now"]["rows"]] == ["eff ddp a", "eff ddp b", "engine fsdp2"]
    ddp = d["model_now"]["engines"]["ddp"]
    assert ddp["rows"] == 2 and abs(ddp["worst_abs_error"] - 0.2) < 1e-9 and abs(ddp["mean_error"] - 0.05) < 1e-9
    assert abs(d["model_now"]["engines"]["fsdp2"]["p90_abs_error"] - 2.0) < 1e-9


def test_multi_gpu_runs_list_context_parallelism_and_skip_without_gpus(tmp_path):
    """CP needs CUDA (docs/ENGINE_FACTS.md): it is on the GPU run list, with what to measure; without GPUs every
    run is recorded as skipped, saying how many GPUs it needs (in this process: with no GPU nothing is started)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import multi_gpu_check

    assert multi_gpu_check("cpu", False, str(tmp_path)) == 0
    rows = {r["label"]: r for r in json.loads((tmp_path / "multi_gpu_check.json").read_text())["rows"]}
    cp = rows["fsdp2 x cp=2 llama-1b fp32"]
    assert "ring attention" in cp["why"] and "losses" in cp["measure"]
    assert "pins host memory" in rows["fsdp2-offload llama-1b fp32"]["why"]
    assert all(r["skipped"] == f"needs {r['gpus']} GPUs, this machine has 0" for r in rows.values())


@pytest.mark.multiprocess
@pytest.mark.one_core
@pytest.mark.xdist_group("gpu-check")
def test_memory_edge_rehearses_on_cpu_with_the_estimate_beside_each_case(rehearsal):
    """--memory-edge on CPU: the parent starts the child process, the child builds each case's model, runs its steps
    and calls the estimator; the capped rows and the expandable-segments child say they need CUDA."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import EDGE_CASES, EDGE_HEADROOMS

    codes, out = rehearsal
    assert codes["memory_edge"] == 0, codes["memory_edge"]
    result = json.loads((out / "gpu_memory_edge.json").read_text())
    rows = {r["label"]: r for r in result["rows"]}
    errors = [f'{r["label"]}: {r["error"]}' for r in result["rows"] if "error" in r]
    assert not errors, errors
    assert result["meta"]["headrooms"] == list(EDGE_HEADROOMS)
    for case in EDGE_CASES:
        uncapped = rows[f"{case.label} | default | uncapped"]
        assert "error" not in uncapped, uncapped
        assert uncapped["step_median_s"] > 0 and not uncapped["oom"]
        assert uncapped["allocated_predicted"] > 0 and uncapped["step_predicted_s"] > 0
        capped = [r for r in result["rows"] if r.get("case") == case.label and r["headroom"] is not None]
        assert [r["headroom"] for r in capped] == list(EDGE_HEADROOMS)
        assert all("needs CUDA" in r["skipped"] for r in capped)
    assert rows["allocator expandable_segments:True"]["skipped"] == "allocator settings need CUDA"
    from gpu_derive import main as derive_main

    assert derive_main([str(out / "gpu_memory_edge.json")]) == 0
    assert "nothing to derive" in (out / "gpu_memory_edge_derived.md").read_text()


def test_derive_memory_edge_keeps_the_smallest_headroom_within_the_time_band():
    """Synthetic rows (labelled so, not a measurement): the default allocator slows past the band at a 4% cap and
    runs out of memory at 2%; with expandable segments every headroom stays within it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_derive import derive_memory_edge, render_memory_edge

    from toolkit.estimate.errorband import time_band

    gib = 2**30

    def row(allocator, headroom, step=None, retries=0, oom=False):
        r = {"case": "edge fsdp2", "allocator": allocator, "headroom": headroom, "allocated_predicted": 20 * gib}
        if headroom is None:
            return {**r, "step_median_s": step, "allocated_peak": 21 * gib, "reserved_peak": 23 * gib,
                    "step_times_s": [step]}
        r["cap_bytes"] = int(21 * gib * (1 + headroom))
        if oom:
            return {**r, "oom": True}
        return {**r, "oom": False, "step_median_s": step, "step_times_s": [step] * 5, "reserved_peak": r["cap_bytes"],
                "timed": {"num_alloc_retries": retries}}

    rows = [row("default", None, 1.0), row("default", 0.30, 1.0), row("default", 0.08, 1.05, retries=5),
            row("default", 0.04, 1.2, retries=40), row("default", 0.02, oom=True),
            row("expandable_segments:True", None, 1.0), row("expandable_segments:True", 0.30, 1.0),
            row("expandable_segments:True", 0.005, 1.02, retries=2)]
    d = derive_memory_edge({"meta": {"device": "synthetic test input, not a measurement"}, "rows": rows}, band=0.1)
    default, expandable = d["sweeps"]
    assert default["speed_headroom"] == 0.08 and default["retries_from_headroom"] == 0.08
    assert abs(default["speed_headroom_over_predicted"] - (21 * 1.08 / 20 - 1)) < 1e-6
    assert [p["oom"] for p in default["points"]] == [False, False, False, True]
    assert abs(default["points"][2]["slowdown"] - 0.2) < 1e-9 and default["points"][2]["retries_per_step"] == 8
    assert expandable["speed_headroom"] == 0.005 and expandable["within_band_everywhere"]
    assert d["speed_headroom"] == {"default": 0.08, "expandable_segments:True": 0.005}
    assert "out of memory" in render_memory_edge(d)
    assert derive_memory_edge({"meta": {}, "rows": rows})["band"] == time_band().fraction
    # what the planner keeps, set against the nearest measured headroom not above it
    kept = derive_memory_edge({"meta": {}, "rows": rows}, band=0.1,
                              planner_keeps=lambda case, allocator: 0.05 if allocator == "default" else 0.4)
    at_default, at_expandable = kept["sweeps"]
    assert at_default["planner_keeps"] == 0.05 and at_default["planner_point"]["headroom"] == 0.04
    assert at_expandable["planner_point"]["headroom"] == 0.30
    assert "the planner keeps 5.0%: at 4.0% the step ran +20.0% (outside the band)" in render_memory_edge(kept)


def test_what_the_planner_keeps_at_the_h200_memory_edge():
    """The GPU day's memory edge (gpu_memory_edge.json, H200): with the plan's expandable segments the planner keeps
    36.8% over FSDP2 + checkpointing's tensor peak (the step ran +0.4% at 30%; 12.1% before FSDP2's own allocations
    were replayed, toolkit.estimate.engineevents, where it ran 37.5% slower at 8%); with torch's defaults 40.2%
    (+0.7% at 30%; 25.7% before). DDP: 12.4% / 13.7%, within the band."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_derive import derive_memory_edge, kept_by_planner

    results = json.loads((ROOT / "benchmarks/results/gpu_memory_edge.json").read_text())
    d = derive_memory_edge(results, planner_keeps=kept_by_planner)
    got = {(s["case"].split()[1], s["allocator"]): (round(s["planner_keeps"], 3), s["planner_point"]["headroom"],
                                                   round(s["planner_point"]["slowdown"], 3)) for s in d["sweeps"]}
    assert got == {("fsdp2", "default"): (0.402, 0.3, 0.007), ("ddp", "default"): (0.137, 0.08, 0.01),
                   ("fsdp2", "expandable_segments:True"): (0.368, 0.3, 0.004),
                   ("ddp", "expandable_segments:True"): (0.124, 0.08, -0.002)}


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_allocator_check_predicts_every_sequence_under_every_setting_on_cpu(tmp_path):
    """gpu_check --allocator on CPU: one child per allocator setting (the allocator reads its settings at start),
    each row with the model's replay and the measurement left to CUDA."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from allocator_check import SEQUENCES, SETTINGS
    from gpu_check import main

    assert main(["--device", "cpu", "--allocator", "--out", str(tmp_path)]) == 0
    rows = {r["label"]: r for r in json.loads((tmp_path / "gpu_allocator.json").read_text())["rows"]}
    assert len(rows) == len(SEQUENCES) * len(SETTINGS)
    assert all("needs CUDA" in r["skipped"] and "predicted" in r for r in rows.values())
    MiB = 1 << 20
    sliver = "best fit leaves a 40 MiB sliver"
    assert rows[f"{sliver} | default"]["predicted"]["reserved_peak"] == 160 * MiB
    assert rows[f"{sliver} | expandable_segments:True"]["predicted"]["reserved_peak"] == 120 * MiB
    assert rows["out of memory frees the cache and retries | default"]["predicted"]["retries"] == 1


def test_the_tune_probe_runs_its_cpu_dry_path(tmp_path):
    """gpu_check --tune (benchmarks/tune_check.py) on CPU with --dry: a tiny model made, planned for 1 x H200 and
    tuned with a budget the planning spends, so every candidate is skipped and no process starts; gpu_tune.json
    records the plan, each candidate's prediction and no calibration. On the GPU the same words run the candidates
    there (no --cpu) with the GPU budget."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tune_check

    one = {"llama-h64-l2": tune_check.QUICK_MODELS["llama-h64-l2"]}
    assert tune_check.tune_check("cpu", True, str(tmp_path), "H200", dry=True, models=one) == 0
    got = json.loads((tmp_path / "gpu_tune.json").read_text())
    (row,) = got["rows"]
    assert "error" not in row and row["plan_code"] == 0 and row["tune_code"] == 1  # nothing measured to export
    assert len(row["candidates"]) == tune_check.TUNE_CANDIDATES and row["ranking"] == []
    assert all(c["status"] == "skipped" and c["predicted_step_s"] > 0 for c in row["candidates"])
    assert got["calibration"] is None and not (tmp_path / tune_check.CALIBRATION_FILE).exists()
    gpu = tune_check.tune_argv(tmp_path / "plan", cuda=True, dry=False, export=tmp_path / "c.json")
    assert "--cpu" not in gpu and gpu[gpu.index("--budget-min") + 1] == str(tune_check.TUNE_BUDGET_MIN)
    from gpu_check import main

    with pytest.raises(SystemExit, match="--dry is the CPU path"):  # gpu_check --tune is tune_check's
        main(["--device", "cuda", "--tune", "--dry", "--out", str(tmp_path)])


def test_the_gpu_days_calibration_is_made_again_from_its_tune_rows():
    """The GPU day's probe measured 6 candidates of 3 models and stored nothing (toolkit.run.tune.priced_boxes);
    tune_check.calibration_from_result folds the same rows as three probes would have been folded, under the H200's
    own name and library versions: the file in benchmarks/data/calibrations/ is that calibration, and its fixed
    per-step cost is the ~28 ms the small models' steps showed over their compute."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tune_check import calibration_from_result

    from toolkit.inputs import calibration as cal

    results = ROOT / "benchmarks" / "results"
    meta = json.loads((results / "gpu_check.json").read_text())["meta"]
    made = calibration_from_result(json.loads((results / "gpu_tune.json").read_text()),
                                   {"torch": meta["torch"], **meta["versions"]})
    assert (made.device, made.device_model, made.count, made.runs) == ("H200-141GB", "NVIDIA H200", 1, 6)
    assert made.versions == {"torch": "2.11.0+cu130", "deepspeed": "0.19.8", "transformers": "5.24.0"}
    assert sorted({m["probe"] for m in made.measurements}) == [1, 2, 3]
    assert 0.020 < made.step_overhead_s < 0.035 and 0.8 < made.compute_ratio < 1.3
    stored = cal.read_file(ROOT / "benchmarks" / "data" / "calibrations" / "gpu-h200-2026-12-04.json")
    assert stored.compute_ratio == pytest.approx(made.compute_ratio, rel=1e-12)
    assert stored.step_overhead_s == pytest.approx(made.step_overhead_s, rel=1e-12)


def test_the_lora_case_is_predicted_and_matches_the_gpu_day():
    """gpu_check's LoRA case (PEFT LoRA r=16, alpha 32, all-linear, PEFT's dropout 0, on a Llama-3-8B-shaped base
    in bf16, fp32 adapters, fused AdamW, micro-batch 1 x 2,048) is predicted like the others now; its one-process
    measurement on the H200 (gpu_isolated.json): 39,149,938,688 bytes allocated, 41,106,276,352 reserved."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    case = next(c for c in gpu_check.cases() if c.label == "lora llama-8b bf16-pure")
    got = gpu_check._predict(case, gpu_check._config(gpu_check.SHAPES[case.shape], 128256, case.seq_len), "cuda",
                             "H200")
    measured = {r["label"]: r for r in json.loads((ROOT / "benchmarks" / "results" / "gpu_isolated.json")
                                                   .read_text())["rows"]}[case.label]
    assert measured["allocated_measured"] == 39_149_938_688
    assert got["allocated_predicted"] / measured["allocated_measured"] - 1 == pytest.approx(0, abs=0.001)
    assert got["reserved_predicted"] / measured["reserved_measured"] - 1 == pytest.approx(0, abs=0.02)

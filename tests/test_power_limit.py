"""--power-limit-w: a capped GPU's step time is the one the step-time corpus scores (torchtitan's 500 W H100s), the
limit travels through plan.json to emit / check / re-prediction, and every bad value is one line, exit 2."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from toolkit.cli import main
from toolkit.inputs.hardware import find_gpu, power_limited
from toolkit.plan.schema import load_plan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import throughput  # noqa: E402  (benchmarks/ is not a package)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def test_estimate_at_500_w_is_the_step_time_the_corpus_scores_for_torchtitans_h100s(capsys):
    """TT-8B-8G-eager (Llama-3.1-8B, FSDP2, 8 x H100 96GB at 500 W): the CLI and benchmarks/throughput.py's row
    path build the same hardware and predict the same step."""
    row = next(r for r in throughput.load_rows() if r["id"] == "TT-8B-8G-eager")
    assert row["power_limit_w"] == 500 and row["gpu"] == "H100-SXM-96GB" and row["checkpointing"] == "selective-op"
    prep = throughput.prepared(row)
    per_gpu, timing = throughput.ours_tokens_per_gpu(prep)
    argv = ["estimate", row["model"], "--gpus", f"{row['gpus_per_node']}x{row['gpu']}", "--strategy", row["strategy"],
            "--seq", str(row["seq_len"]), "--micro-batch", str(row["micro_batch"]), "--checkpointing", "op",
            "--inter-node-gbps", str(row["inter_node_gbps"]), "--json"]
    assert main(argv + ["--power-limit-w", "500"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["timing"]["step_time_s"] == pytest.approx(timing["step_time_s"], rel=1e-9)
    assert out["timing"]["tokens_per_s"] / 8 == pytest.approx(per_gpu, rel=1e-9)
    limit = out["power_limit"]
    assert limit["watts"] == 500 and limit["tdp_w"] == 700 and limit["tdp_dense_peak_tflops"] == 989.4
    assert limit["dense_peak_tflops"] == pytest.approx(prep[3].gpu.bf16_tflops, abs=0.05)
    assert limit["dense_peak_tflops"] == pytest.approx(835.5 + (989.4 - 835.5) * 100 / 300, abs=0.05)
    assert "power_limited" in limit["source"] and any("500 W power limit" in n for n in out["notes"])
    spec, strategy, job, hw, recompute, grid = prep
    uncapped = throughput.ours_tokens_per_gpu((spec, strategy, job, replace(hw, gpu=find_gpu(row["gpu"])), recompute,
                                               grid))
    assert uncapped[1]["step_time_s"] < timing["step_time_s"]  # the cap is what slows it
    assert main(argv[:-1] + ["--power-limit-w", "500", "--explain"]) == 0
    text = capsys.readouterr().out
    assert "on 8xH100-SXM-96GB, 500 W power limit: 887 TFLOP/s dense bf16 peak (989 at the 700 W TDP)" in text
    assert "note: 500 W power limit: tensor peaks scaled" in text and "H100-NVL-94GB" in text


def test_a_plan_folder_keeps_its_power_limit_through_plan_json(tmp_path, capsys):
    out = tmp_path / "p"
    # A job the device bounds (a power limit slows the GPU, not the host's dispatch: timing.py's floor).
    argv = ["plan", "llama-3.1-8b", "--gpus", "8xH100-SXM-96GB", "--seq", "2048", "--global-batch", "32",
            "--strategies", "zero3", "--checkpointing", "off"]
    assert main(argv + ["--power-limit-w", "450", "--out", str(out)]) == 0
    assert "(89.4 GiB each, 450 W power limit: 861 TFLOP/s dense bf16 peak" in capsys.readouterr().out
    plan = load_plan(out)
    assert plan.power_limit_w == 450 and json.loads((out / "plan.json").read_text())["power_limit_w"] == 450
    assert not plan.prediction_is_stale
    from toolkit.estimate.search import predict_plan
    from toolkit.plan.job import plan_job

    assert plan_job(plan)[1].gpu == power_limited(find_gpu("H100-SXM-96GB"), 450)
    assert predict_plan(plan).predicted == plan.predicted  # a re-prediction sees the same hardware
    assert "at a 450 W board power limit" in (out / "PLAN.md").read_text()
    again = tmp_path / "again"
    assert main(["emit", str(out), "--out", str(again)]) == 0
    assert load_plan(again).power_limit_w == 450 and load_plan(again).predicted == plan.predicted
    assert main(["check", str(out)]) == 0
    capsys.readouterr()
    assert main(argv + ["--out", str(tmp_path / "uncapped")]) == 0  # no limit: no field, as before it existed
    uncapped = json.loads((tmp_path / "uncapped" / "plan.json").read_text())
    assert "power_limit_w" not in uncapped and load_plan(tmp_path / "uncapped").power_limit_w is None
    assert uncapped["predicted"]["step_time_s"] < plan.predicted["step_time_s"]
    capsys.readouterr()
    edited = json.loads((out / "plan.json").read_text())
    edited["power_limit_w"] = 750  # an edit past the TDP is refused like the flag
    (out / "plan.json").write_text(json.dumps(edited))
    assert main(["emit", str(out), "--out", str(tmp_path / "o")]) == 2
    assert "power limit 750 W is above H100-SXM-96GB's 700 W" in _one_error_line(capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("gpus, value, fragment", [
    ("8xH100-SXM-96GB", "fast", "--power-limit-w 'fast' is not a number"),
    ("8xH100-SXM-96GB", "0", "--power-limit-w must be positive, got 0"),
    ("8xH100-SXM-96GB", "-300", "--power-limit-w must be positive"),
    ("8xH100-SXM-96GB", "nan", "--power-limit-w nan is not a finite number"),
    ("8xH100-SXM-96GB", "750", "power limit 750 W is above H100-SXM-96GB's 700 W board power"),
    ("8xH100-SXM-96GB", "300", "power limit 300 W is below 400 W, the lowest board power with a datasheet peak"),
    ("1xH100-NVL", "350", "does not extrapolate; give 400 W, or no power limit"),
    ("8xA100-80GB", "300", "no board-power data for A100-80GB (one datasheet point of its die or none), so power "
                           "limit 300 W cannot be modelled for it"),
])
def test_a_bad_power_limit_is_one_line_before_anything_is_written(tmp_path, capsys, gpus, value, fragment):
    assert main(["estimate", "gpt2", "--gpus", gpus, f"--power-limit-w={value}"]) == 2
    assert fragment in _one_error_line(capsys)
    assert main(["plan", "gpt2", "--gpus", gpus, "--global-batch", "8", f"--power-limit-w={value}",
                 "--out", str(tmp_path / "p")]) == 2
    assert fragment in _one_error_line(capsys) and not (tmp_path / "p").exists()

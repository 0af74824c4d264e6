"""Time to train (toolkit.estimate.duration): steps, hours, GPU-hours and cost for a dataset, from the candidate's
own predicted step; the step-time band only where published runs back the engine; bad input refused in one line."""

from __future__ import annotations

import json
import math

import pytest

from toolkit.cli import main
from toolkit.errors import UserError
from toolkit.estimate.duration import RunSize, duration
from toolkit.estimate.errorband import time_band


def estimate_json(capsys, *argv: str) -> dict:
    assert main(["estimate", "gpt2", "--seq", "1024", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_steps_hours_and_cost_follow_from_the_predicted_step(capsys):
    out = estimate_json(capsys, "--gpus", "8xH100-80GB", "--strategy", "ddp", "--micro-batch", "4",
                        "--accumulation", "2", "--dataset-tokens", "1.5B", "--epochs", "2", "--gpu-hour-price", "3")
    run, step = out["time_to_train"], out["timing"]["step_time_s"]
    tokens_per_step = 4 * 2 * 8 * 1024
    steps = math.ceil(1_500_000_000 * 2 / tokens_per_step)
    assert (run["tokens_per_step"], run["steps"], run["gpus"]) == (tokens_per_step, steps, 8)
    assert run["seconds"] == pytest.approx(steps * step, rel=1e-12)
    assert run["gpu_hours"] == pytest.approx(steps * step / 3600 * 8, rel=1e-12)
    assert run["cost"] == pytest.approx(run["gpu_hours"] * 3, rel=1e-12)


def test_the_band_is_the_step_time_band_only_where_published_runs_back_the_engine(capsys):
    backed = estimate_json(capsys, "--gpus", "1xH100-80GB", "--strategy", "ddp", "--dataset-tokens", "1e9")
    assert time_band().covers("ddp", 1)
    run = backed["time_to_train"]
    assert run["band"] == time_band().fraction
    assert run["hours_band"] == pytest.approx([run["hours"] * (1 - run["band"]), run["hours"] * (1 + run["band"])])
    unbacked = estimate_json(capsys, "--gpus", "8xH100-80GB", "--strategy", "zero3", "--dataset-tokens", "1e9")
    assert not time_band().covers("zero3", 8)
    assert unbacked["time_to_train"]["band"] is None and unbacked["time_to_train"]["hours_band"] is None
    assert "cost" in unbacked["time_to_train"] and unbacked["time_to_train"]["cost"] is None


def test_one_partial_step_counts_whole():
    class Timing:
        step_time_s, tokens_per_s = 2.0, 500.0  # 1,000 tokens a step

    class Candidate:
        timing, speed_evidenced = Timing(), False

    d = duration(RunSize(dataset_tokens=1001), Candidate(), gpus=4)
    assert (d.steps, d.seconds, d.gpu_hours) == (2, 4.0, 4.0 * 4 / 3600)
    assert "no band" in d.text() and "2 steps of 1,000 tokens" in d.text()


def test_plan_writes_the_time_to_train_into_plan_json_and_plan_md(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "gpt2", "--gpus", "1xH100-80GB", "--seq", "1024", "--global-batch", "8",
                 "--strategies", "ddp", "--dataset-tokens", "1e8", "--gpu-hour-price", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    run = plan["predicted"]["time_to_train"]
    assert run["steps"] == math.ceil(1e8 / (8 * 1024)) and run["gpus"] == 1
    assert f"{run['steps']:,} steps" in printed and "time to train" in (out / "PLAN.md").read_text()


@pytest.mark.parametrize("argv, words", [
    (["--epochs", "2"], "--epochs needs --dataset-tokens"),
    (["--gpu-hour-price", "2"], "--gpu-hour-price needs --dataset-tokens"),
    (["--dataset-tokens", "1e9", "--gpu-hour-price", "-1"], "--gpu-hour-price must be"),
    (["--dataset-tokens", "1e9", "--epochs", "0"], "--epochs must be"),
    (["--dataset-tokens", "lots"], "--dataset-tokens 'lots' is not a count"),
    (["--dataset-tokens", "1e9", "--seq", "max"], "not --seq max"),
])
def test_bad_run_sizes_are_refused_in_one_line(capsys, argv, words):
    try:
        code = main(["estimate", "gpt2", *argv])
    except SystemExit as exc:  # a value argparse's type refuses
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_the_python_api_times_the_run_as_the_command_does(capsys):
    import toolkit.api as tk

    argv = ["--gpus", "8xH100-80GB", "--strategy", "ddp", "--micro-batch", "4", "--accumulation", "2"]
    printed = estimate_json(capsys, *argv, "--dataset-tokens", "1.5B", "--epochs", "2", "--gpu-hour-price", "3")
    e = tk.estimate("gpt2", "8xH100-80GB", strategy="ddp", seq_len=1024, micro_batch=4, grad_accum=2)
    assert e.time_to_train(1.5e9, epochs=2, gpu_hour_price=3).to_dict() == printed["time_to_train"]
    with pytest.raises(UserError, match="epochs"):
        e.time_to_train(1e9, epochs=float("nan"))

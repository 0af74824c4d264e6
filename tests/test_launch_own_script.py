"""`toolkit launch PLAN --processes 2 --cpu -- SCRIPT`: a launch is what it announces, or stops with one line.

An unmodified HF Trainer script (no toolkit import) used to run as two world-size-1 trainings into one output
folder under an FSDP2 plan (exit 0), and to fail minutes later with DeepSpeed's raw batch assertion under a ZeRO-2
plan. Now the launcher sets up the gloo state for it (toolkit.train.own_script_guard): with the plan's batch it
trains as one 2-rank run under both; with another batch both stop as TrainingArguments are created, in one line
naming the helper. A script that never joins the launch's process group does not end in exit 0. A failing script's
own last error line is the one line; the log is written beside the working directory, never into the plan folder;
a rank killed by a signal is named as the one that failed first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.emit import emit_files
from toolkit.run.rehearsal import plan_for_model

MICRO, ACCUM = 2, 2

PLAIN_TRAINER = """\
import json, os, sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

model_dir, data_dir, out, report = sys.argv[1:5]
batch, accumulation = (int(a) for a in sys.argv[5:7]) if len(sys.argv) > 5 else (8, 1)
args = TrainingArguments(output_dir=out, max_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                         report_to=[], per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation)
model = AutoModelForCausalLM.from_pretrained(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
ids = tokenizer(Path(data_dir, "train.txt").read_text())["input_ids"]
blocks = [ids[i:i + 32] for i in range(0, 32 * 64, 32)]
trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": blocks, "labels": blocks}),
                  data_collator=default_data_collator)
trainer.train()
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
Path(report, f"rank-{args.process_index}.json").write_text(json.dumps({
    "world": args.world_size, "steps": trainer.state.global_step, "losses": losses,
    "engine": type(trainer.model_wrapped).__name__, "fsdp2": type(trainer.model).__name__.startswith("FSDP")}))
"""


def toolkit(*argv: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "toolkit", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def plans(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("launch-plans")
    for strategy in ("fsdp2", "zero2", "ddp"):
        plan = plan_for_model(tiny_llama_dir, strategy, micro_batch=MICRO, grad_accum=ACCUM, seq_len=32)
        emit_files(plan, base / strategy)
    return {strategy: base / strategy for strategy in ("fsdp2", "zero2", "ddp")}


def _plain(tmp_path: Path, strategy_dir: Path, model: Path, data: Path, *batch: int):
    (tmp_path / "plain_train.py").write_text(PLAIN_TRAINER)
    reports = tmp_path / "reports"
    reports.mkdir()
    before = sorted(strategy_dir.iterdir())
    done = toolkit("launch", str(strategy_dir), "--processes", "2", "--cpu", "--", "plain_train.py", str(model),
                   str(data), str(tmp_path / "out"), str(reports), *map(str, batch), cwd=tmp_path)
    assert sorted(strategy_dir.iterdir()) == before  # nothing of a launch is written into the plan folder
    ranks = [json.loads(p.read_text()) for p in sorted(reports.glob("rank-*.json"))]
    return done, ranks


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp2", "zero2"])
def test_an_unmodified_trainer_script_with_another_batch_stops_at_once_naming_the_helper(strategy, plans,
                                                                                        tiny_llama_dir, corpus_dir,
                                                                                        tmp_path):
    done, ranks = _plain(tmp_path, plans[strategy], tiny_llama_dir, corpus_dir)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert (f"per_device_train_batch_size 8 x gradient_accumulation_steps 1 per process, the plan {MICRO} x "
            f"{ACCUM}") in errors[0]
    assert "**training_arguments() from toolkit.train.own_script" in errors[0]
    assert ranks == [] and not (tmp_path / "out").exists()  # stopped before any training or model load


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["fsdp2", "zero2"])
def test_an_unmodified_trainer_script_with_the_plans_batch_trains_as_one_2_rank_run(strategy, plans,
                                                                                   tiny_llama_dir, corpus_dir,
                                                                                   tmp_path):
    done, ranks = _plain(tmp_path, plans[strategy], tiny_llama_dir, corpus_dir, MICRO, ACCUM)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert len(ranks) == 2 and all(r["world"] == 2 and r["steps"] == 2 for r in ranks)
    assert ranks[0]["losses"] == pytest.approx(ranks[1]["losses"], abs=1e-6)  # one run: the ranks agree
    if strategy == "fsdp2":
        assert ranks[0]["fsdp2"]
    else:
        assert ranks[0]["engine"] == "DeepSpeedEngine"
    log = next((tmp_path / "toolkit-logs").glob("launch-*.log"))
    assert f"every rank's stderr goes to {log}" in done.stdout


@pytest.mark.multiprocess
def test_a_script_whose_ranks_never_join_one_process_group_does_not_exit_0(plans, tmp_path):
    (tmp_path / "alone.py").write_text("print('trained alone')\n")
    done = toolkit("launch", str(plans["ddp"]), "--processes", "2", "--cpu", "--", "alone.py", cwd=tmp_path)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "alone.py: ran as 2 separate single-process runs" in errors[0], done.stderr


@pytest.mark.multiprocess
def test_a_rank_killed_by_a_signal_is_named_as_the_one_that_failed_first(plans, tmp_path):
    (tmp_path / "killed.py").write_text(
        "import os, signal\nimport torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\ndist.barrier()\n"
        "if dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "for _ in range(1000):\n    dist.all_reduce(torch.ones(4))\n")
    done = toolkit("launch", str(plans["ddp"]), "--processes", "2", "--cpu", "--", "killed.py", cwd=tmp_path)
    assert done.returncode not in (0, 2), done.stdout[-2000:] + done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("error: rank 1 was killed by SIGKILL (it failed first)"), errors[0]
    assert "(full log: " in errors[0] and str(tmp_path / "toolkit-logs") in errors[0]


def test_a_survivor_torchrun_stopped_with_sigterm_is_not_named_before_the_rank_killed_first(tmp_path):
    """torchrun may list the survivor it stopped (-15) beside the killed rank (-9), and with whole-second
    timestamps its "first observed failure" ties to the lowest rank: the rank killed by SIGKILL is the one named."""
    from toolkit.run.launcher import _first_failure, _killed_ranks

    rule, section = "=" * 40, "-" * 40
    entry = ("[{i}]:\n  time      : 2026-12-04_12:32:05\n  host      : box\n  rank      : {r} (local_rank: {r})\n"
             "  exitcode  : {c} (pid: 1{r})\n  error_file: <N/A>\n  traceback : Signal\n")
    log = tmp_path / "launch.log"
    log.write_text(f"earlier run\n{rule}\nkilled.py FAILED\n{section}\nFailures:\n" + entry.format(i=1, r=1, c=-9)
                   + f"{section}\nRoot Cause (first observed failure):\n" + entry.format(i=0, r=0, c=-15) + rule + "\n")
    killed = _killed_ranks(log, 0)
    assert killed == [(0, 15), (1, 9)]
    assert _first_failure(None, killed, 1).startswith("rank 1 was killed by SIGKILL (it failed first)")
    said = {"rank": 0, "user_error": False, "message": "Connection reset by peer"}
    assert _first_failure(said, killed, 1) == ("rank 1 was killed by SIGKILL (it failed first); rank 0 then failed: "
                                               "Connection reset by peer")
    assert _first_failure(None, [(0, 15)], 1).startswith("rank 0 was killed by SIGTERM")


def test_a_script_exiting_with_a_code_is_reported_with_its_own_last_error_line(tmp_path, monkeypatch):
    """argparse's "prog: error: ..." is the one line, not only "exited with code 2"."""
    from toolkit.train.own_script import run_script

    (tmp_path / "needs_data.py").write_text("import argparse\np = argparse.ArgumentParser()\n"
                                            "p.add_argument('--data', required=True)\np.parse_args()\n")
    monkeypatch.setenv("TOOLKIT_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    assert run_script([str(tmp_path / "needs_data.py")]) == 2
    reported = json.loads((tmp_path / "error.json").read_text())
    assert reported["user_error"] is True
    assert reported["message"] == ("needs_data.py: exited with code 2: needs_data.py: error: the following "
                                   "arguments are required: --data")


def test_the_script_log_goes_beside_the_working_directory_never_into_the_plan_folder(tmp_path, monkeypatch):
    from toolkit.run.launcher import SCRIPT_LOGS, script_log

    plan = tmp_path / "plan"
    (plan / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert script_log(plan).parent == tmp_path / SCRIPT_LOGS
    for inside in (plan, plan / "sub"):
        monkeypatch.chdir(inside)
        assert script_log(plan).parent == tmp_path / SCRIPT_LOGS

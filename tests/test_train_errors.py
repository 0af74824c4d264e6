"""Bad input to toolkit.train: one line from rank 0, exit code 2, no traceback."""

from __future__ import annotations

import json

import pytest

from toolkit.run.rehearsal import plan_for_model


def _one_error_line(run) -> str:
    assert run.returncode == 2, (run.stdout[-2000:], run.stderr[-4000:])
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr[-4000:]
    return errors[0]


@pytest.fixture(scope="module")
def one_process_plan(tiny_llama_dir):
    return plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=2, seq_len=32)


def test_missing_data(train_in_process, one_process_plan, tmp_path):
    run = train_in_process(one_process_plan, "no-data", "--data", str(tmp_path / "nothing.txt"), "--max-steps", "1")
    assert "does not exist" in _one_error_line(run)


def test_empty_dataset(train_in_process, one_process_plan, tmp_path):
    (tmp_path / "tiny.txt").write_text("too short\n")
    run = train_in_process(one_process_plan, "empty-data", "--data", str(tmp_path / "tiny.txt"), "--max-steps", "1")
    assert "not one training block" in _one_error_line(run)


def test_sequence_longer_than_model_positions(train_in_process, tiny_llama_dir, corpus_dir):
    plan = plan_for_model(tiny_llama_dir, "ddp", gpus_per_node=1, micro_batch=1, seq_len=512)  # model: 256
    run = train_in_process(plan, "long-seq", "--data", str(corpus_dir), "--max-steps", "1")
    assert "longer than model" in _one_error_line(run)


def test_plan_and_model_disagree(train_in_process, one_process_plan, tiny_gpt2_dir, corpus_dir):
    run = train_in_process(one_process_plan, "other-model", "--data", str(corpus_dir), "--model",
                           str(tiny_gpt2_dir), "--max-steps", "1")
    line = _one_error_line(run)
    assert "is not the model the plan was made for" in line and "gpt2 vs llama" in line


def test_malformed_plan(tmp_path, capsys):
    from toolkit.train.__main__ import main

    (tmp_path / "plan.json").write_text(json.dumps({"version": 1, "model": "x"}))
    code = main(["--plan", str(tmp_path), "--data", "d", "--output", str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    assert code == 2
    assert stderr.strip().startswith("error: plan file") and "Field required" in stderr
    assert "Traceback" not in stderr


def test_existing_checkpoints_without_resume(train_in_process, one_process_plan, corpus_dir, tmp_path):
    (tmp_path / "out" / "checkpoint-5").mkdir(parents=True)
    run = train_in_process(one_process_plan, "exists", "--data", str(corpus_dir), "--max-steps", "1",
                           output=tmp_path / "out")
    assert "pass --resume" in _one_error_line(run)


@pytest.mark.multiprocess
def test_two_processes_only_rank0_reports_and_launch_exits_2(tiny_llama_dir, tmp_path, toolkit_in_process):
    """A refusal only the workers can make (a hub dataset: the preflight does not reach for the network, and offline
    the ranks cannot load it); torchrun reports the failed workers as its own exit 1 with a summary block, and
    `toolkit launch` (run in this process: toolkit_in_process) turns that back into exit 2."""
    from toolkit.run.launcher import emit_plan_files

    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32), tmp_path / "p")
    proc = toolkit_in_process("launch", str(plan_dir), "--", "--data", "nobody/no-such-dataset", "--output",
                              str(tmp_path / "out"), "--max-steps", "1", cwd=tmp_path, HF_DATASETS_OFFLINE="1",
                              HF_HUB_OFFLINE="1")
    assert proc.returncode == 2, proc.stderr[-4000:]
    errors = proc.stderr.strip().splitlines()  # no launcher traceback: every rank's stderr is in the log
    assert len(errors) == 1 and errors[0].startswith("error: ") and "as a hub dataset failed" in errors[0]
    log = tmp_path / "out" / "toolkit-launch.log"
    assert f"(full log: {log})" in errors[0] and "as a hub dataset failed" in log.read_text()
    assert not (tmp_path / "out" / ".toolkit-run.lock").exists()


def test_launch_preflight_refuses_a_mismatched_model_before_starting(tiny_llama_dir, tiny_gpt2_dir, tmp_path,
                                                                     capsys):
    from toolkit.cli import main
    from toolkit.run.launcher import emit_plan_files

    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32), tmp_path / "p")
    code = main(["launch", str(plan_dir), "--", "--data", str(tmp_path), "--output", str(tmp_path / "o"), "--model",
                 str(tiny_gpt2_dir)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not the model the plan was made for" in err[0]


def test_catalog_model_loads_as_its_hub_id(tiny_llama_dir, tmp_path):
    """A plan made for a catalog name trains its hub id, read from the config the package ships (no network): here
    the plan's numbers are a tiny model's, so the hub id's config contradicts them, named in one line with the fix."""
    from toolkit.errors import UserError
    from toolkit.commands.launch import launch_main
    from toolkit.run.launcher import emit_plan_files

    plan = plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=32).replace(model="llama-2-7b")
    plan_dir = emit_plan_files(plan, tmp_path / "p")
    with pytest.raises(UserError, match=r"model meta-llama/Llama-2-7b-hf is not the model the plan was made for "
                                        r"\(llama-2-7b\): 32 layers vs 2.*pass the planned --model"):
        launch_main(plan_dir, ["--data", str(tmp_path), "--output", str(tmp_path / "o")], dry_run=True)

"""Signals and races with real processes: a killed launcher leaves no rank and an exact resume; two writers of one
plan folder, one refused; a writer killed mid-write leaves the old folder whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import toolkit_here
from tests.quick_launch import quick_launch
from tests.test_hostile import _snapshot, run_cli
from toolkit.run.launcher import emit_plan_files
from toolkit.processes import _alive, descendants
from toolkit.run.rehearsal import plan_for_model

# A writer that pauses inside write_folder after its first staged file, until its stdin gets a line.
PAUSING_WRITER = """
import sys
from pathlib import Path
from toolkit.cli import _finish_on_termination
from toolkit.emit import render_files
from toolkit.fileio import write_folder
from toolkit.plan.schema import load_plan

class Pausing(dict):
    def items(self):
        for i, item in enumerate(super().items()):
            if i == 1:
                print("paused", flush=True)
                sys.stdin.readline()
            yield item

if sys.argv[2] == "cli":
    _finish_on_termination()  # as toolkit's CLI runs
folder = Path(sys.argv[1])
plan = load_plan(folder).replace(precision="fp32")
write_folder(folder, Pausing(render_files(plan)), force=True)
"""


def _start_pausing_writer(folder: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", PAUSING_WRITER, str(folder), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "paused", proc.stderr.read()
    return proc


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_two_writers_one_refused_and_a_terminated_writer_leaves_the_old_folder(tiny_llama_dir, tmp_path):
    folder = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32), tmp_path / "p")
    before = _snapshot(tmp_path)
    writer = _start_pausing_writer(folder, "cli")
    try:
        # A second writer while the first is mid-write: refused, naming the owner; nothing it does shows.
        code, _, err = run_cli(["emit", str(folder), "--force"])
        assert code == 2 and len(err.strip().splitlines()) == 1
        assert f"in use by pid {writer.pid} on " in err
        staged = [p for p in tmp_path.iterdir() if p.name.endswith(".staging")]
        assert len(staged) == 1 and (staged[0] / "ds_config.json").is_file()  # the first writer's half-made copy
    finally:
        writer.send_signal(signal.SIGTERM)
        writer.wait(timeout=60)
    assert writer.returncode != 0
    assert _snapshot(tmp_path) == before  # old folder whole; staging folder and lock removed


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_a_killed_writers_lock_is_taken_over_and_its_staging_swept(tiny_llama_dir, tmp_path):
    folder = emit_plan_files(plan_for_model(tiny_llama_dir, "zero2", micro_batch=2, seq_len=32), tmp_path / "p")
    before = _snapshot(tmp_path)
    writer = _start_pausing_writer(folder, "raw")
    writer.kill()  # SIGKILL: no cleanup at all
    writer.wait(timeout=60)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left != ["p"] and ".p.lock" in left  # the dead writer's lock file and staging folder remain
    assert {k: v for k, v in _snapshot(tmp_path).items() if k.startswith(str(folder) + "/")} == \
        {k: v for k, v in before.items() if k.startswith(str(folder) + "/")}
    code, out, err = run_cli(["emit", str(folder), "--force"])
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _final_state(output: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(output / "model.safetensors"))


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _steps(corpus_dir: Path) -> list[str]:
    return ["--data", str(corpus_dir), "--random-init", "--max-steps", "12", "--save-steps", "2",
            "--logging-steps", "1", "--lr-scheduler", "constant", "--max-eval-blocks", "2", "--seed", "3"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_llama_dir, corpus_dir, tmp_path_factory):
    """(plan folder, output) of a DDP run of 12 steps that nothing interrupts: what every interrupted run of the
    same plan and flags must end with. Its `toolkit launch` runs in this process (toolkit_here), as the resume of
    the killed run does below: nothing signals them."""
    root = tmp_path_factory.mktemp("whole")
    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=32), root / "p")
    code, _, err = toolkit_here(["launch", str(plan_dir), "--", *_steps(corpus_dir), "--output", str(root / "whole")])
    assert code == 0, err[-3000:]
    return plan_dir, root / "whole"


def _losses_after(output: Path, step: int) -> list[float]:
    log = json.loads((output / "checkpoint-12" / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in log if "loss" in e and e["step"] > step]


def _same_end(output: Path, reference: Path, resumed_at: int) -> None:
    import torch

    ours, theirs = _final_state(output), _final_state(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert _losses_after(output, resumed_at) == _losses_after(reference, resumed_at)
    assert len(_losses_after(reference, resumed_at)) == 12 - resumed_at


@pytest.mark.multiprocess
def test_launcher_killed_stops_every_rank_refuses_a_second_run_and_resumes_exactly(corpus_dir, uninterrupted,
                                                                                   tmp_path):
    from toolkit.train.checkpoints import COMPLETE_MARKER, is_complete, last_complete_checkpoint

    plan_dir, whole = uninterrupted
    env = ENV
    steps = _steps(corpus_dir)
    toolkit = [sys.executable, "-m", "toolkit.cli", "launch", str(plan_dir), "--"]

    killed = tmp_path / "killed"
    launcher = subprocess.Popen([*toolkit, *steps, "--output", str(killed)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (killed / ".toolkit-run.lock").is_file(), 120, "the run's lock")
        # A second run into the folder the live run holds: refused before it starts anything.
        code, _, err = run_cli(["launch", str(plan_dir), "--", *steps, "--output", str(killed)])
        assert code == 2 and f"in use by pid {launcher.pid}" in err, err
        _wait_for(lambda: (killed / "checkpoint-2" / COMPLETE_MARKER).is_file(), 300, "checkpoint-2")
        ranks = descendants(launcher.pid)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert len(ranks) >= 3  # accelerate's launcher and two training ranks
    assert not [pid for pid in ranks if _alive(pid)]
    last = last_complete_checkpoint(killed)
    assert last is not None and is_complete(last)
    assert err.strip().splitlines()[-1].startswith("stopped by SIGTERM: every rank was stopped; "
                                                   f"the last complete checkpoint is {last}; resume with: ")
    assert not (killed / "model.safetensors").exists()  # the run did not go on to write its final model
    assert not (killed / ".toolkit-run.lock").exists()

    code, _, err = toolkit_here(["launch", str(plan_dir), "--", *steps, "--output", str(killed), "--resume"])
    assert code == 0, err[-3000:]
    _same_end(killed, whole, int(last.name.split("-")[1]))


def _training_ranks(launcher_pid: int) -> list[int]:
    """The toolkit.train worker processes under a launcher (not accelerate's or torchrun's own)."""
    ranks = []
    for pid in descendants(launcher_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"toolkit.train" in cmdline and b"accelerate" not in b" ".join(cmdline[:3]):
            ranks.append(pid)
    return ranks


@pytest.mark.multiprocess
def test_a_worker_killed_mid_run_is_restarted_and_ends_with_the_uninterrupted_runs_losses(corpus_dir, uninterrupted,
                                                                                          tmp_path):
    """`toolkit launch --max-restarts 1`: SIGKILL of one training rank after checkpoint-2; torchrun's elastic
    agent restarts the workers, toolkit.train resumes them from the last complete checkpoint, and the run ends
    with the weights and (after the resume point) the losses of a run nothing interrupted."""
    from toolkit.train.checkpoints import COMPLETE_MARKER, last_complete_checkpoint

    plan_dir, whole = uninterrupted
    output = tmp_path / "elastic"
    launcher = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "launch", str(plan_dir), "--max-restarts",
                                 "1", "--", *_steps(corpus_dir), "--output", str(output)],
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (output / "checkpoint-2" / COMPLETE_MARKER).is_file(), 300, "checkpoint-2")
        ranks = _training_ranks(launcher.pid)
        assert len(ranks) == 2, ranks
        resumed_at = int(last_complete_checkpoint(output).name.split("-")[1])
        os.kill(ranks[1], signal.SIGKILL)
        out, err = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    log = (output / "toolkit-launch.log").read_text(errors="replace")
    assert "toolkit.train: restart 1 after a worker died; resuming from the last complete checkpoint" in log
    # The restart resumed from the newest complete checkpoint at the time of the kill, or a later one if the ranks
    # wrote one before they noticed: either way the end is the uninterrupted run's.
    _same_end(output, whole, resumed_at)


@pytest.mark.multiprocess
def test_a_worker_that_keeps_dying_ends_the_run_with_one_line(tiny_llama_dir, corpus_dir, tmp_path):
    """The restarts run out (a worker killed again after the restart; a node that never comes back ends the same
    way: its rendezvous fails): one line naming --max-restarts and the checkpoint to resume from."""
    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=32), tmp_path / "p")
    output = tmp_path / "dying"
    launcher = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "launch", str(plan_dir), "--max-restarts",
                                 "1", "--", *_steps(corpus_dir), "--max-steps", "100000", "--output", str(output)],
                                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for attempt in range(2):
            _wait_for(lambda: len(_training_ranks(launcher.pid)) == 2, 300, f"the workers of attempt {attempt}")
            first = _training_ranks(launcher.pid)
            time.sleep(1.0)
            os.kill(first[0], signal.SIGKILL)
            _wait_for(lambda: first[0] not in _training_ranks(launcher.pid), 60, "the killed worker to go")
            if attempt == 0:
                _wait_for(lambda: not set(first) & set(_training_ranks(launcher.pid)), 120, "the restart")
        out, err = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode not in (0, 2)
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: the workers did not recover within --max-restarts 1 (a worker kept dying, "
                                "or a node never came back)"), err[-3000:]


@pytest.mark.multiprocess
def test_sigkill_of_the_launcher_leaves_no_rank_running_and_the_run_resumes_from_its_last_complete_checkpoint(
        tiny_llama_dir, corpus_dir, tmp_path):
    """No handler runs on SIGKILL: the ranks go because each process asked to die with its parent (toolkit.train
    has no handler for the SIGTERM torchrun passes on either), so the run is killed mid-training as a lost node
    would be, checkpointing every 2 steps. The dead launcher's lock is taken over, and the run resumes from its last
    complete checkpoint (once test_train_engines' own kill-and-resume run: one training launch serves both)."""
    from toolkit.run.launcher import launch_command
    from toolkit.train.checkpoints import COMPLETE_MARKER, last_complete_checkpoint

    plan_dir = emit_plan_files(plan_for_model(tiny_llama_dir, "ddp", micro_batch=2, seq_len=32), tmp_path / "p")
    output = tmp_path / "out"
    argv = ["--data", str(corpus_dir), "--output", str(output), "--lr-scheduler", "constant", "--save-steps", "2",
            "--logging-steps", "1", "--max-eval-blocks", "4", "--eval-steps", "1000"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "toolkit.cli", "launch", str(plan_dir), "--", *argv, "--max-steps", "100000"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Two complete checkpoints (2 and 4) or more before the kill: the resume must pick the newest complete one.
        _wait_for(lambda: (output / "checkpoint-4" / COMPLETE_MARKER).is_file(), 300, "checkpoint-4")
        ranks = descendants(launcher.pid)
    finally:
        launcher.kill()
        launcher.wait(timeout=60)
    assert len(ranks) >= 3
    _wait_for(lambda: not [pid for pid in ranks if _alive(pid)], 60, "every rank to exit")
    code, _, err = run_cli(["launch", str(plan_dir), "--dry-run", "--", *argv, "--resume"])
    assert code == 0, err  # the dead launcher's lock is taken over

    last = last_complete_checkpoint(output)
    assert last is not None, "no complete checkpoint before the kill"
    step = int(last.name.split("-")[1])
    assert step >= 4
    resumed = subprocess.run(quick_launch(launch_command(plan_dir, [*argv, "--max-steps", str(step + 2), "--resume",
                                                                    "--no-save-final"])),
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e][-2:] == [step + 1, step + 2]


def test_the_first_failing_rank_is_the_one_reported(tmp_path, monkeypatch):
    """Ranks that fail later (usually because the first one left the process group) do not overwrite it."""
    from toolkit.errors import UserError
    from toolkit.run.launcher import _read_failure
    from toolkit.train.failures import report_failure

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TOOLKIT_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")
    assert report_failure(UserError("data shard 1 is empty"), user_error=True)
    monkeypatch.setenv("RANK", "0")
    assert not report_failure(RuntimeError("Connection closed by peer"), user_error=False)
    assert _read_failure(error_file) == {"rank": 1, "user_error": True, "message": "data shard 1 is empty"}

"""Bad multi-node input (issue 18): a hostfile naming a host that does not resolve or whose slots do not add up to
the plan's GPUs, a node count that does not divide the plan's world, a SLURM allocation smaller than the plan. Each
is one line, exit 2, no traceback, before any process starts or any file (the run log included) is written; the
emitted slurm.sbatch refuses a small allocation itself before srun. No connection is made: names are only resolved
(a `.invalid` name fails at once offline, RFC 6761)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from toolkit.cli import main as cli
from toolkit.emit import emit_files
from toolkit.emit.presets import reference_plan
from toolkit.emit.scripts import write_generic
from toolkit.errors import UserError
from toolkit.run.preflight import check_hostfile, check_slurm_allocation

SLURM_VARS = ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_NTASKS")


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def no_slurm(monkeypatch):
    for name in SLURM_VARS:
        monkeypatch.delenv(name, raising=False)


def _refused(tmp_path: Path, argv: list[str], capsys) -> str:
    """Run the CLI; assert exit 2, one line on stderr, nothing on stdout, no traceback, nothing written."""
    before = _snapshot(tmp_path)
    code = cli(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert _snapshot(tmp_path) == before
    return err.strip()


def _plan_dir(tmp_path: Path, nodes: int, gpus: int, hosts: list[str] | None = None) -> Path:
    plan_dir = tmp_path / "plan"
    emit_files(reference_plan("zero3", nodes=nodes, gpus_per_node=gpus), plan_dir, hosts=hosts)
    return plan_dir


def _launch(plan_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["launch", str(plan_dir), *extra, "--", "--data", str(tmp_path / "data.txt"),
            "--output", str(tmp_path / "out")]


def test_a_hostfile_host_that_does_not_resolve_is_refused(tmp_path, capsys, no_slurm):
    plan_dir = _plan_dir(tmp_path, 2, 2, hosts=["localhost", "no-such-node.invalid"])
    err = _refused(tmp_path, _launch(plan_dir, tmp_path), capsys)
    assert "no-such-node.invalid" in err and str(plan_dir / "hostfile") in err and "cannot be resolved" in err
    assert not (tmp_path / "out").exists()


def test_hostfile_slots_that_do_not_add_up_are_refused_naming_what_works(tmp_path, capsys, no_slurm):
    plan_dir = _plan_dir(tmp_path, 2, 2, hosts=["localhost", "127.0.0.1"])
    (plan_dir / "hostfile").write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    err = _refused(tmp_path, _launch(plan_dir, tmp_path), capsys)
    assert "3 slots on 2 host(s)" in err and "4 GPUs" in err
    assert "1 host(s) x slots=4; 2 host(s) x slots=2; 4 host(s) x slots=1" in err
    (plan_dir / "hostfile").write_text("localhost slots=two\n")
    assert "line 1 is not `host slots=GPUS`" in _refused(tmp_path, _launch(plan_dir, tmp_path), capsys)


def test_a_good_hostfile_and_the_emitted_placeholders_pass():
    plan = reference_plan("zero3", nodes=2, gpus_per_node=2)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hostfile"
        hostfile.write_text("# two local names\nlocalhost slots=2\n\n127.0.0.1 slots=2  # the second\n")
        check_hostfile(plan, hostfile)
        hostfile.write_text("node0 slots=2\nnode1 slots=2\n")  # `toolkit emit` without --hosts: not resolved
        check_hostfile(plan, hostfile)


def test_a_node_count_that_does_not_divide_the_world_is_refused(tmp_path, capsys, no_slurm):
    plan_dir = _plan_dir(tmp_path, 1, 8)
    err = _refused(tmp_path, ["launch", str(plan_dir), "--rehearse", "--nodes", "3"], capsys)
    assert "--nodes 3" in err and "8 GPUs" in err and "1, 2, 4, 8" in err


@pytest.mark.parametrize("env,says", [
    ({"SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "4"}, "1 node(s)"),
    ({"SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "a100:2"}, "2 GPU(s) per node"),
])
def test_toolkit_launch_refuses_a_slurm_allocation_smaller_than_the_plan(tmp_path, capsys, monkeypatch, no_slurm,
                                                                         env, says):
    plan_dir = _plan_dir(tmp_path, 2, 4)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    err = _refused(tmp_path, _launch(plan_dir, tmp_path, "--dry-run"), capsys)
    assert says in err and "2 node(s) x 4 GPUs" in err and "--nodes=2 --gpus-per-node=4" in err
    assert not (tmp_path / "out").exists()


def test_an_allocation_as_large_as_the_plan_passes():
    plan = reference_plan("zero3", nodes=2, gpus_per_node=4)
    check_slurm_allocation(plan, {})
    check_slurm_allocation(plan, {"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS": "2"})
    check_slurm_allocation(plan, {"SLURM_NNODES": "3", "SLURM_GPUS_PER_NODE": "gpu:h100:4"})
    with pytest.raises(UserError, match="1 task"):
        check_slurm_allocation(plan, {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "1"})


def _sbatch(script: Path, args: list[str], tmp_path: Path, env: dict[str, str]) -> tuple[int, str, bool]:
    """Run an sbatch script under bash with fake SLURM variables; srun and scontrol are shims that record they
    were called. Returns (exit code, stderr, whether srun was called)."""
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    for name in ("srun", "scontrol"):
        (shims / name).write_text(f'#!/usr/bin/env bash\necho {name} >> "$CALLS"\n')
        (shims / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(script), *args], env={
        **base, "PATH": f"{shims}:{os.environ['PATH']}", "CALLS": str(log), "SLURM_JOB_NODELIST": "gpu-[a-b]",
        **env}, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    called = log.exists() and "srun" in log.read_text().split()
    return proc.returncode, proc.stderr, called


@pytest.mark.multiprocess
@pytest.mark.one_core
@pytest.mark.parametrize("env,ok", [
    ({"SLURM_JOB_NUM_NODES": "1", "SLURM_GPUS_ON_NODE": "4"}, False),
    ({"SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "gpu:a100:2"}, False),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4"}, True),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "a100:8"}, True),
    ({}, True),  # nothing to compare: the script goes on
])
def test_slurm_sbatch_refuses_a_small_allocation_before_srun(tmp_path, env, ok):
    plan_dir = _plan_dir(tmp_path, 2, 4)
    launch = tmp_path / "launch"
    write_generic(launch)
    for script, args, extra in ((plan_dir / "slurm.sbatch", [], {"SLURM_SUBMIT_DIR": str(plan_dir)}),
                                (launch / "slurm.sbatch", [str(plan_dir)], {})):
        code, err, called = _sbatch(script, [*args, "--data", "d.txt", "--output", "o"], tmp_path, {**env, **extra})
        if ok:
            assert code == 0 and called, (script, err)
        else:
            assert code == 2 and not called, (script, code, err)
            line, = err.strip().splitlines()
            assert line.startswith("error: the SLURM allocation has") and "plan needs 2 x 4" in line
            assert "--nodes=2 --gpus-per-node=4" in line

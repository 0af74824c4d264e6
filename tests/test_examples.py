"""The seed note's patterns (examples/): data parallel, model parallel, hybrid, accumulation with mixed
precision and checkpoints, each planned, emitted and trained for real on CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("examples")


def run_example(script: str, work: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORK": str(work), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(EXAMPLES / script)], env=env, capture_output=True, text=True, timeout=600)


def reloads(out: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize("script, name, strategy", [
    ("1_data_parallel.sh", "data_parallel", "ddp"),
    ("2_model_parallel.sh", "model_parallel", "pipeline"),
    ("3_hybrid.sh", "hybrid", "hybrid"),
])
def test_seed_parallel_pattern_trains_and_saves(work, script, name, strategy):
    proc = run_example(script, work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((work / name / "plan" / "plan.json").read_text())
    assert plan["strategy"] == strategy
    assert reloads(work / name / "out") == plan["params"]


@pytest.mark.multiprocess
def test_seed_accumulation_mixed_precision_and_resume(work):
    proc = run_example("4_accumulation_mixed_precision_checkpointing.sh", work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads((work / "accum" / "plan" / "plan.json").read_text())
    assert (plan["micro_batch"], plan["grad_accum"], plan["precision"], plan["checkpointing"]) == (2, 2, "bf16", True)
    state = json.loads((work / "accum" / "out" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8
    assert reloads(work / "accum" / "out") == plan["params"]


@pytest.mark.multiprocess
def test_seed_fault_tolerance_a_killed_worker_is_restarted_and_the_run_finishes(work):
    proc = run_example("5_elastic_restart.sh", work)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "killed worker" in proc.stdout
    log = (work / "elastic" / "out" / "toolkit-launch.log").read_text(errors="replace")
    assert "toolkit.train: restart 1 after a worker died" in log
    state = json.loads((work / "elastic" / "out" / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12

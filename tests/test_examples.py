"""The seed note's patterns (examples/): data parallel, model parallel, hybrid, accumulation with mixed
precision and checkpoints, each planned, emitted and trained for real on CPU processes."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ("1_data_parallel.sh", "2_model_parallel.sh", "3_hybrid.sh",
           "4_accumulation_mixed_precision_checkpointing.sh", "5_elastic_restart.sh")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("examples")


@pytest.fixture(scope="module")
def examples(work):
    """Every example script started at once, each into its own folder of work, once common.sh has made the tiny
    model and corpus they share (made here first, so that no script races another to make them): one script's
    ranks alone leave a core idle while they start, meet and save. example(script) waits for that script and gives
    its exit code and its output (stdout and stderr, in a file: a full pipe would stall a script)."""
    env = {**os.environ, "WORK": str(work), "PYTHON": sys.executable}
    subprocess.run(["bash", "-c", f"source {shlex.quote(str(EXAMPLES / 'common.sh'))}"], env=env, check=True,
                   timeout=600)
    started = {}
    for script in SCRIPTS:
        with open(work / f"{script}.log", "w") as log:
            started[script] = subprocess.Popen(["bash", str(EXAMPLES / script)], env=env, stdout=log,
                                               stderr=subprocess.STDOUT)

    def example(script: str) -> tuple[int, str]:
        code = started[script].wait(timeout=900)
        return code, (work / f"{script}.log").read_text(errors="replace")

    yield example
    for proc in started.values():  # a test that failed early leaves no script waited for
        proc.wait(timeout=900)


def reloads(out: Path) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize("script, name, strategy", [
    ("1_data_parallel.sh", "data_parallel", "ddp"),
    ("2_model_parallel.sh", "model_parallel", "pipeline"),
    ("3_hybrid.sh", "hybrid", "hybrid"),
])
def test_seed_parallel_pattern_trains_and_saves(examples, work, script, name, strategy):
    code, output = examples(script)
    assert code == 0, output[-6000:]
    plan = json.loads((work / name / "plan" / "plan.json").read_text())
    assert plan["strategy"] == strategy
    assert reloads(work / name / "out") == plan["params"]


@pytest.mark.multiprocess
def test_seed_accumulation_mixed_precision_and_resume(examples, work):
    code, output = examples("4_accumulation_mixed_precision_checkpointing.sh")
    assert code == 0, output[-6000:]
    plan = json.loads((work / "accum" / "plan" / "plan.json").read_text())
    assert (plan["micro_batch"], plan["grad_accum"], plan["precision"], plan["checkpointing"]) == (2, 2, "bf16", True)
    state = json.loads((work / "accum" / "out" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8
    assert reloads(work / "accum" / "out") == plan["params"]


@pytest.mark.multiprocess
def test_seed_fault_tolerance_a_killed_worker_is_restarted_and_the_run_finishes(examples, work):
    code, output = examples("5_elastic_restart.sh")
    assert code == 0, output[-6000:]
    assert "killed worker" in output
    log = (work / "elastic" / "out" / "toolkit-launch.log").read_text(errors="replace")
    assert "toolkit.train: restart 1 after a worker died" in log
    state = json.loads((work / "elastic" / "out" / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12

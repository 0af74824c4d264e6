"""toolkit.api, the Python face: the same numbers as the commands, typed results, bad input as one UserError line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import toolkit.api as tk
from toolkit.cli import main
from toolkit.errors import UserError


def _cli_json(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*argv, "--json"])
    return json.loads(out.getvalue())


def test_estimate_equals_the_command():
    e = tk.estimate("gpt2", "8xH100-80GB", strategy="zero2", seq_len=1024, micro_batch=4, checkpointing=True)
    cli = _cli_json("estimate", "gpt2", "--gpus", "8xH100-80GB", "--strategy", "zero2", "--seq", "1024",
                    "--micro-batch", "4", "--checkpointing")
    assert e.memory.to_dict() == cli["per_gpu"]
    assert e.timing.to_dict() == cli["timing"]
    assert e.fits is cli["fits"] is True and e.strategy == "zero2" and e.job.checkpointing is True
    assert e.required_gib == pytest.approx(cli["per_gpu"]["required_bytes"] / 1024**3)


def test_plan_equals_the_command_and_writes_the_same_folder(tmp_path):
    p = tk.plan("gpt2", "8xH100-80GB", seq_len=1024, global_batch=64, strategies="zero2,fsdp2,ddp")
    cli = _cli_json("plan", "gpt2", "--gpus", "8xH100-80GB", "--seq", "1024", "--global-batch", "64",
                    "--strategies", "zero2,fsdp2,ddp")
    assert p.rows() == cli["candidates"]
    assert p.chosen.name == cli["chosen"]["name"]
    assert {c.strategy.name for c in p.candidates} == {"zero2", "fsdp2", "ddp"}
    written = tk.emit(p, tmp_path / "plan")
    assert (tmp_path / "plan" / "plan.json") in written
    loaded = tk.load_plan(tmp_path / "plan")
    assert loaded == p.to_plan()
    with pytest.raises(UserError, match="exists"):
        tk.emit(p, tmp_path / "plan")


def test_another_row_by_the_name_the_table_prints():
    p = tk.plan("gpt2", "8xH100-80GB", seq_len=1024, global_batch=64, strategies=("zero3", "ddp"))
    other = next(c for c in p.feasible if c is not p.chosen)
    assert p.to_plan(other.name).strategy == other.strategy.name
    assert p.to_plan(other.name.upper()).strategy == other.strategy.name  # as --choose takes it
    with pytest.raises(UserError, match="candidate 'zero9' names no row"):
        p.to_plan("zero9")


def test_bad_settings_are_one_line():
    with pytest.raises(UserError, match="unknown setting 'sequence' for Job"):
        tk.estimate("gpt2", strategy="ddp", sequence=1024)
    with pytest.raises(UserError, match="--precision"):
        tk.estimate("gpt2", strategy="ddp", seq_len=1024, precision="fp8")
    with pytest.raises(UserError):
        tk.plan("gpt2", "8xH100-80GB", seq_len=1024, global_batch=64, strategies="zero9")


def test_a_model_by_numbers_and_an_adapter():
    spec = tk.model(params=7e9)
    e = tk.estimate(spec, "1xA100-80GB", strategy="ddp", seq_len=2048, method="lora")
    full = tk.estimate(spec, "1xA100-80GB", strategy="ddp", seq_len=2048)
    assert e.job.method == "lora" and e.memory.required_bytes < full.memory.required_bytes / 2

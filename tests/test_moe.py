"""Mixture-of-experts models through the default paths: plan, the MoE parts found from the model, ZeRO-3 leaf
modules (plan, toolkit.train, a user's script) and check's finding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from toolkit.cli import main

ARCH = Path(__file__).parent / "arch_configs"


def _model_dir(name: str, root: Path) -> Path:
    folder = root / name
    folder.mkdir()
    shutil.copy(ARCH / f"{name}.json", folder / "config.json")
    return folder


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b-v0.1"])
def test_moe_models_plan_through_the_default_path(name, tmp_path, capsys):
    """`toolkit plan` of a real MoE config as a new user runs it (all strategies, automatic tiling and
    checkpointing) on one and two 8xH100 nodes plans without a traceback and tiles no MoE block (DeepSpeed's
    TiledMLP cannot run one: issue 34's Qwen3-MoE ValueError and GPT-OSS TypeError)."""
    folder = _model_dir(name, tmp_path)
    for nodes in ("1", "2"):
        assert main(["plan", str(folder), "--gpus", "8xH100-80GB", "--nodes", nodes, "--seq", "2048",
                     "--global-batch", "16", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["chosen"] is not None and out["chosen"]["feasible"]
        assert not any(c["tiled"] for c in out["candidates"])
        assert any(c["strategy"] == "zero3" for c in out["candidates"])

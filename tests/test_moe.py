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


@pytest.mark.parametrize("name, block, router, experts, top_k, shared, extra", [
    ("qwen3-30b-a3b", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", 4, 8, (), {}),
    ("gpt-oss-20b", "GptOssMLP", "GptOssTopKRouter", 4, 4, (), {}),
    ("mixtral-8x7b-v0.1", "MixtralSparseMoeBlock", "MixtralTopKRouter", 4, 2, (), {}),
    ("qwen1.5-moe-a2.7b", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", 4, 4, ("shared_expert", "shared_expert_gate"), {}),
    ("deepseek-v3", "DeepseekV3MoE", "DeepseekV3TopkRouter", 4, 8, ("shared_experts",), {"first_k_dense_replace": 1}),
])
def test_the_moe_parts_are_found_from_the_model(name, block, router, experts, top_k, shared, extra):
    """The block holding router and experts, the expert count (the fused experts' leading dimension), the router's
    top_k and the shared experts come from the meta-device model, for five architectures without a table."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.inputs.modelconfig import config_from_dict
    from toolkit.inputs.modelspec import spec_from_config_dict
    from toolkit.inputs.moe import find_moe
    from toolkit.run.tiny import shrink_config

    config = shrink_config(config_from_dict(json.loads((ARCH / f"{name}.json").read_text()), name), layers=2,
                           experts=experts, **extra)
    config.num_experts_per_tok = min(top_k, experts)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parts = find_moe(model, config)
    assert (parts.block_class, parts.router_class, parts.experts, parts.top_k, parts.shared) == \
        (block, router, experts, min(top_k, experts), shared)
    assert parts.moe_layers == (1 if extra else 2)
    spec = spec_from_config_dict(config.to_dict(), name=name)
    assert (spec.moe_block, spec.moe_experts, spec.moe_top_k) == (block, experts, min(top_k, experts))


def test_a_dense_model_and_a_config_declaring_unused_experts_have_no_moe_parts():
    """Nemotron-H's config class declares 8 experts by default, but its layers hold none: the model decides."""
    from toolkit.inputs.modelspec import resolve_model

    for name in ("qwen3-0.6b", "nemotron-h-56b"):
        spec = resolve_model(str(ARCH / f"{name}.json"))
        assert (spec.moe_block, spec.moe_experts, spec.moe_top_k) == (None, 0, 0)
        assert spec.active_params == spec.params

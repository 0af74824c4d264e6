"""presets/sets/ is exactly what the emitter writes today (regenerate: python -m toolkit.emit.presets --write)."""

from __future__ import annotations

import filecmp
import stat

from toolkit.check.folder import check_paths
from toolkit.emit.presets import SETS_DIR, preset_names, preset_plan, write_presets


def tree(root):
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def test_preset_folder_equals_the_emitter_output_byte_for_byte(tmp_path):
    write_presets(tmp_path)
    fresh, committed = tree(tmp_path), tree(SETS_DIR)
    assert sorted(committed) == sorted(fresh), "run: python -m toolkit.emit.presets --write"
    for name, path in fresh.items():
        assert filecmp.cmp(path, committed[name], shallow=False), f"{name} differs; run python -m toolkit.emit.presets --write"
        assert bool(path.stat().st_mode & stat.S_IXUSR) == bool(committed[name].stat().st_mode & stat.S_IXUSR), name


def test_every_strategy_in_bf16_and_fp16():
    names = set(preset_names())
    for strategy in ("zero1", "zero2", "zero3", "zero3-offload", "fsdp2", "pipeline", "hybrid"):
        assert {f"{strategy}-bf16", f"{strategy}-fp16"} <= names
    assert {p.name for p in SETS_DIR.iterdir()} == names


def test_presets_describe_their_reference_job():
    text = (SETS_DIR / "zero3-bf16" / "PLAN.md").read_text()
    assert "meta-llama/Llama-2-7b-hf" in text and "1 node(s) x 8 H100-80GB" in text
    assert "micro 2 x accum 8 x dp 8 = 128" in text


def test_presets_pass_toolkit_check():
    assert check_paths([str(SETS_DIR / name) for name in preset_names()]) == []


def test_presets_carry_their_ds_config_inside_the_yaml():
    """No path to resolve: the YAML holds ds_config.json's content (a preset folder works copied anywhere)."""
    import json

    import yaml

    folder = SETS_DIR / "zero2-bf16"
    config = yaml.safe_load((folder / "accelerate_config.yaml").read_text())
    inline = json.loads(config["deepspeed_config"]["deepspeed_config_file"])
    assert inline == json.loads((folder / "ds_config.json").read_text())
    assert preset_plan("hybrid", "bf16").num_machines == 2

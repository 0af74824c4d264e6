"""Built-in catalogs: presets/models/*.json (real HF config.json content) and presets/gpus.json.

Model configs are checked by building each model on the meta device (no weights, no hub
access) and counting parameters; tied weights count once, as ``model.parameters()`` yields them.
"""

from __future__ import annotations

import json
import numbers
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "presets" / "models"
GPUS_FILE = ROOT / "presets" / "gpus.json"

MODEL_FILES = sorted(MODELS_DIR.glob("*.json"))

# Exact counts established independently of the catalog (meta-device builds, tied weights once).
KNOWN_COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-3-70b": 70_553_706_496,
}

REQUIRED_MODELS = [
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl",
    "llama-2-7b", "llama-2-13b", "llama-2-70b",
    "llama-3-8b", "llama-3-70b", "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b",
    "mistral-7b", "mixtral-8x7b",
    "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-72b",
    "gemma-2-2b", "gemma-2-9b", "gemma-2-27b",
    "opt-1.3b", "phi-3-mini", "tinyllama-1.1b",
    "qwen3-0.6b", "qwen3-30b-a3b", "deepseek-v3",
]

MODEL_CARD_SIZES = {"qwen3-0.6b": 0.6e9, "qwen3-30b-a3b": 30.5e9, "deepseek-v3": 671e9}
"""Entries without an exact published count: the size their model card states (Qwen3-0.6B "0.6B", Qwen3-30B-A3B
"30.5B in total"; DeepSeek-V3 "671B total parameters", its technical report, the multi-token-prediction module
that transformers does not build left out), to the figure's last digit."""


def _load(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def _hf_config(d: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(**{k: v for k, v in d.items() if not k.startswith("_")})


_COUNT_CACHE: dict[str, int] = {}


def _meta_count(name: str) -> int:
    if name not in _COUNT_CACHE:
        import torch
        from transformers import AutoModelForCausalLM

        cfg = _hf_config(_load(MODELS_DIR / f"{name}.json"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        _COUNT_CACHE[name] = sum(p.numel() for p in model.parameters())
        del model
    return _COUNT_CACHE[name]


# ---------------------------------------------------------------- models


def test_model_catalog_complete():
    present = {p.stem for p in MODEL_FILES}
    missing = [m for m in REQUIRED_MODELS if m not in present]
    assert not missing, f"missing model presets: {missing}"


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.stem)
def test_model_file_shape(path: Path):
    d = _load(path)
    assert isinstance(d.get("model_type"), str) and d["model_type"]
    assert isinstance(d.get("architectures"), list) and d["architectures"]
    assert d["architectures"][0].endswith(("ForCausalLM", "LMHeadModel"))
    hub = d.get("_hub_id")
    assert isinstance(hub, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", hub), hub
    if "_published_params" in d:
        pp = d["_published_params"]
        assert isinstance(pp, int) and not isinstance(pp, bool) and pp > 0
    extra = [k for k in d if k.startswith("_") and k not in ("_hub_id", "_published_params")]
    assert not extra, f"unexpected private keys {extra}"


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.stem)
def test_model_builds_and_matches_published(path: Path):
    d = _load(path)
    cfg = _hf_config(d)
    assert cfg.model_type == d["model_type"]
    n = _meta_count(path.stem)
    assert n > 0
    if "_published_params" in d:
        assert n == d["_published_params"], (
            f"{path.stem}: built {n:,} != published {d['_published_params']:,}"
        )


@pytest.mark.parametrize("name,size", sorted(MODEL_CARD_SIZES.items()))
def test_model_card_sizes(name: str, size: float):
    """The catalog copies these configs from tests/arch_configs (the hub's config.json), less the keys that are
    not the architecture: auto_map, the FP8 checkpoint's quantization_config, transformers_version."""
    digits = len(f"{size:.3g}".split("e")[0].replace(".", "").rstrip("0"))
    assert float(f"{_meta_count(name):.{digits}g}") == size
    source = _load(ROOT / "tests" / "arch_configs" / f"{name}.json")
    left_out = {"auto_map", "quantization_config", "transformers_version", "_hub_id"}
    entry = _load(MODELS_DIR / f"{name}.json")
    assert {k: v for k, v in entry.items() if k not in left_out} == \
        {k: v for k, v in source.items() if k not in left_out}


@pytest.mark.parametrize("name,count", sorted(KNOWN_COUNTS.items()))
def test_known_counts(name: str, count: int):
    assert _meta_count(name) == count
    assert _load(MODELS_DIR / f"{name}.json").get("_published_params") == count


def test_model_architecture_details():
    """Spot-check keys that change the architecture but not always the count."""
    q = _load(MODELS_DIR / "qwen2.5-7b.json")
    assert q["model_type"] == "qwen2" and q["num_key_value_heads"] == 4
    assert q["tie_word_embeddings"] is False
    assert _load(MODELS_DIR / "qwen2.5-0.5b.json")["tie_word_embeddings"] is True

    g = _load(MODELS_DIR / "gemma-2-27b.json")
    assert g["head_dim"] == 128 and g["query_pre_attn_scalar"] == 144
    assert g["attn_logit_softcapping"] == 50.0 and g["final_logit_softcapping"] == 30.0
    assert g["sliding_window"] == 4096

    m = _load(MODELS_DIR / "mixtral-8x7b.json")
    assert m["num_local_experts"] == 8 and m["num_experts_per_tok"] == 2

    l31 = _load(MODELS_DIR / "llama-3.1-8b.json")
    assert l31["rope_scaling"]["rope_type"] == "llama3"
    assert l31["max_position_embeddings"] == 131072

    assert _load(MODELS_DIR / "mistral-7b.json")["sliding_window"] == 4096
    opt = _load(MODELS_DIR / "opt-1.3b.json")
    assert opt["do_layer_norm_before"] is True and opt["word_embed_proj_dim"] == 2048


def test_qwen2_attention_bias_is_built():
    """qwen2 has q/k/v biases (implicit in the architecture, not a config key)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(_load(MODELS_DIR / "qwen2.5-0.5b.json"))
    cfg.num_hidden_layers = 1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


# ---------------------------------------------------------------- GPUs

GPU_NUMERIC = [
    "bf16_tflops", "fp16_tflops", "fp32_tflops", "tf32_tflops",
    "hbm_gbps", "intra_node_gbps", "pcie_gbps",
]
GPU_FIELDS = {
    "name", "architecture", "aliases", "memory_bytes", *GPU_NUMERIC,
    "interconnect", "bf16_supported", "source",
}
OPTIONAL_GPU_FIELDS = {"tdp_w", "die", "cuda_context_bytes"}  # power: the TDP the peaks are quoted at, the die; a measured context
ARCHITECTURES = {"volta", "turing", "ampere", "ada", "hopper", "blackwell", "cdna2", "cdna3"}
INTERCONNECTS = {
    "nvlink2", "nvlink3", "nvlink4", "nvlink5", "pcie3", "pcie4", "pcie5", "pcie6", "xgmi",
}
REQUIRED_GPUS = [
    "V100-16GB", "V100-32GB", "T4", "A10G", "L4", "L40S", "RTX-4090", "A100-40GB",
    "A100-80GB", "H100-SXM-80GB", "H100-PCIe-80GB", "H200-141GB", "B200", "MI250X", "MI300X",
]


@pytest.fixture(scope="module")
def gpus() -> list[dict]:
    data = _load(GPUS_FILE)
    assert isinstance(data, dict) and set(data) == {"gpus"}
    assert isinstance(data["gpus"], list) and data["gpus"]
    return data["gpus"]


def _lookup(gpus: list[dict], key: str) -> dict:
    k = key.lower()
    hits = [g for g in gpus if g["name"].lower() == k or k in (a.lower() for a in g["aliases"])]
    assert len(hits) == 1, f"{key!r} resolves to {len(hits)} entries"
    return hits[0]


def test_gpu_catalog_complete(gpus):
    names = [g["name"] for g in gpus]
    missing = [n for n in REQUIRED_GPUS if n not in names]
    assert not missing, f"missing GPU entries: {missing}"


def test_gpu_fields_and_ranges(gpus):
    for g in gpus:
        name = g.get("name")
        assert GPU_FIELDS <= set(g) <= GPU_FIELDS | OPTIONAL_GPU_FIELDS, f"{name}: fields {sorted(set(g) ^ GPU_FIELDS)}"
        if "tdp_w" in g or "die" in g:
            assert 50 <= g["tdp_w"] <= 1500 and isinstance(g["die"], str) and g["die"], f"{name}: power fields"
        assert isinstance(name, str) and name
        assert g["architecture"] in ARCHITECTURES, f"{name}: architecture {g['architecture']!r}"
        assert isinstance(g["aliases"], list)
        assert all(isinstance(a, str) and a for a in g["aliases"])
        mem = g["memory_bytes"]
        assert isinstance(mem, int) and not isinstance(mem, bool)
        assert 8 * 2**30 <= mem <= 256 * 2**30, f"{name}: memory {mem}"
        for f in GPU_NUMERIC:
            v = g[f]
            assert isinstance(v, numbers.Real) and not isinstance(v, bool), f"{name}.{f}"
            assert v >= 0, f"{name}.{f}"
        assert isinstance(g["bf16_supported"], bool)
        if g["bf16_supported"]:
            assert g["bf16_tflops"] > 0
        else:
            assert g["bf16_tflops"] == 0
        assert 1 <= g["fp32_tflops"] <= 200, f"{name}: fp32"
        assert 10 <= g["fp16_tflops"] <= 5000, f"{name}: fp16"
        assert g["fp16_tflops"] >= g["fp32_tflops"]
        assert g["bf16_tflops"] <= 5000 and g["tf32_tflops"] <= 2500
        if g["tf32_tflops"]:
            assert g["tf32_tflops"] <= g["fp16_tflops"]
        assert 100 <= g["hbm_gbps"] <= 10000, f"{name}: hbm"
        assert 8 <= g["intra_node_gbps"] <= 1000, f"{name}: intra-node"
        assert 8 <= g["pcie_gbps"] <= 128, f"{name}: pcie"
        assert g["interconnect"] in INTERCONNECTS, f"{name}: {g['interconnect']}"
        if g["interconnect"].startswith("pcie"):
            assert g["intra_node_gbps"] <= g["pcie_gbps"]
        assert isinstance(g["source"], str) and g["source"].strip()


def test_gpu_names_and_aliases_unique(gpus):
    seen: dict[str, str] = {}
    for g in gpus:
        for key in [g["name"], *g["aliases"]]:
            k = key.lower()
            assert k not in seen, f"{key!r} used by {seen[k]} and {g['name']}"
            seen[k] = g["name"]


@pytest.mark.parametrize(
    "typed,name",
    [
        ("a100-80gb", "A100-80GB"), ("A100-80GB", "A100-80GB"),
        ("A100-40GB", "A100-40GB"), ("H100-80GB", "H100-SXM-80GB"),
        ("h100-sxm-80gb", "H100-SXM-80GB"), ("H100-PCIe", "H100-PCIe-80GB"), ("4090", "RTX-4090"),
        ("H200", "H200-141GB"), ("V100-32GB", "V100-32GB"), ("t4", "T4"), ("mi300x", "MI300X"),
    ],
)
def test_gpu_alias_resolution(gpus, typed, name):
    assert _lookup(gpus, typed)["name"] == name


@pytest.mark.parametrize("typed", ["A100", "a100", "H100", "h100-sxm", "V100", "A100-SXM4", "H100_SXM5"])
def test_a_gpu_family_is_refused_with_its_members(typed):
    """`--gpus 8xA100` once meant 80 GB silently: a name several entries share is refused, naming them."""
    from toolkit.errors import UserError
    from toolkit.inputs.hardware import find_gpu

    with pytest.raises(UserError, match="is ambiguous: the catalog has ") as refused:
        find_gpu(typed)
    assert "\n" not in str(refused.value)


def test_no_alias_is_a_family_of_several_entries(gpus):
    """find_gpu resolves a name only when it is exact: no alias (or name) may be the leading part of another
    entry's name or alias, or typing it would silently pick one member of a family."""
    from toolkit.inputs.hardware import _norm

    keys = {_norm(k): g["name"] for g in gpus for k in [g["name"], *g["aliases"]]}
    for key, owner in keys.items():
        others = {name for k, name in keys.items() if k.startswith(key + "-") and name != owner}
        assert not others, f"{key!r} of {owner} also leads {sorted(others)}"


def test_gpu_spot_values(gpus):
    h100 = _lookup(gpus, "H100-80GB")
    assert h100["bf16_tflops"] == pytest.approx(989, abs=1)
    assert h100["fp16_tflops"] == pytest.approx(989, abs=1)
    assert h100["interconnect"] == "nvlink4"
    a100 = _lookup(gpus, "A100-80GB")
    assert a100["bf16_tflops"] == 312 and a100["tf32_tflops"] == 156
    assert _lookup(gpus, "A100-40GB")["bf16_tflops"] == 312
    for no_bf16 in ("V100-16GB", "V100-32GB", "T4"):
        g = _lookup(gpus, no_bf16)
        assert g["bf16_supported"] is False and g["bf16_tflops"] == 0
    # Memory ordering that a planner relies on.
    mem = {n: _lookup(gpus, n)["memory_bytes"] for n in REQUIRED_GPUS}
    assert mem["V100-16GB"] < mem["V100-32GB"] < mem["A100-40GB"] < mem["A100-80GB"]
    assert mem["H100-SXM-80GB"] < mem["H200-141GB"] < mem["B200"] < mem["MI300X"]
    assert 60 * 2**30 <= mem["MI250X"] <= 64 * 2**30  # one GCD, as PyTorch sees it


def test_gpu_catalog_resolves_through_hardware_module(gpus):
    """Every name and alias resolves to its own entry through the loader the planner uses."""
    hardware = pytest.importorskip("toolkit.inputs.hardware")
    for g in gpus:
        for key in [g["name"], *g["aliases"]]:
            assert hardware.find_gpu(key).name == g["name"], key
        gpu = hardware.find_gpu(g["name"])
        assert gpu.memory_bytes == g["memory_bytes"] and gpu.bf16_tflops == g["bf16_tflops"]


def test_power_limit_lowers_the_tensor_peak_between_one_dies_datasheet_points():
    """H100 SXM (700 W, 989 TFLOP/s) and H100 NVL (400 W, 835.5) share a die: a 500 W limit sits on the line between
    them; at the TDP nothing is scaled; above the TDP, below the lowest point or on a GPU with no sibling entry a limit
    is refused with one line."""
    hardware = pytest.importorskip("toolkit.inputs.hardware")
    from toolkit.errors import UserError

    sxm = hardware.find_gpu("H100-SXM-96GB")
    capped = hardware.power_limited(sxm, 500)
    assert capped.bf16_tflops == pytest.approx(835.5 + (989.4 - 835.5) / 3, rel=1e-6)
    assert capped.fp16_tflops / sxm.fp16_tflops == pytest.approx(capped.bf16_tflops / sxm.bf16_tflops)
    assert capped.hbm_gbps == sxm.hbm_gbps == 2400 and capped.power_limit_w == 500
    at_tdp = hardware.power_limited(sxm, 700)
    assert at_tdp.bf16_tflops == sxm.bf16_tflops and at_tdp.power_limit_w == 700  # recorded, nothing scaled
    assert hardware.power_limited(hardware.find_gpu("H100-NVL"), 400).bf16_tflops == pytest.approx(835.5)
    hw = hardware.parse_hardware("2x8xH100-SXM-96GB", power_limit_w=500)
    assert hw.gpu.bf16_tflops == pytest.approx(capped.bf16_tflops) and hw.world_size == 16
    with pytest.raises(UserError, match="power limit 300 W cannot be modelled for it"):
        hardware.power_limited(hardware.find_gpu("A100-80GB"), 300)
    for watts, words in ((701, "above H100-SXM-96GB's 700 W"), (399, "below 400 W"), (0, "must be positive")):
        with pytest.raises(UserError, match=words):
            hardware.power_limited(sxm, watts)

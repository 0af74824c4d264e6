"""Mixture-of-experts findings of `toolkit check`: a ZeRO-3 DeepSpeed config for an MoE model with per-expert
submodules whose MoE block is not a leaf module (docs/ENGINE_FACTS.md "Mixture of experts under ZeRO-3"; fused
experts, transformers 5's, need none: every rank calls the one experts module once a pass), and DeepSpeed AutoEP
(`"expert_parallel"`) asked of a model it cannot split: a dense model, an expert count autoep_size does not divide,
a preset for another model type or none for this one.

What check can know: the model (a plan folder's model_config, or `--model` beside a DeepSpeed JSON; a lone JSON
names no model, so nothing is said) and the leaf modules the JSON gives DeepSpeed's engine (its
zero_optimization.leaf_module, read through DeepSpeed's own config model, whose default list names three
transformers MoE blocks). What it cannot know: a script that calls deepspeed.utils.set_z3_leaf_modules itself, or
accelerate's --deepspeed_moe_layer_cls_names on a launch line; the finding says so and is a warning, not an error.
"""

from __future__ import annotations

from typing import Any

from toolkit.check.findings import EVERY, Problem


def _leaf_config(zero: dict[str, Any]):
    """DeepSpeed's parsed leaf_module block (its defaults when absent), or None when DeepSpeed would refuse it (the
    config checks say why)."""
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig

    try:
        return DeepSpeedZeroLeafModuleConfig(**(zero.get("leaf_module") or {}))
    except Exception:  # noqa: BLE001 - DeepSpeed's own validation error; ds_problems reports the file
        return None


def leaf_module_problem(config: dict[str, Any], file: str, *, model: str, moe_block: str | None,
                        yaml_fields: bool = False) -> Problem | None:
    """A warning when `config` runs ZeRO-3 and `moe_block` (the model's MoE block class where ZeRO-3 needs it as a
    leaf: its experts are separate submodules, toolkit.inputs.modelspec `leaf_module_needed`; None for fused
    experts, which every rank calls once a pass) is not among the leaf module classes DeepSpeed's engine will flag;
    None otherwise. yaml_fields: `config` is what
    accelerate builds from a YAML's own deepspeed_config fields, so the fix is accelerate's key."""
    zero = config.get("zero_optimization")
    if not moe_block or not isinstance(zero, dict) or zero.get("stage") != 3:
        return None
    leaf = _leaf_config(zero)
    if leaf is None or any(c == moe_block or c.endswith(f".{moe_block}") for c in leaf.classes):
        return None
    fix = (f"add deepspeed_moe_layer_cls_names: {moe_block} to deepspeed_config" if yaml_fields else
           f"add \"leaf_module\": {{\"classes\": [\"{moe_block}\"]}} to zero_optimization")
    fix += (", or call "
           f"deepspeed.utils.set_z3_leaf_modules(model, [\"{moe_block}\"]) before the engine wraps the model "
           "(check cannot see a script that already does)")
    if leaf.names or leaf.name_suffixes:
        return Problem(file, "note", f"ZeRO-3 with {model}, a mixture of experts: leaf_module names modules by "
                       f"name, which check does not match against the model; make sure they cover every "
                       f"{moe_block}, or {fix}", EVERY)
    said = (f"leaf_module.classes is {leaf.classes}" if "leaf_module" in zero else
            "no leaf_module, and DeepSpeed's default list names only "
            + ", ".join(c.rsplit(".", 1)[-1] for c in leaf.classes))
    return Problem(file, "warning", f"ZeRO-3 with {model}, a mixture of experts: its MoE block {moe_block} is not a "
                   f"leaf module ({said}) and its experts are separate modules, so each rank gathers the experts its "
                   "tokens pick, in an order routing changes (hangs and wrong prefetches, DeepSpeed's "
                   "set_z3_leaf_modules); " + fix, EVERY)


def yaml_leaf_module_problem(config: dict[str, Any], path, *, model: str, moe_block: str | None) -> Problem | None:
    """The same finding for an accelerate YAML: its DeepSpeed JSON (the copy it carries, or the file it names), else
    the ZeRO stage of its own deepspeed_config fields; accelerate's deepspeed_moe_layer_cls_names (applied in
    Accelerator.prepare, DeepSpeedPlugin.set_moe_leaf_modules) covers the block too."""
    from toolkit.check.accelerate import resolve_ds_file
    from toolkit.check.read import read_config
    from toolkit.emit.accelerate import inline_ds_config

    section = config.get("deepspeed_config")
    if not moe_block or config.get("distributed_type") != "DEEPSPEED" or not isinstance(section, dict):
        return None
    names = str(section.get("deepspeed_moe_layer_cls_names") or "").split(",")
    if moe_block in (n.strip() for n in names):
        return None
    ds_file = section.get("deepspeed_config_file")
    if ds_file:
        ds = inline_ds_config(ds_file)
        if ds is None:
            found = resolve_ds_file(str(ds_file), path, [], quiet=True)
            ds = read_config(found) if found is not None else None
        return leaf_module_problem(ds, str(path), model=model, moe_block=moe_block) if isinstance(ds, dict) else None
    stage = section.get("zero_stage")
    return leaf_module_problem({"zero_optimization": {"stage": stage}}, str(path), model=model, moe_block=moe_block,
                               yaml_fields=True)


def autoep_problems(config: dict[str, Any], file: str, *, model: str, model_type: str, experts: int) -> list[Problem]:
    """DeepSpeed AutoEP's own rules for `config`'s expert_parallel section against the model (module_inject/
    auto_ep_config.py validate_autoep_post_detection, auto_ep.py detection, auto_ep_presets/registry.py)."""
    if not isinstance(config.get("expert_parallel"), dict):
        return []
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS, preset_name_for_hf_model_type
    from deepspeed.runtime.config import get_expert_parallel_config

    try:
        ep = get_expert_parallel_config(config)
    except (ValueError, TypeError):  # DeepSpeed's own refusal of the section; the config checks report it
        return []
    if not ep.enabled:
        return []

    def error(message: str) -> Problem:
        return Problem(file, "error", f"expert_parallel (DeepSpeed AutoEP) with {model}: {message}", EVERY)

    if not experts:
        return [error("a dense model (no MoE block): AutoEP finds no MoE layer to split; remove expert_parallel")]
    out = []
    size = ep.autoep_size
    if size > experts or experts % size:
        sizes = [d for d in range(1, experts + 1) if experts % d == 0]
        out.append(error(f"autoep_size {size} does not divide its {experts} experts (each rank owns experts / "
                         f"autoep_size of them); use one of {sizes}"))
    preset = ep.preset_model
    fitting = preset_name_for_hf_model_type(model_type)
    if preset and preset in PRESET_MODELS and model_type not in PRESET_MODELS[preset].hf_model_types:
        out.append(error(f"preset_model {preset} is for model types {', '.join(PRESET_MODELS[preset].hf_model_types)}"
                         f", not {model_type}; " + (f"use preset_model {fitting}" if fitting else
                                                    "AutoEP has no preset for it")))
    elif not preset and fitting is None:
        out.append(error(f"AutoEP has no preset for model type {model_type} (presets: {', '.join(PRESET_MODELS)}): "
                         "it detects no MoE layer, logs a warning and trains without expert parallelism; use ZeRO-3 "
                         "with the MoE block as leaf module instead"))
    return out

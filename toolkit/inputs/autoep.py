"""DeepSpeed AutoEP as a planned route: which ZeRO plans may split a model's experts with
`"expert_parallel": {"enabled": true, "autoep_size": N, "preset_model": ...}` (deepspeed 0.19.8, applied in
runtime/engine.py `DeepSpeedEngine._configure_expert_parallel`; docs/ENGINE_FACTS.md, the AutoEP entry).

The engine's rules, read in its source:
  - a preset for the model type (module_inject/auto_ep_presets/registry.py `preset_name_for_hf_model_type`): without
    one AutoEP finds no MoE layer and trains without expert parallelism;
  - autoep_size divides the expert count and does not exceed it (auto_ep_config.py
    `validate_autoep_post_detection`), and tiles the world (auto_ep_folding.py `build_folding_spec`:
    stage_size % (ep x etp) == 0) with no pipeline / tensor / sequence degree here;
  - ZeRO stage 0, 1, 2 and a constrained ZeRO-3 (engine.py `_validate_zero3_moe_compatibility`: no sequence
    parallelism, zero_quantized_gradients or hpZ, expert_tensor_parallel_size 1; toolkit's AutoEP grids have none of
    them). toolkit plans ZeRO-1, ZeRO-2 and ZeRO-3 without offload. Under ZeRO-3 the engine partitions each
    parameter over its own group (the dense ones over every rank, the experts over world / autoep_size, measured:
    docs/ENGINE_FACTS.md, the AutoEP entry), and toolkit.train.autoep_export saves it (a plain HF Trainer cannot:
    AUTOEP_ZERO3_SAVE). The offload paths are not modelled, and a plain torch DDP plan has no DeepSpeed engine.
Every rank has its own batch: the expert group exchanges routed tokens by all-to-all (auto_ep_layer.py), dense
parameters are data-parallel over the world, expert parameters over world / autoep_size ranks."""

from __future__ import annotations

from typing import Any

from toolkit.errors import options_text
from toolkit.inputs.strategy import Engine, Strategy

AUTOEP_STAGES = (1, 2, 3)
"""ZeRO stages toolkit plans AutoEP on (see the module docstring; stage 0 is plain DDP-like data parallelism,
which toolkit plans as ddp)."""

AUTOEP_ZERO3_SAVE = ("a plain HF Trainer saves a ZeRO-3 model through the engine's 16-bit consolidated state dict, "
                     "which DeepSpeed refuses for AutoEP's expert partitions (NotImplementedError, runtime/engine.py "
                     "_raise_if_autoep_zero3_consolidated_export)")
"""What `toolkit check` says of a config asking AutoEP under ZeRO-3 for a plain HF Trainer: measured on 2 gloo ranks
(tiny Qwen3-MoE, autoep_size 2, fp32), 3 steps train to the single-process losses, then the first save raises
(docs/ENGINE_FACTS.md, the AutoEP entry). toolkit.train saves through toolkit.train.autoep_export.AutoEPSaves."""


def autoep_preset(model_type: str) -> str | None:
    """DeepSpeed's AutoEP preset name for a Hugging Face model type, or None (its own registry)."""
    from deepspeed.module_inject.auto_ep_presets.registry import preset_name_for_hf_model_type

    return preset_name_for_hf_model_type(model_type)


def autoep_strategy_problem(strategy: Strategy) -> str | None:
    """Why toolkit plans no AutoEP on `strategy`, or None."""
    if strategy.engine != Engine.DEEPSPEED:
        return None
    if strategy.zero_stage not in AUTOEP_STAGES:
        return (f"DeepSpeed AutoEP on {strategy.name} is not planned (toolkit plans it on ZeRO-1, ZeRO-2 and ZeRO-3); "
                "use zero1, zero2 or zero3 with --expert-parallel")
    if strategy.offloads:
        return (f"DeepSpeed AutoEP on {strategy.name} is not planned: optimizer offload with expert parameter groups "
                "is not modelled; use zero1, zero2 or zero3 with --expert-parallel")
    return None


def autoep_problem(spec: Any, expert: int) -> str | None:
    """Why `spec` cannot split its experts over `expert` ranks under DeepSpeed AutoEP, or None."""
    if not spec.moe_experts:
        return (f"--expert-parallel {expert} needs a mixture-of-experts model; {spec.name} is dense (no routed "
                "experts found in its layers); drop --expert-parallel")
    preset = autoep_preset(spec.model_type)
    if preset is None:
        from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

        return (f"DeepSpeed AutoEP has no preset for model type {spec.model_type} (presets: "
                f"{', '.join(PRESET_MODELS)}): it would find no MoE layer; use zero3 (the MoE block as a leaf "
                "module) or fsdp2 --expert-parallel")
    if spec.moe_experts % expert:
        fits = [d for d in range(2, spec.moe_experts + 1) if spec.moe_experts % d == 0]
        return (f"--expert-parallel {expert} does not divide {spec.name}'s {spec.moe_experts} experts (DeepSpeed "
                f"AutoEP's autoep_size: each rank owns experts / autoep_size); try {options_text(fits, limit=6)}")
    return None


def autoep_optimizer_problem(optimizer: str) -> str | None:
    """Why an AutoEP plan cannot train with `optimizer`, or None. Its ZeRO builds the optimizer from the DeepSpeed
    JSON's own block (toolkit writes AdamW's): a client optimizer's param groups mark no MoE parameters, which
    DeepSpeed refuses at start ("The model has moe layers, but None of the param groups are marked as MoE",
    runtime/engine.py), and toolkit emits a block for AdamW only."""
    if optimizer == "adamw":
        return None
    return (f"--optimizer {optimizer} with DeepSpeed AutoEP: its ZeRO takes the optimizer from the DeepSpeed JSON "
            "(toolkit writes AdamW's; a client optimizer's param groups mark no MoE parameters and DeepSpeed refuses "
            "it); use --optimizer adamw, or fsdp2 --expert-parallel")


def autoep_section(model_type: str, expert: int) -> dict[str, Any]:
    """The DeepSpeed JSON's expert_parallel section for a plan of `expert` ranks."""
    return {"enabled": True, "autoep_size": expert, "preset_model": autoep_preset(model_type)}

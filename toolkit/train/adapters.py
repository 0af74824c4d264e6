"""LoRA / QLoRA in toolkit.train: which adapter a run trains (the plan's method, or --lora / --qlora), the PEFT
wrapping of the loaded model, and the merged-model save.

The base is loaded in the compute dtype (what toolkit.estimate.memory budgets: toolkit.inputs.lora.base_storage_bytes_per_param)
and wrapped by peft.get_peft_model, whose default autocast_adapter_dtype=True keeps the adapters in fp32. The
Trainer then sees a PeftModel: it saves adapter_config.json + adapter_model.safetensors (PEFT format) in every
checkpoint and in the final output, and resumes from them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from toolkit.errors import UserError
from toolkit.inputs.lora import Adapter
from toolkit.inputs.job import adapter_problem, base_dtype_problem


def adapter_for_run(plan, args) -> Adapter | None:
    """The plan's adapter, switched on or changed by the run's flags; None for full fine-tuning."""
    adapter = Adapter(**plan.adapter) if plan.adapter else Adapter()
    if plan.method != "full" and not plan.adapter:
        adapter = replace(adapter, method=plan.method)
    if args.lora and args.qlora:
        raise UserError("give --lora or --qlora, not both")
    if args.lora or args.qlora:
        adapter = replace(adapter, method="qlora" if args.qlora else "lora")
    overrides = {k: v for k, v in (("r", args.lora_r), ("alpha", args.lora_alpha), ("dropout", args.lora_dropout),
                                   ("targets", args.lora_targets), ("modules_to_save", args.lora_modules_to_save))
                 if v is not None}
    if overrides and not adapter.is_adapter:
        raise UserError("--lora-r/--lora-alpha/--lora-dropout/--lora-targets need a LoRA run: give --lora or "
                        "--qlora, or plan with --method lora")
    adapter = replace(adapter, **overrides)  # validates the values (UserError on bad ones)
    if not adapter.is_adapter:
        return None
    if args.lora or args.qlora or args.lora_dropout is not None:  # the run chose the adapter: PEFT's dropout rule
        from toolkit.inputs.lora import adapter_for_model
        from toolkit.inputs.modelspec import spec_from_config_dict

        spec = spec_from_config_dict(plan.model_config, name=plan.model, params=plan.params,
                                     images=bool(plan.images_per_sample))
        adapter = adapter_for_model(spec, adapter, dropout_given=args.lora_dropout is not None)
    problem = adapter_problem(adapter, plan.strategy_spec) or base_dtype_problem(  # the planner's rules
        adapter, plan.precision, plan.strategy_spec, objective=bool(plan.dpo or plan.grpo))
    if problem:
        raise UserError(problem)
    if args.merge_final and (args.random_init or adapter.method == "qlora"):
        raise UserError("--merge-final merges the adapter into saved 16-bit base weights: a --random-init run has "
                        "none and a QLoRA base is 4-bit; drop --merge-final (merge onto the original weights with "
                        "PeftModel.merge_and_unload)")
    return adapter


def base_dtype(plan):
    import torch

    from toolkit.inputs.lora import base_dtype_name

    return getattr(torch, base_dtype_name(plan.precision, plan.adapter_spec.base_dtype))


def quantization_config(adapter: Adapter):
    """transformers' BitsAndBytesConfig for a QLoRA base."""
    return bnb_config(adapter.bnb_config_kwargs())


def bnb_config(kwargs: dict):
    """BitsAndBytesConfig from Adapter.bnb_config_kwargs() (dtype names become torch dtypes)."""
    import torch
    from transformers import BitsAndBytesConfig

    dtypes = {k: getattr(torch, v) for k, v in kwargs.items() if k in ("bnb_4bit_compute_dtype",
                                                                        "bnb_4bit_quant_storage")}
    return BitsAndBytesConfig(**{**kwargs, **dtypes})


def wrap_model(model, adapter: Adapter, *, checkpointing: bool):
    """The PEFT model the Trainer trains (peft_wrap with the adapter's LoraConfig and --modules-to-save-dtype)."""
    return peft_wrap(model, adapter.lora_config(), adapter.saved_dtype, checkpointing=checkpointing)


def peft_wrap(model, lora_config, saved_dtype: str, *, checkpointing: bool):
    """peft.get_peft_model as toolkit.train and a user's script (toolkit.train.own_script.peft_model) run it. With
    activation checkpointing the frozen embedding's output must require grad so that the checkpointed layers'
    recompute reaches the adapters (enable_input_require_grads, which transformers' activation_checkpointing_enable
    also calls). `saved_dtype` (Adapter.saved_dtype) casts PEFT's trainable modules_to_save copies (which it
    deep-copies in the base's dtype) before any engine sees them."""
    from peft import get_peft_model

    from toolkit.inputs.lora import apply_saved_dtype

    if checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    try:
        wrapped = get_peft_model(model, lora_config)
    except ValueError as exc:
        message = str(exc).splitlines()[0][:200]
        fix = "give --lora-dropout 0 (MoE expert parameters take none)" if "lora_dropout" in message else \
            "check --lora-targets"
        raise UserError(f"PEFT refuses the adapter ({message}); {fix}") from None
    apply_saved_dtype(wrapped, saved_dtype)
    return wrapped


def save_merged(base_source: str, adapter_dir: Path, out_dir: Path, dtype) -> None:
    """Load the base weights, apply the saved adapter (PEFT format) and write the merged model in HF format."""
    from peft import PeftModel

    from toolkit.inputs.modelconfig import load_pretrained

    base = load_pretrained(base_source, dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out_dir))

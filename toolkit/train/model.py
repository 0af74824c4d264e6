"""Load the model the plan was made for, and refuse a different one with one clear message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.inputs.job import plan_positions_problem
from toolkit.inputs.modelconfig import model_positions, text_config
from toolkit.inputs.resolve import catalog_hub_id, loadable_model, locate_model
from toolkit.plan.schema import Plan

# Where configs keep the width, in the order HF architectures name it.
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def model_source(plan: Plan, model: str | None, *, random_init: bool = False) -> str:
    """What to load: --model when given; else the plan's model as something that loads (loadable_model), except a
    catalog name under --random-init, whose config the catalog itself supplies (no download)."""
    if model:
        return model
    if random_init and locate_model(plan.model).kind == "catalog" and catalog_hub_id(plan.model) is not None:
        return plan.model
    return loadable_model(plan.model)


def load_config(source: str, *, random_init: bool = False):
    """An HF config from a hub id, a model folder or a config.json path; a toolkit catalog name (a config
    without weights, as plans made from `--model llama-2-7b` name it) only for --random-init."""
    from transformers import AutoConfig

    from toolkit.inputs.resolve import catalog_name_of_hub_id

    path = Path(source).expanduser()
    shipped = catalog_name_of_hub_id(source)
    if shipped is not None:  # the hub id of a catalog model: its config ships in the package, no network call
        from toolkit.inputs.modelconfig import load_config as catalog_config

        return catalog_config(shipped)
    in_catalog = locate_model(source).kind == "catalog"
    if in_catalog and random_init:
        from toolkit.inputs.modelconfig import load_config as catalog_config

        return catalog_config(source)
    if in_catalog:  # no weights to train, and not a hub id: say what to pass instead of asking the hub
        hub_id = catalog_hub_id(source)
        hint = f"--model {hub_id} (its hub id), a local folder of its weights," if hub_id else \
            "--model with the hub id or local folder of its weights,"
        raise UserError(f"plan model '{source}' is a toolkit catalog entry (a config, no weights): pass {hint} "
                        "or --random-init")
    try:
        if path.is_file():
            return AutoConfig.from_pretrained(str(path.parent)) if path.name == "config.json" \
                else _config_from_json(path)
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        if in_catalog:
            raise UserError(f"plan model '{source}' is a toolkit catalog entry (a config, no weights): pass --model "
                            "with the hub id or local folder of its weights, or --random-init") from None
        raise UserError(f"cannot load the model config from {source}: {_first_line(exc)}; pass --model with a "
                        "hub id, a local model folder or a config.json") from None


def _config_from_json(path: Path):
    import json

    from transformers import AutoConfig

    data = json.loads(path.read_text())
    return AutoConfig.for_model(data.pop("model_type"), **data)


def config_value(config: Any, keys: tuple[str, ...]) -> Any:
    """The first of `keys` `config` sets, read from the decoder's own config (a multimodal class keeps its layers
    and width in text_config)."""
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    else:
        config = text_config(config)
    for key in keys:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if value is not None:
            return value
    return None


def check_matches_plan(config: Any, plan: Plan, source: str) -> None:
    """The model to train must be the one the plan's memory and batch arithmetic were computed for. The plan's
    model_config_overrides (its RoPE scaling, toolkit.inputs.rope) are set on `config` here, in place, so every
    route that loads the model (the HF runner, the pipeline runner, launch's preflight) builds the planned one."""
    mismatches = []
    if config.model_type != plan.model_type:
        mismatches.append(f"model_type {config.model_type} vs {plan.model_type}")
    layers = config_value(config, _LAYER_KEYS)
    if layers != plan.num_layers:
        mismatches.append(f"{layers} layers vs {plan.num_layers}")
    hidden, planned_hidden = config_value(config, _HIDDEN_KEYS), config_value(plan.model_config, _HIDDEN_KEYS)
    if planned_hidden is not None and hidden != planned_hidden:
        mismatches.append(f"hidden size {hidden} vs {planned_hidden}")
    if mismatches:
        raise UserError(f"model {source} is not the model the plan was made for ({plan.model}): "
                        f"{'; '.join(mismatches)}; re-plan for this model or pass the planned --model")
    from toolkit.inputs.attention import config_attention_problem

    problem = config_attention_problem(config, plan.attention, name=source)  # transformers would refuse it at load
    if problem:
        raise UserError(problem)
    if plan.model_config_overrides:
        from toolkit.inputs.rope import apply_overrides

        apply_overrides(config, plan.model_config_overrides, source)
    problem = plan_positions_problem(plan.seq_len, source, model_positions(config),
                                     rotary=bool(getattr(config, "rope_parameters", None)))
    if problem:
        raise UserError(problem)


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a tokenizer from {source}: {_first_line(exc)}; pass --tokenizer") from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"tokenizer {source} has no EOS token to separate packed documents; pass --tokenizer")
    return tokenizer


def check_vocab(config: Any, tokenizer: Any, source: str) -> None:
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but model {source} embeds only {vocab}; "
                        "use the model's own tokenizer")


def build_model(source: str, config: Any, plan: Plan, *, random_init: bool, attention: str, adapter=None,
                distributed_config=None):
    """Create the model. Under ZeRO-3 the caller must keep TrainingArguments(deepspeed=...) alive first, so
    transformers' HfDeepSpeedConfig makes from_pretrained / from_config partition under deepspeed.zero.Init.
    With a LoRA / QLoRA `adapter` the frozen base is loaded in the compute dtype (4-bit for QLoRA).
    With a `distributed_config` (tensor parallelism) transformers shards the model as it loads it; it shards only
    while loading a checkpoint, so random weights go through a temporary folder, as for QLoRA."""
    import torch
    from toolkit.inputs.modelconfig import auto_model_class

    # bf16-pure trains bf16 weights (and optimizer states); mixed precision keeps fp32 master weights.
    dtype = torch.bfloat16 if plan.precision == "bf16-pure" else torch.float32
    kwargs = dict(dtype=dtype, attn_implementation=attention)
    model_class = auto_model_class(config, images=bool(plan.images_per_sample))
    if adapter is not None:
        from toolkit.train.adapters import base_dtype, quantization_config

        kwargs["dtype"] = base_dtype(plan)
        if adapter.method == "qlora":
            kwargs["quantization_config"] = quantization_config(adapter)
            if random_init or Path(source).expanduser().is_file():
                # transformers quantises weights only as it loads a checkpoint (rehearsals, tests).
                return _load_random_through_checkpoint(config, model_class, kwargs)
    if distributed_config is not None:
        kwargs["distributed_config"] = distributed_config
        if random_init or Path(source).expanduser().is_file():
            return _load_random_through_checkpoint(config, model_class, kwargs)
    try:
        if random_init or Path(source).expanduser().is_file():
            return model_class.from_config(config, **kwargs)
        return model_class.from_pretrained(source, config=config, **kwargs)
    except (OSError, ValueError, ImportError) as exc:
        raise UserError(f"cannot load model {source}: {_first_line(exc)}") from None


def freeze_vision_tower(model: Any, plan: Plan) -> None:
    """--vision-tower freeze: the planned encoder and projector modules (plan.json model_parts) stop requiring grad
    before the Trainer builds its optimizer, which then holds only the language model's parameters
    (Trainer.create_optimizer passes only parameters that require grad); a module the loaded model lacks is refused."""
    if plan.vision_tower != "freeze":
        return
    for path in plan.model_parts["vision_modules"]:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise UserError(f"the plan freezes {path}, which the loaded {type(model).__name__} does not have; "
                            "re-plan for this model") from None
        module.requires_grad_(False)


def _load_random_through_checkpoint(config: Any, model_class: Any, kwargs: dict):
    """Random (seeded, so equal on every rank) weights written to a temporary folder and loaded back with
    `kwargs`: transformers quantises (QLoRA) and shards (tensor parallelism) only as it loads a checkpoint.
    Every rank writes its own (save_pretrained writes on the main process only). Under ZeRO-3 from_config builds
    the random model partitioned (deepspeed.zero.Init: each rank holds an empty placeholder per parameter), so its
    parameters are gathered whole for the write; without that the checkpoint held size-0 tensors and the load
    refused it (a QLoRA ZeRO-3 plan's rehearsal failed so)."""
    import contextlib
    import tempfile

    from safetensors.torch import save_model
    from transformers import GenerationConfig

    with tempfile.TemporaryDirectory() as tmp:
        config.to_json_file(str(Path(tmp) / "config.json"))
        GenerationConfig.from_model_config(config).to_json_file(str(Path(tmp) / "generation_config.json"))
        random = model_class.from_config(config, dtype=kwargs["dtype"])
        partitioned = [p for p in random.parameters() if hasattr(p, "ds_id")]
        whole = contextlib.nullcontext()
        if partitioned:
            import deepspeed

            whole = deepspeed.zero.GatheredParameters(partitioned)
        with whole:
            save_model(random, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        del random
        return model_class.from_pretrained(tmp, config=config, **kwargs)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__

"""Which attention implementations a model's transformers class runs, read from the class flags transformers'
load reads, for a built model or for a config alone (docs/ENGINE_FACTS.md "Which attention a model class runs")."""

from __future__ import annotations

from toolkit.inputs.modelconfig import config_from_dict


def attention_support(model) -> tuple[str, ...]:
    """The attention implementations transformers lets a model class (or instance) run, from the class flags its
    load reads (modeling_utils.py, transformers 5.24: _sdpa_can_dispatch reads `_supports_sdpa`,
    _flash_attn_can_dispatch `_supports_flash_attn`; docs/ENGINE_FACTS.md "Which attention a model class runs").
    Eager always runs."""
    return tuple(["eager"] + (["sdpa"] if getattr(model, "_supports_sdpa", False) is True else [])
                 + (["flash_attention_2"] if getattr(model, "_supports_flash_attn", False) is True else []))


def default_attention(support: tuple[str, ...]) -> str:
    """transformers' pick when no attn_implementation is given (get_correct_attn_implementation(None)): sdpa, or
    eager when the class has no sdpa."""
    return "sdpa" if "sdpa" in support else "eager"


def attention_problem(model_class: str, support: tuple[str, ...], requested: str | None, *,
                      name: str | None = None) -> str | None:
    """Why a model class cannot run `requested` attention, or None (None: transformers' default, always runs)."""
    if requested is None or requested in support:
        return None
    from importlib import metadata

    fix = default_attention(support)
    return (f"{model_class}{f' ({name})' if name and name != model_class else ''} cannot run {requested} attention: "
            f"transformers {metadata.version('transformers')} refuses it at load (the class runs "
            f"{' or '.join(support) if len(support) > 1 else support[0] + ' only'}); use --attention {fix}")


def config_attention(config, name: str | None = None) -> tuple[str, tuple[str, ...]] | None:
    """(class name, attention_support) of the class AutoModelForCausalLM builds for `config` (a transformers config,
    or a plan's model_config dict), or None when transformers has no causal-LM class of its own for it (remote
    code): for a config alone, without building the model."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if isinstance(config, dict):
        config = config_from_dict(dict(config), name or "the model config")

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, TypeError):
        return None
    return cls.__name__, attention_support(cls)


def config_attention_problem(config, requested: str | None, *, name: str | None = None) -> str | None:
    """attention_problem for a config alone (a transformers config, or a plan's model_config dict), without building
    the model; None also when transformers has no causal-LM class of its own for it (remote code)."""
    if requested is None:
        return None
    found = config_attention(config, name)
    return attention_problem(found[0], found[1], requested, name=name) if found else None


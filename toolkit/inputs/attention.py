"""Which attention implementations a model's transformers class runs, read from the class flags transformers'
load reads, for a built model or for a config alone (docs/ENGINE_FACTS.md "Which attention a model class runs")."""

from __future__ import annotations

from toolkit.inputs.modelconfig import auto_model_class, config_from_dict, text_config


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


def language_attention(config, attention: str) -> str | dict:
    """The attn_implementation to build `config`'s model with so that `attention` applies to its language model
    only: every other sub-model (a vision tower, Apertus-1.5's vision tokenizer, which has no sdpa) keeps
    transformers' own pick per sub-model (sdpa where its class has it, else eager: get_correct_attn_implementation
    with nothing requested). A plain string is set on every sub-config (PreTrainedConfig._attn_implementation's
    setter), and a sub-model whose class lacks it then refuses to build; the dict form names the configs it sets
    ("" the top one)."""
    text = text_config(config)
    subs = [key for key in getattr(config, "sub_configs", None) or {} if getattr(config, key, None) is not None]
    if not subs:
        return attention
    return {"": attention, **{key: attention for key in subs if getattr(config, key) is text}}


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
    """(class name, attention_support) of the class transformers builds for `config` (auto_model_class; a
    transformers config, or a plan's model_config dict), or None when transformers has no class of its own for it
    (remote code): for a config alone, without building the model."""

    if isinstance(config, dict):
        config = config_from_dict(dict(config), name or "the model config")

    try:
        cls = auto_model_class(config)._model_mapping[type(config)]
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


# ---------------------------------------------------------------------------------------------------------------
# Context parallelism (torch ring attention) and sliding windows: what the grid asks of a model's attention.

def context_parallel_problem(spec: "ModelSpec", context: int) -> str | None:
    """Why context parallelism (accelerate's, on torch's ring attention) cannot run this model's attention, or None.

    The ring replaces only the SDPA kernels (and takes no explicit mask), so a model transformers gives no SDPA path
    (Gemma-2: attention soft-capping, which SDPA lacks) cannot run it; and accelerate drops every layer's mask for
    `is_causal`, so it refuses models with sliding-window or chunked layers up front (its own check, applied here to
    the model's config: accelerate/big_modeling.py `_attach_context_parallel_hooks`)."""
    reasons = _context_parallel_reasons(spec)
    if not reasons:
        return None
    return (f"--context-parallel {context} cannot run {spec.name}: {'; and '.join(reasons)}; use --sequence-parallel "
            "(Ulysses) or no context parallelism")


def _context_parallel_reasons(spec: "ModelSpec") -> list[str]:
    """context_parallel_problem's reasons, kept per model (its source_key) in memory and in the on-disk cache with
    accelerate's version beside it: the probe imports torch, accelerate and transformers' config class, which a
    repeated plan otherwise never needs."""
    from toolkit import cache

    if not spec.source_key:
        return _probe_context_parallel(spec)
    if spec.source_key not in _CP_REASONS:
        key = [spec.source_key, cache.installed_version("accelerate")]
        hit = cache.get("cp-reasons", key, code=_probe_context_parallel)
        if not (isinstance(hit, list) and all(isinstance(r, str) for r in hit)):
            hit = _probe_context_parallel(spec)
            cache.put("cp-reasons", key, hit, code=_probe_context_parallel)
        _CP_REASONS[spec.source_key] = hit
    return list(_CP_REASONS[spec.source_key])


_CP_REASONS: dict[str, list[str]] = {}


def _probe_context_parallel(spec: "ModelSpec") -> list[str]:
    """The reasons, asked of torch, accelerate and the model's transformers config."""
    import torch

    reasons = []
    if "sdpa" not in spec.attention_support:
        config = spec.hf_config()
        softcap = getattr(config, "attn_logit_softcapping", None)
        why = f"SDPA has no attention soft-capping, attn_logit_softcapping {softcap:g}" if softcap else \
            "its class does not support SDPA"
        reasons.append(f"transformers gives it no SDPA attention ({why}), and torch's ring attention replaces only "
                       "the SDPA kernels")
    try:
        from accelerate.big_modeling import _attach_context_parallel_hooks
    except ImportError:  # an accelerate without the check: nothing more to ask
        _attach_context_parallel_hooks = None
    kinds = ""
    if _attach_context_parallel_hooks is not None:
        probe = torch.nn.Module()  # no submodules: only the config check runs, no hook is attached
        probe.config = spec.hf_config()
        try:
            _attach_context_parallel_hooks(probe)
        except ValueError as exc:
            kinds = str(exc).split("of type [", 1)[-1].split("]", 1)[0].replace("'", "")
    if not kinds:
        # An accelerate without the check (or one that lets the model through) still drops every layer's mask for
        # `is_causal`: the model's sliding-window or chunked layers would train with full causal attention, silently.
        kinds = ", ".join(_windowed_layer_kinds(spec.hf_config()))
    if kinds:
        reasons.append(f"its {kinds} layers need their own mask, which accelerate's context parallelism drops "
                       "(accelerate refuses such models)")
    return reasons


def _windowed_layer_kinds(config) -> list[str]:
    """The model's layer kinds whose mask is stricter than full causal (sliding-window, chunked), from the config
    fields transformers builds its masks from: `layer_types`, or before it a `sliding_window` on every layer."""
    config = text_config(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return sorted(set(layer_types) - {"full_attention"})
    return ["sliding_attention"] if getattr(config, "sliding_window", None) else []


def attention_window(spec: "ModelSpec") -> int | None:
    """The shortest window of the model's sliding-window or chunked attention layers (None: all full causal), from
    the config fields transformers builds its masks from (`layer_types`, or before it `sliding_window`). Kept per
    model (its source_key) in memory and in the on-disk cache: reading it builds transformers' config class."""
    from toolkit import cache

    if not spec.source_key:
        return _attention_window(spec)
    if spec.source_key not in _WINDOWS:
        hit = cache.get("attention-window", spec.source_key, code=_attention_window)
        if not (isinstance(hit, list) and len(hit) == 1 and (hit[0] is None or isinstance(hit[0], int))):
            hit = [_attention_window(spec)]
            cache.put("attention-window", spec.source_key, hit, code=_attention_window)
        _WINDOWS[spec.source_key] = hit[0]
    return _WINDOWS[spec.source_key]


_WINDOWS: dict[str, int | None] = {}


def _attention_window(spec: "ModelSpec") -> int | None:
    config = spec.hf_config()
    config = text_config(config)
    windows = [getattr(config, "attention_chunk_size" if "chunk" in kind else "sliding_window", None)
               for kind in _windowed_layer_kinds(config)]
    sizes = [int(w) for w in windows if isinstance(w, int) and w > 0]
    return min(sizes) if sizes else None

"""RoPE scaling as part of the job: `--rope-scaling yarn|linear|dynamic|llama3 --rope-factor F`, applied to the
model's transformers config the way transformers reads it (docs/ENGINE_FACTS.md, "RoPE scaling").

The scaled config is the one source: the estimate traces a model built from it, plan.json's model_config holds it,
its max_position_embeddings / rope_parameters give the positions every command checks `--seq` against
(toolkit.inputs.modelconfig.model_positions), and `model_config_overrides` names the keys toolkit.train and a
user's own script set on the config they load. Memory barely moves: the rotary embedding keeps one inv_freq buffer
of head_dim / 2 floats (and its copy) whatever the scaling; what changes is how long a sequence the run may plan.

This module imports neither torch nor transformers at import time (toolkit.train and plan.json's loader read it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from toolkit.errors import UserError
from toolkit.inputs.choices import ROPE_SCALINGS

OVERRIDE_KEYS = ("rope_parameters", "max_position_embeddings")
"""The config keys a rope scaling sets (model_config_overrides): nothing else of the model changes."""


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str
    """transformers' rope_type (one of ROPE_SCALINGS)."""
    factor: float
    """Scaled positions / original positions; transformers' validation asks for a number >= 1."""
    original_positions: int | None = None
    """The positions the model was trained with (original_max_position_embeddings); None: its
    max_position_embeddings."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALINGS:
            raise UserError(f"--rope-scaling '{self.rope_type}' is not known; choose one of: {', '.join(ROPE_SCALINGS)}")
        factor = self.factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or factor < 1:
            # transformers only logs "factor field must be a float or int >= 1" (_validate_yarn_rope_parameters);
            # a factor below 1 shrinks the positions and NaN passes its `factor < 1.0` test: both refused here.
            raise UserError(f"--rope-factor must be a finite number of at least 1 (scaled positions / original "
                            f"positions), got {factor!r}")
        original = self.original_positions
        if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
            raise UserError(f"--rope-original-positions must be a positive whole number, got {original!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"rope_type": self.rope_type, "factor": float(self.factor),
                **({"original_positions": self.original_positions} if self.original_positions else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RopeScaling":
        unknown = set(data) - {"rope_type", "factor", "original_positions"}
        if unknown:
            raise TypeError(f"unknown rope_scaling setting(s) {sorted(unknown)}")
        return cls(**data)

    def words(self) -> str:
        return f", {self.rope_type} RoPE x{self.factor:g}"


def rope_scaling_from_flags(rope_type: str | None, factor: float | None,
                            original: int | None) -> RopeScaling | None:
    """The job's RopeScaling from --rope-scaling / --rope-factor / --rope-original-positions, or None (none given:
    the model's config as it is, its own rope scaling included)."""
    if rope_type is None and factor is None and original is None:
        return None
    if rope_type is None:
        given = " and ".join(f for f, v in (("--rope-factor", factor), ("--rope-original-positions", original))
                             if v is not None)
        raise UserError(f"{given} scale{'s' if ' and ' not in given else ''} RoPE, and no --rope-scaling type is "
                        f"given; add --rope-scaling {'|'.join(ROPE_SCALINGS)} or drop {given}")
    if factor is None:
        raise UserError(f"--rope-scaling {rope_type} needs --rope-factor F (scaled positions / original positions, "
                        "at least 1)")
    return RopeScaling(rope_type, factor, original)


def scaled_config(config, rope: RopeScaling, name: str):
    """A copy of the transformers `config` with `rope` applied as transformers reads it, validated by its own
    validate_rope; UserError (one line) where the config cannot take it."""
    import copy

    if config.get_text_config() is not config:
        raise UserError(f"--rope-scaling: {name} keeps its language model's config nested ({type(config).__name__}); "
                        "scale RoPE in its text config.json, or drop --rope-scaling")
    current = getattr(config, "rope_parameters", None)
    if not isinstance(current, dict) or not current:
        raise UserError(f"--rope-scaling: {name} ({config.model_type}) has no rotary position embedding "
                        "(rope_parameters) in its config; drop --rope-scaling")
    if config.nested_rope_parameter_keys(current):
        raise UserError(f"--rope-scaling: {name} sets RoPE per layer type "
                        f"({', '.join(config.nested_rope_parameter_keys(current))}); one scaling for all of them is "
                        "not planned; drop --rope-scaling")
    base = getattr(config, "max_position_embeddings", None)
    original = rope.original_positions or base
    if not isinstance(original, int):
        raise UserError(f"--rope-scaling: {name} states no max_position_embeddings; give "
                        "--rope-original-positions N")
    params: dict[str, Any] = {"rope_type": rope.rope_type, "factor": float(rope.factor),
                              "rope_theta": current.get("rope_theta", config.default_theta)}
    if "partial_rotary_factor" in current:
        params["partial_rotary_factor"] = current["partial_rotary_factor"]
    if rope.rope_type in ("yarn", "llama3"):  # transformers' required keys for these types
        params["original_max_position_embeddings"] = original
    if rope.rope_type == "llama3":
        missing = [k for k in ("low_freq_factor", "high_freq_factor") if not isinstance(current.get(k), (int, float))]
        if missing:
            raise UserError(f"--rope-scaling llama3 needs {' and '.join(missing)}, which transformers requires "
                            f"(_validate_llama3_rope_parameters) and {name}'s config does not carry; use "
                            "--rope-scaling yarn")
        params.update(low_freq_factor=current["low_freq_factor"], high_freq_factor=current["high_freq_factor"])
    out = copy.deepcopy(config)
    out.rope_parameters = params
    # dynamic NTK grows the base past max_position_embeddings (_compute_dynamic_ntk_parameters), so that key stays
    # the trained length; the others state the scaled length there, as Llama 3.1 (llama3) and DeepSeek-V3 (yarn) do.
    out.max_position_embeddings = original if rope.rope_type == "dynamic" else int(original * rope.factor)
    if hasattr(out, "original_max_position_embeddings"):  # standardize_rope_params prefers this key (Phi-3)
        out.original_max_position_embeddings = original
    try:
        out.validate_rope()
    except (KeyError, ValueError, TypeError) as exc:
        raise UserError(f"--rope-scaling {rope.rope_type}: transformers refuses it for {name}: "
                        f"{str(exc).splitlines()[0][:200]}") from None
    return out


def rotary_effect(config, rope: RopeScaling, name: str) -> dict[str, Any]:
    """What the model's own rotary code does with the scaled `config`, from a model built on the meta device: its
    rope_type, cos / sin scaling (attention_scaling) and inv_freq length; UserError when its rotary code lacks the
    type (no rotary module reads rope_type, or one runs another type)."""
    import torch
    from toolkit.inputs.modelconfig import auto_model_class

    try:
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
    except KeyError as exc:  # ROPE_INIT_FUNCTIONS[rope_type] in the rotary module's __init__
        raise UserError(f"--rope-scaling {rope.rope_type}: {name}'s rotary code has no {exc} RoPE; drop "
                        "--rope-scaling") from None
    rotary = [m for m in model.modules() if hasattr(m, "rope_type") and hasattr(m, "inv_freq")]
    if not rotary:
        raise UserError(f"--rope-scaling {rope.rope_type}: {name}'s model code ({type(model).__name__}) has no rotary "
                        "module that reads rope_type from its config; drop --rope-scaling")
    other = [m for m in rotary if m.rope_type != rope.rope_type]
    if other:
        raise UserError(f"--rope-scaling {rope.rope_type}: {name}'s {type(other[0]).__name__} runs rope_type "
                        f"{other[0].rope_type!r} whatever the config says; drop --rope-scaling")
    first = rotary[0]
    return {"rope_type": rope.rope_type, "attention_scaling": float(getattr(first, "attention_scaling", 1.0)),
            "inv_freq": int(first.inv_freq.numel()), "modules": len(rotary)}


def scaled_spec(spec, rope: RopeScaling):
    """`spec` with `rope` applied: its config scaled (scaled_config), its counts and traces those of the model
    built from that config (cached by it), max_positions the scaled length, a note saying what changed."""
    from dataclasses import replace

    from toolkit.inputs.modelspec import spec_from_config_dict

    config = scaled_config(spec.hf_config(), rope, spec.name)
    effect = rotary_effect(config, rope, spec.name)
    out = spec_from_config_dict(config.to_dict(), name=spec.name, params=spec.params)
    note = (f"RoPE {rope.rope_type} x{rope.factor:g} (transformers' modeling_rope_utils): positions "
            f"{spec.max_positions} -> {out.max_positions}; cos / sin scaled by {effect['attention_scaling']:.4f}; "
            f"inv_freq stays {effect['inv_freq']} floats per rotary module (no memory change)")
    return replace(out, rope_scaling=rope.to_dict(), notes=out.notes + (note,))


def traceable_config(config):
    """The config the activation trace builds: `config` itself, except under dynamic NTK, whose rotary forward
    recomputes inv_freq from max(position_ids) (dynamic_rope_update: a data-dependent branch the fake-tensor trace
    cannot follow); it is traced as linear scaling with the same factor, whose tensors have the same shapes (one
    inv_freq of head_dim / 2 floats), so the saved activations are the same bytes."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or params.get("rope_type") != "dynamic":
        return config
    import copy

    out = copy.deepcopy(config)
    out.rope_parameters = {k: v for k, v in params.items() if k != "rope_type"} | {"rope_type": "linear"}
    return out


def model_config_overrides(model_config: dict[str, Any]) -> dict[str, Any]:
    """The config keys a plan's rope scaling sets, read from its (scaled) model_config: what toolkit.train sets on
    the config it loads and what a user's script passes to from_pretrained."""
    return {k: model_config[k] for k in OVERRIDE_KEYS if k in model_config}


def apply_overrides(config, overrides: dict[str, Any], name: str):
    """The loaded `config` with a plan's model_config_overrides set and transformers' validation run again."""
    for key, value in overrides.items():
        setattr(config, key, value if not isinstance(value, dict) else dict(value))
    try:
        config.validate_rope()
    except (KeyError, ValueError, TypeError) as exc:
        raise UserError(f"the plan's rope scaling does not apply to {name}: {str(exc).splitlines()[0][:200]}; "
                        "re-plan for this model") from None
    return config

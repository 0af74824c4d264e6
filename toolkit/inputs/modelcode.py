"""Why transformers' own model code cannot run a config: a default or incomplete config.json leaves a field unset
(null, empty, or absent) that the modelling code reads without a fallback (Hunyuan's head_dim, Nemotron's
num_key_value_heads, DeepSeek-V2's num_experts_per_tok, DBRX's attn_config.rope_theta); real checkpoints fill it.
The failure is the model's, not the planner's: it is told in one line naming the field, from the failing line of
transformers' code and the config's own values, with no per-architecture table."""

from __future__ import annotations

import linecache
import os
import re
from typing import Any

# Exceptions the modelling code raises on a field it cannot use (None in arithmetic, a missing key or attribute,
# transformers' own ValueError on an unset setting); a RuntimeError comes from torch's kernels and is not told here.
CONFIG_ERRORS = (TypeError, AttributeError, KeyError, IndexError, ValueError)


def _transformers_root() -> str:
    import transformers

    return os.path.dirname(transformers.__file__) + os.sep


def _config_parts(config: Any) -> list[tuple[str, Any]]:
    """The config and its nested configs (text_config, attn_config, ...), each with its dotted path."""
    from transformers import PreTrainedConfig

    parts, todo = [], [("", config)]
    while todo:
        path, part = todo.pop(0)
        parts.append((path, part))
        todo += [(f"{path}{key}.", value) for key, value in vars(part).items() if isinstance(value, PreTrainedConfig)]
    return parts


def _unset_fields(config: Any, names: list[str], missing: str | None) -> list[str]:
    """Of `names`, the config fields that are null or empty in some part of the config; `missing`, an attribute
    a part of the config lacks."""
    found = []
    for path, part in _config_parts(config):
        for name in names:
            name = getattr(part, "attribute_map", {}).get(name, name)  # Dots1's num_local_experts: n_routed_experts
            value = vars(part).get(name, 0)
            if value is None or (isinstance(value, (dict, list, tuple)) and not value):
                found.append(f"'{path}{name}' ({'null' if value is None else 'empty'})")
        if missing and type(part).__name__ == missing[0]:
            found.append(f"'{path}{missing[1]}' (absent)")
    return list(dict.fromkeys(found))


def _class_fields(frame) -> list[str]:
    """The config fields the failing code's class reads (`config.x` in its source): the field a line reads through
    an attribute of its own (DeepSeek-V2's self.top_k = config.num_experts_per_tok) is named there."""
    import inspect

    owner = frame.f_locals.get("self")
    try:
        source = inspect.getsource(type(owner)) if owner is not None else ""
    except (OSError, TypeError):
        source = ""
    return re.findall(r"config\.(\w+)", source)


def _frames_above_torch(exc: BaseException) -> list:
    """The frames of `exc`'s traceback, outermost first, outside torch (torch's layers take what they get), when
    the innermost of them is in transformers' code; else []."""
    import torch

    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    torch_root = os.path.dirname(torch.__file__) + os.sep
    own = [f for f in frames if not f.f_code.co_filename.startswith(torch_root)]
    return own if own and own[-1].f_code.co_filename.startswith(_transformers_root()) else []


def text_only_problem(exc: BaseException, config: Any, name: str) -> str | None:
    """One line for an image-text model whose forward will not run on text alone (BLIP-2 and InstructBLIP take
    pixel_values as a required argument, IDEFICS and Kosmos-2 raise without image inputs): toolkit traces the
    language model through a text-only step (the image tower apart, toolkit.estimate.visiontower), which such a
    forward refuses. None when `exc` is not that."""
    if getattr(config, "vision_config", None) is None or not isinstance(exc, CONFIG_ERRORS):
        return None
    frames = _frames_above_torch(exc)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    # GIT's loss drops the image tokens' positions from the logits (logits[:, num_image_tokens:-1]) whether or not
    # there are images: torch's cross-entropy then finds the logits shorter than the labels.
    if not frames or not re.search(r"pixel_values|image|qformer|mm_token|to match target batch_size", message,
                                   re.IGNORECASE):
        return None
    models = [f for f in frames if f.f_code.co_filename.startswith(_transformers_root() + "models" + os.sep)]
    frame = (models or frames)[-1]
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    return (f"'{name}': its forward does not run on text alone ({where}: {message[:120]}); toolkit traces an "
            "image-text model's language model through a text-only step, so it plans only those whose forward "
            "takes text without images (Gemma-3, Qwen2.5-VL, LLaVA)")


def model_code_problem(exc: BaseException, config: Any, name: str) -> str | None:
    """One line saying which config field transformers' model code fails on, and where, when `exc` is one of
    CONFIG_ERRORS raised inside transformers (its innermost frame there); None otherwise (a failure of ours or of
    torch stays a traceback, to be fixed)."""
    if not isinstance(exc, CONFIG_ERRORS):
        return None
    root = _transformers_root()
    own = _frames_above_torch(exc)
    if not own:
        return None
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if re.search(r"required positional argument|unexpected keyword argument", message):
        return None  # a call the model's forward did not expect (image inputs a text-only step lacks), no field
    models = [f for f in own if f.f_code.co_filename.startswith(root + "models" + os.sep)]
    if not models:
        return None
    frame = models[-1]
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    absent = re.search(r"'(\w+)' object has no attribute '(\w+)'", message) if isinstance(exc, AttributeError) else None
    read = re.sub(r"^[\w.]+\s*=(?!=)", "", line)  # what the line reads, not the attribute it assigns
    named = [n for group in re.findall(r"\.(\w+)|\[[\"'](\w+)[\"']\]|`(\w+)`|'(\w+)'", f"{read} {message}")
             for n in group if n]
    fields = (_unset_fields(config, named, absent.groups() if absent else None)
              or (_unset_fields(config, _class_fields(frame), None) if not isinstance(exc, ValueError) else []))
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    kind = getattr(config, "model_type", "?")
    if fields:
        return (f"'{name}': {', '.join(fields)} in its config, which transformers' {kind} code needs ({where}: "
                f"{message[:100]}); set it in config.json as a real checkpoint does")
    if isinstance(exc, ValueError):
        return None  # transformers' own words on something else than a field (an attention it does not support)
    return (f"'{name}': transformers' {kind} code cannot run this config ({where}: {type(exc).__name__}: "
            f"{message[:100]}); complete its config.json from a real checkpoint's")


def missing_package_problem(exc: ImportError, name: str) -> str:
    """One line for a model whose code needs a package that is not installed: transformers' requires_backends
    ("X requires the timm library ... `pip install timm`", utils/import_utils.py) or a plain ModuleNotFoundError."""
    text = str(exc)
    found = re.search(r"requires the (\S+) librar", text)
    install = re.search(r"pip install ([\w.\-\[\]]+)", text)
    package = (found and found.group(1)) or getattr(exc, "name", None) or (install and install.group(1))
    if not package:
        return f"'{name}': transformers cannot build this model here ({text.strip().splitlines()[0][:160]})"
    return (f"'{name}': transformers' code for this model needs the {package} package, which is not installed "
            f"(pip install {install.group(1) if install else package})")


def rotary_sections_problem(model: Any, name: str) -> str | None:
    """One line for a multimodal rotary embedding whose position sections (mrope_section: temporal, height, width)
    do not add up to its frequencies: transformers splits the frequencies by those sections (GLM-4.1V's
    recomposition_frequencies, Qwen2-VL's apply_multimodal_rotary_pos_emb), so the forward would fail in torch's
    split. GLM-4.1V's code falls back to [8, 12, 12] where rope_parameters names none, which fits a real checkpoint's
    partial_rotary_factor 0.5 and head_dim 128 (32 frequencies), not the default config's full rotary (64). Read
    from the built model (meta device is fine); None when every such module fits."""
    for path, module in model.named_modules():
        sections, inv_freq = getattr(module, "mrope_section", None), getattr(module, "inv_freq", None)
        if not isinstance(sections, (list, tuple)) or inv_freq is None or sum(sections) == inv_freq.numel():
            continue
        return (f"'{name}': its rotary embedding ({path}) splits {inv_freq.numel()} frequencies (head_dim x "
                f"partial_rotary_factor / 2) into mrope_section {list(sections)}, which add up to {sum(sections)}; "
                "set rope_parameters' mrope_section and partial_rotary_factor in config.json as a real checkpoint "
                "does")
    return None

"""The standard parts of a Hugging Face decoder-only causal LM, found in the model itself (no per-architecture table).

A model is "built from the standard parts" when its *ForCausalLM holds a base model and an LM head, and the module
that holds the list of decoder layers holds besides it only: the token embedding (the model's own
get_input_embeddings, scaled inside it for Gemma), a learned position embedding (GPT-2, OPT), an embedding dropout, a
rotary embedding module (recomputed on every pipeline stage), input / output projections around the layers (OPT's
project_in / project_out), and one final norm. The decoder layers must take hidden states plus what can be rebuilt
from their shape (attention mask, position ids, rotary embeddings). Anything else is named as what stops the
pipeline conversion, so the planner refuses pipeline plans for that model before anything runs.

Torch only (no DeepSpeed): the planner calls it on the meta-device model it counts.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from toolkit.inputs.modelconfig import layer_count, text_config

# What a decoder layer may ask for that a pipeline stage can rebuild from the hidden states' shape: the mask and
# positions (HF's own mask functions, arange), the rotary (cos, sin), and None for optional extras (no cache, no
# ALiBi bias: refused below when the config turns ALiBi on).
LAYER_INPUTS = ("attention_mask", "position_ids", "position_embeddings")
LAYER_NONE_INPUTS = ("layer_past", "cache", "past_key_values", "encoder_hidden_states",
                     "encoder_attention_mask", "head_mask")
ROTARY_INPUTS = ("x", "position_ids", "layer_type")


@dataclass(frozen=True)
class DecoderParts:
    """Attribute paths inside the *ForCausalLM of each standard part (None: the model has no such part)."""
    embed: str
    layers: str
    head: str
    norm: str | None = None
    positions: str | None = None
    """Learned absolute position embedding, added to the token embedding."""
    positions_take_mask: bool = False
    """The position module's forward takes (attention_mask, ..., position_ids=) (OPT) rather than position ids."""
    dropout: str | None = None
    """Embedding dropout, after the positions."""
    rotary: str | None = None
    rotary_per_layer_type: bool = False
    """The rotary module's forward takes the layer type (Gemma-3: local and global rope bases)."""
    project_in: str | None = None
    project_out: str | None = None
    router_class: str | None = None
    """Class of the MoE router whose output `router_index` is the router logits (the model's _can_record_outputs),
    when the config asks for the load-balancing loss (output_router_logits)."""
    router_index: int = 0
    layer_none_inputs: tuple[str, ...] = ()
    """Required decoder-layer arguments that are None for unpadded training without a cache (Falcon's alibi)."""


class NotStandard(Exception):
    """The model is not built from the standard parts; the message names the part."""


def find_parts(model: Any, config: Any) -> DecoderParts:
    """The parts of `model` (a *ForCausalLM, meta device is fine); NotStandard names what does not fit."""
    import torch.nn as nn

    text = text_config(config)
    kind = getattr(config, "model_type", type(model).__name__)
    paths = {id(m): name for name, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or id(embed) not in paths:
        raise NotStandard(f"{kind}: no token embedding (get_input_embeddings)")
    if head is None or id(head) not in paths:
        raise NotStandard(f"{kind}: no LM head (get_output_embeddings)")
    layer_list = decoder_layers(model, layer_count(config))
    if layer_list is None:
        raise NotStandard(f"{kind}: no list of decoder layers (an nn.ModuleList of num_hidden_layers entries)")
    layers_path = paths[id(layer_list)]
    parent_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    for path, child in _beside(model, head, parent_path):
        raise NotStandard(f"{kind}: part '{path}' ({type(child).__name__}) beside the language model")
    if getattr(text, "alibi", False):
        raise NotStandard(f"{kind}: ALiBi attention bias (config alibi=true) is built from the whole sequence's "
                          "mask inside the base model")
    found: dict[str, Any] = {"embed": paths[id(embed)], "layers": layers_path, "head": paths[id(head)]}
    parent = model.get_submodule(parent_path) if parent_path else model
    for name, child in parent.named_children():
        path = f"{parent_path}.{name}" if parent_path else name
        if child is layer_list or child is embed:
            continue
        cls = type(child).__name__
        role = None
        if cls.endswith("RotaryEmbedding") or any(b.endswith("inv_freq") for b, _ in child.named_buffers()):
            role = "rotary"
            params = _params(child.forward)
            unknown = [p for p in params if p not in ROTARY_INPUTS]
            if unknown:
                raise NotStandard(f"{kind}: rotary module '{path}' ({cls}) needs {', '.join(unknown)}")
            found["rotary_per_layer_type"] = "layer_type" in params
        elif isinstance(child, nn.Embedding):
            role = "positions"
            found["positions_take_mask"] = "position_ids" in _params(child.forward) and \
                _params(child.forward)[0] != "position_ids"
        elif isinstance(child, nn.Dropout):
            role = "dropout"
        elif isinstance(child, nn.Linear) and name in ("project_in", "project_out"):
            role = name
        elif "norm" in cls.lower() or "norm" in name.lower():
            role = "norm"
        if role in found:
            raise NotStandard(f"{kind}: part '{path}' ({cls}) is a second {role} beside '{found[role]}' around the "
                              "decoder layers")
        if role is None:
            raise NotStandard(f"{kind}: part '{path}' ({cls}) beside the decoder layers is not one the pipeline "
                              "converter knows (token / position embedding, dropout, rotary, projections, final norm)")
        found[role] = path
    layer = layer_list[0]
    signature = inspect.signature(layer.forward)
    none_inputs = []
    for i, (name, p) in enumerate(signature.parameters.items()):
        if i == 0 or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or name in LAYER_INPUTS:
            continue
        if p.default is inspect.Parameter.empty:
            # ALiBi is None only where the config says it is off (Falcon's alibi=false); Bloom always uses it.
            if name not in LAYER_NONE_INPUTS and not (name == "alibi" and getattr(text, "alibi", None) is False):
                raise NotStandard(f"{kind}: decoder layer {type(layer).__name__} needs '{name}', which a pipeline "
                                  "stage cannot rebuild from the hidden states")
            none_inputs.append(name)
    found["layer_none_inputs"] = tuple(none_inputs)
    if getattr(text, "output_router_logits", False):
        recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is None:
            for m in model.modules():
                recorder = (getattr(m, "_can_record_outputs", None) or {}).get("router_logits") or recorder
        target = getattr(recorder, "target_class", None)
        if target is None or not all(hasattr(model, a) for a in ("num_experts", "num_experts_per_tok")):
            raise NotStandard(f"{kind}: the router load-balancing loss (output_router_logits) is not recorded the "
                              "way transformers' MoE models record it")
        found["router_class"] = target.__name__
        found["router_index"] = int(getattr(recorder, "index", 0) or 0)
    return DecoderParts(**found)


def _beside(model: Any, head: Any, parent_path: str):
    """(path, module) of each part with weights beside the language model: from the causal LM down to the module
    holding the decoder layers (`parent_path`) there are the base model(s), the head and nothing else with weights,
    except in a vision-language model, whose vision tower and projector sit beside its language model."""
    ancestors = [""] + [".".join(parent_path.split(".")[:i + 1]) for i in range(parent_path.count(".") + 1)
                        if parent_path]
    for ancestor in ancestors[:-1] if parent_path else ancestors:
        for name, child in (model.get_submodule(ancestor) if ancestor else model).named_children():
            path = f"{ancestor}.{name}" if ancestor else name
            if child is head or (parent_path + ".").startswith(path + "."):
                continue
            if any(True for _ in child.parameters()):
                yield path, child


def side_parts(model: Any, config: Any) -> tuple[tuple[str, str, int], ...]:
    """(path, class, unique parameters) of each part beside the language model (a vision tower, a projector), found
    as find_parts finds them; () for a plain causal LM or a model without a recognisable layer list."""
    layer_list = decoder_layers(model, layer_count(config))
    head = model.get_output_embeddings()
    if layer_list is None:
        return ()
    paths = {id(m): name for name, m in model.named_modules()}
    layers_path = paths.get(id(layer_list), "")
    parent_path = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
    return tuple((path, type(child).__name__, sum({id(p): p.numel() for p in child.parameters()}.values()))
                 for path, child in _beside(model, head, parent_path))


def vision_parts(model: Any, config: Any) -> tuple[tuple[tuple[str, str, int], ...], tuple[tuple[str, str, int], ...]]:
    """(tower, projector): (path, class, unique parameters) of the vision encoder's parts and of the projector's, split
    from side_parts by the model's own modules: a part holding a list of blocks (an nn.ModuleList of more than one
    module of one class) is an encoder; inside it, a module registered after that list whose weights (2-D and up)
    have the language model's hidden size as a dimension projects into it (Qwen2.5-VL's merger, Qwen3-VL's
    deepstack mergers), and so is the projector's; a part without blocks is a projector (Gemma-3's, LLaVA's)."""
    text = text_config(config)
    hidden = getattr(text, "hidden_size", None)
    tower: list[tuple[str, str, int]] = []
    projector: list[tuple[str, str, int]] = []
    for path, cls, count in side_parts(model, config):
        part = model.get_submodule(path)
        blocks = decoder_layers(part)
        if blocks is None or len(blocks) < 2:
            projector.append((path, cls, count))
            continue
        inner = [(f"{path}.{name}", type(child).__name__, _unique(child))
                 for name, child in _after_blocks(part, blocks) if _projects_to(child, hidden)]
        projector.extend(inner)
        tower.append((path, cls, count - sum(n for *_, n in inner)))
    return tuple(tower), tuple(projector)


def vision_block_classes(model: Any, vision_modules: list[str]) -> list[str]:
    """The class of each vision part's block list (decoder_layers of the part; parts without one, a projector, add
    none): the classes an FSDP auto-wrap policy names to shard the encoder block by block, read from the model."""
    found: list[str] = []
    for path in vision_modules:
        blocks = decoder_layers(model.get_submodule(path))
        if blocks is not None and len(blocks) > 1 and type(blocks[0]).__name__ not in found:
            found.append(type(blocks[0]).__name__)
    return found


def _after_blocks(part: Any, blocks: Any):
    """(relative path, module) of each child registered after the block list, on every level from `part` down to
    the module that holds the list."""
    paths = {id(m): name for name, m in part.named_modules()}
    chain = paths[id(blocks)].split(".")
    for depth in range(len(chain)):
        prefix = ".".join(chain[:depth])
        holder = part.get_submodule(prefix) if prefix else part
        passed = False
        for name, child in holder.named_children():
            if name == chain[depth]:
                passed = True
            elif passed:
                yield (f"{prefix}.{name}" if prefix else name), child


def _projects_to(module: Any, hidden: int | None) -> bool:
    return hidden is not None and any(p.dim() >= 2 and hidden in p.shape for p in module.parameters())


def _unique(module: Any) -> int:
    return sum({id(p): p.numel() for p in module.parameters()}.values())


def pipeline_blocker(model: Any, config: Any) -> str | None:
    """Why the pipeline converter cannot split `model` (one phrase naming the part), or None when it can."""
    try:
        find_parts(model, config)
    except NotStandard as exc:
        return str(exc)
    return None


def _params(fn) -> list[str]:
    return [n for n, p in inspect.signature(fn).parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def decoder_layers(model: Any, count: int | None = None):
    """The nn.ModuleList of the decoder layers. With `count` (the config's num_hidden_layers): a list of that many
    entries, of one class or several (hybrid stacks: Jamba's attention and Mamba layers, Mllama's cross-attention
    layers); without: the longest list of one class. In a multimodal class the vision encoder's block list may match
    too: the list held beside the token embedding (the language model's) is preferred, then the shallowest."""
    import torch.nn as nn

    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) > 0
             and (len(module) == count if count is not None else len({type(m) for m in module}) == 1)]
    if not found:
        return None
    embed = _input_embedding_path(model)
    beside = [(name, m) for name, m in found
              if embed is not None and embed.startswith(name.rsplit(".", 1)[0] + "." if "." in name else "")]
    return max(beside or found, key=lambda nm: (len(nm[1]), -nm[0].count(".")))[1]


def _input_embedding_path(model: Any) -> str | None:
    """Path of the model's token embedding (get_input_embeddings), or None where it has none."""
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return next((name for name, m in model.named_modules() if m is embed), None) if embed is not None else None

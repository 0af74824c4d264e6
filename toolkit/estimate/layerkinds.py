"""Layer kinds and depth reduction for the activation tracer (toolkit.estimate.tracer).

Kinds are told apart by comparing the decoder layers' structure and settings (class, parameter shapes, per-layer
attributes such as a sliding window) in a meta-device build of the full model; the traced copy keeps the fewest
leading layers that show every kind twice, and each layer of the full depth takes the trace of a traced layer of its
kind."""

from __future__ import annotations

import copy

from toolkit.inputs.modelconfig import layer_count, text_config



def num_layers(config) -> int:
    n = layer_count(config)
    if not isinstance(n, int):  # BLT (local encoder, global transformer, local decoder), PI0 (a VLM and an expert)
        parts = ", ".join(getattr(config, "sub_configs", {})) or "none"
        raise NotImplementedError(f"{type(config).__name__} names no num_hidden_layers for one decoder stack (its "
                                  f"parts: {parts}); toolkit traces causal LMs of one stack of decoder layers")
    return n


def decoder_layers(model, count: int):
    """The ModuleList of the model's `count` decoder layers (toolkit.inputs.decoder_parts.decoder_layers)."""
    from toolkit.inputs.decoder_parts import decoder_layers as find

    layers = find(model, count)
    if layers is None:  # num_hidden_layers counts something else (HRM's recurrent cycles, LongCat-Flash's sub-layers)
        import torch

        found = sorted({f"{name} ({len(m)})" for name, m in model.named_modules()
                        if isinstance(m, torch.nn.ModuleList) and len(m) > 1}) or ["none"]
        raise NotImplementedError(
            f"{type(model).__name__}: its config's num_hidden_layers ({count}) is the length of no list of decoder "
            f"layers in the built model (its layer lists: {', '.join(found[:4])}); toolkit traces one list of "
            "num_hidden_layers decoder layers")
    return layers


def per_layer_keys(config, n: int) -> tuple[str, ...]:
    """The config's keys whose values are lists with one entry per layer (such as layer_types)."""
    return tuple(sorted(k for k, v in vars(text_config(config)).items() if isinstance(v, (list, tuple)) and len(v) == n))


def per_layer_settings(config, n: int, keys: tuple[str, ...] | None = None) -> list[tuple]:
    """Per-layer entries of the config (lists with one value per layer, such as layer_types), layer by layer:
    the model's forward may read them by index (which mask a layer gets) without the layer storing them. `keys`:
    the per-layer keys of the full-depth config, for a depth-reduced copy, where a list that is no per-layer entry
    can have the copy's length by chance (Mamba-2's time_step_limit pair in a 2-layer copy)."""
    text = text_config(config)
    keys = per_layer_keys(config, n) if keys is None else keys
    return [tuple((k, repr(getattr(text, k)[i])) for k in keys) for i in range(n)]


def layer_kind(layer, settings: tuple = ()) -> tuple:
    """What makes two decoder layers trace alike: module classes, parameter shapes, per-layer settings."""
    parts = [settings]
    for name, module in layer.named_modules():
        settings = tuple(sorted((k, v) for k, v in vars(module).items()
                                if not k.startswith("_") and k != "training" and "idx" not in k
                                and isinstance(v, (bool, int, float, str, type(None)))))
        params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters(recurse=False))
        parts.append((name, type(module).__name__, settings, params))
    return tuple(parts)


_KINDS_CACHE: dict[str, tuple] = {}


def layer_kinds_of_full_model(config) -> tuple:
    key = config.to_json_string(use_diff=False)
    if key not in _KINDS_CACHE:
        _KINDS_CACHE[key] = _build_layer_kinds(config)
    return _KINDS_CACHE[key]


_BUILT: dict[str, object] = {}
_BUILT_KEPT = 2
"""Full meta-device models kept per process: the last two configs' (a plan reads the full model's and then a
tensor-parallel rank's view of it, each for its layer kinds and then its tensor sizes)."""


def full_meta_model(config):
    """The whole model of `config` built on the meta device from a copy of it, once per config (its JSON) while it
    is among the last _BUILT_KEPT built: the layer kinds and the tensor sizes read the same build (a 70B's 80 layers
    take 0.06 s of CPU a build, twice per config before). Callers read it, never change it."""
    key = config.to_json_string(use_diff=False)
    if key not in _BUILT:
        import torch
        from toolkit.inputs.modelconfig import auto_model_class

        with torch.device("meta"):
            model = auto_model_class(config).from_config(copy.deepcopy(config))
        while len(_BUILT) >= _BUILT_KEPT:
            del _BUILT[next(iter(_BUILT))]
        _BUILT[key] = model
    return _BUILT[key]


def _build_layer_kinds(config) -> tuple:
    n = num_layers(config)
    model = full_meta_model(config)
    kinds = tuple(layer_kind(layer, settings)
                  for layer, settings in zip(decoder_layers(model, n), per_layer_settings(config, n)))
    # Kinds as small integers in order of first appearance: cheap to compare and to show.
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(k, len(ids)) for k in kinds)


def traced_layer_count(kinds: tuple) -> int:
    """The shortest prefix in which every kind appears twice (or as often as it appears at all)."""
    want = {k: min(2, kinds.count(k)) for k in set(kinds)}
    seen: dict[int, int] = {}
    for i, k in enumerate(kinds):
        seen[k] = seen.get(k, 0) + 1
        if all(seen.get(kk, 0) >= c for kk, c in want.items()):
            return i + 1
    return len(kinds)


def traced_index_for(i: int, kinds: tuple, traced_count: int) -> int:
    if i < traced_count:
        return i
    return max(j for j in range(traced_count) if kinds[j] == kinds[i])


def kind_ids(kinds: tuple) -> tuple:
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(k, len(ids)) for k in kinds)


_TENSORS_CACHE: dict[str, tuple] = {}


def region_tensor_numels(spec) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(before the layers, each decoder layer, after the layers): the elements of each parameter tensor, tied ones
    once, from a meta-device build of the full model (split as toolkit.inputs.modelspec.outside_layer_params splits
    them). A torch optimizer makes its states, and foreach AdamW its temporaries, one tensor per parameter: the
    allocator sees these sizes, not a region's total (toolkit.estimate.reserved)."""
    import json

    # keyed as the traces are, by the spec's source key where it has one (a tensor-parallel rank's view holds its
    # config as a deferred function), else by its config dict: a cached answer neither imports transformers nor
    # builds the model
    key = spec.source_key or json.dumps(spec.config_dict(), sort_keys=True, default=str)
    if key not in _TENSORS_CACHE:
        from toolkit import cache

        stored = cache.get("tensors", key, code=region_tensor_numels,
                           decode=lambda d: (tuple(d[0]), tuple(tuple(x) for x in d[1]), tuple(d[2])))
        if stored is not None:
            _TENSORS_CACHE[key] = stored
            return stored
        from toolkit.inputs.modelspec import outside_layer_tensors

        config = spec.hf_config()
        n = num_layers(config)
        model = full_meta_model(config)
        layers = decoder_layers(model, n)
        pre, post = outside_layer_tensors(model, layers)
        per_layer = tuple(tuple(p.numel() for p in layer.parameters()) for layer in layers)
        _TENSORS_CACHE[key] = (tuple(pre), per_layer, tuple(post))
        cache.put("tensors", key, _TENSORS_CACHE[key], code=region_tensor_numels)
    return _TENSORS_CACHE[key]


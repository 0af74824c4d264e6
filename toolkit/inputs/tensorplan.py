"""Tensor parallelism as the model's own `tp_plan` does it: which parameters one rank holds, and the per-rank shapes
its decoder layers compute with.

The plan is the one transformers applies (transformers/distributed/mixin.py `init_parallel_plans`): the causal-LM
class's `_tp_plan` (e.g. `lm_head: colwise_gather_output`), the config's `base_model_tp_plan` under the base model's
prefix, and `embed_tokens: embedding_rowwise` added when the plan is not empty. Each style shards what
transformers/distributed/tensor_parallel.py shards: colwise splits a weight's output dimension (and its bias),
rowwise its input dimension (the bias stays whole), embedding styles one dimension of the table; every parameter the
plan does not name (norms, routers, a bias after a row reduce) stays whole on every rank. A dimension that does not
divide leaves the first ranks one row more (torch's Shard placement); we count the largest rank's share.
"""

from __future__ import annotations

import copy
import fnmatch
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from toolkit.errors import options_text
from toolkit.inputs.modelconfig import text_config

if TYPE_CHECKING:
    from toolkit.inputs.modelspec import ModelSpec

SHARDING_STYLES = {
    # style -> which dimension of a 2-D weight it splits (bias: split with colwise, whole with rowwise)
    "colwise": -2, "colwise_rep": -2, "colwise_gather_output": -2, "packed_colwise": -2,
    "rowwise": -1, "rowwise_rep": -1, "packed_rowwise": -1, "rowwise_split_input": -1,
    "embedding_rowwise": 0, "embedding_colwise": 1, "moe_tp_experts": -2,
}
"""Styles that split parameters (transformers/distributed/tensor_parallel.py ALL_PARALLEL_STYLES); the others
(replicate, sequence_parallel, all_reduce, replicated_with_grad_allreduce, local_params, ...) keep them whole."""

HEAD_KEYS = ("num_attention_heads", "num_key_value_heads")
FFN_KEYS = ("intermediate_size",)


@dataclass(frozen=True)
class TensorSplit:
    """What tensor parallelism of degree `tensor` leaves on one rank."""

    tensor: int
    plan: tuple[tuple[str, str], ...]
    """The model's tp_plan as transformers resolves it (module pattern, style)."""
    layer_sharded_params: int
    """Parameters of decoder layer 0 that the plan splits (whole-model count, before the split)."""
    layer_whole_params: int
    """Parameters of decoder layer 0 every rank keeps whole (norms, biases after a row reduce, ...)."""
    outside_sharded_params: int
    """Embedding / LM head / final norm parameters the plan splits (whole count)."""
    outside_whole_params: int
    rank_layer_params: int
    """One rank's share of decoder layer 0."""
    rank_outside_params: int
    """One rank's share of everything outside the decoder layers."""
    by_pattern: tuple[tuple[str, str, int], ...] = ()
    """(pattern, style, whole parameters it covers in layer 0 + outside) for --explain."""
    rank_kept_outside_params: int = 0
    """One rank's share of the parameters outside the decoder layers that the model's `fsdp_plan` marks
    `keep_full_weight` (Llama: the final norm and the LM head), which transformers' FSDP2 wrapping
    (distributed/fsdp.py apply_fully_sharded_data_parallelism) leaves unsharded from their forward to their
    backward; the rest outside the layers (the embedding) is resharded after its forward."""
    layers_kept: bool = False
    """The fsdp_plan keeps the decoder layers unsharded too (keep_full_weight on `layers.*`)."""
    head_style: str | None = None
    """The tp_plan's style for the output embedding (`lm_head`: colwise_gather_output gathers the logits)."""

    def layer_fraction(self) -> float:
        return self.rank_layer_params / (self.layer_sharded_params + self.layer_whole_params)


def model_tp_plan(spec: "ModelSpec") -> dict[str, str]:
    """The tp_plan transformers applies to this model (empty: the architecture has none)."""
    return dict(_split_inputs(spec)[0])


def model_fsdp_plan(spec: "ModelSpec") -> dict[str, str]:
    """The fsdp_plan transformers' own FSDP2 wrapping applies to this model (module pattern -> free_full_weight |
    keep_full_weight; empty: none)."""
    return dict(_split_inputs(spec)[2])


def tp_plan_problem(spec: "ModelSpec", tensor: int) -> str | None:
    """Why tensor parallelism of degree `tensor` cannot run this model, or None."""
    plan = model_tp_plan(spec)
    if not plan:
        return (f"{spec.name} ({spec.model_type}) has no tp_plan in transformers (config.base_model_tp_plan), so "
                "accelerate cannot tensor-parallelise it; use fsdp2 / zero without --tensor-parallel, or "
                "--sequence-parallel")
    missing = _split_inputs(spec)[3]
    if missing:
        return (f"{spec.model_type}'s config has no {', '.join(missing)}, from which toolkit derives the per-rank "
                "shapes of its tp_plan; tensor parallelism is not planned for it")
    counts = spec.head_counts()  # every layer's heads: Gemma-4's global-attention layers have fewer KV heads
    checks = [("attention heads", h) for h in sorted({h for h, _ in counts})]
    for what, count in checks + [("KV heads", kv) for kv in sorted({kv for _, kv in counts})]:
        if count % tensor:
            # transformers get_kv_heads_per_rank: heads that do not divide by tp cannot be sharded evenly.
            options = [d for d in range(2, count + 1) if all(h % d == 0 and kv % d == 0 for h, kv in counts)]
            some = " in some decoder layers" if len(counts) > 1 else ""
            return (f"--tensor-parallel {tensor} does not divide {spec.name}'s {count} {what}{some} (the tp_plan "
                    f"splits attention by heads; try {options_text(options, limit=6, none='no tensor parallelism')})")
    return _rank_shape_problem(spec, tensor)


_RANK_SHAPE_PROBLEMS: dict[tuple[int, int], tuple["ModelSpec", str | None]] = {}


def _rank_shape_problem(spec: "ModelSpec", tensor: int) -> str | None:
    """_built_rank_shape_problem, kept per process and, for a model with a source key, in the on-disk cache
    (toolkit.cache): a repeated plan imports neither torch nor transformers."""
    key = (id(spec), tensor)
    if key not in _RANK_SHAPE_PROBLEMS:
        from toolkit import cache

        stored_key = [spec.source_key, tensor, cache.installed_version("transformers")]
        stored = cache.get("tp_rank_shapes", stored_key, code=_built_rank_shape_problem) if spec.source_key else None
        if stored is not None:
            problem = stored["problem"]
        else:
            problem = _built_rank_shape_problem(spec, tensor)
            if spec.source_key:
                cache.put("tp_rank_shapes", stored_key, {"problem": problem}, code=_built_rank_shape_problem)
        _RANK_SHAPE_PROBLEMS[key] = (spec, problem)
    return _RANK_SHAPE_PROBLEMS[key][1]


def _built_rank_shape_problem(spec: "ModelSpec", tensor: int) -> str | None:
    """Why the per-rank config (heads / tp, head_dim kept, FFN / tp) does not build one rank's layer shapes, the tp_plan's
    split dimension / tp: a class that derives its head width from hidden_size / heads (Qwen2.5-VL's text attention)
    keeps its whole q, k, v, o projections there, so the tracer cannot see one rank. One layer on the meta device."""
    import torch

    from toolkit.inputs.modelconfig import auto_model_class, reduced_config
    from toolkit.inputs.moe import is_expert_param

    plan, named, _, _ = _split_inputs(spec)
    one = reduced_config(per_rank_spec(spec, tensor).hf_config(), spec.num_layers, 1)
    with torch.device("meta"):
        built = {n: tuple(p.shape) for n, p in auto_model_class(one).from_config(one).named_parameters()}
    for name, shape, in_layer in named:
        if is_expert_param(name):  # routed experts: one rank's share is tensor_split's, not the config's
            continue
        style = _style_for(name, plan)[0] if in_layer else None
        dim = SHARDING_STYLES.get(style) if style else None
        if dim is None or (name.endswith(".bias") and style.startswith(("rowwise", "packed_rowwise"))):
            continue
        dim = 0 if len(shape) == 1 else dim
        wanted = tuple(math.ceil(n / tensor) if i == (dim % len(shape)) else n for i, n in enumerate(shape))
        if built.get(name) != wanted:
            return (f"{spec.model_class} built at heads/{tensor} gives {name} the shape {built.get(name)}, "
                    f"not one rank's {wanted} (the class derives its head width from hidden_size / heads, "
                    "not config.head_dim), so toolkit cannot trace one rank; tensor parallelism is not "
                    "planned for it: use fsdp2 / zero without --tensor-parallel")
    return None


def tensor_split(spec: "ModelSpec", tensor: int) -> TensorSplit:
    """One rank's parameters under the model's tp_plan at degree `tensor` (cached per model and degree)."""
    plan, named, fsdp_plan, _ = _split_inputs(spec)
    layer_sharded = layer_whole = out_sharded = out_whole = rank_layer = rank_out = kept_out = 0
    layers_kept = False
    covered: dict[tuple[str, str], int] = {}
    for name, shape, in_layer in named:
        style, pattern = _style_for(name, plan)
        numel = math.prod(shape)
        dim = SHARDING_STYLES.get(style) if style else None
        if dim is not None and name.endswith(".bias") and style.startswith(("rowwise", "packed_rowwise")):
            dim = None  # rowwise: the bias is added after the reduce, whole on every rank
        if dim is not None and len(shape) == 1:
            dim = 0
        share = numel if dim is None else numel // shape[dim] * math.ceil(shape[dim] / tensor)
        if dim is not None:
            covered[(pattern, style)] = covered.get((pattern, style), 0) + numel
        if in_layer:
            layer_sharded += numel if dim is not None else 0
            layer_whole += numel if dim is None else 0
            rank_layer += share
        else:
            out_sharded += numel if dim is not None else 0
            out_whole += numel if dim is None else 0
            rank_out += share
        if _style_for(name, fsdp_plan)[0] == "keep_full_weight":
            if in_layer:
                layers_kept = True
            else:
                kept_out += share
    head = next((style for pattern, style in plan if pattern == "lm_head" or pattern.endswith(".lm_head")), None)
    return TensorSplit(tensor=tensor, plan=tuple(plan), layer_sharded_params=layer_sharded,
                       layer_whole_params=layer_whole, outside_sharded_params=out_sharded,
                       outside_whole_params=out_whole, rank_layer_params=rank_layer, rank_outside_params=rank_out,
                       by_pattern=tuple((p, s, n) for (p, s), n in covered.items()),
                       rank_kept_outside_params=kept_out, layers_kept=layers_kept, head_style=head)


def per_rank_spec(spec: "ModelSpec", tensor: int) -> "ModelSpec":
    """`spec` as one tensor-parallel rank sees it: parameters divided as the tp_plan divides them, and a config with
    the per-rank shapes (heads / tp, KV heads / tp, FFN / tp; the hidden size whole, as the colwise inputs and
    rowwise outputs are) so the tracer records the activations one rank saves."""
    if tensor == 1:
        return spec
    key = (id(spec), tensor)
    if key not in _RANK_SPECS:  # one object per model and degree, so the tracer's per-spec cache holds
        _RANK_SPECS[key] = (spec, _per_rank_spec(spec, tensor))
    return _RANK_SPECS[key][1]


_RANK_SPECS: dict[tuple[int, int], tuple["ModelSpec", "ModelSpec"]] = {}
"""Keyed by the spec's identity; the entry keeps the spec alive so its id is never reused."""


def _per_rank_spec(spec: "ModelSpec", tensor: int) -> "ModelSpec":
    split = tensor_split(spec, tensor)
    fraction = split.layer_fraction()
    layer_params = tuple(int(round(p * fraction)) for p in spec.layer_params)
    outside = spec.pre_layer_params + spec.post_layer_params
    out_fraction = split.rank_outside_params / outside if outside else 1.0

    def rank_config():
        """Built on first use (ModelSpec.hf_config): a plan whose traces are cached never imports transformers."""
        config = copy.deepcopy(spec.hf_config())
        text = text_config(config)
        # A heterogeneous config (transformers' per_layer_config): its layers' overrides are divided like the
        # global values, which read only once the overrides are taken off.
        overrides = text.to_dict().get("per_layer_config") if getattr(text, "is_heterogeneous", False) else None
        if overrides is not None:
            text.per_layer_config = None
        per_rank = {key: lambda n: n // tensor for key in HEAD_KEYS} | {key: lambda n: math.ceil(n / tensor)
                                                                         for key in FFN_KEYS}
        for key, divide in per_rank.items():
            if getattr(text, key, None):
                setattr(text, key, divide(getattr(text, key)))
        text.head_dim = getattr(text, "head_dim", None) or spec.head_dim  # keep the per-head width as heads shrink
        if overrides is not None:
            text.per_layer_config = {layer: {key: per_rank[key](value) if key in per_rank and value else value
                                             for key, value in changes.items()} for layer, changes in overrides.items()}
        return config

    pre = int(round(spec.pre_layer_params * out_fraction))
    post = int(round(spec.post_layer_params * out_fraction))
    source = f"{spec.source_key}-tp{tensor}" if spec.source_key else None
    return replace(spec, config=rank_config, params=sum(layer_params) + pre + post, layer_params=layer_params,
                   pre_layer_params=pre, post_layer_params=post,
                   embedding_params=math.ceil(spec.embedding_params / tensor) if _embedding_split(split) else
                   spec.embedding_params,
                   layer_matmul_params=tuple(int(round(p / tensor)) for p in spec.layer_matmul_params),
                   source_key=source, notes=spec.notes + (
                       f"tensor parallel {tensor}: each rank holds {fraction:.1%} of a decoder layer's parameters "
                       "(the model's tp_plan) and traces heads / tp, KV heads / tp, FFN / tp",))


def _embedding_split(split: TensorSplit) -> bool:
    return any(p.endswith("embed_tokens") and s in SHARDING_STYLES for p, s, _ in split.by_pattern)


# ----------------------------------------------------------------------------------------------------------------

_CACHE: dict[str, tuple[tuple[tuple[str, str], ...], tuple[tuple[str, tuple[int, ...], bool], ...],
                        tuple[tuple[str, str], ...], tuple[str, ...]]] = {}
"""Keyed by the spec's source_key (or, without one, its config's JSON)."""



def _split_inputs(spec: "ModelSpec"):
    """(the resolved tp_plan, [(parameter name, shape, inside decoder layer 0)], the fsdp_plan, the shape keys the
    config lacks) from a one-layer meta build; kept in memory and, for a spec with a source_key, in the on-disk cache
    (toolkit.cache), so a repeated plan imports neither torch nor transformers for it."""
    from toolkit import cache

    key = spec.source_key or spec.hf_config().to_json_string(use_diff=False)
    if key not in _CACHE:
        hit = cache.get("tp-split", spec.source_key, code=_split_inputs, decode=_from_json) if spec.source_key \
            else None
        if hit is None:
            hit = _meta_split(spec.hf_config(), spec.num_layers)
            if spec.source_key:
                cache.put("tp-split", spec.source_key, hit, code=_split_inputs)
        _CACHE[key] = hit
    return _CACHE[key]


def _from_json(value: list) -> tuple:
    plan, named, fsdp_plan, missing = value
    return (tuple((p, s) for p, s in plan), tuple((n, tuple(shape), bool(inside)) for n, shape, inside in named),
            tuple((p, s) for p, s in fsdp_plan), tuple(missing))


def _meta_split(config: Any, num_layers: int) -> tuple:
    import torch

    from toolkit.inputs.modelconfig import auto_model_class, reduced_config

    one = reduced_config(config, num_layers, 1)
    with torch.device("meta"):
        model = auto_model_class(one).from_config(one)
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    base_prefix = getattr(model, "base_model_prefix", "model")
    resolved = {}
    for pattern, style in plan.items():
        full = pattern if pattern.startswith(base_prefix + ".") or pattern == "lm_head" or \
            pattern.split(".")[0] in dict(model.named_children()) else f"{base_prefix}.{pattern}"
        resolved[full] = style
    named = []
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        named.append((name, tuple(p.shape), ".layers.0." in f".{name}" or name.startswith("layers.0.")))
    fsdp_plan = dict(getattr(model, "fsdp_plan", None) or getattr(model, "_fsdp_plan", None) or {})
    text = text_config(config)
    per_layer = getattr(text, "per_layer_attributes", None) or ()  # a global read of these raises; set per layer
    missing = tuple(k for k in HEAD_KEYS[:1] + FFN_KEYS if k not in per_layer and getattr(text, k, None) is None)
    return tuple(resolved.items()), tuple(named), tuple(fsdp_plan.items()), missing


def _style_for(param_name: str, plan) -> tuple[str | None, str | None]:
    """The plan entry that covers a parameter: its module (or the parameter itself) matches the pattern, '*'
    standing for a layer number."""
    module = param_name.rsplit(".", 1)[0]
    for pattern, style in plan:
        if fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(param_name, pattern):
            return style, pattern
    return None, None

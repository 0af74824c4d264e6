"""ModelSpec: exact parameter counts and shape of a Hugging Face causal LM, from its config alone.

The model is built on the meta device with its own Hugging Face code and counted (tied weights once), so the
count is exact for any architecture transformers knows, not a formula. Sources, in the order they are tried:
a catalog name (presets/models/NAME.json), a local directory or config.json, a hub id (local cache, or online),
or bare numbers (`shape_config`): the config is read in toolkit.inputs.modelconfig, the attention the model's class runs
in toolkit.inputs.attention.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from toolkit.errors import UserError
from toolkit.inputs.attention import attention_problem, attention_support, default_attention
from toolkit.inputs.modelconfig import (causal_lm_problem, config_from_dict, first_int, layer_count, load_config,
                                        model_positions, read_config_json, shape_config, shape_from_params,
                                        text_config)
from toolkit.inputs.modelcode import (CONFIG_ERRORS, missing_package_problem, model_code_problem,
                                     rotary_sections_problem)
from toolkit.inputs.moe import find_moe, is_expert_param


PARAM_NO_DECAY, PARAM_EXPERT, PARAM_VISION = 1, 2, 4
"""ModelSpec.param_kinds bits: in the HF Trainer's no-weight-decay param group (Trainer.get_decay_parameter_names
leaves it out), a routed expert's tensor (toolkit.inputs.moe.is_expert_param), the vision encoder's or projector's
(frozen under --vision-tower freeze)."""


@dataclass(frozen=True, eq=False)
class ModelSpec:
    name: str
    model_type: str
    config: Any
    """The transformers PretrainedConfig (the tracer and the trainer build from it); until first use
    (`hf_config()`) it may be its dict (a spec from the cache) or a function that builds it (a per-rank spec)."""
    params: int
    """Exact unique parameter count (tied weights once)."""
    layer_params: tuple[int, ...]
    """Parameters of each decoder layer."""
    pre_layer_params: int
    """Everything that runs before the first decoder layer: token (and position) embeddings, input projections."""
    post_layer_params: int
    """Everything after the last decoder layer: final norm, output projections, and the LM head unless tied."""
    embedding_params: int
    """The token-embedding matrix alone (vocab x hidden)."""
    tied: bool
    """LM head shares the token-embedding matrix."""
    layer_class: str
    """Decoder-layer class name (FSDP wrap policy; pipeline conversion)."""
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int | None
    layer_matmul_params: tuple[int, ...]
    """Per decoder layer, the weights one token multiplies through (MoE: shared + top-k of the experts)."""
    head_matmul_params: int
    """LM head weights a token multiplies through (vocab x hidden, tied or not)."""
    layer_heads: tuple[int, ...] = ()
    """Attention heads of each decoder layer, from transformers' per-layer configs (config.per_layer_config, where
    a heterogeneous config's layers differ: Gemma-4's global-attention layers, dots3's MLA layers); () (a spec
    built from bare numbers or cached before) means every layer has `heads`. In a heterogeneous config `heads`,
    `kv_heads` and `head_dim` are the shape most layers have."""
    layer_kv_heads: tuple[int, ...] = ()
    layer_head_dims: tuple[int, ...] = ()
    layer_cache_windows: tuple[int | None, ...] = ()
    """Per decoder layer, what transformers' DynamicCache keeps of its keys and values in generate (cache_windows):
    None every token (full attention), the window of a sliding / chunked layer, 0 nothing (a KV-shared layer that
    reuses an earlier layer's keys, Gemma-4's last num_kv_shared_layers; an attention-free layer); () every layer
    keeps every token."""
    attention_support: tuple[str, ...] = ("eager", "sdpa", "flash_attention_2")
    """Attention implementations the model's HF class runs (attention_support(); gemma2 and MPT have no sdpa)."""
    model_class: str = ""
    """The transformers class a causal-LM load builds (LlamaForCausalLM), named in attention refusals."""
    factored_state_fraction: float = 0.0
    """Adafactor's factored second moment (row + column statistics per matrix, full for vectors) per parameter."""
    active_params: int = 0
    """Parameters one token uses (differs from `params` for mixture-of-experts models)."""
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_block: str | None = None
    """Class of the MoE block (router + experts; toolkit.inputs.moe), the module ZeRO-3 must fetch whole; None for
    a dense model."""
    moe_expert_modules: bool = False
    """Its routed experts are separate submodules, called only when routed to (toolkit.inputs.moe.MoeParts)."""
    notes: tuple[str, ...] = ()
    pipeline_blocker: str | None = None
    """Why the pipeline converter cannot split this model (the part that stops it), or None: it can
    (toolkit.inputs.decoder_parts, found from the model's own modules)."""
    tiling_blocker: str | None = None
    """Why ALST tiling cannot run this model (a decoder layer's MLP DeepSpeed's TiledMLP cannot run, probed on the
    meta device: toolkit.inputs.tileable), or None."""
    rope_scaling: dict[str, Any] | None = None
    """The job's RoPE scaling applied to `config` (toolkit.inputs.rope.RopeScaling.to_dict), or None: the config as
    the model ships it (its own rope scaling included)."""
    vision_params: int = 0
    """A multimodal class (Gemma-3, Qwen3.5 loaded whole): the vision encoder's parameters (patch embedding, blocks,
    its norms), found beside the language model (toolkit.inputs.decoder_parts.vision_parts); 0 for a text model."""
    projector_params: int = 0
    """The projector's parameters (from the encoder's width into the language model's hidden size)."""
    vision_modules: tuple[str, ...] = ()
    """Module paths of the encoder and the projector in the class (what a frozen tower freezes, what LoRA leaves out)."""
    param_numels: tuple[int, ...] = ()
    """Elements of each parameter tensor in the model's own order (named_parameters, tied weights once): the order
    DeepSpeed ZeRO-1/2 flatten them in, which decides the tensors each rank's gradient partition holds whole
    (toolkit.estimate.zeropartition). () for a spec rescaled from --params or cached before they were recorded."""
    param_kinds: tuple[int, ...] = ()
    """Per tensor of `param_numels`, its PARAM_NO_DECAY / PARAM_EXPERT / PARAM_VISION bits."""
    source_key: str | None = None
    """Hash of where the config came from (its config.json text, or the bare numbers): the on-disk cache key of
    this spec and of its activation traces. None (hub ids) caches nothing."""

    @property
    def language_params(self) -> int:
        """The language model alone: embeddings, decoder layers, final norm and head (tied once)."""
        return self.params - self.vision_params - self.projector_params

    @property
    def multimodal(self) -> bool:
        return bool(self.vision_params or self.projector_params)

    @property
    def leaf_module_needed(self) -> str | None:
        """The MoE block class ZeRO-3 must flag as a leaf module to run correctly: one whose routed experts are
        separate submodules (ranks call different subsets, so ZeRO-3's per-module gathers and its traced prefetch
        order differ between them); None for a dense model or fused experts, which every rank calls once a pass
        (there a leaf flag only saves hooks: docs/ENGINE_FACTS.md, "Mixture of experts under ZeRO-3")."""
        return self.moe_block if self.moe_expert_modules else None

    def parts_words(self) -> str:
        """The class's parts with their exact counts, for output ("" for a text model)."""
        if not self.multimodal:
            return ""
        return (f"language model {self.language_params:,} + vision encoder {self.vision_params:,} + projector "
                f"{self.projector_params:,} parameters ({', '.join(self.vision_modules)})")

    def attention_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """(heads, KV heads, head dim) of each decoder layer."""
        if not self.layer_heads:
            return ((self.heads, self.kv_heads, self.head_dim),) * self.num_layers
        return tuple(zip(self.layer_heads, self.layer_kv_heads, self.layer_head_dims))

    def head_counts(self) -> tuple[tuple[int, int], ...]:
        """The distinct (heads, KV heads) of the decoder layers: a degree that splits heads must divide each."""
        return tuple(sorted({(h, kv) for h, kv, _ in self.attention_shapes()}))

    @property
    def query_width(self) -> int:
        """Heads x head dim summed over the decoder layers: the width QK^T and AV multiply through per token."""
        return sum(h * d for h, _, d in self.attention_shapes())

    @property
    def kv_width(self) -> int:
        """KV heads x head dim summed over the decoder layers: one of keys or values per token, every layer."""
        return sum(kv * d for _, kv, d in self.attention_shapes())

    def attention_words(self) -> str:
        """'30 layers x 8 KV heads x head dim 256', one such term per distinct layer shape."""
        counts = Counter((kv, d) for _, kv, d in self.attention_shapes())
        return " + ".join(f"{n} layers x {kv} KV heads x head dim {d}" for (kv, d), n in counts.items())

    @property
    def largest_layer_params(self) -> int:
        """Largest unit a ZeRO-3 / FSDP rank gathers at once: a decoder layer, or the embedding/head block."""
        return max([*self.layer_params, self.pre_layer_params, self.post_layer_params, self.embedding_params])

    def hf_config(self):
        """The transformers config, built on first use when the spec holds its dict (from the cache) or the function
        that derives it (toolkit.inputs.tensorplan.per_rank_spec)."""
        if isinstance(self.config, dict):
            object.__setattr__(self, "config", config_from_dict(dict(self.config), self.name))
        elif callable(self.config):
            object.__setattr__(self, "config", self.config())
        return self.config

    def config_dict(self) -> dict[str, Any]:
        return dict(self.config) if isinstance(self.config, dict) else self.hf_config().to_dict()

    def to_cache(self) -> dict[str, Any]:
        from dataclasses import fields

        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}
        data["config"] = json.loads(json.dumps(self.config_dict(), default=str))
        return data

    @classmethod
    def from_cache(cls, data: dict[str, Any]) -> "ModelSpec":
        from dataclasses import fields

        kwargs = {}
        for f in fields(cls):
            if f.name not in data:  # a field added since the entry was written keeps its default
                continue
            value = data[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) and f.name != "config" else value
        return cls(**kwargs)

    @property
    def default_attention(self) -> str:
        """What transformers runs when no attention is asked for (default_attention())."""
        return default_attention(self.attention_support)

    def attention_problem(self, requested: str | None) -> str | None:
        """Why the model cannot run `requested` attention (transformers refuses it at load), or None."""
        return attention_problem(self.model_class or self.model_type, self.attention_support, requested,
                                 name=self.name)

    def effective_attention(self, requested: str | None) -> str:
        """The implementation a run uses: `requested`, or transformers' default for the model when None. One the
        model cannot run is refused (UserError), never swapped: transformers refuses it at load."""
        if requested is None:
            return self.default_attention
        problem = self.attention_problem(requested)
        if problem:
            raise UserError(problem)
        return requested

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name, "model_type": self.model_type, "params": self.params,
            "layers": self.num_layers, "hidden": self.hidden, "heads": self.heads, "kv_heads": self.kv_heads,
            "active_params": self.active_params, "vocab": self.vocab, "tied_embeddings": self.tied, "layer_class": self.layer_class,
            "largest_layer_params": self.largest_layer_params, "moe_experts": self.moe_experts,
            **(self.parts() if self.multimodal else {}),
        }

    def parts(self) -> dict[str, Any]:
        """The exact counts of a multimodal class's parts (they add up to `params`) and the encoder's modules."""
        return {"language_params": self.language_params, "vision_params": self.vision_params,
                "projector_params": self.projector_params, "vision_modules": list(self.vision_modules)}


# --------------------------------------------------------------------------------------------------------------
# Counting on the meta device


def find_decoder_layers(model):
    """The decoder-layer list (toolkit.inputs.decoder_parts.decoder_layers): num_hidden_layers entries where the
    config gives it, else the longest nn.ModuleList whose entries share one class."""
    from toolkit.inputs.decoder_parts import decoder_layers

    count = layer_count(model.config) if hasattr(model, "config") else None
    best = decoder_layers(model, count if isinstance(count, int) else None)
    if best is None:
        raise UserError(f"cannot find the decoder layers of {type(model).__name__}; is it a decoder-only causal LM?")
    return best


def unique_numel(params) -> int:
    """Elements of `params`, each tensor once (tied weights counted once)."""
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _matmul_params(module, moe_fraction: float) -> int:
    """Weights a token multiplies through: tensors of 2+ dims; expert weights scaled by top_k / experts."""
    total = 0.0
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            total += p.numel() * (moe_fraction if is_expert_param(name) else 1.0)
    return int(round(total))


_AFTER_LAYERS = {"ln_f", "norm", "final_layer_norm", "final_norm", "project_out", "lm_head"}


def outside_layer_params(model, layers, wanted=lambda p: True) -> tuple[int, int]:
    """(before, after) the decoder layers: elements of the `wanted` parameters outside them, tied ones once.
    Registration order mostly follows execution order; final norms and output projections registered before the
    layers (OPT) are recognised by name."""
    pre, post = outside_layer_tensors(model, layers, wanted)
    return sum(pre), sum(post)


def outside_layer_tensors(model, layers, wanted=lambda p: True) -> tuple[list[int], list[int]]:
    """outside_layer_params tensor by tensor: the elements of each parameter before and after the layers."""
    pre: list[int] = []
    post: list[int] = []
    seen: set[int] = {id(p) for p in layers.parameters()}
    passed_layers = False
    for module_name, module in model.named_modules():
        if module is layers:
            passed_layers = True
            continue
        for p in module.parameters(recurse=False):
            if id(p) in seen or not wanted(p):
                continue
            seen.add(id(p))
            (post if passed_layers or module_name.rsplit(".", 1)[-1] in _AFTER_LAYERS else pre).append(p.numel())
    return pre, post


def _attention_shape(config, hidden: int) -> tuple[int, int, int]:
    """(heads, KV heads, head dim) of one layer's config, as the attention classes read them."""
    heads = first_int(config, ("num_attention_heads", "n_head"), 1)
    kv_heads = first_int(config, ("num_key_value_heads",), 1) or heads
    return heads, kv_heads, (first_int(config, ("head_dim",), 1) or hidden // heads) if heads else 0


def cache_windows(config, layers: int) -> tuple[int | None, ...]:
    """ModelSpec.layer_cache_windows from the cache layers transformers' generate builds for `config`: DynamicCache
    (config=the decoder's text config) dispatches each layer kind of cache_utils.get_layer_types_and_kwargs, where a
    sliding / chunked layer is a DynamicSlidingWindowLayer of its window and a KV-sharing consumer ("reuse") or an
    MoE / MLP-only layer a DummyLayer storing nothing; () when every layer keeps every token or the kinds do not
    line up with the `layers` decoder layers found."""
    from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, DummyLayer, DynamicSlidingWindowLayer,
                                          get_layer_types_and_kwargs)

    try:
        kinds, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError, KeyError):  # a config whose layers transformers cannot type
        return ()

    def window(kind: str, kw: dict) -> int | None:
        layer = DYNAMIC_LAYER_TYPE_MAPPING.get(kind)
        return kw["sliding_window"] if layer is DynamicSlidingWindowLayer else 0 if layer is DummyLayer else None

    windows = tuple(window(kind, kw) for kind, kw in zip(kinds, kwargs))
    return windows if len(windows) == layers and any(w is not None for w in windows) else ()


def build_spec(name: str, config, *, images: bool = False) -> ModelSpec:
    """Build the model on the meta device with its own code and count everything exactly; `images` (an
    image-and-text job): the class that runs images (auto_model_class), the vision tower built and counted with the
    language model."""
    import torch
    from toolkit.inputs.modelconfig import auto_model_class

    problem = causal_lm_problem(config)
    if problem:
        raise UserError(f"'{name}': {problem}")
    try:
        with torch.device("meta"):
            model = auto_model_class(config, images=images).from_config(config)
    except ImportError as exc:  # a package the model's code requires (timm for a TimmWrapper vision tower)
        raise UserError(missing_package_problem(exc, name)) from None
    except CONFIG_ERRORS as exc:
        problem = model_code_problem(exc, config, name)
        if problem and not isinstance(exc, ValueError):
            raise UserError(problem) from None
        if not isinstance(exc, ValueError):
            raise
        raise UserError(f"'{name}' is not a causal LM transformers can build ({str(exc).splitlines()[0][:160]})") \
            from None
    problem = rotary_sections_problem(model, name)
    if problem:
        raise UserError(problem)
    layers = find_decoder_layers(model)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    total = unique_numel(model.parameters())
    moe = find_moe(model, config)
    experts, top_k = (moe.experts, moe.top_k) if moe else (0, 0)
    moe_fraction = top_k / experts if experts else 1.0

    pre, post = outside_layer_params(model, layers)
    embedding_params = embed.weight.numel() if embed is not None else 0
    head_weight = head.weight if head is not None else embed.weight
    text = text_config(config)
    # A state-space or recurrent model (Mamba, RWKV, xLSTM) names no attention heads, and a model of several
    # stacks of different widths (BLT) no one hidden size: 0 then, and what needs them (TP, CP, SP, attention FLOPs,
    # KV cache) has none (toolkit.inputs.grid refuses the degrees that split heads).
    hidden = first_int(text, ("hidden_size", "n_embd", "d_model"), 1)
    shapes = ()
    if getattr(text, "is_heterogeneous", False):  # a global read of a per-layer attribute raises; read each layer
        shapes = tuple(_attention_shape(layer, hidden) for layer in text.per_layer_config)
    heads, kv_heads, head_dim = Counter(shapes).most_common(1)[0][0] if shapes else _attention_shape(text, hidden)
    max_positions = model_positions(config)
    factored = 0
    for p in {id(p): p for p in model.parameters()}.values():
        shape = tuple(p.shape)
        factored += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else p.numel()
    expert_params = sum(p.numel() for n, p in layers.named_parameters() if is_expert_param(n))
    from toolkit.inputs.decoder_parts import pipeline_blocker, vision_parts

    from toolkit.inputs.tileable import model_tiling_blocker

    tiling_blocker = model_tiling_blocker(model, hidden)
    notes = []
    if experts:
        shared = f", shared {', '.join(moe.shared)}" if moe.shared else ""
        notes.append(f"mixture of experts: {experts} experts, top-{top_k} per token in {moe.moe_layers} "
                     f"{moe.block_class} blocks{shared}")
    tower, projector = vision_parts(model, config)
    numels, kinds = parameter_kinds(model, tuple(path for path, *_ in tower + projector))
    if tower or projector:  # a multimodal class: what a text-only run loads beside the language model
        parts = ", ".join(f"{path} ({cls}) {n:,}" for path, cls, n in tower + projector)
        side = sum(n for *_, n in tower + projector)
        notes.append(f"beside the language model ({total - side:,} parameters): {parts} "
                     "parameters, loaded with the class; counted as trained unless --vision-tower freeze (full "
                     "fine-tuning trains them; text alone gives them no gradients, so torch's optimizers (DDP, "
                     "FSDP2) then keep no states for them, while DeepSpeed ZeRO's flat partitions hold states for "
                     "every trainable parameter; frozen, they keep their weights only)")
    if getattr(config, "vision_config", None) is not None:
        notes.append(_load_words(config, type(model).__name__, total, bool(tower or projector), images))
    if tiling_blocker:  # the planner's auto tiling skips this model; --tiled refuses it with the same words
        notes.append(f"ALST tiling not tried: {tiling_blocker}")
    return ModelSpec(
        name=name,
        model_type=config.model_type,
        config=config,
        params=total,
        layer_params=tuple(unique_numel(layer.parameters()) for layer in layers),
        pre_layer_params=pre,
        post_layer_params=post,
        embedding_params=embedding_params,
        tied=tied,
        layer_class=type(layers[0]).__name__,
        num_layers=len(layers),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=int(head_weight.shape[0]),
        max_positions=max_positions,
        layer_matmul_params=tuple(_matmul_params(layer, moe_fraction) for layer in layers),
        head_matmul_params=int(head_weight.numel()),
        layer_heads=tuple(h for h, _, _ in shapes),
        layer_kv_heads=tuple(kv for _, kv, _ in shapes),
        layer_head_dims=tuple(d for _, _, d in shapes),
        layer_cache_windows=cache_windows(config, len(layers)),
        attention_support=attention_support(model),
        model_class=type(model).__name__,
        factored_state_fraction=factored / total if total else 0.0,
        active_params=total - int(round(expert_params * (1 - moe_fraction))),
        moe_experts=experts,
        moe_top_k=top_k,
        moe_block=moe.block_class if moe else None,
        moe_expert_modules=bool(moe and moe.expert_modules),
        notes=tuple(notes),
        pipeline_blocker=pipeline_blocker(model, config),
        tiling_blocker=tiling_blocker,
        vision_params=sum(n for *_, n in tower),
        projector_params=sum(n for *_, n in projector),
        vision_modules=tuple(path for path, *_ in tower + projector),
        param_numels=numels,
        param_kinds=kinds,
    )


def parameter_kinds(model, vision_modules: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(numels, kinds) of the model's parameter tensors in named_parameters order (ModelSpec.param_numels /
    param_kinds). PARAM_NO_DECAY marks what the HF Trainer's own rule leaves out of weight decay (its
    get_decay_parameter_names, read by toolkit.inputs.decay without importing the Trainer)."""
    from toolkit.inputs.decay import decay_parameter_names

    decay = decay_parameter_names(model)
    numels, kinds = [], []
    for name, p in model.named_parameters():
        numels.append(p.numel())
        kinds.append((0 if name in decay else PARAM_NO_DECAY) | (PARAM_EXPERT if is_expert_param(name) else 0)
                     | (PARAM_VISION if any(name.startswith(f"{path}.") for path in vision_modules) else 0))
    return tuple(numels), tuple(kinds)


def _load_words(config, model_class: str, total: int, whole_class: bool, images: bool = False) -> str:
    """What a run of a multimodal checkpoint loads (toolkit.inputs.textload): the class transformers builds
    (auto_model_class), the tower's cost, and, for a text-only run, whether the language model alone could load
    instead."""
    from toolkit.inputs.modelconfig import auto_model_class
    from toolkit.inputs.textload import text_alone_problem, unloaded_tower_params

    auto = auto_model_class(config, images=images).__name__
    if images:
        return (f"the runner loads the whole class {model_class} ({auto}'s class for {config.model_type}) to run "
                "the images, its vision encoder and projector included (their per-GPU share: --explain)")
    if whole_class:
        problem = text_alone_problem(config)
        return (f"the runner loads the whole class {model_class} ({auto}'s class for "
                f"{config.model_type}), its vision encoder and projector included (their per-GPU share: "
                "--explain); the language model alone " + (f"cannot load: {problem}" if problem else
                                                          "would load through transformers' key mapping"))
    problem = text_alone_problem(config)
    return (f"the runner loads the language model alone, {model_class} ({auto}'s class for "
            f"{config.model_type}): " + (f"transformers renames the checkpoint's keys and leaves its vision encoder "
                                         f"({unloaded_tower_params(config, total):,} parameters) unloaded"
                                         if problem is None else f"from a class checkpoint it {problem}"))


def resolve_model(model: str | None = None, *, trust_remote_code: bool = False, images: bool = False,
                  **numbers: int | None) -> ModelSpec:
    """The one entry point: a model name/path/id, or bare numbers (params, or layers / hidden / heads / kv_heads /
    ffn / vocab). Specs of configs read from disk and of bare numbers come from the on-disk cache when they were
    built before (toolkit.cache). `images`: the class of an image-and-text job (build_spec)."""
    from toolkit import cache

    unknown = set(numbers) - {"params", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab"}
    if unknown:
        raise TypeError(f"resolve_model() got unexpected keyword(s) {sorted(unknown)}")
    key = _source_key(model, **numbers)
    if key is not None and images:
        key.append("images")
    if key is not None:
        hit = cache.get("spec", key, code=build_spec, decode=ModelSpec.from_cache)
        if hit is not None:
            return hit
    spec = _resolve_uncached(model, trust_remote_code=trust_remote_code, images=images, **numbers)
    if key is not None:
        from dataclasses import replace

        spec = replace(spec, source_key=hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32])
        cache.put("spec", key, spec.to_cache(), code=build_spec)
    return spec


def _source_key(model: str | None, **numbers: Any) -> list | None:
    """What determines the spec, readable without transformers: the config.json text, or the numbers."""
    if model:
        from toolkit.inputs.resolve import locate_model

        where = locate_model(model)
        candidates = () if where.path is None else (where.path / "config.json", where.path)
        for candidate in candidates:
            if candidate.is_file():
                return ["file", model, json.dumps(read_config_json(candidate), sort_keys=True)]
        return None
    return ["numbers", sorted(numbers.items())]


def _resolve_uncached(model: str | None = None, *, params: int | None = None, layers: int | None = None,
                      hidden: int | None = None, heads: int | None = None, kv_heads: int | None = None,
                      ffn: int | None = None, vocab: int | None = None, trust_remote_code: bool = False,
                      images: bool = False) -> ModelSpec:
    if model:
        return build_spec(model, load_config(model, trust_remote_code=trust_remote_code), images=images)
    if layers or hidden or heads:
        if not (layers and hidden and heads):
            raise UserError("a bare shape needs --layers, --hidden and --heads (and optionally --kv-heads --ffn "
                            "--vocab)")
        config = shape_config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                              vocab=vocab or 32000)
        return build_spec(f"custom-{layers}L-{hidden}h", config)
    if params is not None:
        config = shape_from_params(params, vocab=vocab or 32000)
        spec = build_spec(f"custom-{params / 1e9:.3g}B", config)
        return _rescaled(spec, params)
    raise UserError("name a model (catalog name, local path or hub id), or give --params or --layers/--hidden/--heads")


def _rescaled(spec: ModelSpec, params: int) -> ModelSpec:
    """Keep the guessed shape for activations but make the counts add up to the given total exactly."""
    from dataclasses import replace

    scale = params / spec.params
    layer = tuple(int(p * scale) for p in spec.layer_params)
    pre = int(spec.pre_layer_params * scale)
    post = params - pre - sum(layer)
    note = (f"shape guessed from --params {params:,} (Llama-like, {spec.num_layers} layers x {spec.hidden}); "
            "model-state bytes use the given count exactly, activations the guessed shape")
    return replace(spec, params=params, active_params=params, layer_params=layer, pre_layer_params=pre, post_layer_params=post,
                   notes=spec.notes + (note,), param_numels=(), param_kinds=())


def spec_from_config_dict(config: dict[str, Any], *, name: str, params: int | None = None,
                          images: bool = False) -> ModelSpec:
    """The spec of a config carried as a dict (a plan's model_config), cached like a config read from disk;
    `params` rescales the counts when the plan was made from bare numbers (--params); `images`: an image-and-text
    plan's class (build_spec)."""
    from dataclasses import replace

    from toolkit import cache

    key = ["dict", name, json.dumps(config, sort_keys=True), *(["images"] if images else [])]
    spec = cache.get("spec", key, code=build_spec, decode=ModelSpec.from_cache)
    if spec is None:
        spec = build_spec(name, config_from_dict(dict(config), f"the plan's model_config ({name})"), images=images)
        spec = replace(spec, source_key=hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32])
        cache.put("spec", key, spec.to_cache(), code=build_spec)
    return _rescaled(spec, params) if params is not None and params != spec.params else spec

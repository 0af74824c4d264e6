"""ModelSpec: exact parameter counts and shape of a Hugging Face causal LM, from its config alone.

The model is built on the meta device with its own Hugging Face code and counted (tied weights once), so the
count is exact for any architecture transformers knows, not a formula. Sources, in the order they are tried:
a catalog name (presets/models/NAME.json), a local directory or config.json, a hub id (local cache, or online),
or bare numbers (`shape_config`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.paths import MODEL_CATALOG_DIR


@dataclass(frozen=True, eq=False)
class ModelSpec:
    name: str
    model_type: str
    config: Any
    """The transformers PretrainedConfig (the tracer and the trainer build from it)."""
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
    notes: tuple[str, ...] = ()
    pipeline_blocker: str | None = None
    """Why the pipeline converter cannot split this model (the part that stops it), or None: it can
    (toolkit.inputs.decoder_parts, found from the model's own modules)."""
    tiling_blocker: str | None = None
    """Why ALST tiling cannot run this model (a decoder layer's MLP DeepSpeed's TiledMLP cannot run, probed on the
    meta device: toolkit.inputs.tileable), or None."""
    source_key: str | None = None
    """Hash of where the config came from (its config.json text, or the bare numbers): the on-disk cache key of
    this spec and of its activation traces. None (hub ids) caches nothing."""

    @property
    def largest_layer_params(self) -> int:
        """Largest unit a ZeRO-3 / FSDP rank gathers at once: a decoder layer, or the embedding/head block."""
        return max([*self.layer_params, self.pre_layer_params, self.post_layer_params, self.embedding_params])

    def hf_config(self):
        """The transformers config (built on first use when the spec came from the cache as a plain dict)."""
        if isinstance(self.config, dict):
            object.__setattr__(self, "config", _config_from_dict(dict(self.config), self.name))
        return self.config

    def config_dict(self) -> dict[str, Any]:
        return dict(self.config) if isinstance(self.config, dict) else self.config.to_dict()

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
        }


# --------------------------------------------------------------------------------------------------------------
# Resolving a model name to a config


def catalog_names() -> list[str]:
    return sorted(p.stem for p in MODEL_CATALOG_DIR.glob("*.json"))


def _config_from_dict(data: dict[str, Any], where: str):
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if not k.startswith("_")}
    model_type = data.pop("model_type", None)
    if not model_type:
        raise UserError(f"{where} has no 'model_type'; it must be a Hugging Face config.json")
    if not isinstance(model_type, str):
        raise UserError(f"{where}: 'model_type' is {model_type!r}, not a name; fix the config.json")
    check_config_shape(data, where)
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise UserError(f"{where}: transformers does not know model_type '{model_type}'; "
                        "upgrade transformers or give --trust-remote-code with a hub id")
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # the config class's own validation (transformers' rules, not ours), in any class
        cause = exc.__cause__ or exc
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[-1].strip()
        raise UserError(f"{where}: transformers refuses this {model_type} config ({first[:200]}); fix the "
                        "config.json") from None


# Shape keys of Hugging Face configs (the Llama names first, then GPT-2's / OPT's), with their sane bounds. A
# value here that is not a whole number in bounds would fail deep inside the model's constructor, or build an
# absurd model for minutes; checked on the raw JSON so the message names the key.
_SHAPE_KEYS: tuple[tuple[str, Any, bool], ...] = (
    ("hidden_size", "HIDDEN", True), ("n_embd", "HIDDEN", True), ("d_model", "HIDDEN", True),
    ("num_attention_heads", "HEADS", True), ("n_head", "HEADS", True),
    ("num_key_value_heads", "HEADS", False), ("head_dim", "HIDDEN", False),
    ("num_hidden_layers", "LAYERS", True), ("n_layer", "LAYERS", True),
    ("intermediate_size", "FFN", True), ("n_inner", "FFN", False), ("ffn_dim", "FFN", True),
    ("vocab_size", "VOCAB", True), ("max_position_embeddings", "SEQ", False), ("n_positions", "SEQ", True),
)


def check_config_shape(data: dict[str, Any], where: str) -> None:
    """Every shape value a whole number in bounds, hidden divisible by heads (unless head_dim says otherwise),
    heads divisible by KV heads (grouped-query attention shares each KV head by a whole group of query heads)."""
    from toolkit import bounds

    for key, bound_name, required in _SHAPE_KEYS:
        if key not in data:
            continue
        value = data[key]
        if value is None and not required:
            continue  # null means "derive it" for these keys (n_inner = 4 x hidden, KV heads = heads)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: '{key}' is {json.dumps(value)[:40]}, not a whole number; fix the config.json")
        bounds.check_number(f"{where}: '{key}'", value, getattr(bounds, bound_name))
    hidden = next((data[k] for k in ("hidden_size", "n_embd", "d_model") if k in data), None)
    heads = next((data[k] for k in ("num_attention_heads", "n_head") if k in data), None)
    kv_heads = data.get("num_key_value_heads")
    if hidden and heads and data.get("head_dim") is None and hidden % heads:
        raise UserError(f"{where}: hidden size {hidden} does not divide by {heads} attention heads; fix the "
                        "config.json (or give head_dim)")
    if heads and kv_heads and heads % kv_heads:
        raise UserError(f"{where}: {heads} attention heads do not divide into {kv_heads} key/value heads; "
                        "num_key_value_heads must divide num_attention_heads")


def _read_json(path: Path) -> dict[str, Any]:
    from toolkit.fileio import read_bytes_limited

    try:
        data = json.loads(read_bytes_limited(path, "model config").decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); fix or re-download it") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not text (binary or not UTF-8); point at a Hugging Face config.json") from None
    except RecursionError:
        raise UserError(f"{path} nests too deeply to be a config.json; fix or re-download it") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a JSON object; it must be a Hugging Face config.json")
    return data


def load_config(model: str, *, trust_remote_code: bool = False):
    """A transformers config for a local dir/config.json, a catalog name, or a hub id (that precedence:
    toolkit.inputs.resolve.locate_model)."""
    from toolkit.inputs.resolve import catalog_name_of_hub_id, locate_model

    where = locate_model(catalog_name_of_hub_id(model) or model)
    if where.kind == "catalog":  # a catalog name, or the hub id of one: its config ships in the package
        return _config_from_dict(_read_json(where.path), f"catalog entry {where.path.name}")
    path = Path(model).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.exists() and not config_file.is_symlink():
            raise UserError(f"{path} is a directory without config.json; point at a Hugging Face model folder")
        return _config_from_dict(_read_json(config_file), str(config_file))
    if path.is_file():
        return _config_from_dict(_read_json(path), str(path))
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise UserError(f"unknown model '{model}': not a catalog name ({', '.join(catalog_names())}), "
                        "not a local path, and not a hub id (owner/name)")
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except Exception as exc:  # hub errors come in many classes; all mean the same to the user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load the config of '{model}' from the hub or its local cache ({first[:160]}); "
                        "check the id, log in for gated models, or pass a local path") from None


def shape_config(*, layers: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
                 vocab: int = 32000, max_positions: int = 4096, tied: bool = False):
    """A Llama-architecture config from bare numbers (the common shape of today's decoder LMs)."""
    from transformers import LlamaConfig

    for flag, value in (("--layers", layers), ("--hidden", hidden), ("--heads", heads), ("--vocab", vocab)):
        if value is None or value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    for flag, value in (("--kv-heads", kv_heads), ("--ffn", ffn)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be a positive integer, got {value}")
    if kv_heads is not None and kv_heads > heads:
        raise UserError(f"--kv-heads {kv_heads} is more than --heads {heads}; give at most {heads}")
    kv_heads = kv_heads or heads
    if hidden % heads or heads % kv_heads:
        raise UserError(f"--hidden {hidden} must divide by --heads {heads}, and --heads by --kv-heads {kv_heads}")
    ffn = ffn or _llama_ffn(hidden)
    return LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                       max_position_embeddings=max_positions, tie_word_embeddings=tied)


def reduced_config(config, num_layers: int, keep: int):
    """A copy of config with `keep` layers; per-layer lists (e.g. layer_types) cut to match. A vision-language
    config keeps its layers in its text config (what AutoModelForCausalLM builds): that one is cut."""
    reduced = copy.deepcopy(config)
    text = reduced.get_text_config() if hasattr(reduced, "get_text_config") else reduced
    for key, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == num_layers and keep < num_layers:
            setattr(text, key, type(value)(value[:keep]))
    text.num_hidden_layers = keep
    # The HF Trainer sets config.use_cache = TrainingArguments.use_cache (False by default): no KV cache in training.
    for part in {id(reduced): reduced, id(text): text}.values():
        if hasattr(part, "use_cache"):
            part.use_cache = False
    return reduced


def _llama_ffn(hidden: int) -> int:
    """Llama's SwiGLU width rule: 8/3 x hidden rounded up to a multiple of 256 (Llama-2-7B: 11008)."""
    return int(math.ceil(8 * hidden / 3 / 256) * 256)


def shape_from_params(params: int, *, vocab: int = 32000):
    """A Llama-shaped config whose size is near `params`: depth and width follow Llama's aspect (hidden ~ 128 x
    layers, head dim 128). Only the activation estimate depends on this guessed shape."""
    if params <= 0:
        raise UserError(f"--params must be positive, got {params}")
    best = None
    for hidden in range(256, 32768 + 1, 128):
        layers = max(1, round(hidden / 128))
        ffn = _llama_ffn(hidden)
        count = layers * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden) + 2 * vocab * hidden + hidden
        if best is None or abs(count - params) < abs(best[0] - params):
            best = (count, hidden, layers)
    _, hidden, layers = best
    heads = max(1, hidden // 128)
    return shape_config(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, vocab=vocab)


# --------------------------------------------------------------------------------------------------------------
# Counting on the meta device


def _decoder_layers(model):
    """The decoder-layer list: the longest nn.ModuleList whose entries share one class."""
    from toolkit.inputs.decoder_parts import decoder_layers

    best = decoder_layers(model)
    if best is None:
        raise UserError(f"cannot find the decoder layers of {type(model).__name__}; is it a decoder-only causal LM?")
    return best


def _unique_numel(params) -> int:
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _is_expert(param_name: str) -> bool:
    return ".experts." in f".{param_name}"


def _matmul_params(module, moe_fraction: float) -> int:
    """Weights a token multiplies through: tensors of 2+ dims; expert weights scaled by top_k / experts."""
    total = 0.0
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            total += p.numel() * (moe_fraction if _is_expert(name) else 1.0)
    return int(round(total))


def _first_int(config, keys: tuple[str, ...], minimum: int) -> int:
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= minimum:
            return value
    return 0


def _moe_shape(config) -> tuple[int, int]:
    """(experts, experts per token) under the names MoE configs use; (0, 0) for dense models."""
    experts = _first_int(config, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), 2)
    top_k = _first_int(config, ("num_experts_per_tok", "moe_top_k", "top_k", "num_experts_per_token"), 1)
    return (experts, top_k) if experts and top_k else (0, 0)


_AFTER_LAYERS = {"ln_f", "norm", "final_layer_norm", "final_norm", "project_out", "lm_head"}


def outside_layer_params(model, layers, wanted=lambda p: True) -> tuple[int, int]:
    """(before, after) the decoder layers: elements of the `wanted` parameters outside them, tied ones once.
    Registration order mostly follows execution order; final norms and output projections registered before the
    layers (OPT) are recognised by name."""
    pre = post = 0
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
            if passed_layers or module_name.rsplit(".", 1)[-1] in _AFTER_LAYERS:
                post += p.numel()
            else:
                pre += p.numel()
    return pre, post


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
        config = _config_from_dict(dict(config), name or "the model config")

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


POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")
"""Where transformers configs keep the longest sequence the model was built for (Llama's name, GPT-2's, others')."""


def model_positions(config) -> int | None:
    """The longest sequence the model takes, as its transformers config defines it, or None when it says nothing
    (ALiBi / rotary models without a limit). The one source for "the model's positions": estimate, plan, emit,
    check and toolkit.train all read it (ModelSpec.max_positions, toolkit.train.model.check_matches_plan).

    max_position_embeddings (n_positions for GPT-2) is the length, except where rope scaling extends the model past
    it: YaRN's post-scaling length is original_max_position_embeddings x factor (transformers' validate_rope: "factor
    should be the ratio between the pre-yarn and post-yarn context lengths"), which Qwen2.5's YaRN recipe adds to a
    config whose max_position_embeddings stays the pre-scaling 32768. llama3 and longrope configs already state the
    extended length in max_position_embeddings; linear / dynamic factors are taken as the config states its length
    (docs/ENGINE_FACTS.md, "What a training run's inputs must be")."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def read(key: str) -> Any:
        return text.get(key) if isinstance(text, dict) else getattr(text, key, None)

    base = next((int(v) for v in map(read, POSITION_KEYS) if isinstance(v, int) and not isinstance(v, bool)), None)
    if base is None:
        return None
    rope = next((r for r in map(read, ("rope_parameters", "rope_scaling")) if isinstance(r, dict)), {})
    found = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # one dict, or one per layer type
    longest = base
    for params in found:
        factor = params.get("factor")
        if params.get("rope_type", params.get("type")) == "yarn" and isinstance(factor, (int, float)) and factor > 1:
            original = params.get("original_max_position_embeddings") or read("original_max_position_embeddings")
            longest = max(longest, int((original if isinstance(original, int) else base) * factor))
    return longest


def config_dict_positions(data: dict[str, Any], where: str) -> int | None:
    """model_positions of a config carried as a dict (a plan's model_config), with transformers' defaults for the
    keys it leaves out (LlamaConfig's max_position_embeddings is 2048)."""
    return model_positions(_config_from_dict(dict(data), where))


def causal_lm_problem(config) -> str | None:
    """Why `config` is not a decoder-only causal LM, from the config and the model classes transformers maps:
    an encoder-decoder (T5, BART: `is_encoder_decoder`), or an encoder whose type transformers also maps to a
    masked LM (BERT, RoBERTa) and whose config does not ask for causal attention (`is_decoder`). Such models can
    be built with AutoModelForCausalLM, but train bidirectionally (or not as one stack): not what we plan."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        return (f"{kind} is an encoder-decoder model (is_encoder_decoder in its config), not a causal LM; toolkit "
                "plans decoder-only causal LMs")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return (f"{kind} is an encoder (bidirectional attention; transformers maps it to a masked LM), not a causal "
                "LM; set \"is_decoder\": true in its config.json to train it as one, or plan a decoder-only model")
    return None


def build_spec(name: str, config) -> ModelSpec:
    """Build the model on the meta device with its own code and count everything exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    problem = causal_lm_problem(config)
    if problem:
        raise UserError(f"'{name}': {problem}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    per_layer = sorted(getattr(text.__dict__.get("_heterogeneity_spec"), "per_layer_attributes", ()))
    if per_layer:  # transformers refuses the global read of these (AmbiguousGlobalPerLayerAttributeError)
        raise UserError(f"'{name}': its decoder layers differ in {', '.join(per_layer)} (a heterogeneous "
                        f"{text.model_type} config, e.g. Gemma-4's wider global-attention heads); toolkit plans "
                        "models whose decoder layers share one shape")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise UserError(f"'{name}' is not a causal LM transformers can build ({str(exc).splitlines()[0][:160]})") \
            from None
    layers = _decoder_layers(model)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    total = _unique_numel(model.parameters())
    experts, top_k = _moe_shape(config)
    moe_fraction = top_k / experts if experts else 1.0

    pre, post = outside_layer_params(model, layers)
    embedding_params = embed.weight.numel() if embed is not None else 0
    head_weight = head.weight if head is not None else embed.weight
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(getattr(text_config, "hidden_size", None) or getattr(text_config, "n_embd"))
    heads = int(getattr(text_config, "num_attention_heads", None) or getattr(text_config, "n_head"))
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or hidden // heads)
    max_positions = model_positions(config)
    factored = 0
    for p in {id(p): p for p in model.parameters()}.values():
        shape = tuple(p.shape)
        factored += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else p.numel()
    expert_params = sum(p.numel() for n, p in layers.named_parameters() if _is_expert(n))
    from toolkit.inputs.decoder_parts import pipeline_blocker

    from toolkit.inputs.tileable import model_tiling_blocker

    tiling_blocker = model_tiling_blocker(model, hidden)
    notes = []
    if experts:
        notes.append(f"mixture of experts: {experts} experts, top-{top_k} per token")
    if tiling_blocker:  # the planner's auto tiling skips this model; --tiled refuses it with the same words
        notes.append(f"ALST tiling not tried: {tiling_blocker}")
    return ModelSpec(
        name=name,
        model_type=config.model_type,
        config=config,
        params=total,
        layer_params=tuple(_unique_numel(layer.parameters()) for layer in layers),
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
        attention_support=attention_support(model),
        model_class=type(model).__name__,
        factored_state_fraction=factored / total if total else 0.0,
        active_params=total - int(round(expert_params * (1 - moe_fraction))),
        moe_experts=experts,
        moe_top_k=top_k,
        notes=tuple(notes),
        pipeline_blocker=pipeline_blocker(model, config),
        tiling_blocker=tiling_blocker,
    )


def resolve_model(model: str | None = None, *, trust_remote_code: bool = False, **numbers: int | None) -> ModelSpec:
    """The one entry point: a model name/path/id, or bare numbers (params, or layers / hidden / heads / kv_heads /
    ffn / vocab). Specs of configs read from disk and of bare numbers come from the on-disk cache when they were
    built before (toolkit.cache)."""
    from toolkit import cache

    unknown = set(numbers) - {"params", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab"}
    if unknown:
        raise TypeError(f"resolve_model() got unexpected keyword(s) {sorted(unknown)}")
    key = _source_key(model, **numbers)
    if key is not None:
        hit = cache.get("spec", key, code=build_spec, decode=ModelSpec.from_cache)
        if hit is not None:
            return hit
    spec = _resolve_uncached(model, trust_remote_code=trust_remote_code, **numbers)
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
                return ["file", model, json.dumps(_read_json(candidate), sort_keys=True)]
        return None
    return ["numbers", sorted(numbers.items())]


def _resolve_uncached(model: str | None = None, *, params: int | None = None, layers: int | None = None,
                      hidden: int | None = None, heads: int | None = None, kv_heads: int | None = None,
                      ffn: int | None = None, vocab: int | None = None, trust_remote_code: bool = False) -> ModelSpec:
    if model:
        return build_spec(model, load_config(model, trust_remote_code=trust_remote_code))
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
                   notes=spec.notes + (note,))


def spec_from_config_dict(config: dict[str, Any], *, name: str, params: int | None = None) -> ModelSpec:
    """The spec of a config carried as a dict (a plan's model_config), cached like a config read from disk;
    `params` rescales the counts when the plan was made from bare numbers (--params)."""
    from dataclasses import replace

    from toolkit import cache

    key = ["dict", name, json.dumps(config, sort_keys=True)]
    spec = cache.get("spec", key, code=build_spec, decode=ModelSpec.from_cache)
    if spec is None:
        spec = build_spec(name, _config_from_dict(dict(config), f"the plan's model_config ({name})"))
        spec = replace(spec, source_key=hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32])
        cache.put("spec", key, spec.to_cache(), code=build_spec)
    return _rescaled(spec, params) if params is not None and params != spec.params else spec

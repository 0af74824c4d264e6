"""A model's transformers config: where it comes from (a catalog name, a local directory or config.json, a hub id, or
bare numbers), the shape checks on its raw JSON, and what it says on its own (the model's positions, its experts,
whether it is a decoder-only causal LM). No model is built here (toolkit.inputs.modelspec counts one)."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

from toolkit.errors import UserError
from toolkit.paths import MODEL_CATALOG_DIR


def text_config(config: Any) -> Any:
    """The decoder's own config: the text config of a vision-language (or other composite) config, which
    AutoModelForCausalLM builds the language model from (e.g. Qwen3.5, Gemma-3); the config itself otherwise (a plain
    causal LM's, or a dict)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def auto_model_class(config: Any, *, images: bool = False):
    """The transformers auto class that builds `config`'s model: AutoModelForCausalLM where its mapping has the
    config's class, else AutoModelForImageTextToText where that mapping has it (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: no
    causal-LM entry in transformers 5.24), else AutoModelForCausalLM (whose from_config then says what is wrong).
    `images` (an image-and-text job): AutoModelForImageTextToText wherever its mapping has the config, since the
    vision tower must be built with the language model (Qwen3.5's AutoModelForCausalLM builds its language model
    alone, Qwen3_5ForCausalLM; its image-text class is Qwen3_5ForConditionalGeneration). Read from transformers' own
    auto mappings, no per-architecture table."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING)

    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING and (images or type(config) not in
                                                                 MODEL_FOR_CAUSAL_LM_MAPPING):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def layer_count_key(config: Any) -> str:
    """The config attribute that counts the decoder layers of the list the model stacks: num_hidden_layers, or the
    key transformers' own model class counts its layers' hidden states by (the hidden_states recorder's
    num_hidden_layers_key in _can_record_outputs, utils/output_capturing.py): LongCat-Flash's decoder layer holds two
    attention sub-layers, so its num_hidden_layers is 2 x num_layers and its layer list has num_layers entries."""
    mapping = getattr(auto_model_class(config), "_model_mapping", {})
    try:
        model_class = mapping[type(config)]
    except (KeyError, ValueError):  # a config transformers maps to no class here: its from_config says so later
        return "num_hidden_layers"
    recorder = (getattr(model_class, "_can_record_outputs", None) or {}).get("hidden_states")
    key = getattr(recorder, "num_hidden_layers_key", None)
    return key if isinstance(key, str) else "num_hidden_layers"


def layer_count(config: Any) -> Any:
    """The number of decoder layers in the model's layer list (layer_count_key of its text config), as the config
    holds it (None or another non-int where a default config leaves it unset)."""
    return getattr(text_config(config), layer_count_key(config), None)


def load_pretrained(source: Any, *, images: bool = False, **kwargs: Any):
    """The model saved at `source` (a folder or hub id) loaded with the class auto_model_class picks for its config
    (a Qwen2.5-VL checkpoint has no AutoModelForCausalLM class; `images`: the image-text class, as an image plan
    trains it); `kwargs` go to from_pretrained."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source))
    return auto_model_class(config, images=images).from_pretrained(str(source), config=config, **kwargs)


def catalog_names() -> list[str]:
    return sorted(p.stem for p in MODEL_CATALOG_DIR.glob("*.json"))


def config_from_dict(data: dict[str, Any], where: str):
    from transformers import AutoConfig, PreTrainedConfig

    # transformers writes inf and NaN as {"__float__": "Infinity"} (JSON has no such numbers; Mamba-2's
    # time_step_limit is (0, inf)) and reads them back on its own load path (_dict_from_json_file): read them so too.
    data = PreTrainedConfig._decode_special_floats(data)
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
        config = AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # the config class's own validation (transformers' rules, not ours), in any class
        cause = exc.__cause__ or exc
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[-1].strip()
        raise UserError(f"{where}: transformers refuses this {model_type} config ({first[:200]}); fix the "
                        "config.json") from None
    _check_head_width(config, where)
    return config


def _check_head_width(config, where: str) -> None:
    """Hidden size divisible by the attention heads where the model derives its head width from them: a config
    whose class has no head_dim (GLM-4-MoE's attention takes hidden // heads, rounding down, and its rotary half
    then misfits). A class with a head_dim (its default or the file's; Llama validates that itself, MLA models
    such as GLM-4-MoE-Lite carry one) sets the width on its own, so the config's own values are read, defaults
    included, not the raw JSON."""
    if getattr(config, "is_heterogeneous", False):
        # Per-layer configs (dots3-note's per_layer_config): a global read of num_attention_heads raises; each layer's
        # own values are checked.
        for layer in config.per_layer_config:
            _check_head_width(layer, where)
        return
    try:
        text = text_config(config)
    except ValueError:  # several text configs (MusicGen's text_encoder and decoder): refused as no causal LM later
        text = config
    if text is not config:  # an image-text model's language model (Qwen3-Omni's thinker: 2048 wide, 28 heads)
        _check_head_width(text, f"{where} (text_config)")
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if (isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads
            and _head_width(config) is None):
        raise UserError(f"{where}: hidden size {hidden} does not divide by {heads} attention heads; fix the "
                        "config.json (or give head_dim)")


def _head_width(config) -> int | None:
    """The attention head width the config sets on its own, under any of the names transformers' config classes give
    it (head_dim; Reformer's attention_head_size, 64 with 256 hidden and 12 heads: its attention is 768 wide), or
    None where the model takes hidden // heads."""
    if getattr(config, "head_dim", None) is not None:  # a property in some classes, so read, not looked up
        return config.head_dim
    return next((v for k, v in vars(config).items()
                 if re.fullmatch(r"(attention_)?head_(dim|size)", k) and isinstance(v, int) and v > 0), None)


# Shape keys of Hugging Face configs (the Llama names first, then GPT-2's / OPT's), with their sane bounds. A
# value here that is not a whole number in bounds would fail deep inside the model's constructor, or build an
# absurd model for minutes; checked on the raw JSON so the message names the key.
_SHAPE_KEYS: tuple[tuple[str, Any, bool], ...] = (
    ("hidden_size", "HIDDEN", True), ("n_embd", "HIDDEN", True), ("d_model", "HIDDEN", True),
    ("num_attention_heads", "HEADS", True), ("n_head", "HEADS", True),
    ("num_key_value_heads", "HEADS", False), ("head_dim", "HIDDEN", False),
    ("num_hidden_layers", "LAYERS", True), ("n_layer", "LAYERS", True),
    ("intermediate_size", "FFN", False), ("n_inner", "FFN", False), ("ffn_dim", "FFN", True),
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
            # null means "derive it" for these keys (GPT-Neo's intermediate_size and GPT-2's n_inner = 4 x hidden,
            # KV heads = heads)
            continue
        # A list with one value per layer (Gemma-3n's intermediate_size): each a whole number in bounds.
        per_layer = isinstance(value, list) and len(value) == data.get("num_hidden_layers")
        for one in (value if per_layer else [value]):
            if isinstance(one, bool) or not isinstance(one, int):
                raise UserError(f"{where}: '{key}' is {json.dumps(value)[:40]}, not a whole number; fix the "
                                "config.json")
            bounds.check_number(f"{where}: '{key}'", one, getattr(bounds, bound_name))
    heads = next((data[k] for k in ("num_attention_heads", "n_head") if k in data), None)
    kv_heads = data.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise UserError(f"{where}: {heads} attention heads do not divide into {kv_heads} key/value heads; "
                        "num_key_value_heads must divide num_attention_heads")


def read_config_json(path: Path) -> dict[str, Any]:
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
        return config_from_dict(read_config_json(where.path), f"catalog entry {where.path.name}")
    path = Path(model).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.exists() and not config_file.is_symlink():
            raise UserError(f"{path} is a directory without config.json; point at a Hugging Face model folder")
        return config_from_dict(read_config_json(config_file), str(config_file))
    if path.is_file():
        return config_from_dict(read_config_json(path), str(path))
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
    text = text_config(reduced)
    for key, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == num_layers and keep < num_layers:
            setattr(text, key, type(value)(value[:keep]))
    key = layer_count_key(reduced)
    for alias in _layer_count_aliases(text, key) if keep < num_layers else ():
        if getattr(text, alias) == num_layers:
            setattr(text, alias, keep)
    setattr(text, key, keep)
    shared = getattr(text, "num_kv_shared_layers", None)
    if isinstance(shared, int) and shared and keep < num_layers:
        # Gemma-3n / Gemma-4: the last `shared` layers reuse earlier layers' keys and values (kv_sharing_modes); of
        # the leading `keep` layers, those at or past num_layers - shared stay sharing.
        text.num_kv_shared_layers = max(0, keep - (num_layers - shared))
    # The HF Trainer sets config.use_cache = TrainingArguments.use_cache (False by default): no KV cache in training.
    for part in {id(reduced): reduced, id(text): text}.values():
        if hasattr(part, "use_cache"):
            part.use_cache = False
    return reduced


def _layer_count_aliases(text, key: str) -> tuple[str, ...]:
    """The other attributes of the config class that hold its layer count, found by building the class twice with
    different counts: xLSTM's num_blocks (what sizes its block list) is copied from num_hidden_layers by the
    class's __post_init__, so a copy that cuts num_hidden_layers alone would still build every block."""
    try:
        a, b = type(text)(**{key: 3}), type(text)(**{key: 5})
    except Exception:  # noqa: BLE001 - a class whose defaults do not build alone: it has no alias to find
        return ()
    return tuple(k for k, v in vars(a).items() if k != key and v == 3 and vars(b).get(k) == 5)


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




def first_int(config, keys: tuple[str, ...], minimum: int) -> int:
    """The first of `keys` the config sets to a whole number >= `minimum` (attribute_map aliases included), else 0."""
    for key in keys:
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= minimum:
            return value
    return 0


def moe_shape(config) -> tuple[int, int]:
    """(experts, experts per token) under the names MoE configs use; (0, 0) for dense models."""
    experts = first_int(config, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), 2)
    top_k = first_int(config, ("num_experts_per_tok", "moe_top_k", "top_k", "num_experts_per_token"), 1)
    return (experts, top_k) if experts and top_k else (0, 0)



POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")
"""Where transformers configs keep the longest sequence the model was built for (Llama's name, GPT-2's, others')."""


def model_positions(config) -> int | None:
    """The longest sequence the model takes, as its transformers config defines it, or None when it says nothing
    (ALiBi / rotary models without a limit). The one source for "the model's positions": estimate, plan, emit,
    check and toolkit.train all read it (ModelSpec.max_positions, toolkit.train.model.check_matches_plan).

    max_position_embeddings (n_positions for GPT-2) is the length, except where rope scaling extends the model past
    it: YaRN's post-scaling length is original_max_position_embeddings x factor (transformers' validate_rope: "factor
    should be the ratio between the pre-yarn and post-yarn context lengths"), which Qwen2.5's YaRN recipe adds to a
    config whose max_position_embeddings stays the pre-scaling 32768. Dynamic NTK's max_position_embeddings is the
    trained length it grows the base past (_compute_dynamic_ntk_parameters), so its length is that x factor. llama3,
    longrope and linear configs state the extended length in max_position_embeddings (docs/ENGINE_FACTS.md, "What a
    training run's inputs must be", "RoPE scaling")."""
    text = text_config(config)

    def read(key: str) -> Any:
        return text.get(key) if isinstance(text, dict) else getattr(text, key, None)

    # XLNet's max_position_embeddings is -1: "no sequence length limit" (XLNetConfig), as is any value below 1.
    base = next((int(v) for v in map(read, POSITION_KEYS) if isinstance(v, int) and not isinstance(v, bool)), None)
    if base is None or base < 1:
        return None
    rope = next((r for r in map(read, ("rope_parameters", "rope_scaling")) if isinstance(r, dict)), {})
    found = [r for r in rope.values() if isinstance(r, dict)] or [rope]  # one dict, or one per layer type
    longest = base
    for params in found:
        factor = params.get("factor")
        kind = params.get("rope_type", params.get("type"))
        if not isinstance(factor, (int, float)) or not 1 < factor < float("inf"):  # NaN and inf are no factor
            continue
        if kind == "yarn":
            original = params.get("original_max_position_embeddings") or read("original_max_position_embeddings")
            longest = max(longest, int((original if isinstance(original, int) else base) * factor))
        elif kind == "dynamic":
            longest = max(longest, int(base * factor))
    return longest


def config_dict_positions(data: dict[str, Any], where: str) -> int | None:
    """model_positions of a config carried as a dict (a plan's model_config), with transformers' defaults for the
    keys it leaves out (LlamaConfig's max_position_embeddings is 2048)."""
    return model_positions(config_from_dict(dict(data), where))


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
    text = text_config(config)
    shared, layers = getattr(text, "num_kv_shared_layers", None), getattr(text, "num_hidden_layers", None)
    if isinstance(shared, int) and isinstance(layers, int) and 0 < layers <= shared:
        # Every layer reuses keys and values made elsewhere (kv_sharing_modes all "reuse"): a speculative-decoding
        # drafter whose forward takes the target model's shared_kv_states and inputs_embeds, not token ids.
        return (f"{kind} shares the keys and values of all its {layers} layers (num_kv_shared_layers "
                f"{shared}): it is a drafter that runs on another model's states, not a causal LM that trains on "
                "text; plan the model it drafts for")
    return None


"""LoRA and QLoRA: the adapter a job trains, and exact counts of what it adds and freezes.

The counts come from the model built on the meta device and wrapped by the real `peft` package (get_peft_model
with the job's LoraConfig), never from a formula: trainable adapter parameters per module, the frozen base, and for
QLoRA which weights transformers' bitsandbytes integration quantises (every nn.Linear but the ones
`transformers.quantizers.base.get_keys_to_not_convert` keeps: the LM head, tied weights, the last module).

4-bit storage follows bitsandbytes 0.4x/0.5x `functional.quantize_4bit`: two 4-bit codes per byte, one fp32 absmax
per block of 64 elements (the default blocksize), a 16-entry fp32 code table per tensor; with double quantisation
(compress_statistics=True, BitsAndBytesConfig.bnb_4bit_use_double_quant) the absmax values are themselves quantised
by `quantize_blockwise` to 1 byte each in blocks of 256, which adds one fp32 absmax per 256 blocks, a 256-entry fp32
code table and an fp32 offset per tensor. tests/test_lora.py checks these bytes against real bnb tensors.

Nothing here imports torch at module level: a Job (toolkit.inputs.job) holds an Adapter.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from toolkit.errors import UserError
from toolkit.inputs.choices import (BASE_DTYPE_NAMES, BASE_DTYPES, COMPUTE_DTYPES, DTYPE_BYTES, METHODS,
                                    QUANT_STORAGE_DTYPES, QUANT_TYPES)

# peft imports bitsandbytes, whose CPU backend warns on import that an optional faster 4-bit kernel (the `kernels`
# package) is missing: noise on every CPU command (its pure-torch path runs instead), and not one clear line.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


BNB_4BIT_BLOCKSIZE = 64
"""bitsandbytes quantize_4bit: blocksize None -> 64 (functional.py; 128 only on ROCm)."""
BNB_NESTED_BLOCKSIZE = 256
"""quantize_4bit with compress_statistics: quantize_blockwise(absmax, blocksize=256)."""
BNB_4BIT_CODE_ENTRIES = 16
BNB_DYNAMIC_CODE_ENTRIES = 256


@dataclass(frozen=True)
class Adapter:
    """The training method. `full` trains every weight (the other fields are ignored)."""

    method: str = "full"
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: str = "all-linear"
    """PEFT target_modules: "all-linear" (every nn.Linear but the output layer) or comma-separated module names."""
    modules_to_save: str = ""
    """Comma-separated modules trained in full beside the adapters (PEFT modules_to_save), e.g. "lm_head"."""
    exclude: str = ""
    """Comma-separated module paths PEFT leaves alone with everything under them (LoraConfig exclude_modules, as one
    full-match pattern): a multimodal class's vision encoder and projector (ModelSpec.vision_modules), so the
    adapters land on the language model only; PEFT's all-linear alone would also wrap the encoder's linears."""
    quant_type: str = "nf4"
    """QLoRA: BitsAndBytesConfig.bnb_4bit_quant_type."""
    double_quant: bool = True
    """QLoRA: bnb_4bit_use_double_quant."""
    compute_dtype: str = "bfloat16"
    """QLoRA: bnb_4bit_compute_dtype."""
    quant_storage: str = "uint8"
    """QLoRA: bnb_4bit_quant_storage; set it to the compute dtype for FSDP / ZeRO-3, which shard floating tensors."""
    base_dtype: str = "auto"
    """LoRA: the dtype the frozen base is loaded in (BASE_DTYPES; auto: the compute dtype, base_dtype_name). PEFT's
    modules_to_save copies are deep copies of the loaded modules, so they train in it unless saved_dtype says."""
    saved_dtype: str = "auto"
    """LoRA / QLoRA: the dtype the trainable modules_to_save copies train in (BASE_DTYPES; auto: PEFT's own, the
    base's load dtype; saved_dtype_name). toolkit.train casts the copies to it after get_peft_model."""
    adapter_dtype: str = "auto"
    """LoRA / QLoRA: the dtype the adapters train in. auto: as PEFT's get_peft_model leaves them (its
    autocast_adapter_dtype upcasts bf16 / fp16 adapters to fp32; under DeepSpeed and FSDP2 the engine casts them
    back to the compute dtype), what toolkit.train and a PEFT script run; base: the base's compute dtype, as a
    framework with its own LoRA builds them under a low-precision default dtype (LitGPT under Fabric's bf16-true).
    Not a command-line choice: published runs of other frameworks set it (benchmarks/published.py)."""

    def __post_init__(self) -> None:
        _check("--method", self.method, METHODS)
        if self.method == "full":
            return
        if not isinstance(self.r, int) or self.r <= 0:
            raise UserError(f"--lora-r must be a positive integer, got {self.r!r}")
        if not (isinstance(self.alpha, (int, float)) and self.alpha > 0 and math.isfinite(self.alpha)):
            raise UserError(f"--lora-alpha must be a positive number, got {self.alpha!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise UserError(f"--lora-dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_list():
            raise UserError("--lora-targets is empty; give all-linear or module names such as q_proj,v_proj")
        bad = [m for m in self.exclude_list() if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+){0,15}", m)]
        if bad:
            raise UserError(f"adapter exclude {bad[0]!r} is not a module path (dotted names); re-plan")
        _check("--qlora-quant-type", self.quant_type, QUANT_TYPES)
        _check("--qlora-compute-dtype", self.compute_dtype, COMPUTE_DTYPES)
        _check("--qlora-quant-storage", self.quant_storage, QUANT_STORAGE_DTYPES)
        _check("--base-dtype", self.base_dtype, BASE_DTYPES)
        _check("--modules-to-save-dtype", self.saved_dtype, BASE_DTYPES)
        if self.adapter_dtype not in ("auto", "base"):
            raise UserError(f"adapter dtype must be auto or base, got {self.adapter_dtype!r}")
        if self.method == "qlora" and self.base_dtype != "auto":
            raise UserError("--base-dtype applies to --method lora: a QLoRA base is 4-bit (--qlora-quant-storage), "
                            "and the dtype of its other parts is not modelled apart; drop --base-dtype")

    @property
    def is_adapter(self) -> bool:
        return self.method in ("lora", "qlora")

    def target_list(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]

    def save_list(self) -> list[str]:
        return [t.strip() for t in self.modules_to_save.split(",") if t.strip()]

    def exclude_list(self) -> list[str]:
        return [t.strip() for t in self.exclude.split(",") if t.strip()]

    def peft_exclude_modules(self) -> str | None:
        """LoraConfig exclude_modules: one pattern PEFT full-matches against each module's path (a string is a
        regex there, peft tuners_utils.check_target_module_exists), covering each excluded module and its children."""
        paths = self.exclude_list()
        return f"({'|'.join(re.escape(p) for p in paths)})(\\..*)?" if paths else None

    def peft_target_modules(self) -> str | list[str]:
        targets = self.target_list()
        return "all-linear" if targets == ["all-linear"] else targets

    def lora_config_kwargs(self) -> dict[str, Any]:
        """peft.LoraConfig keyword arguments (JSON-safe): what training_args.json gives a user's script."""
        return dict(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                    target_modules=self.peft_target_modules(), modules_to_save=self.save_list() or None,
                    task_type="CAUSAL_LM",
                    **({"exclude_modules": self.peft_exclude_modules()} if self.exclude else {}))

    def lora_config(self):
        """The real peft.LoraConfig of this adapter."""
        from peft import LoraConfig

        return LoraConfig(**self.lora_config_kwargs())

    def bnb_config_kwargs(self) -> dict[str, Any]:
        """transformers.BitsAndBytesConfig keyword arguments of a QLoRA base (dtypes as torch attribute names)."""
        return dict(load_in_4bit=True, bnb_4bit_quant_type=self.quant_type, bnb_4bit_use_double_quant=self.double_quant,
                    bnb_4bit_compute_dtype=self.compute_dtype, bnb_4bit_quant_storage=self.quant_storage)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict; base_dtype, saved_dtype and adapter_dtype only when not auto, so plans and cache
        keys written before them read unchanged."""
        from dataclasses import asdict

        out = asdict(self)
        for key in ("base_dtype", "saved_dtype", "adapter_dtype"):
            if out[key] == "auto":
                del out[key]
        return out


def _check(flag: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{flag} '{value}' is not known; choose one of: {', '.join(choices)}")


FULL = Adapter()

LORA_FLAGS = {"r": "--lora-r", "alpha": "--lora-alpha", "dropout": "--lora-dropout", "targets": "--lora-targets",
              "modules_to_save": "--lora-modules-to-save", "base_dtype": "--base-dtype",
              "saved_dtype": "--modules-to-save-dtype"}
"""Adapter fields only LoRA and QLoRA read, with the flag that sets each."""
QLORA_FLAGS = {"quant_type": "--qlora-quant-type", "double_quant": "--qlora-no-double-quant",
               "compute_dtype": "--qlora-compute-dtype", "quant_storage": "--qlora-quant-storage"}
"""Adapter fields only QLoRA reads (the 4-bit base), with the flag that sets each."""


def adapter_from_flags(method: str, **given: Any) -> Adapter:
    """The Adapter of a command line, its flags checked as a set: a flag the method does not read is refused
    (a LoRA rank under full fine-tuning, a 4-bit quantisation type under LoRA), never silently ignored. `given`
    holds only the flags the user gave (None: not given)."""
    _check("--method", method, METHODS)
    given = {k: v for k, v in given.items() if v is not None}
    unread = [LORA_FLAGS[k] for k in LORA_FLAGS if k in given and method == "full"]
    unread += [QLORA_FLAGS[k] for k in QLORA_FLAGS if k in given and method != "qlora"]
    if unread:
        wants = "--method lora or qlora" if unread[0] in LORA_FLAGS.values() else "--method qlora"
        raise UserError(f"{unread[0]} applies to {wants}, and --method is {method}: it would be ignored; "
                        f"{'add ' + wants.split(' or ')[0] if method == 'full' else 'use --method qlora'} "
                        f"or drop {unread[0]}")
    return Adapter(method=method, **given)


@dataclass(frozen=True)
class AdapterCounts:
    """Exact parameter counts of a PEFT-wrapped model."""

    trainable_params: int
    """What PEFT's get_nb_trainable_parameters reports as trainable: adapters + modules_to_save copies."""
    all_params: int
    """PEFT's "all params": base (tied weights once) + adapters + modules_to_save copies."""
    adapter_params: int
    """lora_A / lora_B weights alone."""
    saved_module_params: int
    """Trainable copies of modules_to_save."""
    frozen_params: int
    """Base parameters that get no gradient (the originals of modules_to_save included: PEFT keeps them)."""
    quantized_params: int
    """QLoRA: elements of the base weights stored in 4 bits (every Linear except those transformers skips)."""
    quantized_tensors: int
    quantized_bytes: int
    """QLoRA: bytes of those 4-bit weights with their quantisation constants (quantized_4bit_bytes per tensor)."""
    largest_quantized_params: int = 0
    """QLoRA: elements of the largest 4-bit weight (bitsandbytes dequantises one whole weight at a time)."""
    quantized_packed_bytes: int = 0
    """QLoRA: the packed 4-bit codes alone (packed_4bit_bytes per tensor): what FSDP2 / ZeRO-3 shard and gather."""
    per_layer_quantized: tuple[int, ...] = ()
    """QLoRA: 4-bit weight elements in each decoder layer."""
    per_layer_quantized_packed: tuple[int, ...] = ()
    """QLoRA: packed 4-bit bytes in each decoder layer (packed_4bit_bytes per tensor)."""
    per_module: dict[str, int] = field(default_factory=dict)
    """Adapter parameters by target module name (e.g. "q_proj": total over all layers)."""
    per_layer: tuple[int, ...] = ()
    """Trainable parameters of each decoder layer."""
    pre_layer_trainable: int = 0
    post_layer_trainable: int = 0

    @property
    def unquantized_frozen_params(self) -> int:
        return self.frozen_params - self.quantized_params


def packed_4bit_bytes(numel: int, quant_storage: str = "uint8") -> int:
    """Bytes of one 4-bit weight's packed codes alone (two codes per byte, rounded up to whole `quant_storage`
    elements): the Params4bit's tensor data, the only part of a 4-bit weight FSDP2 and ZeRO-3 shard and all-gather
    (docs/ENGINE_FACTS.md, "QLoRA under FSDP2 / ZeRO-3")."""
    item = DTYPE_BYTES[quant_storage]
    return math.ceil(math.ceil(numel / 2) / item) * item


def quant_constants_bytes(numel: int, *, double_quant: bool) -> int:
    """Bytes of one 4-bit weight's quantisation constants (bitsandbytes QuantState: absmax, code tables, nested
    absmax and offset). The QuantState is a Python attribute of the Params4bit (and of its Linear4bit), not a tensor
    FSDP2 or ZeRO-3 see: every GPU keeps it whole, and no collective moves it."""
    blocks = math.ceil(numel / BNB_4BIT_BLOCKSIZE)
    code = BNB_4BIT_CODE_ENTRIES * 4
    if not double_quant:
        return 4 * blocks + code
    nested = math.ceil(blocks / BNB_NESTED_BLOCKSIZE)
    return blocks + 4 * nested + BNB_DYNAMIC_CODE_ENTRIES * 4 + 4 + code


def quantized_4bit_bytes(numel: int, *, double_quant: bool, quant_storage: str = "uint8") -> int:
    """Bytes bitsandbytes holds for one 4-bit weight of `numel` elements: packed codes and quantisation constants
    (see the module docstring for the rules and their source)."""
    return packed_4bit_bytes(numel, quant_storage) + quant_constants_bytes(numel, double_quant=double_quant)


_COUNTS_CACHE: dict[tuple, AdapterCounts] = {}


def peft_model_on_meta(config, adapter: Adapter):
    """The model built on the meta device from `config`, wrapped with PEFT (no memory, a few seconds)."""
    import copy
    import warnings

    import torch
    from peft import get_peft_model

    from toolkit.inputs.modelconfig import auto_model_class

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto_model_class(config).from_config(copy.deepcopy(config))
    quantized = _quantized_linears(model) if adapter.method == "qlora" else {}
    names = sorted({n.rsplit(".", 1)[-1] for n in _linear_modules(model)})
    _check_named_modules(model, adapter, names)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = get_peft_model(model, adapter.lora_config(), low_cpu_mem_usage=True)
    except ValueError as exc:
        message = str(exc).splitlines()[0][:160]
        if "not found" in message:
            raise UserError(f"--lora-targets {adapter.targets}: {message}; name modules {type(model).__name__} "
                            f"has ({','.join(names)}) or use all-linear") from None
        fix = "; give --lora-dropout 0" if "lora_dropout" in message else ""
        raise UserError(f"PEFT refuses this LoRA setting for {type(model).__name__}: {message}{fix}") from None
    _check_rank(peft_model, adapter)
    return peft_model, quantized


def check_adapter_on_model(config, adapter: Adapter) -> None:
    """Refuse an adapter the model cannot take (unknown target or saved module, a rank above the adapted
    matrices), built on the meta device as estimate and plan build it: before any process starts."""
    peft_model_on_meta(config, adapter)


def _check_named_modules(model, adapter: Adapter, linear_names: list[str]) -> None:
    """Every module the adapter names must be one of the model's (PEFT matches a name as the last part of a
    module's path; an unknown modules_to_save name it ignores silently)."""
    paths = [name for name, _ in model.named_modules() if name]
    for flag, wanted in (("--lora-targets", [] if adapter.target_list() == ["all-linear"] else adapter.target_list()),
                         ("--lora-modules-to-save", adapter.save_list())):
        for name in wanted:
            if not any(path == name or path.endswith("." + name) for path in paths):
                top = sorted({path.rsplit(".", 1)[-1] for path in paths if path.count(".") == 1})
                known = linear_names if flag == "--lora-targets" else top + ["lm_head"] * ("lm_head" not in top)
                raise UserError(f"{flag} names '{name}', which {type(model).__name__} does not have; name its "
                                f"modules ({','.join(known)})")


def _check_rank(peft_model, adapter: Adapter) -> None:
    """LoRA's update B @ A has rank at most min(in, out) of the adapted matrix: a larger r adds parameters (and
    memory) that can learn nothing more. Refused when r is above that bound for every adapted matrix (a small one
    among them, such as Mixtral's 8 x 4096 router under all-linear, is common and only caps its own update)."""
    sides = [(min(m.in_features, m.out_features), name, m.out_features, m.in_features)
             for name, m in peft_model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "in_features")
             and isinstance(getattr(m, "in_features", None), int)]
    if not sides:
        return
    largest, name, out_features, in_features = max(sides)
    if adapter.r > largest:
        raise UserError(f"--lora-r {adapter.r} is above the rank of every adapted matrix (the largest, "
                        f"{name.split('.')[-1]}, is {out_features} x {in_features}: rank at most {largest}); use "
                        f"--lora-r {largest} or less")


def _quantized_linears(model) -> dict[str, int]:
    """{module name: weight elements} of the Linear layers transformers' bitsandbytes integration replaces with
    Linear4bit (replace_with_bnb_linear skips get_keys_to_not_convert's modules)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    skip = get_keys_to_not_convert(model)
    return {name: weight for name, weight in _linear_modules(model).items()
            if not any(name == k or name.endswith("." + k) or name.startswith(k + ".") for k in skip)}


def _linear_modules(model) -> dict[str, int]:
    """{name: weight elements} of nn.Linear and transformers' Conv1D (GPT-2) modules: what bitsandbytes replaces
    (transformers integrations/bitsandbytes.py) and what PEFT's all-linear targets."""
    import torch
    from transformers.pytorch_utils import Conv1D

    return {name: m.weight.numel() for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}


def adapter_counts(config, adapter: Adapter, *, cache_key: str | None = None) -> AdapterCounts:
    """Exact counts of `config`'s model wrapped with `adapter` (PEFT on the meta device)."""
    if not adapter.is_adapter:
        raise ValueError("adapter_counts needs a lora or qlora adapter")
    key = (cache_key or config.to_json_string(use_diff=False), adapter)
    if key in _COUNTS_CACHE:
        return _COUNTS_CACHE[key]
    counts = counts_of_peft_model(*peft_model_on_meta(config, adapter), adapter)
    _COUNTS_CACHE[key] = counts
    return counts


def counts_of_peft_model(peft_model, quantized: dict[str, int], adapter: Adapter) -> AdapterCounts:
    """AdapterCounts of a model peft_model_on_meta built."""
    trainable, total = peft_model.get_nb_trainable_parameters()
    per_module: dict[str, int] = {}
    adapter_params = saved = 0
    for name, p in peft_model.named_parameters():
        if not p.requires_grad:
            continue
        if ".lora_" in name:
            adapter_params += p.numel()
            module = name.split(".lora_")[0].rsplit(".", 1)[-1]
            per_module[module] = per_module.get(module, 0) + p.numel()
        else:
            saved += p.numel()
    from toolkit.inputs.modelspec import find_decoder_layers, outside_layer_params

    base = peft_model.get_base_model()
    layers = find_decoder_layers(base)
    per_layer = tuple(sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in layers)
    # Trainable parameters outside the layers (modules_to_save such as embed_tokens / lm_head).
    pre, post = outside_layer_params(base, layers, wanted=lambda p: p.requires_grad)
    # 4-bit weights per layer: the quantised names are the unwrapped model's, which PEFT keeps (it wraps in place).
    paths = {id(m): name + "." for name, m in base.named_modules()}
    packed = {name: packed_4bit_bytes(n, adapter.quant_storage) for name, n in quantized.items()}
    in_layer = [[name for name in quantized if name.startswith(paths[id(layer)])] for layer in layers]
    counts = AdapterCounts(
        trainable_params=trainable, all_params=total, adapter_params=adapter_params, saved_module_params=saved,
        frozen_params=total - trainable, quantized_params=sum(quantized.values()),
        quantized_tensors=len(quantized),
        largest_quantized_params=max(quantized.values(), default=0),
        quantized_bytes=sum(quantized_4bit_bytes(n, double_quant=adapter.double_quant,
                                                 quant_storage=adapter.quant_storage) for n in quantized.values()),
        quantized_packed_bytes=sum(packed.values()),
        per_layer_quantized=tuple(sum(quantized[n] for n in names) for names in in_layer) if quantized else (),
        per_layer_quantized_packed=tuple(sum(packed[n] for n in names) for names in in_layer) if quantized else (),
        per_module=dict(sorted(per_module.items())), per_layer=per_layer,
        pre_layer_trainable=pre, post_layer_trainable=post)
    return counts


def frozen_base_bytes(counts: AdapterCounts, adapter: Adapter, storage_bytes_per_param: float) -> float:
    """Bytes of the frozen base: 4-bit weights with their constants for QLoRA (the rest, embeddings, norms and the
    LM head, in `storage_bytes_per_param`), all of it in that dtype for LoRA."""
    if adapter.method != "qlora":
        return counts.frozen_params * storage_bytes_per_param
    return counts.quantized_bytes + counts.unquantized_frozen_params * storage_bytes_per_param


def quantized_base_sharded(adapter: Adapter) -> bool:
    """Whether FSDP2 / ZeRO-3 shard a QLoRA base's packed 4-bit codes: only when bnb_4bit_quant_storage is a
    floating dtype. accelerate's fsdp2_prepare_model passes frozen non-floating Params4bit (uint8 storage) to
    fully_shard as ignored_params, so they stay whole on every GPU; ZeRO-3 refuses them
    (toolkit.inputs.job.adapter_problem)."""
    return adapter.method == "qlora" and adapter.quant_storage != "uint8"


def sharded_base_bytes(counts: AdapterCounts, adapter: Adapter, storage_bytes_per_param: float) -> float:
    """The part of frozen_base_bytes that FSDP2 / ZeRO-3 shard, and so all-gather for compute: the frozen weights
    in their dtype, and for QLoRA the packed 4-bit codes alone (when their storage is floating,
    quantized_base_sharded). The rest, the 4-bit quantisation constants (and uint8-stored codes), stays whole on
    every GPU and never crosses a link. The bytes on the wire of every gather come from here."""
    if adapter.method != "qlora":
        return frozen_base_bytes(counts, adapter, storage_bytes_per_param)
    packed = counts.quantized_packed_bytes if quantized_base_sharded(adapter) else 0
    return packed + counts.unquantized_frozen_params * storage_bytes_per_param


def layer_sharded_base_bytes(counts: AdapterCounts, adapter: Adapter, storage_bytes_per_param: float,
                             layer_params: list[int] | tuple[int, ...]) -> list[float]:
    """sharded_base_bytes of each decoder layer (`layer_params`: the base's parameters per layer, ModelSpec's
    layer_params): what FSDP2 all-gathers into the unsharded buffer while that layer computes."""
    quantized = counts.per_layer_quantized or (0,) * len(layer_params)
    packed = counts.per_layer_quantized_packed or (0,) * len(layer_params)
    keep = quantized_base_sharded(adapter)
    return [(p - q) * storage_bytes_per_param + (b if keep else 0)
            for p, q, b in zip(layer_params, quantized, packed)]


def print_trainable_parameters_line(peft_model) -> str:
    """What peft's print_trainable_parameters prints (for tests and --explain)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        peft_model.print_trainable_parameters()
    return buf.getvalue().strip()


def counts_for_spec(spec, adapter: Adapter) -> AdapterCounts:
    """adapter_counts of a ModelSpec's model, kept in the on-disk cache (toolkit.cache) when the spec has a source
    key: building a 70B model on the meta device and wrapping it takes seconds."""
    from dataclasses import asdict

    from toolkit import cache

    key = None
    if spec.source_key:
        key = [spec.source_key, adapter.to_dict(), cache.installed_version("peft")]
        stored = cache.get("lora_counts", key, code=adapter_counts,
                           decode=lambda value: AdapterCounts(**{**value, **{k: tuple(value[k]) for k in (
                               "per_layer", "per_layer_quantized", "per_layer_quantized_packed")}}))
        if stored is not None:
            return stored
    counts = adapter_counts(spec.hf_config(), adapter, cache_key=spec.source_key)
    if key is not None:
        cache.put("lora_counts", key, asdict(counts), code=adapter_counts)
    return counts


def base_dtype_name(precision: str, base_dtype: str = "auto") -> str:
    """The torch dtype (attribute name) the frozen base is loaded in: Adapter.base_dtype when given, else the
    compute dtype (fp32 only for fp32 jobs). The one rule toolkit.train, the trace, the memory and PLAN.md follow."""
    if base_dtype != "auto":
        return BASE_DTYPE_NAMES[base_dtype]
    if precision == "fp32":
        return "float32"
    return "float16" if precision == "fp16" else "bfloat16"


def saved_dtype_name(precision: str, base_dtype: str = "auto", saved_dtype: str = "auto") -> str:
    """The torch dtype (attribute name) PEFT's trainable modules_to_save copies are held in before an engine touches
    them: Adapter.saved_dtype when given, else the base's load dtype. PEFT deep-copies the loaded module
    (peft/utils/other.py ModulesToSaveWrapper.update) and its autocast_adapter_dtype upcasts only tuner layers
    (lora_A / lora_B), so the copies keep the base's dtype unless toolkit.train casts them (cast_saved_modules)."""
    if saved_dtype != "auto":
        return BASE_DTYPE_NAMES[saved_dtype]
    return base_dtype_name(precision, base_dtype)


def cast_saved_modules(peft_model, dtype) -> int:
    """Cast the trainable copies PEFT made of modules_to_save (each ModulesToSaveWrapper's modules_to_save) to
    `dtype`, by replacing each floating Parameter (nn.Module.to cannot swap fake tensors; the estimate's trace
    calls this too). The originals stay frozen in the base's dtype. Returns the parameters cast."""
    import torch
    from peft.utils.other import ModulesToSaveWrapper

    cast = 0
    for wrapper in peft_model.modules():
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        for module in (m for copy in wrapper.modules_to_save.values() for m in copy.modules()):
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_floating_point() and p.dtype != dtype:
                    module._parameters[name] = torch.nn.Parameter(p.detach().to(dtype),
                                                                  requires_grad=p.requires_grad)
                    cast += p.numel()
    return cast


def apply_saved_dtype(peft_model, saved_dtype: str) -> int:
    """cast_saved_modules to `saved_dtype` (an Adapter.saved_dtype: --modules-to-save-dtype's value); nothing for
    auto (PEFT's own dtype). The one step toolkit.train, a user's script (toolkit.train.own_script.peft_model), the
    CPU profile and the trace run after get_peft_model. Returns the parameters cast."""
    if saved_dtype == "auto":
        return 0
    import torch

    return cast_saved_modules(peft_model, getattr(torch, BASE_DTYPE_NAMES[saved_dtype]))


def base_storage_bytes_per_param(precision: str, base_dtype: str = "auto") -> int:
    """Bytes per frozen base parameter as toolkit.train loads it (and DDP keeps it): base_dtype_name's dtype."""
    return DTYPE_BYTES[base_dtype_name(precision, base_dtype)]


def adapter_for_model(spec, adapter: Adapter, *, dropout_given: bool) -> Adapter:
    """The adapter with PEFT's dropout rule applied for `spec`'s model: LoRA on a parameter (the fused experts of an
    MoE layer, which PEFT 0.21 wraps as lora.ParamWrapper) cannot take dropout (peft/tuners/lora/layer.py,
    ParamWrapper.__init__ raises for lora_dropout != 0: x cannot be factored out of lora_B(lora_A(dropout(x)))).
    There the default dropout is 0; an explicit non-zero --lora-dropout is refused with the fix."""
    from dataclasses import replace

    if adapter.is_adapter and getattr(spec, "vision_modules", ()) and not adapter.exclude:
        adapter = replace(adapter, exclude=",".join(spec.vision_modules))  # LoRA on the language model only
    if not adapter.is_adapter or adapter.dropout == 0 or not wraps_parameters(spec, replace(adapter, dropout=0.0)):
        return adapter
    if dropout_given:
        raise UserError(f"--lora-dropout {adapter.dropout:g}: PEFT wraps {spec.name}'s MoE expert parameters "
                        "(lora.ParamWrapper), which take no dropout; give --lora-dropout 0")
    return replace(adapter, dropout=0.0)


def wraps_parameters(spec, adapter: Adapter) -> bool:
    """Whether PEFT wraps any of `spec`'s parameters (not modules) under `adapter` (lora.ParamWrapper); kept in the
    on-disk cache like counts_for_spec."""
    from toolkit import cache

    key = None
    if spec.source_key:
        key = [spec.source_key, adapter.to_dict(), cache.installed_version("peft")]
        stored = cache.get("lora_param_wrap", key, code=wraps_parameters, decode=bool)
        if stored is not None:
            return stored
    from peft.tuners.lora.layer import ParamWrapper

    peft_model, _ = peft_model_on_meta(spec.hf_config(), adapter)
    found = any(isinstance(m, ParamWrapper) for m in peft_model.modules())
    if key is not None:
        cache.put("lora_param_wrap", key, found, code=wraps_parameters)
    return found

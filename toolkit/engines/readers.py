"""What the installed engines read and fill in a DeepSpeed JSON, taken from the engines themselves (so toolkit check
follows their versions):
- DeepSpeed: `DeepSpeedZeroConfig` reads the ZeRO block (aliases such as stage3_gather_16bit_weights_on_model_save,
  deprecated names such as stage3_gather_fp16_weights_on_model_save); `DeepSpeedConfig` judges the whole file, and
  the top-level keys it never reads while doing so are the ones DeepSpeed ignores.
- "auto": transformers' `HfTrainerDeepSpeedConfig` fills what the HF Trainer fills; accelerate's `DeepSpeedPlugin`
  (run on the file) plus the keys `Accelerator._prepare_deepspeed` / `DeepSpeedPlugin.set_mixed_precision` fill
  (read from their source, below) give what an accelerate script fills. The Trainer runs through accelerate too.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import inspect
import io
import logging
import os
import textwrap
import warnings
from collections.abc import KeysView
from dataclasses import dataclass
from typing import Any, Iterator


from toolkit.emit.deepspeed import auto_keys, enabled


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


@contextlib.contextmanager
def quiet_engines() -> Iterator[None]:
    """DeepSpeed logs config warnings on stdout (its logger's handler), accelerate and transformers warn; the check's
    stdout is its findings (and --json), so the engines speak only through what they raise."""
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        ds_logger.setLevel(level)


@contextlib.contextmanager
def engine_output() -> Iterator[list[str]]:
    """Everything the engines print or log while the block runs (stdout, stderr, warnings, log records of
    accelerate / transformers / DeepSpeed), collected as lines instead of reaching the terminal, so `check` can say
    which file made an engine speak. The list fills when the block ends."""
    lines: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.extend(record.getMessage().splitlines())

    handler = _Collect(level=logging.WARNING)
    loggers = [logging.getLogger(), logging.getLogger("DeepSpeed")]
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    out, err = io.StringIO(), io.StringIO()
    try:
        for lg in loggers:
            lg.handlers = [handler]
        logging.getLogger("DeepSpeed").propagate = False
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield lines
        lines += [str(w.message) for w in caught]
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers = handlers
            lg.propagate = propagate
        lines += out.getvalue().splitlines() + err.getvalue().splitlines()
        lines[:] = list(dict.fromkeys(line.strip() for line in lines if line.strip()))


# --- DeepSpeed: what the engine reads ----------------------------------------------------------------------------------

def concrete_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def without_auto(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_auto(v) for k, v in value.items() if not (isinstance(v, str) and v == "auto")}
    return value


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO block as DeepSpeed's DeepSpeedZeroConfig parses it ("auto" values left out)."""
    stage: int
    offload_optimizer: str
    offload_params: str
    offload_optimizer_nvme_path: str | None
    offload_params_nvme_path: str | None
    gather_16bit_on_save: bool
    overlap_comm: bool
    """DeepSpeed's reading, its stage default included (on at stage 3, off below)."""
    deprecated: tuple[tuple[str, str], ...]
    """(name in the file, what DeepSpeed says to use instead)."""


def zero_default(name: str) -> int:
    """DeepSpeed's own default for a zero_optimization key its config leaves out (DeepSpeedZeroConfig's field, by
    name or alias: reduce_bucket_size 5e8, stage3_prefetch_bucket_size 5e7, ...)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    field = fields.get(name) or next(f for f in fields.values() if f.alias == name)
    return int(field.default)


def zero_settings(zero: dict[str, Any]) -> ZeroSettings | None:
    """None when DeepSpeed refuses the block (DeepSpeedConfig then reports why)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        with quiet_engines():
            model = DeepSpeedZeroConfig(**without_auto(zero))
    except Exception:  # noqa: BLE001 - pydantic ValidationError, TypeError for non-str keys
        return None
    deprecated = []
    for name, field in DeepSpeedZeroConfig.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        spelled = name if name in zero else field.alias if field.alias in zero else None
        if spelled and extra.get("deprecated"):
            deprecated.append((spelled, str(extra.get("new_param", ""))))

    def device(block: Any) -> str:
        value = getattr(block, "device", None) if block is not None else None
        value = getattr(value, "value", value)  # the models keep enum values (use_enum_values) in 0.19
        return value if value in ("cpu", "nvme") else "none"

    def nvme(block: Any) -> str | None:
        return str(block.nvme_path) if block is not None and block.nvme_path is not None else None

    return ZeroSettings(stage=int(model.stage), offload_optimizer=device(model.offload_optimizer),
                        offload_params=device(model.offload_param),
                        offload_optimizer_nvme_path=nvme(model.offload_optimizer),
                        offload_params_nvme_path=nvme(model.offload_param),
                        gather_16bit_on_save=bool(model.gather_16bit_weights_on_model_save),
                        overlap_comm=bool(model.overlap_comm), deprecated=tuple(deprecated))


class _ReadRecorder(dict):
    """A dict that remembers which keys were asked for: DeepSpeedConfig reads its top-level keys with get / [] / in
    (runtime/config.py), so the keys of a file it never asks for are the ones it ignores."""

    def __init__(self, data: dict[str, Any], seen: set[str]) -> None:
        super().__init__(data)
        self.seen = seen

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.seen.add(key)
        return super().__contains__(key)

    def keys(self):  # `KEY in param_dict.keys()` goes through __contains__
        return KeysView(self)

    def __copy__(self):
        return _ReadRecorder(self, self.seen)

    def __deepcopy__(self, memo):
        return _ReadRecorder(copy.deepcopy(dict(self), memo), self.seen)


MAX_REFUSALS = 20
"""How many separate refusals one check collects from DeepSpeed before it stops asking (each costs a config pass)."""


def deepspeed_reads(config: dict[str, Any], processes: int, *, mpu: Any = None
                    ) -> tuple[set[str] | None, str | None]:
    """DeepSpeedConfig on `config` in a run of `processes` ranks (toolkit.engines.validate.deepspeed_config_at):
    (the top-level keys it read, None) or (None, refusal)."""
    seen, refusals = deepspeed_reads_all(config, processes, mpu=mpu)
    return (None, "; ".join(text for text, _ in refusals)) if refusals else (seen, None)


def deepspeed_reads_all(config: dict[str, Any], processes: int, *, mpu: Any = None
                        ) -> tuple[set[str], list[tuple[str, bool]]]:
    """Every refusal DeepSpeedConfig has for `config`, not only the first: a refusal that names fields (pydantic's
    errors: unknown or mistyped keys) is recorded, those fields are taken out, and the rest is asked again. Returns
    the keys read by the last pass (as deepspeed_reads) and the refusals, one per problem, each with whether it
    names a field (True) or is the engine's whole-file refusal (False, at most one, last)."""
    from toolkit.engines.validate import ConfigRejected, deepspeed_config_at

    trial = copy.deepcopy(config)
    refusals: list[tuple[str, bool]] = []
    for _ in range(MAX_REFUSALS):
        seen: set[str] = set()
        try:
            with quiet_engines():
                deepspeed_config_at(_ReadRecorder(trial, seen), processes, mpu=mpu)
        except ConfigRejected as exc:
            fields = _field_errors(exc.__cause__)
            where = [_drop_key(trial, loc[-1]) for loc, _ in fields]
            if not fields or None in where:
                refusals.append((str(exc), False))
                return seen | initialize_reads(), refusals
            refusals += [(f"{path}: {msg}", True) for path, (_, msg) in zip(where, fields)]
            continue
        return seen | initialize_reads(), refusals
    return seen | initialize_reads(), refusals


def _field_errors(exc: BaseException | None) -> list[tuple[tuple, str]]:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return []
    try:
        return [(tuple(e["loc"]), str(e["msg"])) for e in errors() if e.get("loc")]
    except Exception:  # noqa: BLE001 - not pydantic's shape after all
        return []


def _drop_key(config: dict[str, Any], key: Any) -> str | None:
    """Remove `key` where it is, at the top or one block down (pydantic's loc starts at the model's own fields);
    its dotted path, or None when it is nowhere."""
    if key in config:
        del config[key]
        return str(key)
    for block, value in config.items():
        if isinstance(value, dict) and key in value:
            del value[key]
            return f"{block}.{key}"
    return None


@functools.lru_cache(maxsize=1)
def initialize_reads() -> frozenset[str]:
    """Top-level keys read outside the config getters: the world-size branch of DeepSpeedConfig.__init__
    (sequence_parallel_size; a run with an mpu never reaches it) and deepspeed.initialize (data_parallel_size,
    tensor_parallel), taken from their source as `"key" in config`, `config["key"]` and `config.get("key")`."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    keys: set[str] = set()
    for function in (DeepSpeedConfig.__init__, deepspeed.initialize):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
            if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                    and any(isinstance(op, ast.In) for op in node.ops) \
                    and any(getattr(c, "id", None) == "config" for c in node.comparators):
                keys.add(node.left.value)
            elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "config" \
                    and isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" \
                    and getattr(node.func.value, "id", None) == "config" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                keys.add(node.args[0].value)
    return frozenset(k for k in keys if isinstance(k, str))


def deepspeed_data_parallel(config: dict[str, Any], processes: int, *, mpu: Any = None) -> float:
    """The data-parallel world DeepSpeedConfig counts for `config` in a run of `processes` ranks (a float, as
    DeepSpeed computes it: world / sp need not be whole), from its own constructor on the keys of the file it reads
    outside its config getters (initialize_reads); raises ConfigRejected."""
    from toolkit.engines.validate import deepspeed_config_at

    probe = {key: config[key] for key in initialize_reads() & set(config) if key != "tensor_parallel"}
    probe["train_micro_batch_size_per_gpu"] = 1
    return deepspeed_config_at(probe, processes, mpu=mpu).world_size


# --- "auto": what each runner fills ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def accelerate_fills() -> frozenset[str]:
    """The DeepSpeed keys accelerate fills when they are "auto", read from the installed accelerate's source:
    `Accelerator._prepare_deepspeed` collects them in `config_kwargs` (batch sizes, clipping, the ZeRO-3 save flag,
    the hidden-size buckets, DummyOptim/DummyScheduler values), `DeepSpeedPlugin.set_mixed_precision` fills the
    precision flags. Any other "auto" makes accelerate raise."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    keys: set[str] = set()
    for function in (Accelerator._prepare_deepspeed, DeepSpeedPlugin.set_mixed_precision):
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                                  for k in node.keys if k is not None):
                candidates = [k.value for k in node.keys if k is not None]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and getattr(node.value, "id", None) == "config_kwargs" and isinstance(node.slice, ast.Constant):
                candidates = [node.slice.value]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "fill_match" and node.args \
                    and isinstance(node.args[0], ast.Constant):
                candidates = [node.args[0].value]
            else:
                continue
            keys |= {k for k in candidates if isinstance(k, str) and _looks_like_ds_key(k)}
    return frozenset(keys)


def _looks_like_ds_key(key: str) -> bool:
    return key.replace(".", "").replace("_", "").isalnum() and key.islower() and (
        "." in key or "batch" in key or "clipping" in key or "accumulation" in key)


def accelerate_view(config: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The file after accelerate's DeepSpeedPlugin read it (its own fill_match of plugin values; a clean
    environment, as a config file given without YAML deepspeed fields): (config, None) or (None, refusal)."""
    from accelerate.utils import DeepSpeedPlugin

    from toolkit.engines.validate import first_line

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("ACCELERATE_")}
    try:
        with quiet_engines():
            plugin = DeepSpeedPlugin(hf_ds_config=copy.deepcopy(config))
        return plugin.deepspeed_config, None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return None, first_line(exc)
    finally:
        os.environ.update(saved)


def trainer_view(config: dict[str, Any], world_size: int | None) -> tuple[dict[str, Any] | None, str | None]:
    """The file after the HF Trainer's HfTrainerDeepSpeedConfig filled it, with TrainingArguments that agree with
    every concrete value in the file (a mismatch there is the user's command line, not the file)."""
    from toolkit.engines.validate import ConfigRejected, resolve_like_trainer

    optimizer = _mapping(_mapping(config.get("optimizer")).get("params"))
    betas = optimizer.get("betas")
    extra: dict[str, Any] = {}
    if isinstance(betas, list) and len(betas) == 2:
        extra.update(adam_beta1=betas[0], adam_beta2=betas[1])
    for key, arg in (("eps", "adam_epsilon"), ("weight_decay", "weight_decay")):
        if isinstance(optimizer.get(key), (int, float)):
            extra[arg] = optimizer[key]
    lr = optimizer.get("lr")
    clip = config.get("gradient_clipping")
    micro = concrete_int(config.get("train_micro_batch_size_per_gpu"))
    accum = concrete_int(config.get("gradient_accumulation_steps"))
    batch = concrete_int(config.get("train_batch_size"))
    world = world_size
    if world is None and batch and micro and accum and batch % (micro * accum) == 0:
        world = batch // (micro * accum)
    elif world is None and batch is not None:
        # The process count is unknown: a concrete train_batch_size can agree with some launch (batch_problems
        # checks that one exists when micro-batch and accumulation are concrete).
        config = {k: v for k, v in config.items() if k != "train_batch_size"}
    precision = "bf16" if enabled(config.get("bf16")) else "fp16" if enabled(config.get("fp16")) else "fp32"
    try:
        with quiet_engines():
            resolved = resolve_like_trainer(
                config, world_size=world or 1, micro_batch=micro or 1, grad_accum=accum or 1, hidden_size=1024,
                precision=precision, max_grad_norm=clip if isinstance(clip, (int, float)) else 1.0,
                learning_rate=lr if isinstance(lr, (int, float)) else 5e-5, trainer_args=extra, leave_auto=True)
    except ConfigRejected as exc:
        return None, str(exc)
    except (AttributeError, IndexError) as exc:  # a malformed block the Trainer's code trips over
        return None, f"transformers cannot read it ({type(exc).__name__}: {exc})"
    return resolved, None


def unfilled(config: dict[str, Any] | None) -> list[str]:
    return [k for k in auto_keys(config) if k not in accelerate_fills()] if config is not None else []

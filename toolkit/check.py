"""`toolkit check`: what each runner would do with an accelerate YAML, a DeepSpeed JSON, or a plan directory.

    check_paths(["run/accelerate_config.yaml", "ds_config.json", "plans/llama7b/"]) -> [Problem, ...]

Every finding names the runner it concerns - the HF Trainer, an accelerate script, a script started by the deepspeed
launcher (or toolkit.train's pipeline engine), accelerate launch itself - and is an error only when that runner
would fail or silently misbehave; otherwise a warning or a note. A JSON on its own may be read by several runners:
a failure that only some of them hit is a warning naming them (`--runner` says which one you use, and makes it an
error).

The knowledge comes from the installed engines, so the check follows their versions:
- DeepSpeed: `DeepSpeedZeroConfig` reads the ZeRO block (aliases such as stage3_gather_16bit_weights_on_model_save,
  deprecated names such as stage3_gather_fp16_weights_on_model_save); `DeepSpeedConfig` judges the whole file, and
  the top-level keys it never reads while doing so are the ones DeepSpeed ignores.
- "auto": transformers' `HfTrainerDeepSpeedConfig` fills what the HF Trainer fills; accelerate's `DeepSpeedPlugin`
  (run on the file) plus the keys `Accelerator._prepare_deepspeed` / `DeepSpeedPlugin.set_mixed_precision` fill
  (read from their source, below) give what an accelerate script fills. The Trainer runs through accelerate too.
- YAML: accelerate's launch validation and the plugin the Accelerator would build (toolkit.emit.validate), and
  `ParallelismConfig`'s own size checks. No device is touched.

Unreadable input (missing, binary, malformed, nested too deep, an alias bomb) is a UserError, not a Problem.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import difflib
import functools
import inspect
import io
import json
import sys
import logging
import os
import textwrap
import warnings
from collections.abc import KeysView
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Literal

import yaml

from toolkit.emit.deepspeed import auto_keys, ds_zero_stage, is_auto
from toolkit.errors import UserError
from toolkit.plan import Plan, load_plan
from toolkit.strategy import Engine

Severity = Literal["error", "warning", "note"]

TRAINER = "HF Trainer"
ACCELERATE = "accelerate script"
DEEPSPEED = "deepspeed launcher"
PIPELINE = "toolkit.train pipeline"
LAUNCH = "accelerate launch"
EVERY = "every runner"
HF_RUNNERS = frozenset({TRAINER, ACCELERATE})
RUNNER_CHOICES = {"trainer": TRAINER, "accelerate": ACCELERATE, "deepspeed": DEEPSPEED}
"""--runner values."""


@dataclass(frozen=True)
class Problem:
    file: str
    severity: Severity
    message: str
    """What is wrong and how to fix it, in one line."""
    runner: str = EVERY
    """Who it concerns: HF Trainer, accelerate script, deepspeed launcher, accelerate launch, every runner."""

    def __str__(self) -> str:
        return f"{self.file}: {self.severity}: [{self.runner}] {self.message}"


# --- reading -----------------------------------------------------------------------------------------------------------

MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 64
MAX_VALUES = 200_000
"""Limits far above any real config (the corpus in tests/real_configs nests 4 deep, holds < 200 values), so that a
hostile file is one clear line instead of a RecursionError or an exponential walk."""


def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML or JSON file as a dict; UserError for anything unreadable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory without plan.json; give a YAML, a JSON or a plan directory") from None
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"{path} is {len(raw)} bytes, too large for a config file (limit {MAX_FILE_BYTES})")
    try:
        # JSON has no byte-order mark (DeepSpeed's json.load refuses one too); YAML may start with one.
        text = raw.decode("utf-8" if path.suffix == ".json" else "utf-8-sig")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        raise UserError(f"{path} is not UTF-8 text (binary content, or another encoding); give the YAML or JSON "
                        "config, saved as UTF-8")
    try:
        data = _parse_json(text, path) if path.suffix == ".json" else _parse_yaml(text, path)
    except RecursionError:
        raise UserError(f"{path} is nested too deeply to be a config (more than {MAX_DEPTH} levels)") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} does not hold a mapping of keys to values")
    _check_shape(data, path)
    return data


def _parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None


def _parse_yaml(text: str, path: Path) -> Any:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_nodes(node, path)  # before building: aliases are expanded into shared objects
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path} is not valid YAML ({getattr(exc, 'problem', None) or 'parse error'}{where})") from None
    finally:
        loader.dispose()


def _check_yaml_nodes(root: yaml.Node, path: Path) -> None:
    """Refuse alias bombs (a few lines that expand to billions of values) and self-referring aliases."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 0, False)]
    open_nodes: set[int] = set()
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise UserError(f"{path} is nested too deeply to be a config (more than {MAX_DEPTH} levels)")
        children = _yaml_children(node)
        if done:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_VALUES:
                raise UserError(f"{path} expands to more than {MAX_VALUES} values (YAML aliases); write the values "
                                "out instead of nesting aliases")
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise UserError(f"{path} has a YAML alias that refers to itself; write the value out")
        open_nodes.add(id(node))
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_shape(data: Any, path: Path) -> None:
    """Depth and size of parsed data, iteratively (JSON has no aliases, but can nest a few hundred deep)."""
    stack, count = [(data, 0)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise UserError(f"{path} is nested too deeply to be a config (more than {MAX_DEPTH} levels)")
        if count > MAX_VALUES:
            raise UserError(f"{path} holds more than {MAX_VALUES} values; not a config file")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


NUMBERS_READ: dict[str, tuple[str, ...]] = {
    "json": ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "zero_optimization.stage"),
    "yaml": ("num_processes", "num_machines", "machine_rank"),
}
"""Values the check itself computes with (batch identity, process grid, ZeRO stage): anything but a whole number
(or "auto" in a DeepSpeed JSON) there makes the file unreadable for the check. Other fields go to the engines."""


def require_numbers(config: dict[str, Any], path: Path) -> None:
    kind = "json" if path.suffix == ".json" else "yaml"
    for dotted in NUMBERS_READ[kind]:
        parent, _, key = dotted.rpartition(".")
        block = _mapping(config.get(parent)) if parent else config
        if key not in block or block[key] is None:
            continue
        value = block[key]
        if concrete_int(value) is None and not (kind == "json" and value == "auto"):
            shown = json.dumps(value, default=str)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            allowed = "a whole number" + (' or "auto"' if kind == "json" else "")
            raise UserError(f"{path}: {dotted} is {shown} ({type(value).__name__}); it must be {allowed}")


def read_config(path: Path) -> dict[str, Any]:
    """read_mapping, plus the numbers the check computes with (require_numbers)."""
    config = read_mapping(path)
    if not (path.suffix == ".json" and is_plan_json(config)):
        require_numbers(config, path)
    return config


def is_plan_json(data: dict[str, Any]) -> bool:
    return "strategy" in data and "version" in data and "model_config" in data


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


# --- DeepSpeed: what the engine reads ----------------------------------------------------------------------------------

def enabled(block: Any) -> bool:
    return isinstance(block, dict) and str(block.get("enabled", False)).lower() == "true"


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
    deprecated: tuple[tuple[str, str], ...]
    """(name in the file, what DeepSpeed says to use instead)."""


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
                        deprecated=tuple(deprecated))


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


def deepspeed_reads(config: dict[str, Any], data_parallel: int) -> tuple[set[str] | None, str | None]:
    """DeepSpeedConfig on `config` at a data-parallel size: (the top-level keys it read, None) or (None, refusal)."""
    from toolkit.emit.validate import ConfigRejected, deepspeed_config_at

    seen: set[str] = set()
    try:
        with quiet_engines():
            deepspeed_config_at(_ReadRecorder(config, seen), data_parallel)
    except ConfigRejected as exc:
        return None, str(exc)
    return seen | initialize_reads(), None


@functools.lru_cache(maxsize=1)
def initialize_reads() -> frozenset[str]:
    """Top-level keys read outside the config getters, which deepspeed_config_at does not run: the world-size
    branch of DeepSpeedConfig.__init__ (sequence_parallel_size) and deepspeed.initialize (data_parallel_size, ...),
    taken from their source as `"key" in config`, `config["key"]` and `config.get("key")`."""
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

    from toolkit.emit.validate import first_line

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
    from toolkit.emit.validate import ConfigRejected, resolve_like_trainer

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


# --- DeepSpeed JSON ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Readers:
    """Who reads a DeepSpeed JSON, and at what scale."""
    runners: frozenset[str]
    """The runners that may read it: a failure of all of them is an error, of some a warning naming them."""
    world_size: int | None = None
    pipeline_stages: int = 1

    @property
    def pipeline(self) -> bool:
        return PIPELINE in self.runners

    @property
    def direct(self) -> str:
        """The runner that hands the file to deepspeed.initialize unchanged."""
        return PIPELINE if self.pipeline else DEEPSPEED


def readers_of_json(config: dict[str, Any], *, world_size: int | None, runner: str | None,
                    named_by_yaml: bool = False) -> Readers:
    if runner is not None:
        runners = frozenset({runner})
    elif named_by_yaml or auto_keys(config):
        # "auto" is filled only by the HF Trainer and accelerate; a YAML's JSON is read through accelerate.
        runners = HF_RUNNERS
    else:
        runners = HF_RUNNERS | {DEEPSPEED}
    return Readers(runners, world_size)


class _Findings:
    """Collects findings of one file, grading each by the runners it concerns."""

    def __init__(self, file: str, readers: Readers) -> None:
        self.file, self.readers, self.out = file, readers, []

    def fail(self, runners: frozenset[str] | set[str], message: str, *, at_most: Severity = "error") -> None:
        """`runners` would fail or silently misbehave: an error when that is every runner that may read the file."""
        concerned = frozenset(runners) & self.readers.runners
        if not concerned:
            return
        severity: Severity = "error" if concerned == self.readers.runners else "warning"
        severity = min(severity, at_most, key=["note", "warning", "error"].index)
        label = EVERY if concerned >= HF_RUNNERS | {self.readers.direct} else ", ".join(sorted(concerned))
        self.out.append(Problem(self.file, severity, message, label))

    def note(self, message: str, runner: str = EVERY) -> None:
        self.out.append(Problem(self.file, "note", message, runner))

    @property
    def has_error(self) -> bool:
        return any(p.severity == "error" for p in self.out)


def ds_problems(config: dict[str, Any], file: str, readers: Readers) -> list[Problem]:
    """Findings of one DeepSpeed JSON for the runners that may read it."""
    f = _Findings(file, readers)
    direct = readers.direct
    everyone = HF_RUNNERS | {direct}
    zero = config.get("zero_optimization")
    if zero is None:
        # accelerate's DeepSpeedPlugin.__post_init__: "Please specify the ZeRO optimization config". DeepSpeed itself
        # defaults to stage 0, so a file without "auto" (likely a deepspeed-launcher file) gets a note; the DeepSpeed
        # autotuner writes the block into each experiment's config.
        tuned = enabled(config.get("autotuning"))
        f.fail(HF_RUNNERS, "no \"zero_optimization\" block: accelerate refuses the file; add \"zero_optimization\": "
               "{\"stage\": 0} (or the stage you want)" + ("; the DeepSpeed autotuner adds it to each experiment it "
                                                           "runs" if tuned else ""),
               at_most="note" if tuned or DEEPSPEED in readers.runners else "error")
        zero = {}
    elif not isinstance(zero, dict):
        f.fail(everyone, "\"zero_optimization\" must be an object like {\"stage\": 2}")
        zero = {}
    stage_auto = zero.get("stage") == "auto"
    if stage_auto and HF_RUNNERS & readers.runners:
        # DeepSpeedPlugin fills it from `accelerate launch --zero_stage` (default 2) through fill_match.
        view, _ = accelerate_view(config)
        filled = _mapping(_mapping(view).get("zero_optimization")).get("stage")
        f.note(f"zero_optimization.stage is \"auto\": accelerate fills it from `accelerate launch --zero_stage` "
               f"(here {filled}); checked as ZeRO-{filled}", ", ".join(sorted(HF_RUNNERS & readers.runners)))
        zero = {**zero, "stage": filled} if isinstance(filled, int) else zero
    settings = zero_settings(zero)
    stage = settings.stage if settings else (zero.get("stage") if isinstance(zero.get("stage"), int) else 0)
    for name, new in settings.deprecated if settings else ():
        f.note(f"zero_optimization.{name} is a deprecated name that DeepSpeed still honours; the current one is "
               f"\"{new}\"")

    if enabled(config.get("bf16")) and enabled(config.get("fp16")):
        f.fail(everyone, "bf16 and fp16 are both enabled: DeepSpeed refuses this; set \"enabled\": false in one of them")
    for message in batch_problems(config, world_size=readers.world_size, pipeline_stages=readers.pipeline_stages):
        f.fail(everyone, message)
    _auto_problems(config, f, stage)

    if readers.pipeline and stage >= 2:
        f.fail({PIPELINE}, f"ZeRO-{stage} with pipeline parallelism: DeepSpeed's pipeline engine refuses stages 2 "
               "and 3; use \"stage\": 1 (or 0)")
    if readers.pipeline and enabled(config.get("bf16")):
        accum = _mapping(config.get("data_types")).get("grad_accum_dtype")
        if accum != "fp32":
            f.fail({PIPELINE}, "bf16 pipeline accumulates gradients in bf16 (not numerically safe over many "
                   "micro-batches); add \"data_types\": {\"grad_accum_dtype\": \"fp32\"} with ZeRO stage 1",
                   at_most="warning")
        elif stage == 0:
            f.fail({PIPELINE}, "bf16 with \"grad_accum_dtype\": \"fp32\" at ZeRO-0: DeepSpeed refuses this mix; use "
                   "\"zero_optimization\": {\"stage\": 1}")

    if settings is not None:
        for name, device, path, min_stage, what in (
                ("offload_optimizer", settings.offload_optimizer, settings.offload_optimizer_nvme_path, 1, "ZeRO 1-3"),
                ("offload_param", settings.offload_params, settings.offload_params_nvme_path, 3, "ZeRO-3")):
            if device == "none":
                continue
            if stage < min_stage:  # DeepSpeed ignores the block below these stages: no offload, silently
                f.fail(everyone, f"zero_optimization.{name} at ZeRO-{stage}: {name.replace('_', ' ')} needs {what}; "
                       f"set \"stage\": {min_stage if min_stage == 3 else 2} or remove {name}",
                       at_most="warning" if stage_auto else "error")  # "auto": the launch command may say 3
            if device == "nvme" and not path:
                f.fail(everyone, f"zero_optimization.{name} goes to nvme without \"nvme_path\": set it to a "
                       "directory on a local NVMe drive of every node")
    if stage == 3:
        _zero3_save_problem(config, zero, f)
    _engine_problems(config, f)
    return f.out


def _auto_problems(config: dict[str, Any], f: _Findings, stage: int) -> None:
    autos = auto_keys(config)
    if not autos:
        return
    if f.readers.pipeline:
        f.fail({PIPELINE}, f"\"auto\" in {', '.join(autos)}: a pipeline run calls deepspeed.initialize itself and "
               "nothing fills \"auto\"; write concrete values (toolkit emit does)")
        return
    f.fail({DEEPSPEED}, f"\"auto\" in {len(autos)} value(s) ({', '.join(autos[:3])}{', ...' if len(autos) > 3 else ''})"
           ": deepspeed.initialize fills nothing, only the HF Trainer and accelerate do; write values for a "
           "deepspeed-launcher script")
    left: dict[str, set[str]] = {}
    refused: dict[str, str] = {}
    if TRAINER in f.readers.runners:
        trainer, why = trainer_view(config, f.readers.world_size)
        if why is not None:
            refused[TRAINER] = why
        else:
            view, why = accelerate_view(trainer)  # the Trainer hands its filled config to accelerate
            if why is not None:
                refused[TRAINER] = why
            for key in unfilled(view):
                left.setdefault(key, set()).add(TRAINER)
    if ACCELERATE in f.readers.runners:
        view, why = accelerate_view(config)
        if why is not None:
            refused[ACCELERATE] = why
        for key in unfilled(view):
            left.setdefault(key, set()).add(ACCELERATE)
    for runner, why in refused.items():
        if "ZeRO optimization config" not in why:  # named above
            f.fail({runner}, f"{'transformers' if runner == TRAINER else 'accelerate'} refuses it: {why}")
    for key, runners in left.items():
        fillers = sorted((HF_RUNNERS & f.readers.runners) - runners)
        if not fillers:
            why = "no runner fills it; write a concrete value"
            from deepspeed.runtime.constants import BFLOAT16, BFLOAT16_OLD

            if key.startswith(f"{BFLOAT16_OLD}."):  # DeepSpeed's old block name; the runners fill only the new one
                why = f"no runner fills it; rename the block to \"{BFLOAT16}\" (DeepSpeed's current name; they fill it)"
            if key.startswith("zero_optimization.stage3_") and stage != 3 and TRAINER in runners:
                why = (f"the HF Trainer fills it only at ZeRO-3 (this file is ZeRO-{stage}); remove the key or "
                       "write a value")
        else:
            why = f"the {' and '.join(fillers)} fills it but the {' and '.join(sorted(runners))} does not; write a value"
        f.fail(runners, f"\"{key}\" is \"auto\": {why}")


def _zero3_save_problem(config: dict[str, Any], zero: dict[str, Any], f: _Findings) -> None:
    """ZeRO-3 keeps each weight in pieces; a full model file needs gather_16bit_weights_on_model_save (DeepSpeed's
    name; stage3_gather_16bit_weights_on_model_save is its alias, stage3_gather_fp16_... the deprecated one)."""
    view, _ = accelerate_view(config) if HF_RUNNERS & f.readers.runners else (None, None)
    gathered = zero_settings(_mapping((view or config).get("zero_optimization")) or zero)
    if gathered is None or gathered.gather_16bit_on_save:
        return
    auto = view is not None and any(zero.get(k) == "auto" for k in ("stage3_gather_16bit_weights_on_model_save",
                                                                      "gather_16bit_weights_on_model_save"))
    said = ("is \"auto\", which accelerate's DeepSpeedPlugin fills from `accelerate launch --zero3_save_16bit_model` "
            "(default false)") if auto else "is not true"
    # transformers Trainer.save_model: catches accelerate's ValueError, keeps only the DeepSpeed checkpoint. "auto"
    # leaves the choice to the launch command, so it is a note; false or missing is a warning.
    f.fail(HF_RUNNERS, f"ZeRO-3 and \"stage3_gather_16bit_weights_on_model_save\" {said}: save_model writes an empty "
           "model (the HF Trainer keeps only the DeepSpeed checkpoint, to be merged with zero_to_fp32.py; accelerate's "
           "save_model raises); " + ("launch with --zero3_save_16bit_model true or write true here" if auto else
                                     "add \"stage3_gather_16bit_weights_on_model_save\": true to zero_optimization"),
           at_most="note" if auto else "warning")


def _engine_problems(config: dict[str, Any], f: _Findings) -> None:
    """DeepSpeedConfig judges the file ("auto" values and batch arithmetic are ours to report); then the top-level
    keys it never read are the ones DeepSpeed ignores."""
    trial = without_auto(json.loads(json.dumps(config)))
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if f.readers.world_size is None or any(config.get(k) == "auto" for k in batch_keys):
        for key in batch_keys:
            trial.pop(key, None)
        trial["train_micro_batch_size_per_gpu"] = 1
        data_parallel = 1
    else:
        data_parallel = max(f.readers.world_size // f.readers.pipeline_stages, 1)
    seen, refusal = deepspeed_reads(trial, data_parallel)
    everyone = HF_RUNNERS | {f.readers.direct}
    if refusal is not None:
        if not f.has_error:
            f.fail(everyone, f"DeepSpeed/transformers refuse it: {refusal}")
        return
    known = sorted(k for k in seen if isinstance(k, str))
    for key in sorted(set(config) - set(seen)):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if key.startswith("_"):
            f.note(f"\"{key}\" is not a DeepSpeed key; DeepSpeed ignores it (fine for a comment)")
        elif close:
            f.fail(everyone, f"unknown key \"{key}\": DeepSpeed ignores it silently; did you mean \"{close[0]}\"? "
                   "remove or rename it")
        else:
            f.fail(everyone, f"\"{key}\" is not read by the installed DeepSpeed; it has no effect", at_most="warning")


def batch_problems(config: dict[str, Any], *, world_size: int | None, pipeline_stages: int) -> list[str]:
    batch = concrete_int(config.get("train_batch_size"))
    micro = concrete_int(config.get("train_micro_batch_size_per_gpu"))
    accum = concrete_int(config.get("gradient_accumulation_steps", 1))
    if batch is None or micro is None or accum is None or micro <= 0 or accum <= 0:
        return []
    if world_size is not None:
        from toolkit.grid import ParallelGrid

        if pipeline_stages < 1 or world_size % pipeline_stages:
            return [f"{pipeline_stages} pipeline stages do not divide {world_size} processes"]
        grid = ParallelGrid(1, world_size, pipeline_stages=pipeline_stages, dp_shard=world_size // pipeline_stages)
        expected = grid.global_batch(micro, accum)
        if batch != expected:
            stages = f" / {pipeline_stages} pipeline stages" if pipeline_stages > 1 else ""
            return [f"train_batch_size {batch} != micro {micro} x accum {accum} x data-parallel "
                    f"{grid.data_parallel} ({world_size} processes{stages}) = {expected}; set train_batch_size to "
                    f"{expected} or change the accumulation"]
    elif batch % (micro * accum):
        return [f"train_batch_size {batch} is not a multiple of micro {micro} x accum {accum} = {micro * accum}: no "
                "GPU count satisfies DeepSpeed's batch identity; fix one of the three"]
    return []


def json_precision(config: dict[str, Any]) -> str:
    if enabled(config.get("bf16")) or enabled(config.get("bfloat16")):
        return "bf16"
    return "fp16" if enabled(config.get("fp16")) else "fp32"


# --- accelerate YAML ---------------------------------------------------------------------------------------------------

DS_FILE_IGNORED_KEYS: dict[str, str] = {
    "gradient_accumulation_steps": "\"gradient_accumulation_steps\"",
    "gradient_clipping": "\"gradient_clipping\"",
    "zero_stage": "\"zero_optimization\": {\"stage\": ...}",
    "offload_optimizer_device": "\"zero_optimization\": {\"offload_optimizer\": {\"device\": ...}}",
    "offload_param_device": "\"zero_optimization\": {\"offload_param\": {\"device\": ...}}",
    "offload_optimizer_nvme_path": "\"zero_optimization\": {\"offload_optimizer\": {\"nvme_path\": ...}}",
    "offload_param_nvme_path": "\"zero_optimization\": {\"offload_param\": {\"nvme_path\": ...}}",
    "zero3_save_16bit_model": "\"zero_optimization\": {\"stage3_gather_16bit_weights_on_model_save\": true}",
}
"""Where each YAML deepspeed_config key that accelerate refuses next to deepspeed_config_file belongs in the JSON
(the keys are those of DeepSpeedPlugin._deepspeed_config_checks; the test checks that accelerate refuses each)."""


def yaml_problems(config: dict[str, Any], path: Path, *, gpus: tuple[int, int] | None = None,
                  plan: Plan | None = None, launcher_names_ds_file: bool = False) -> tuple[list[Problem], Path | None]:
    """Findings of one accelerate YAML (they concern `accelerate launch`, so every script it starts), and the
    DeepSpeed JSON it names (if it exists).

    launcher_names_ds_file: the directory's launch script passes --deepspeed_config_file itself (emitted
    directories do), so a relative deepspeed_config_file in the YAML is not a trap.
    """
    file = str(path)
    out: list[Problem] = []

    def err(message: str) -> None:
        out.append(Problem(file, "error", message, LAUNCH))

    def warn(message: str) -> None:
        out.append(Problem(file, "warning", message, LAUNCH))

    from toolkit.emit.accelerate import inline_ds_config

    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig

    if str(config.get("compute_environment")) == "AMAZON_SAGEMAKER":
        # load_config_from_file picks SageMakerConfig; the launch itself happens on SageMaker, not here.
        known = set(SageMakerConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
        out += [Problem(file, "error", f"unknown key \"{key}\": accelerate refuses the file", LAUNCH)
                for key in sorted(set(config) - known, key=str)]
        out.append(Problem(file, "note", "a SageMaker config: its keys were checked; the launch runs on SageMaker "
                           "and is not rehearsed here", LAUNCH))
        return out, None
    known = set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}
    for key in sorted(set(config) - known, key=str):
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean \"{close[0]}\"? " if close else ""
        err(f"unknown key \"{key}\": accelerate refuses the file; {hint}remove or rename it")
    for key, wanted in sorted(_cluster_config_shapes().items()):
        value = config.get(key)
        if value is None:
            continue
        if wanted is dict and not isinstance(value, dict):
            err(f"{key} must be a mapping of keys to values, not {type(value).__name__}")
        elif wanted is list and not isinstance(value, list):
            err(f"{key} must be a list, not {type(value).__name__}")
        elif wanted is None and isinstance(value, (dict, list)):
            # accelerate's launch code calls string methods on these and fails with an AttributeError.
            err(f"{key} must be a single value, not a {type(value).__name__}; accelerate launch crashes on it")

    kind = str(config.get("distributed_type", ""))
    machines = config.get("num_machines", 1)
    processes = config.get("num_processes")
    if concrete_int(machines) and concrete_int(processes) and machines > 0:
        if processes % machines:
            err(f"num_processes {processes} is not a multiple of num_machines {machines}: num_processes counts the "
                "processes of all nodes (nodes x GPUs per node)")
        if gpus is not None and (machines, processes) != (gpus[0], gpus[0] * gpus[1]):
            err(f"num_machines {machines} x num_processes {processes} does not match {gpus[0]} node(s) x {gpus[1]} "
                f"GPUs: set num_machines: {gpus[0]} and num_processes: {gpus[0] * gpus[1]}")
        # accelerate's launch_command: CPU runs go to simple_launcher, one process unless mpirun starts them.
        mpirun = _mapping(config.get("mpirun_config")).get("mpirun_hostfile")
        if (kind in ("MULTI_CPU",) or config.get("use_cpu") is True) and not mpirun:
            warn(f"{kind or 'use_cpu'} with num_processes {processes}: accelerate starts one process on this path; "
                 "use MULTI_GPU (with ACCELERATE_USE_CPU=1 on CPUs)")

    ds_path = None
    if kind == "DEEPSPEED":
        ds_section = _mapping(config.get("deepspeed_config"))
        ds_file = ds_section.get("deepspeed_config_file")
        if ds_file:
            for key in sorted(set(ds_section) & set(DS_FILE_IGNORED_KEYS)):
                err(f"deepspeed_config.{key} next to deepspeed_config_file: accelerate refuses it (\"will be "
                    f"ignored\"); remove it and set {DS_FILE_IGNORED_KEYS[key]} in the JSON")
            inline = inline_ds_config(ds_file)
            if inline is not None:  # emitted YAMLs carry the JSON itself (toolkit.emit.accelerate)
                ds_path = path.parent / "ds_config.json"
                if not ds_path.is_file():
                    ds_path = None
                elif read_mapping(ds_path) != inline:
                    warn("deepspeed_config_file (inline JSON) differs from "
                         f"{ds_path}: accelerate launch uses the YAML's; re-emit with `toolkit emit`")
            else:
                ds_path = resolve_ds_file(str(ds_file), path, out, quiet=launcher_names_ds_file)
            if config.get("mixed_precision") not in (None, "no"):
                mp = config["mixed_precision"]
                precision = json_precision(read_mapping(ds_path)) if ds_path else None
                if precision not in (None, mp):
                    err(f"mixed_precision {mp} in the YAML but ds_config enables "
                        f"{precision if precision != 'fp32' else 'neither bf16 nor fp16'}: remove mixed_precision "
                        "from the YAML; the JSON's bf16/fp16 blocks decide")
                else:
                    err(f"mixed_precision {mp} next to deepspeed_config_file: accelerate refuses it (\"will be "
                        "ignored\"); remove it and enable the JSON's bf16 or fp16 block")
        if plan is not None and plan.engine == Engine.PIPELINE:
            err("distributed_type DEEPSPEED for a pipeline plan: accelerate cannot run DeepSpeed pipelines; use a "
                "MULTI_GPU config (accelerate only starts the processes, toolkit.train runs the pipeline engine)")
    if kind == "FSDP":
        fsdp = _mapping(config.get("fsdp_config"))
        policy = str(fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")).upper()
        if policy == "TRANSFORMER_BASED_WRAP" and not fsdp.get("fsdp_transformer_layer_cls_to_wrap"):
            # FullyShardedDataParallelPlugin.set_auto_wrap_policy falls back to model._no_split_modules.
            layer = f" ({plan.layer_class})" if plan else ""
            out.append(Problem(file, "note", "FSDP TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap: "
                               "accelerate wraps the classes the model lists in _no_split_modules (its decoder "
                               f"layer{layer}); set the key only to wrap something else", LAUNCH))
        elif policy == "NO_WRAP":
            warn("FSDP without an auto-wrap policy shards the whole model as one unit (no memory saving during "
                 "forward); set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP")
    launch_flags = []
    if "num_processes" not in config and kind not in ("", "NO"):
        # accelerate launch: "You need to manually pass in `--num_processes` using this config yaml" (SLURM
        # templates do, from the job's node count); the rest of the file is checked as if it were passed.
        warn("no num_processes: accelerate launch refuses to start unless the command passes --num_processes "
             "(nodes x GPUs per node); add it here or to the launch command")
        launch_flags = ["--num_processes", str(concrete_int(machines) or 1)]
    if not any(p.severity == "error" for p in out):
        out += accelerate_problems(path, ds_path, launch_flags)
    return out, ds_path


@functools.lru_cache(maxsize=1)
def _cluster_config_shapes() -> dict[str, type | None]:
    """accelerate's ClusterConfig field types, reduced to dict / list / None (a single value)."""
    import typing

    from accelerate.commands.config.config_args import ClusterConfig

    shapes: dict[str, type | None] = {}
    for name, hint in typing.get_type_hints(ClusterConfig).items():
        union = typing.get_origin(hint) is typing.Union
        args = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
        origins = {typing.get_origin(a) or a for a in args}
        shapes[name] = dict if origins == {dict} else list if origins == {list} else None
    return shapes


def resolve_ds_file(name: str, yaml_path: Path, out: list[Problem], *, quiet: bool = False) -> Path | None:
    """accelerate opens deepspeed_config_file relative to the launch directory; we also look beside the YAML."""
    candidate = Path(name)
    beside = yaml_path.parent / name
    if candidate.is_file() and (candidate.is_absolute() or not beside.is_file()):
        return candidate
    if not candidate.is_absolute() and beside.is_file():
        if not quiet:
            out.append(Problem(str(yaml_path), "note", f"deepspeed_config_file {name} is relative: accelerate opens "
                               f"it from the directory you launch in; launch from {yaml_path.parent} or pass "
                               f"--deepspeed_config_file {beside}", LAUNCH))
        return beside
    out.append(Problem(str(yaml_path), "error", f"deepspeed_config_file {name} does not exist; emit it with "
                       "`toolkit plan --out DIR` or fix the path", LAUNCH))
    return None


def accelerate_problems(path: Path, ds_path: Path | None, flags: list[str] | None = None) -> list[Problem]:
    """accelerate's own launch validation and plugin, then its ParallelismConfig rules, for what ours do not name."""
    from toolkit.emit.validate import ConfigRejected, accelerate_launch_plugins, first_line

    extra = (["--deepspeed_config_file", str(ds_path)] if ds_path is not None else []) + (flags or [])
    try:
        with quiet_engines():
            args, plugin, env = accelerate_launch_plugins(path, extra)
    except ConfigRejected as exc:
        return [Problem(str(path), "error", f"accelerate launch refuses it: {exc}", LAUNCH)]
    except (RuntimeError, ImportError) as exc:
        # e.g. "FP8 is not available on this machine": a property of the machine running the check.
        return [Problem(str(path), "note", f"accelerate's launch check stops on this machine ({first_line(exc)}); "
                        "the rest of its checks did not run here", LAUNCH)]
    found = parallelism_problems(path, args, env)
    if args.use_deepspeed and ds_path is None and plugin is not None:
        found += inline_deepspeed_problems(path, plugin.deepspeed_config)
    return found


def inline_deepspeed_problems(path: Path, built: dict[str, Any]) -> list[Problem]:
    """A YAML's own deepspeed_config fields, as the DeepSpeed config DeepSpeedPlugin builds from them."""
    settings = zero_settings(_mapping(built.get("zero_optimization")))
    if settings is None:
        return []
    out = []
    both = ", ".join(sorted(HF_RUNNERS))
    if settings.offload_params != "none" and settings.stage < 3:
        out.append(Problem(str(path), "error", f"offload_param_device {settings.offload_params} at zero_stage "
                           f"{settings.stage}: DeepSpeed offloads parameters only at ZeRO-3 and ignores it; set "
                           "zero_stage: 3 or offload_param_device: none", both))
    if settings.offload_optimizer != "none" and settings.stage < 1:
        out.append(Problem(str(path), "error", f"offload_optimizer_device {settings.offload_optimizer} at zero_stage "
                           "0: DeepSpeed offloads the optimizer only at ZeRO 1-3 and ignores it; set zero_stage: 2",
                           both))
    if settings.stage == 3 and not settings.gather_16bit_on_save:
        out.append(Problem(str(path), "warning", "ZeRO-3 without zero3_save_16bit_model: true: save_model writes an "
                           "empty model (the HF Trainer keeps only the DeepSpeed checkpoint, to be merged with "
                           "zero_to_fp32.py; accelerate's save_model raises); add zero3_save_16bit_model: true to "
                           "deepspeed_config", both))
    return out


def parallelism_problems(path: Path, args: SimpleNamespace, env: dict[str, str]) -> list[Problem]:
    """parallelism_config (tp / cp / sp / dp sizes): ParallelismConfig reads the launcher's environment and checks
    its sizes; its Accelerator-time check compares their product with the process count."""
    if not getattr(args, "use_parallelism_config", False):
        return []
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    from toolkit.emit.validate import _environment, first_line

    kind = DistributedType.DEEPSPEED if args.use_deepspeed else DistributedType.FSDP if args.use_fsdp else \
        DistributedType.MULTI_GPU if args.multi_gpu else DistributedType.NO
    fsdp2 = bool(args.use_fsdp) and str(getattr(args, "fsdp_version", "1")) == "2"
    # What Accelerator._validate_accelerator reads: num_processes is the whole world (accelerate state).
    accelerator = SimpleNamespace(multi_device=bool(args.multi_gpu or args.use_fsdp or args.use_deepspeed),
                                  num_processes=int(args.num_processes or 1), is_fsdp2=fsdp2, distributed_type=kind,
                                  is_main_process=True)
    try:
        with _environment(env), quiet_engines():
            parallel = ParallelismConfig()
            parallel._validate_accelerator(accelerator)
    except (ValueError, TypeError) as exc:
        return [Problem(str(path), "error", f"accelerate refuses its parallelism_config: {first_line(exc)}", LAUNCH)]
    return []


# --- plan directory ----------------------------------------------------------------------------------------------------

def plan_readers(plan: Plan) -> Readers:
    """toolkit.train runs the HF Trainer, or hands the file to the pipeline engine unchanged."""
    runner = PIPELINE if plan.engine == Engine.PIPELINE else TRAINER
    return Readers(frozenset({runner}), plan.world_size, plan.pipeline_stages)


def json_file_problems(config: dict[str, Any], file: str, readers: Readers, plan: Plan | None = None) -> list[Problem]:
    found = ds_problems(config, file, readers)
    if plan is not None:
        found += plan_json_consistency(config, file, plan)
        if not any(p.severity == "error" for p in found):
            from toolkit.emit.validate import ConfigRejected, validate_ds_config_for_plan

            try:
                with quiet_engines():
                    validate_ds_config_for_plan(config, plan)
            except ConfigRejected as exc:
                found.append(Problem(file, "error", f"DeepSpeed/transformers refuse it: {exc}",
                                     next(iter(readers.runners))))
    return found


def plan_json_consistency(config: dict[str, Any], file: str, plan: Plan) -> list[Problem]:
    out: list[Problem] = []
    runner = next(iter(plan_readers(plan).runners))
    for key, planned in (("train_batch_size", plan.global_batch), ("train_micro_batch_size_per_gpu", plan.micro_batch),
                         ("gradient_accumulation_steps", plan.grad_accum)):
        value = config.get(key)
        if concrete_int(value) is not None and value != planned:
            out.append(Problem(file, "error", f"{key} {value} but plan.json plans {planned}; re-emit the plan "
                               "directory or make them agree", runner))
    precision = json_precision(config)
    planned_precision = {"bf16-pure": "bf16"}.get(plan.precision, plan.precision)
    runner_decides = any(is_auto(_mapping(config.get(name)).get("enabled")) for name in ("bf16", "fp16"))
    if precision != planned_precision and not runner_decides:  # "auto": the runner fills it (toolkit.emit.deepspeed)
        out.append(Problem(file, "error", f"ds_config trains in {precision} but plan.json plans {plan.precision}; "
                           "toolkit.train passes the plan's precision and the Trainer will refuse the mismatch", runner))
    stage = _mapping(config.get("zero_optimization")).get("stage")
    if isinstance(stage, int) and stage != ds_zero_stage(plan):
        out.append(Problem(file, "error", f"ZeRO stage {stage} but plan.json plans {plan.strategy} "
                           f"(stage {ds_zero_stage(plan)}); the memory prediction assumes the plan's stage", runner))
    return out


def yaml_plan_consistency(config: dict[str, Any], file: str, plan: Plan) -> list[Problem]:
    out: list[Problem] = []
    if config.get("num_processes") != plan.world_size or config.get("num_machines", 1) != plan.num_machines:
        out.append(Problem(file, "error", f"num_machines {config.get('num_machines', 1)} / num_processes "
                           f"{config.get('num_processes')} but plan.json plans {plan.num_machines} node(s) x "
                           f"{plan.gpus_per_node} = {plan.world_size} processes; set them to match", LAUNCH))
    expected = {"ddp": ("MULTI_GPU", "NO"), "deepspeed": ("DEEPSPEED",), "fsdp2": ("FSDP",),
                "pipeline": ("MULTI_GPU", "NO")}[plan.engine]
    kind = config.get("distributed_type")
    if kind not in expected and not (kind == "DEEPSPEED" and plan.engine == Engine.PIPELINE):
        out.append(Problem(file, "error", f"distributed_type {kind} but plan.json plans {plan.strategy} "
                           f"(needs {expected[0]}); re-emit the plan directory", LAUNCH))
    if plan.engine in (Engine.DDP, Engine.FSDP2):
        from toolkit.emit.accelerate import ACCELERATE_MIXED_PRECISION

        mp = config.get("mixed_precision") or "no"
        if mp != ACCELERATE_MIXED_PRECISION[plan.precision]:
            out.append(Problem(file, "error", f"mixed_precision {mp} but plan.json plans {plan.precision}; set "
                               f"mixed_precision: {ACCELERATE_MIXED_PRECISION[plan.precision]}", LAUNCH))
    return out


def check_plan_dir(directory: Path, *, gpus: tuple[int, int] | None) -> list[Problem]:
    plan_path = directory / "plan.json"
    plan = load_plan(plan_path) if plan_path.exists() else None
    if plan is None:
        names = [directory / n for n in ("accelerate_config.yaml", "ds_config.json") if (directory / n).exists()]
        if not names:
            raise UserError(f"{directory} holds no plan.json, accelerate_config.yaml or ds_config.json; give the "
                            "config files themselves")
        return check_paths([str(n) for n in names[:1]], gpus=gpus)  # the YAML names its JSON, else the JSON
    out: list[Problem] = []
    yaml_path = directory / "accelerate_config.yaml"
    json_path = directory / "ds_config.json"
    checked_json: Path | None = None
    if yaml_path.exists():
        config = read_config(yaml_path)
        scripts = [directory / name for name in ("launch.sh", "slurm.sbatch")]
        overrides = any(p.exists() and "--deepspeed_config_file" in p.read_text() for p in scripts)
        found, ds_path = yaml_problems(config, yaml_path, gpus=gpus, plan=plan, launcher_names_ds_file=overrides)
        out += found + yaml_plan_consistency(config, str(yaml_path), plan)
        if ds_path is not None:
            out += json_file_problems(read_config(ds_path), str(ds_path), plan_readers(plan), plan)
            checked_json = ds_path.resolve()
    else:
        out.append(Problem(str(directory), "error", "no accelerate_config.yaml: `accelerate launch --config_file` "
                           "needs it; re-emit the plan directory", LAUNCH))
    if json_path.exists() and json_path.resolve() != checked_json:
        out += json_file_problems(read_config(json_path), str(json_path), plan_readers(plan), plan)
    elif plan.engine in (Engine.DEEPSPEED, Engine.PIPELINE) and checked_json is None:
        out.append(Problem(str(directory), "error", f"no ds_config.json for a {plan.strategy} plan; re-emit the "
                           "plan directory", next(iter(plan_readers(plan).runners))))
    return out


# --- entry points ------------------------------------------------------------------------------------------------------

def check_paths(paths: list[str], *, gpus: tuple[int, int] | None = None, runner: str | None = None) -> list[Problem]:
    """Findings for each path: an accelerate YAML, a DeepSpeed JSON, a plan.json, or a plan directory.

    runner: "trainer", "accelerate" or "deepspeed" when the user says who reads a lone JSON (or a YAML's JSON).
    """
    pinned = RUNNER_CHOICES[runner] if runner else None
    out: list[Problem] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            out += check_plan_dir(path, gpus=gpus)
            continue
        config = read_config(path)
        if path.suffix == ".json" and is_plan_json(config):
            out += check_plan_dir(path.parent, gpus=gpus)
        elif path.suffix == ".json":
            world = gpus[0] * gpus[1] if gpus else None
            out += json_file_problems(config, str(path), readers_of_json(config, world_size=world, runner=pinned))
        else:
            found, ds_path = yaml_problems(config, path, gpus=gpus)
            out += found
            if ds_path is not None:
                ds_config = read_config(ds_path)
                world = concrete_int(config.get("num_processes"))
                # accelerate launches it: the HF Trainer or an accelerate script reads the JSON.
                readers = readers_of_json(ds_config, world_size=world, named_by_yaml=True,
                                          runner=pinned if pinned in HF_RUNNERS else None)
                out += json_file_problems(ds_config, str(ds_path), readers)
    return out


def parse_gpus(text: str) -> tuple[int, int]:
    """"8" (one node of 8), "2x8" (2 nodes of 8) or a GPU spec "2x8xH100" -> (nodes, gpus per node)."""
    parts = text.lower().split("x")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if not numbers:  # a GPU spec with a type (8xH100-80GB): the grid is its node and GPU counts
        from toolkit.hardware import parse_hardware

        try:
            hw = parse_hardware(text)
        except UserError:
            raise UserError(f"--gpus '{text}' is not understood; write GPUS (one node) or NODESxGPUS, e.g. 2x8, "
                            "or a GPU spec such as 8xH100-80GB") from None
        return hw.nodes, hw.gpus_per_node
    if len(numbers) == 1:
        numbers = [1, numbers[0]]
    if len(numbers) != 2 or min(numbers) < 1:
        raise UserError(f"--gpus '{text}' is not understood; write GPUS (one node) or NODESxGPUS, e.g. 2x8")
    return numbers[0], numbers[1]


def exit_code(problems: list[Problem], *, strict: bool = False) -> int:
    """0 clean (notes never count), 1 with an error, or with a warning under --strict."""
    failing = ("error", "warning") if strict else ("error",)
    return 1 if any(p.severity in failing for p in problems) else 0


def main_check(argv_paths: list[str], *, gpus: str | None = None, runner: str | None = None,
               fit: Callable[[str], list[Problem]] | None = None, strict: bool = False, as_json: bool = False,
               print_fn: Callable[[str], None] = print) -> int:
    """The CLI: errors and warnings on stderr, notes and the summary on stdout, one line each, like every other
    command (or, with --json, one JSON object on stdout); 0 / 1 as exit_code says.

    Unreadable input raises UserError (the CLI prints it on stderr and exits 2). fit: the fit check bound to
    --model/--gpus by the CLI (toolkit.check_fit.fit_findings), called once per path.
    """
    grid = parse_gpus(gpus) if gpus else None
    problems: list[Problem] = []
    with quiet_engines():  # DeepSpeed logs its accelerator choice on stdout when first imported
        for name in argv_paths:
            problems += check_paths([name], gpus=grid, runner=runner)
            if fit is not None:
                problems += fit(name)
    code = exit_code(problems, strict=strict)
    if as_json:
        print_fn(json.dumps({"exit_code": code, "strict": strict, "paths": argv_paths,
                             "findings": [asdict(p) for p in problems]}, indent=2))
        return code
    for problem in problems:
        if problem.severity in ("error", "warning") and print_fn is print:
            print(str(problem), file=sys.stderr)
        else:
            print_fn(str(problem))
    counts = {s: sum(p.severity == s for p in problems) for s in ("error", "warning", "note")}
    print_fn(f"{len(argv_paths)} path(s) checked: " + (", ".join(f"{n} {s}(s)" for s, n in counts.items() if n)
                                                         or "no findings"))
    return code

"""The Plan: what plan.json holds. The planner writes it; emit, check, launch and train read it.

A plan file is shared between people and machines, so it is untrusted input: `Plan` is one strict, typed model
(pydantic) whose closed choices are enums, whose strings cannot carry control characters, whose sizes have the bounds every command uses (toolkit.bounds), and whose parts must
agree with each other (the grid multiplies, the batch identity holds, the partition splits the layers). Everything
derivable is derived, never stored twice: the engine, the ZeRO stage, the offload targets and the FSDP mode come
from the strategy name (toolkit.inputs.strategy); the data-parallel degree and the world size from the grid
(toolkit.inputs.grid). Older files (version 1) that stored those are read when the stored copies agree.

`predicted` holds the planner's memory / speed prediction and `predicted_for` the key of the inputs it was made
for; an edit that changes those inputs makes the prediction stale (`Plan.prediction_is_stale`), which `toolkit
emit` refreshes.

This module imports nothing heavy (no torch, no transformers), so a training process can read a plan cheaply.
The published JSON Schema is toolkit/plan/plan.schema.json (`python -m toolkit.plan.schema --schema` writes it).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from dataclasses import asdict, replace
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass
from pydantic_core import ArgsKwargs

from toolkit import bounds
from toolkit.errors import UserError
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.choices import (VISION_TOWER_MODES, Attention, DeviceKind, Loss, Method, Optimizer,
                                    OptimizerImpl, Precision)
from toolkit.inputs.strategy import ALL_STRATEGY_NAMES, Engine, Strategy, parse_strategy
from toolkit.plan.files import PLAN_JSON

if TYPE_CHECKING:
    from toolkit.inputs.lora import Adapter
    from toolkit.inputs.grpo import Grpo
    from toolkit.inputs.preference import Dpo

PLAN_VERSION = 2
READABLE_VERSIONS = (1, 2)
SCHEMA_FILE = Path(__file__).with_name("plan.schema.json")

StrategyName = Literal[ALL_STRATEGY_NAMES]  # type: ignore[valid-type]

_DEGREES = ("tensor_parallel", "context_parallel", "sequence_parallel", "expert_parallel")
"""Model-parallel degrees (added within version 2, default 1)."""

_LEFT_OUT = {"compile": (False,), "tiled": (False,), "power_limit_w": (None,), "device_kind": ("cuda",),
             "leaf_modules": (None, []), "dpo": ({},), "rope_scaling": ({},), "grpo": ({},),
             "model_parts": ({},), "vision_tower": ("train",), "loss": ("model",),
             "images_per_sample": (0,), "image_size": ("",), "image_tokens": (0,)}
"""Fields added within version 2, left out of plan.json at this value (their default), so a plan without them reads
and keys its prediction as it did before they existed."""

_DERIVED_V1 = ("engine", "zero_stage", "offload_optimizer", "offload_params", "fsdp_mode", "data_parallel")
"""Keys version 1 stored beside the strategy and grid; read only to check that they agree."""


def _no_control_characters(value: str, field: str) -> str:
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValueError(f"contains the control character {bad!r}; {field} must be one printable line")
    return value


@dataclass(frozen=True, kw_only=True, config=ConfigDict(extra="forbid", strict=True))
class Plan:

    # --- model ----------------------------------------------------------------------------------------------------
    model: str = Field(min_length=1, max_length=4096)
    """What the run loads: a hub id or an absolute local path (a catalog name is written as its hub id)."""
    model_config: dict[str, Any]
    """The Hugging Face config (config.to_dict()), so a run can check that the model it loads is the planned one."""
    model_type: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    """config.model_type, e.g. "llama", "gpt2"."""
    layer_class: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
    """Decoder-layer class name, e.g. "LlamaDecoderLayer" (FSDP wrap policy, pipeline conversion)."""
    num_layers: int = Field(ge=1, le=int(bounds.LAYERS.high))
    params: int = Field(ge=1, le=int(bounds.PARAMS.high))
    """Exact unique parameter count."""

    # --- strategy and grid ------------------------------------------------------------------------------------------
    strategy: StrategyName
    """Canonical strategy name (toolkit.inputs.strategy); engine, ZeRO stage, offload and FSDP mode derive from it."""
    num_machines: int = Field(ge=1, le=int(bounds.NODES.high))
    gpus_per_node: int = Field(ge=1, le=int(bounds.GPUS_PER_NODE.high))
    pipeline_stages: int = Field(default=1, ge=1, le=int(bounds.STAGES.high))
    partition: list[int] | None = None
    """Pipeline only: decoder-layer boundaries, len = stages + 1, e.g. [0, 12, 24] for 24 layers on 2 stages."""
    tensor_parallel: int = Field(default=1, ge=1, le=int(bounds.DEGREE.high))
    """Tensor-parallel degree (fsdp2 strategies): the model's own tp_plan splits the layers over this many GPUs of
    a node (accelerate ParallelismConfig tp_size)."""
    context_parallel: int = Field(default=1, ge=1, le=int(bounds.DEGREE.high))
    """Context-parallel degree (fsdp2 strategies, torch ring attention; accelerate cp_size, cp_backend torch)."""
    sequence_parallel: int = Field(default=1, ge=1, le=int(bounds.DEGREE.high))
    """Sequence-parallel degree (zero1-3 strategies, DeepSpeed Ulysses / ALST; accelerate sp_size, sp_backend
    deepspeed)."""
    expert_parallel: int = Field(default=1, ge=1, le=int(bounds.DEGREE.high))
    """Expert-parallel degree (fsdp2 only, MoE models): transformers' DistributedConfig ep_size, which takes no ranks
    of its own (each rank holds experts / ep of every MoE layer, FSDP-sharded over fsdp / ep; toolkit.inputs.grid)."""

    # --- batch and job ------------------------------------------------------------------------------------------------
    seq_len: int = Field(ge=1, le=int(bounds.SEQ.high))
    micro_batch: int = Field(ge=1, le=int(bounds.BATCH.high))
    grad_accum: int = Field(ge=1, le=int(bounds.BATCH.high))
    global_batch: int = Field(ge=1)
    precision: Precision
    optimizer: Optimizer = "adamw"
    checkpointing: bool = False
    attention: Attention = "sdpa"
    device_kind: DeviceKind = "cuda"
    """Whose kernels' saved tensors the prediction modelled (plan --device-kind). Left out of plan.json when cuda,
    so plans written before it read (and key their prediction) unchanged."""
    optimizer_impl: OptimizerImpl = "fused"
    """How torch's optimizer runs its step (DDP / FSDP2; toolkit.estimate.savers)."""
    activation_offloading: bool = False
    """Decoder layers' saved activations in host RAM (TRL's activation_offloading)."""
    liger: bool = False
    """Liger kernels (the HF Trainer's use_liger_kernel=True): fused linear cross-entropy, RMSNorm, SwiGLU, RoPE."""
    loss: Loss = "model"
    """The LM head + loss the memory was predicted with: the model's own, or TRL's chunked NLL (TRL's fused LM head,
    toolkit.patches.trlloss), which toolkit.train applies and TRL's SFTTrainer always runs. Left out of plan.json
    when "model"."""
    allocator_conf: str = Field(default="", pattern=r"^[A-Za-z0-9_.:, ]{0,200}$")
    """PYTORCH_CUDA_ALLOC_CONF the memory was predicted with; the launch scripts export it unless the environment
    already sets one (toolkit.inputs.allocconf)."""
    compile: bool = False
    """torch.compile (inductor) of the model: TrainingArguments torch_compile, accelerate's dynamo_config. Left out
    of plan.json when off, so plans written before it read unchanged."""
    leaf_modules: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,255}$")]] = \
        Field(default_factory=list, max_length=16)
    """ZeRO-3 plans of MoE models: module classes ZeRO-3 fetches whole (the MoE block holding router and experts,
    toolkit.inputs.moe), written to the DeepSpeed JSON as zero_optimization.leaf_module.classes, which DeepSpeed's
    engine applies (set_z3_leaf_modules) in every route. Left out of plan.json when empty."""
    tiled: bool = False
    """ALST's tiled MLP and tiled logits + loss (DeepSpeed TiledMLP / TiledFusedLogitsLoss; toolkit.patches.tiling),
    which toolkit.train applies and a user's own script must. Left out of plan.json when off."""

    # --- hardware ---------------------------------------------------------------------------------------------------
    gpu: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,63}$")
    """GPU catalog name (toolkit gpus)."""
    inter_node_gbps: float | None = Field(default=None, gt=0, le=bounds.INTER_NODE_GBPS.high, allow_inf_nan=False)
    """Network bandwidth per node the prediction assumed (None: the default)."""
    cpu_ram_gib: float | None = Field(default=None, gt=0, le=bounds.CPU_RAM_GIB.high, allow_inf_nan=False)
    """Host RAM per node the prediction assumed (None: the default)."""
    power_limit_w: float | None = Field(default=None, gt=0, le=bounds.POWER_LIMIT_W.high, allow_inf_nan=False)
    """Board power limit per GPU the prediction assumed (--power-limit-w; None: the TDP). Left out of plan.json
    when None, so plans written before it read (and key their prediction) unchanged."""

    # --- predictions (informational for train; printed by launch / PLAN.md) -------------------------------------
    predicted: dict[str, Any] = Field(default_factory=dict)
    """peak_bytes, per-component bytes, cpu_bytes_per_node, step_time_s, tokens_per_s, ... (planner output)."""
    predicted_for: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    """prediction_key() of the fields `predicted` was computed from; a mismatch means the prediction is stale."""
    notes: list[str] = Field(default_factory=list, max_length=1000)
    # --- training method (LoRA / QLoRA, toolkit.inputs.lora); the defaults describe full fine-tuning, so older plans load
    method: Method = "full"
    adapter: dict[str, Any] = Field(default_factory=dict)
    """toolkit.inputs.lora.Adapter fields: r, alpha, dropout, targets, modules_to_save, quant_type, double_quant,
    compute_dtype, quant_storage (empty for full fine-tuning); checked by toolkit.inputs.lora when the plan loads."""
    trainable_params: int = Field(default=0, ge=0)
    """Parameters that get gradients (PEFT's count for adapters; 0 means all, as in full fine-tuning)."""
    dpo: dict[str, Any] = Field(default_factory=dict)
    """toolkit.inputs.preference.Dpo fields (beta, loss_type, reference) of a DPO job, TRL's DPOTrainer (empty:
    supervised fine-tuning); checked by toolkit.inputs.preference when the plan loads."""
    rope_scaling: dict[str, Any] = Field(default_factory=dict)
    """The job's RoPE scaling (toolkit.inputs.rope.RopeScaling fields: rope_type, factor, original_positions), already
    applied in model_config; toolkit.train sets model_config_overrides() on the config it loads. Empty: the model's
    config as it ships. Left out of plan.json when empty."""
    grpo: dict[str, Any] = Field(default_factory=dict)
    """toolkit.inputs.grpo.Grpo fields (num_generations, lengths, beta, vLLM settings) of a GRPO job, TRL's
    GRPOTrainer (empty: not GRPO); checked by toolkit.inputs.grpo when the plan loads."""
    vision_tower: Literal[VISION_TOWER_MODES] = "train"  # type: ignore[valid-type]
    """A multimodal class's vision encoder and projector (model_parts' vision_modules): trained, or frozen by
    toolkit.train before the Trainer builds its optimizer (weights only). Left out of plan.json at "train"."""
    images_per_sample: int = Field(default=0, ge=0, le=bounds.IMAGES.high)
    """An image-and-text job: images in every sample; seq_len is the language model's sequence, text tokens plus
    images_per_sample x image_tokens. Left out of plan.json at 0 (a text job), as image_size and image_tokens."""
    image_size: str = Field(default="", pattern=r"^([0-9]{1,6}x[0-9]{1,6})?$")
    """Each image's WIDTHxHEIGHT in pixels before the model's processor resizes it."""
    image_tokens: int = Field(default=0, ge=0)
    """Tokens one image puts in the language model's sequence (the model's image processor at image_size)."""
    model_parts: dict[str, int | list[str]] = Field(default_factory=dict)
    """A multimodal class: language_params, vision_params, projector_params (exact, they add up to `params`) and
    vision_modules (the encoder's and projector's module paths), as ModelSpec counts them; left out when empty."""
    version: Literal[2] = PLAN_VERSION

    # --- validation ----------------------------------------------------------------------------------------------

    @model_validator(mode="before")
    @classmethod
    def _read_older_and_derived(cls, data: Any) -> Any:
        """Version 1 stored the derived fields; accept them (and the same from older constructors) when they
        agree with the strategy and grid, so no plan can say two things at once."""
        kwargs = data.kwargs if isinstance(data, ArgsKwargs) else data
        if not isinstance(kwargs, dict):
            return data
        kwargs = dict(kwargs)
        if kwargs.get("version") == 1:
            kwargs["version"] = PLAN_VERSION
        stored = {k: kwargs.pop(k) for k in _DERIVED_V1 if k in kwargs}
        name = kwargs.get("strategy")
        if stored and isinstance(name, str) and name in ALL_STRATEGY_NAMES:
            s = parse_strategy(name)
            derived: dict[str, Any] = {"engine": s.engine, "zero_stage": s.zero_stage,
                                       "offload_optimizer": s.offload_optimizer, "offload_params": s.offload_params,
                                       "fsdp_mode": s.fsdp_mode}
            sizes = [kwargs.get(k, 1) for k in ("num_machines", "gpus_per_node", "pipeline_stages")]
            if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
                derived["data_parallel"] = sizes[0] * sizes[1] // sizes[2]
            for key, value in stored.items():
                if key in derived and value != derived[key]:
                    raise ValueError(f"'{key}' is {value!r} but strategy {s.name} on this grid means "
                                     f"{derived[key]!r}; delete '{key}' (the strategy decides it) or change the "
                                     "strategy")
        return ArgsKwargs(data.args, kwargs) if isinstance(data, ArgsKwargs) else kwargs

    @field_validator("model", "gpu")
    @classmethod
    def _one_line(cls, value: str, info) -> str:
        return _no_control_characters(value, info.field_name)

    @field_validator("notes")
    @classmethod
    def _notes_one_line(cls, value: list[str]) -> list[str]:
        for note in value:
            _no_control_characters(note, "each note")
        return value

    @field_validator("model_parts")
    @classmethod
    def _parts(cls, v: dict[str, Any]) -> dict[str, Any]:
        import re

        if v:
            counts = ("language_params", "vision_params", "projector_params")
            if set(v) != {*counts, "vision_modules"} or not all(isinstance(v[k], int) and v[k] >= 0 for k in counts):
                raise ValueError(f"'model_parts' needs exactly {', '.join(counts)} (counts) and vision_modules; "
                                 "re-plan")
            bad = [m for m in v["vision_modules"] if not isinstance(m, str) or
                   not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+){0,15}", m)]
            if bad:
                raise ValueError(f"'model_parts' vision_modules holds {bad[0]!r}, not a module path; re-plan")
        return v

    @field_validator("predicted")
    @classmethod
    def _numbers_are_finite(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, v in value.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"predicted '{key}' is {v}; re-emit to refresh the prediction")
        return value

    @model_validator(mode="after")
    def _parts_agree(self) -> "Plan":
        if self.model_config.get("model_type", self.model_type) != self.model_type:
            raise ValueError(f"model_type {self.model_type!r} differs from model_config's "
                             f"{self.model_config.get('model_type')!r}")
        grid = self.grid  # raises when the strategy cannot run on this grid
        if not self.strategy_spec.is_pipeline and self.partition is not None:
            raise ValueError(f"'partition' is only for pipeline plans; {self.strategy} has none (set it to null)")
        if self.strategy_spec.is_pipeline:
            if self.partition is None:
                raise ValueError(f"{grid.pipeline_stages} pipeline stages need a 'partition' of the layers")
            grid.check_partition(self.partition, self.num_layers)
        grid.check_sequence(self.seq_len, self.attention)
        grid.check_batch(self.global_batch, self.micro_batch, self.grad_accum)
        if self.power_limit_w is not None:  # the GPU's own datasheet points bound it (the rule --power-limit-w meets)
            from toolkit.inputs.hardware import find_gpu, power_limited

            power_limited(find_gpu(self.gpu), self.power_limit_w)
        if self.leaf_modules and (self.engine != Engine.DEEPSPEED or self.zero_stage != 3):
            raise ValueError(f"'leaf_modules' are ZeRO-3's (DeepSpeed leaf modules); {self.strategy} has none "
                             "(delete 'leaf_modules')")
        if self.method == "full" and self.adapter:
            raise ValueError("'adapter' settings need 'method' lora or qlora (or delete 'adapter')")
        if self.method != "full":
            try:
                adapter = self.adapter_spec
            except TypeError as exc:
                raise ValueError(f"'adapter' holds an unknown setting ({exc})") from None
            if adapter.method != self.method:
                raise ValueError(f"'adapter' says method {adapter.method!r} but 'method' is {self.method!r}")
        if self.vision_tower != "train" and not self.model_parts:
            raise ValueError(f"'vision_tower' {self.vision_tower} needs 'model_parts' (a multimodal class); re-plan")
        if self.images_per_sample and not self.model_parts:
            raise ValueError("'images_per_sample' needs 'model_parts' (a multimodal class); re-plan")
        from toolkit.inputs.job import images_problem

        if problem := images_problem(self.images_per_sample, self.image_size, self.image_tokens, self.seq_len):
            raise ValueError(f"{problem.replace('--', '')}")
        if self.model_parts and sum(self.model_parts[k] for k in ("language_params", "vision_params",
                                                                   "projector_params")) != self.params:
            raise ValueError("'model_parts' counts do not add up to 'params'; re-plan")
        if self.rope_scaling:
            from toolkit.inputs.rope import OVERRIDE_KEYS, RopeScaling

            try:
                rope = RopeScaling.from_dict(self.rope_scaling)
            except (TypeError, UserError) as exc:
                raise ValueError(f"'rope_scaling' is not a RoPE scaling ({exc})") from None
            stated = self.model_config.get("rope_parameters")
            if not isinstance(stated, dict) or stated.get("rope_type") != rope.rope_type \
                    or stated.get("factor") != rope.factor:
                raise ValueError(f"'rope_scaling' says {rope.rope_type} x{rope.factor:g} but model_config's "
                                 f"rope_parameters say {stated!r}; re-plan (plan applies it to model_config)")
            missing = [k for k in OVERRIDE_KEYS if k not in self.model_config]
            if missing:
                raise ValueError(f"'rope_scaling' needs model_config's {', '.join(missing)}; re-plan")
        if self.dpo:
            try:
                self.dpo_spec
            except TypeError as exc:
                raise ValueError(f"'dpo' holds an unknown setting ({exc})") from None
        if self.grpo:
            try:
                self.grpo_spec
            except TypeError as exc:
                raise ValueError(f"'grpo' holds an unknown setting ({exc})") from None
        return self

    # --- derived ----------------------------------------------------------------------------------------------------

    @property
    def model_config_overrides(self) -> dict[str, Any]:
        """The model_config keys the job changed (its RoPE scaling), which the run sets on the config it loads;
        empty when the model runs as it ships."""
        from toolkit.inputs.rope import model_config_overrides

        return model_config_overrides(self.model_config) if self.rope_scaling else {}

    @property
    def strategy_spec(self) -> Strategy:
        return parse_strategy(self.strategy)

    @property
    def grid(self) -> ParallelGrid:
        return ParallelGrid.for_strategy(self.strategy_spec, nodes=self.num_machines,
                                         gpus_per_node=self.gpus_per_node, pipeline_stages=self.pipeline_stages,
                                         tensor=self.tensor_parallel, context=self.context_parallel,
                                         sequence=self.sequence_parallel, expert=self.expert_parallel)

    @property
    def adapter_spec(self) -> "Adapter":
        """The training method as toolkit.inputs.lora.Adapter (FULL for full fine-tuning)."""
        from toolkit.inputs.lora import FULL, Adapter

        return Adapter(**self.adapter) if self.method != "full" else FULL

    @property
    def dpo_spec(self) -> "Dpo | None":
        """The DPO settings as toolkit.inputs.preference.Dpo (None for supervised fine-tuning)."""
        from toolkit.inputs.preference import Dpo

        return Dpo(**self.dpo) if self.dpo else None

    @property
    def grpo_spec(self) -> "Grpo | None":
        """The GRPO settings as toolkit.inputs.grpo.Grpo (None unless a GRPO plan)."""
        from toolkit.inputs.grpo import Grpo

        return Grpo(**self.grpo) if self.grpo else None

    @property
    def engine(self) -> str:
        return self.strategy_spec.engine

    @property
    def zero_stage(self) -> int:
        return self.strategy_spec.zero_stage

    @property
    def offload_optimizer(self) -> str:
        return self.strategy_spec.offload_optimizer

    @property
    def offload_params(self) -> str:
        return self.strategy_spec.offload_params

    @property
    def fsdp_mode(self) -> str:
        return self.strategy_spec.fsdp_mode

    @property
    def data_parallel(self) -> int:
        return self.grid.data_parallel

    @property
    def world_size(self) -> int:
        return self.grid.world

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def prediction_key(self) -> str:
        """Key of every input the memory / speed prediction depends on."""
        inputs = {k: v for k, v in self.to_dict().items()
                  if k not in ("model", "predicted", "predicted_for", "notes", "version")}
        return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def prediction_is_stale(self) -> bool:
        return bool(self.predicted) and self.predicted_for != self.prediction_key()

    # --- (de)serialisation -------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plan as plan.json holds it; degrees of 1 and the fields of _LEFT_OUT at their default are left out, so
        a plan without them reads as it did before they existed."""
        data = json.loads(json.dumps(asdict(self)))
        return {k: v for k, v in data.items()
                if not ((k in _DEGREES and v == 1) or (k in _LEFT_OUT and v in _LEFT_OUT[k]))}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def replace(self, **changes: Any) -> "Plan":
        """A copy with `changes`, validated like a file (an inconsistent change raises)."""
        return replace(self, **changes)

    def with_prediction(self, predicted: dict[str, Any]) -> "Plan":
        return self.replace(predicted=predicted, predicted_for=self.prediction_key())


def check_batch_arithmetic(global_batch: int, micro_batch: int, grad_accum: int, data_parallel: int) -> None:
    """The batch identity for callers that hold only the degree (a DeepSpeed JSON): see ParallelGrid.check_batch."""
    ParallelGrid(1, data_parallel, dp_shard=data_parallel).check_batch(global_batch, micro_batch, grad_accum)


def _field_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    msg = err.get("msg", "is invalid")
    msg = msg[len("Value error, "):] if msg.startswith("Value error, ") else msg
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list, ArgsKwargs)) or not where else f" (got {json.dumps(value)[:60]})"
    more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{repr(where) + ': ' if where else ''}{msg}{shown}{more}"


def parse_plan(data: Any, where: str = "plan") -> Plan:
    """A Plan from parsed JSON; UserError naming the field for anything wrong."""
    if not isinstance(data, dict):
        raise UserError(f"{where} does not hold a JSON object; re-emit it with `toolkit plan ... --out DIR`")
    version = data.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise UserError(f"{where} has schema version {version!r}; this toolkit reads versions "
                        f"{', '.join(map(str, READABLE_VERSIONS))} (re-emit it with this toolkit's `toolkit plan`)")
    try:
        return Plan(**data)
    except ValidationError as exc:
        raise UserError(f"{where}: {_field_error(exc)}; fix the field or re-emit with `toolkit plan`") from None
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    except (RecursionError, TypeError) as exc:
        raise UserError(f"{where} cannot be read as a plan ({type(exc).__name__}); re-emit it with "
                        "`toolkit plan`") from None


def load_plan(path: str | Path) -> Plan:
    """Read plan.json (or a directory holding one); one clear error for anything unreadable or inconsistent."""
    from toolkit.fileio import read_bytes_limited

    path = Path(path)
    if path.is_dir() and path.name != PLAN_JSON:  # a folder named plan.json is refused as one, never looked into
        path = path / PLAN_JSON
    if not path.exists() and not path.is_symlink():
        raise UserError(f"plan file {path} does not exist; run `toolkit plan ... --out DIR` first")
    try:
        text = read_bytes_limited(path, "plan file").decode("utf-8")
        data = json.loads(text)
    except UnicodeDecodeError:
        raise UserError(f"plan file {path} is not UTF-8 text; re-emit it with `toolkit plan`") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"plan file {path} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                        "re-emit it with `toolkit plan`") from None
    except RecursionError:
        raise UserError(f"plan file {path} nests too deeply to be a plan; re-emit it with `toolkit plan`") from None
    return parse_plan(data, f"plan file {path}")


def json_schema() -> dict[str, Any]:
    return TypeAdapter(Plan).json_schema()


if __name__ == "__main__":
    if sys.argv[1:] == ["--schema"]:
        SCHEMA_FILE.write_text(json.dumps(json_schema(), indent=2) + "\n")
        print(f"wrote {SCHEMA_FILE}")
    else:
        print("usage: python -m toolkit.plan.schema --schema")

"""The Plan: what plan.json holds. The planner writes it; emit, launch and train only read it.

This module is the bottom of the house: it imports nothing heavy (no torch, no transformers), so a training
process can read a plan without importing the planner. The schema is versioned: `load_plan` reads every version
it knows and refuses newer ones with a clear message.

Batch arithmetic lives here, once: global = micro_batch x grad_accum x data_parallel, and
world = data_parallel x pipeline_stages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import UserError

PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    # --- model -------------------------------------------------------------------------------------------------
    model: str
    """What the user named: a hub id, a local path, or a catalog name."""
    model_config: dict[str, Any]
    """The Hugging Face config (config.to_dict()), so a run can check that the model it loads is the planned one."""
    model_type: str
    """config.model_type, e.g. "llama", "gpt2"."""
    layer_class: str
    """Decoder-layer class name, e.g. "LlamaDecoderLayer" (FSDP wrap policy, pipeline conversion)."""
    num_layers: int
    params: int
    """Exact unique parameter count."""

    # --- strategy ----------------------------------------------------------------------------------------------
    strategy: str
    """Canonical strategy name (toolkit.strategy): ddp, zero1..3, zero2-offload, fsdp2, pipeline, hybrid, ..."""
    engine: str
    """ddp | deepspeed | fsdp2 | pipeline."""
    zero_stage: int
    offload_optimizer: str
    """none | cpu | nvme."""
    offload_params: str
    fsdp_mode: str
    """full | grad_op | hybrid (only meaningful for fsdp2)."""

    # --- process grid --------------------------------------------------------------------------------------------
    num_machines: int
    gpus_per_node: int
    pipeline_stages: int
    """1 unless the engine is pipeline."""
    data_parallel: int
    """Data-parallel degree (world / pipeline_stages)."""
    partition: list[int] | None
    """Pipeline only: decoder-layer boundaries, len = stages + 1, e.g. [0, 12, 24] for 24 layers on 2 stages."""

    # --- batch and job -------------------------------------------------------------------------------------------
    seq_len: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    precision: str
    """fp32 | bf16 | fp16 | bf16-pure."""
    optimizer: str
    """adamw | adamw-8bit | sgd | adafactor."""
    checkpointing: bool
    attention: str

    # --- hardware and predictions (informational for train; printed by launch/profile) --------------------------
    gpu: str
    predicted: dict[str, Any] = field(default_factory=dict)
    """peak_bytes, per-component bytes, cpu_bytes_per_node, step_time_s, tokens_per_s, ... (planner output)."""
    notes: list[str] = field(default_factory=list)
    # --- training method (LoRA / QLoRA, toolkit.lora); the defaults describe full fine-tuning, so older plans load
    method: str = "full"
    """full | lora | qlora."""
    adapter: dict[str, Any] = field(default_factory=dict)
    """toolkit.lora.Adapter fields: r, alpha, dropout, targets, modules_to_save, quant_type, double_quant,
    compute_dtype, quant_storage (empty for full fine-tuning)."""
    trainable_params: int = 0
    """Parameters that get gradients (PEFT's count for adapters; 0 means all, as in full fine-tuning)."""
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        check_batch_arithmetic(self.global_batch, self.micro_batch, self.grad_accum, self.data_parallel)
        if self.data_parallel * self.pipeline_stages != self.world_size:
            raise UserError(
                f"plan grid does not multiply: data_parallel {self.data_parallel} x pipeline_stages "
                f"{self.pipeline_stages} != {self.world_size} processes ({self.num_machines} node(s) x "
                f"{self.gpus_per_node}); change the stages or the GPU count")
        if self.partition is not None and len(self.partition) != self.pipeline_stages + 1:
            raise UserError(f"plan partition {self.partition} does not describe {self.pipeline_stages} stages")

    @property
    def world_size(self) -> int:
        return self.num_machines * self.gpus_per_node

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    def replace(self, **changes: Any) -> "Plan":
        data = asdict(self)
        data.update(changes)
        return Plan(**data)


def check_batch_arithmetic(global_batch: int, micro_batch: int, grad_accum: int, data_parallel: int) -> None:
    """The one batch identity every engine asserts (DeepSpeed: train_batch_size == micro x accum x dp)."""
    if micro_batch * grad_accum * data_parallel != global_batch:
        raise UserError(
            f"batch does not multiply: micro-batch {micro_batch} x accumulation {grad_accum} x data-parallel "
            f"{data_parallel} = {micro_batch * grad_accum * data_parallel}, not the global batch {global_batch}")


def load_plan(path: str | Path) -> Plan:
    """Read plan.json (or a directory holding one); one clear error for anything unreadable."""
    path = Path(path)
    if path.is_dir():
        path = path / "plan.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"plan file {path} does not exist; run `toolkit plan ... --out DIR` first") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"plan file {path} is not valid JSON ({exc.msg} at line {exc.lineno}); "
                        "re-emit it with `toolkit plan`") from None
    if not isinstance(data, dict):
        raise UserError(f"plan file {path} does not hold a JSON object; re-emit it with `toolkit plan`")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise UserError(f"plan file {path} has version {version!r}; this toolkit reads version {PLAN_VERSION} "
                        "(re-emit it with this toolkit's `toolkit plan`)")
    known = set(Plan.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"plan file {path} has unknown key(s) {', '.join(unknown)}; re-emit it with `toolkit plan`")
    try:
        return Plan(**data)
    except TypeError as exc:
        raise UserError(f"plan file {path} is incomplete ({exc}); re-emit it with `toolkit plan`") from None

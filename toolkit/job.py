"""The training job: what one step does, independent of the hardware and the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from toolkit.errors import UserError
from toolkit.lora import FULL, Adapter

Precision = Literal["fp32", "bf16", "fp16", "bf16-pure"]
Optimizer = Literal["adamw", "adamw-8bit", "sgd", "adafactor"]
Attention = Literal["eager", "sdpa", "flash_attention_2"]
DeviceKind = Literal["cuda", "cpu"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "bf16-pure")
OPTIMIZERS: tuple[str, ...] = ("adamw", "adamw-8bit", "sgd", "adafactor")
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash_attention_2")
DEVICE_KINDS: tuple[str, ...] = ("cuda", "cpu")


@dataclass(frozen=True)
class Job:
    seq_len: int
    """Tokens per sample (packed blocks of this length)."""
    micro_batch: int = 1
    """Samples per GPU per forward/backward (per pipeline micro-batch for pipeline plans)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (pipeline: micro-batches per step, which feed 1F1B)."""
    precision: Precision = "bf16"
    """fp32; bf16 / fp16 mixed (fp32 master weights; fp16 with dynamic loss scaling); bf16-pure (all in bf16)."""
    optimizer: Optimizer = "adamw"
    checkpointing: bool = False
    """Activation checkpointing of every decoder layer."""
    attention: Attention = "sdpa"
    device_kind: DeviceKind = "cuda"
    """Whose kernels' saved tensors to model: the GPU kernels (default) or the real CPU dispatch."""
    adapter: Adapter = FULL
    """Training method: full fine-tuning (default), LoRA or QLoRA with its settings (toolkit.lora)."""

    def __post_init__(self) -> None:
        for field, value in (("--seq", self.seq_len), ("--micro-batch", self.micro_batch),
                             ("--accumulation", self.grad_accum)):
            if not isinstance(value, int) or value <= 0:
                raise UserError(f"{field} must be a positive integer, got {value!r}")
        check_choice("--precision", self.precision, PRECISIONS)
        check_choice("--optimizer", self.optimizer, OPTIMIZERS)
        check_choice("--attention", self.attention, ATTENTIONS)
        check_choice("--device-kind", self.device_kind, DEVICE_KINDS)

    @property
    def mixed(self) -> bool:
        """Mixed precision: low-precision compute over fp32 master weights."""
        return self.precision in ("bf16", "fp16")

    @property
    def compute_dtype_name(self) -> str:
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "bf16-pure": "bfloat16"}[self.precision]

    @property
    def method(self) -> str:
        return self.adapter.method

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch


def check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{flag} '{value}' is not known; choose one of: {', '.join(choices)}")

"""Strategies: which engine shards what, named the way users type them.

One `Strategy` value is one way of running a step. Its canonical name round-trips through `parse_strategy` and
`Strategy.name`, and that name is what plan.json, the CLI and the tables print. STRATEGIES (the end of this
module) is the one list of them.

Names:
  ddp                      torch DDP (one process with --gpus 1x...)
  zero1 | zero2 | zero3    DeepSpeed ZeRO stage 1/2/3
  zero1-offload, zero2-offload        ... with the optimizer (states + fp32 master + step) in CPU RAM
  zero3-offload            ZeRO-3 with optimizer and parameters in CPU RAM
  zero3-offload-opt        ZeRO-3 with only the optimizer in CPU RAM
  zero3-offload-nvme                       the same offload to NVMe (ZeRO-Infinity) instead of CPU RAM (ZeRO-3 only:
                                           see NOT_NVME)
  fsdp2                    torch FSDP2, full shard (reshard after forward)
  fsdp2-grad-op            FSDP2 without resharding after forward (ZeRO-2-like)
  fsdp2-hybrid             FSDP2 sharded inside a node, replicated across nodes (HSDP)
  fsdp2-offload            FSDP2 full shard with CPUOffloadPolicy: sharded params, grads, optimizer states and
                           the optimizer step in CPU RAM, each unit's shard copied to the GPU for its all-gather
  pipeline                 DeepSpeed pipeline engine, all ranks are stages (data parallel 1)
  hybrid                   DeepSpeed pipeline x data parallel with ZeRO-1
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

from toolkit.errors import UserError

class _Name(str, Enum):
    """A closed choice that compares, prints and serialises as its plain name ("ddp"), so a typo in a comparison
    is an AttributeError rather than a silent False."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Engine(_Name):
    """Which engine runs a strategy's step."""
    DDP = "ddp"
    DEEPSPEED = "deepspeed"
    FSDP2 = "fsdp2"
    PIPELINE = "pipeline"


class Kind(_Name):
    """A strategy's family (offload and FSDP mode are separate fields of Strategy)."""
    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP2 = "fsdp2"
    PIPELINE = "pipeline"
    HYBRID = "hybrid"


KindName = Literal["ddp", "zero1", "zero2", "zero3", "fsdp2", "pipeline", "hybrid"]
OffloadDevice = Literal["none", "cpu", "nvme"]
FsdpMode = Literal["full", "grad_op", "hybrid"]

KINDS: tuple[str, ...] = tuple(k.value for k in Kind)


@dataclass(frozen=True)
class Strategy:
    kind: KindName
    offload_optimizer: OffloadDevice = "none"
    """Where optimizer states, fp32 master weights and the optimizer step live (ZeRO; FSDP2 with CPUOffloadPolicy)."""
    offload_params: OffloadDevice = "none"
    """Where the parameter partitions live between uses (ZeRO-3; FSDP2's CPUOffloadPolicy, which always moves
    params, grads and the optimizer together)."""
    fsdp_mode: FsdpMode = "full"
    """FSDP2 sharding: full (reshard after forward), grad_op (keep params unsharded to backward), hybrid (HSDP)."""

    @property
    def engine(self) -> Engine:
        if self.kind == Kind.DDP:
            return Engine.DDP
        if self.kind == Kind.FSDP2:
            return Engine.FSDP2
        if self.kind in (Kind.PIPELINE, Kind.HYBRID):
            return Engine.PIPELINE
        return Engine.DEEPSPEED

    @property
    def zero_stage(self) -> int:
        """DeepSpeed ZeRO stage (pipeline plans: 0 for pure pipeline, 1 for hybrid)."""
        return {"zero1": 1, "zero2": 2, "zero3": 3, "hybrid": 1}.get(self.kind, 0)

    @property
    def is_pipeline(self) -> bool:
        return self.kind in ("pipeline", "hybrid")

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer != "none" or self.offload_params != "none"

    @property
    def name(self) -> str:
        if self.kind == "fsdp2":
            if self.offloads:
                return "fsdp2-offload"
            return {"full": "fsdp2", "grad_op": "fsdp2-grad-op", "hybrid": "fsdp2-hybrid"}[self.fsdp_mode]
        if not self.offloads:
            return self.kind
        device = self.offload_optimizer
        if self.kind == "zero3":
            base = "zero3-offload" if self.offload_params != "none" else "zero3-offload-opt"
        else:
            base = f"{self.kind}-offload"
        return base + ("-nvme" if device == "nvme" else "")


STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy("ddp"),
    "zero1": Strategy("zero1"),
    "zero2": Strategy("zero2"),
    "zero3": Strategy("zero3"),
    "zero1-offload": Strategy("zero1", offload_optimizer="cpu"),
    "zero2-offload": Strategy("zero2", offload_optimizer="cpu"),
    "zero3-offload-opt": Strategy("zero3", offload_optimizer="cpu"),
    "zero3-offload": Strategy("zero3", offload_optimizer="cpu", offload_params="cpu"),
    "zero3-offload-nvme": Strategy("zero3", offload_optimizer="nvme", offload_params="nvme"),
    "fsdp2": Strategy("fsdp2"),
    "fsdp2-grad-op": Strategy("fsdp2", fsdp_mode="grad_op"),
    "fsdp2-hybrid": Strategy("fsdp2", fsdp_mode="hybrid"),
    "fsdp2-offload": Strategy("fsdp2", offload_optimizer="cpu", offload_params="cpu"),
    "pipeline": Strategy("pipeline"),
    "hybrid": Strategy("hybrid"),
}
"""Every strategy, by its canonical name, in the order tables list them: the one list the parser, the planner's
search, the plan schema (plan.schema.json) and the help read. A name not here is refused at the parser."""

ALL_STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)
"""Every strategy the planner considers, in the order tables list them."""

_ALIASES = {"fsdp2-full": "fsdp2"}


NOT_NVME = {"zero1-offload-nvme": "zero1-offload", "zero2-offload-nvme": "zero2-offload"}
"""Names a user may expect that DeepSpeed does not run as named: ZeRO-1/2 with an nvme offload device keep the
optimizer states in CPU RAM (deepspeed 0.19.8 runtime/zero/stage_1_and_2.py sets cpu_offload for any device but
none and has no optimizer swapper; NVMe swapping is ZeRO-3's, stage3.py). Refused with the name that says it."""


def parse_strategy(text: str) -> Strategy:
    """Parse a canonical strategy name (see STRATEGIES; "_" for "-" and fsdp2-full for fsdp2 are accepted)."""
    name = text.strip().lower().replace("_", "-")
    name = _ALIASES.get(name, name)
    if name in NOT_NVME:
        raise UserError(f"{name}: DeepSpeed's ZeRO-1/2 keep an nvme-device optimizer in CPU RAM (no optimizer "
                        f"swapper outside ZeRO-3), so it would run as {NOT_NVME[name]}; use {NOT_NVME[name]}, or "
                        "zero3-offload-nvme to offload to NVMe")
    if name not in STRATEGIES:
        raise UserError(f"unknown strategy '{text}'; choose one of: {', '.join(ALL_STRATEGY_NAMES)}")
    return STRATEGIES[name]

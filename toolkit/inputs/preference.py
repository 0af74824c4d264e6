"""Preference fine-tuning with TRL's DPOTrainer: the settings that move memory and time, checked once for every
command (estimate, plan, check, emit).

What TRL 1.16 does with them (docs/ENGINE_FACTS.md, "DPO"): chosen and rejected run as one concatenated batch
through the policy (twice the micro-batch of pairs); the reference model scores the same batch under no_grad, kept
beside the policy (a frozen copy; with PEFT the adapter-disabled policy, no extra weights) or replaced by
log-probs precomputed over the dataset before training (DPOConfig.precompute_ref_log_probs).

Nothing here imports beyond the standard library and toolkit's ground.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError
from toolkit.inputs.choices import DPO_DEFAULT_BETA, DPO_LOSS_TYPES, METHOD_JOIN, REFERENCES

if TYPE_CHECKING:
    from toolkit.inputs.strategy import Strategy

KEPT, PRECOMPUTED, NONE = REFERENCES
REFERENCE_FREE_LOSSES: tuple[str, ...] = ()
"""DPO loss types that run without a reference. TRL 1.16's DPOTrainer scores every batch with the reference (or
reads precomputed log-probs) whatever the loss_type (dpo_trainer.py _compute_loss, lines 1318-1347): none. Its
reference-free losses (SimPO, CPO) live in trl.experimental.cpo's CPOTrainer, which toolkit does not model."""


@dataclass(frozen=True)
class Dpo:
    """A DPO job's settings (TRL DPOConfig)."""

    beta: float = DPO_DEFAULT_BETA
    """Deviation from the reference (DPOConfig.beta); moves neither memory nor time."""
    loss_type: str = "sigmoid"
    """DPOConfig.loss_type (one of TRL's; moves neither memory nor time)."""
    reference: str = KEPT
    """kept: the reference model beside the policy; precomputed: its log-probs computed over the dataset before
    training (DPOConfig.precompute_ref_log_probs); none: no reference (a reference-free loss)."""

    def __post_init__(self) -> None:
        if self.reference not in REFERENCES:
            raise UserError(f"--reference '{self.reference}' is not known; choose one of: {', '.join(REFERENCES)}")
        if self.loss_type not in DPO_LOSS_TYPES:
            raise UserError(f"--dpo-loss '{self.loss_type}' is not one of TRL's DPO loss types; choose one of: "
                            f"{', '.join(DPO_LOSS_TYPES)}")
        if not (isinstance(self.beta, (int, float)) and not isinstance(self.beta, bool)
                and math.isfinite(self.beta) and self.beta > 0):
            raise UserError(f"--dpo-beta must be a positive number, got {self.beta!r}")
        if self.reference == NONE and self.loss_type not in REFERENCE_FREE_LOSSES:
            raise UserError(f"--reference none: TRL's DPOTrainer scores every batch with a reference for loss_type "
                            f"{self.loss_type} (it has no reference-free DPO loss; SimPO / CPO are trl.experimental's "
                            "CPOTrainer); use --reference kept or precomputed")

    @property
    def reference_forward(self) -> bool:
        """The reference scores each training batch (a forward under no_grad in every micro-step)."""
        return self.reference == KEPT

    def dpo_config_kwargs(self, seq_len: int) -> dict[str, Any]:
        """TRL DPOConfig keyword arguments of these settings (JSON-safe); max_length is the plan's tokens per sequence
        (prompt + completion, each of chosen and rejected)."""
        return {"beta": self.beta, "loss_type": [self.loss_type], "max_length": seq_len,
                "precompute_ref_log_probs": self.reference == PRECOMPUTED}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DPO_FLAGS = {"reference": "--reference", "beta": "--dpo-beta", "loss_type": "--dpo-loss"}
"""Dpo fields with the flag that sets each."""


def dpo_from_flags(objective: str | None, **given: Any) -> Dpo | None:
    """The Dpo of a command line (None when --method names no objective); a DPO flag without --method dpo is
    refused, never ignored. `given` holds the flags' values (None: not given)."""
    given = {k: v for k, v in given.items() if v is not None}
    if objective is None:
        if given:
            flag = DPO_FLAGS[next(iter(given))]
            raise UserError(f"{flag} applies to --method dpo (dpo{METHOD_JOIN}lora, dpo{METHOD_JOIN}qlora), and "
                            f"--method names no preference objective: it would be ignored; add --method dpo or drop "
                            f"{flag}")
        return None
    return Dpo(**given)


def dpo_problem(dpo: Dpo | None, strategy: "Strategy | None", *, liger: bool = False, tiled: bool = False,
                compile: bool | str = False, chunked_loss: int = 0) -> str | None:
    """Why a DPO job cannot be planned with `strategy` and the rest of the job, or None."""
    if dpo is None:
        return None
    if strategy is not None and strategy.is_pipeline:
        return ("DPO runs through TRL's DPOTrainer on the HF Trainer path, not the pipeline engine; use ddp, zero1, "
                "zero2, zero3 or fsdp2")
    for on, what in ((liger, "--liger"), (tiled, "--tiled"), (compile, "--compile"),
                     (chunked_loss, "--chunked-loss")):
        if on:
            # TRL 1.16 patches the LM head with its own chunked log-prob head (add_fused_lm_head) and refuses Liger's
            # fused loss; the others change the head or the layers in ways not traced with it.
            return f"--method dpo with {what} is not modelled; drop {what}"
    return None


MODEL_PARALLEL_DPO_PROBLEM = ("DPO with tensor, context, sequence or expert parallelism is not modelled yet (the "
                              "reference's placement on those grids is not read from TRL); plan it on DDP, ZeRO or "
                              "FSDP2 alone")


def reference_words(dpo: Dpo | None) -> str:
    """How job summaries name a DPO job: ", DPO (sigmoid, reference kept; micro-batch counts pairs)", or nothing."""
    return "" if dpo is None else f", DPO ({dpo.loss_type}, reference {dpo.reference}; micro-batch counts pairs)"

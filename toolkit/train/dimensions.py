"""Tensor, sequence and context parallelism in the HF Trainer run: who shards what, from the plan's grid.

Measured on CPU over gloo (docs/ENGINE_FACTS.md, "Which dimensions run on CPU"):
- tensor parallelism (FSDP2 x TP, HSDP x TP): transformers shards the model as it loads it
  (`from_pretrained(distributed_config=DistributedConfig(tp_size, fsdp_size, dp_replicate_size))`, the model's own
  tp_plan, FSDP2 over the rest of the mesh). The Trainer then only prepares it; accelerate's FSDP plugin must stay
  off (with it on, the Trainer's load-time-sharded branch hands accelerate an optimizer alone, which FSDP2 refuses),
  and the Trainer derives its ParallelismConfig from the model. Such a model's optimizer is not checkpointed (the
  Trainer refuses it): checkpoints hold the model only and the run cannot resume.
- sequence parallelism (DeepSpeed Ulysses / ALST with ZeRO-1/2/3): TrainingArguments' `parallelism_config` with
  sp_backend "deepspeed"; accelerate registers the Ulysses attention and the Trainer wraps the data loader in
  DeepSpeed's adapter, which needs position_ids in every batch.
- context parallelism (FSDP2 x CP, torch ring attention): needs CUDA's SDPA kernels; refused on CPU.
"""

from __future__ import annotations

import os
from typing import Any

from toolkit.errors import UserError
from toolkit.plan.schema import Plan

CP_NEEDS_CUDA = ("context parallelism needs a GPU: torch's ring attention shards only the CUDA SDPA kernels "
                 "(on CPU: 'aten._scaled_dot_product_flash_attention_for_cpu does not have a sharding strategy "
                 "registered'); it is validated here and checked by benchmarks/gpu_check.py on 2+ GPUs")
"""One line for a CP plan on a machine without a GPU (docs/ENGINE_FACTS.md)."""




def check_runnable(plan: Plan, *, on_cpu: bool) -> None:
    """Refuse, before any process group or model, the dimensions this runner cannot run here."""
    if plan.context_parallel > 1 and plan.tensor_parallel > 1:
        raise UserError(f"toolkit.train runs tensor parallel {plan.tensor_parallel} through transformers' load-time "
                        f"sharding, whose mesh has no context-parallel axis: re-plan with --tensor-parallel or "
                        f"--context-parallel {plan.context_parallel}, not both")
    if plan.context_parallel > 1 and on_cpu:
        raise UserError(CP_NEEDS_CUDA)
    if plan.method != "full" and (plan.tensor_parallel > 1 or plan.sequence_parallel > 1
                                  or plan.context_parallel > 1 or plan.expert_parallel > 1):
        raise UserError(f"toolkit.train does not run {plan.method} adapters with tensor / sequence / context / "
                        "expert parallelism; re-plan without the parallel degree, or train the full model")


def leave_sharding_to_transformers(plan: Plan) -> None:
    """A TP / EP plan's YAML is a plain multi-process launch (toolkit.emit.parallelism); a TP plan launched with an FSDP
    config of another origin would make the Trainer fail opaquely. Turn accelerate's FSDP plugin and its
    parallelism_config off in this process, because transformers shards the model (FSDP2 included) as it loads it.
    Call before accelerate's state exists."""
    from toolkit.emit.parallelism import sharded_at_load

    if not sharded_at_load(plan):
        return
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    for name in [n for n in os.environ if n.startswith("PARALLELISM_CONFIG_")]:
        del os.environ[name]  # the Trainer builds its ParallelismConfig from the sharded model
    os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)


def distributed_config(plan: Plan):
    """transformers' DistributedConfig for a TP / EP plan, from the keyword arguments training_args.json carries."""
    from toolkit.emit.parallelism import distributed_config as config_kwargs

    kwargs = config_kwargs(plan)
    if not kwargs:
        return None
    from transformers.distributed.configuration_utils import DistributedConfig

    return DistributedConfig(**kwargs)


def parallelism_config(plan: Plan, attention: str):
    """TrainingArguments' `parallelism_config` for an SP or CP plan, from the keyword arguments training_args.json
    carries (None otherwise: a TP plan's comes from the sharded model). `attention`: the implementation the model
    runs with here (Ulysses refuses a model whose attention differs from the one it wraps)."""
    from toolkit.emit.parallelism import build_parallelism_config, parallelism_kwargs

    kwargs = parallelism_kwargs(plan)
    if not kwargs or plan.grid.model_parallel == 1:  # as training_args.json: only with a tp / cp / sp degree
        return None
    if "sp_handler" in kwargs:
        kwargs["sp_handler"] = {**kwargs["sp_handler"], "sp_attn_implementation": attention}
    return build_parallelism_config(kwargs)


def sequence_parallel_collator(base):
    """DeepSpeed's Ulysses data-loader adapter shards every batch along the sequence and needs position_ids to keep
    each token's global position (ulysses_sp.py UlyssesSPDataLoaderAdapter.refill raises without them). Blocks are
    whole sequences here (packed text, or one right-padded conversation), so positions run 0..seq-1. The attention
    mask is dropped: Ulysses attends causally over the gathered sequence, and right padding (labels -100) is never
    attended to by a real token under a causal mask."""
    import torch

    def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = base(features)
        batch.pop("attention_mask", None)
        batch_size, seq_len = batch["input_ids"].shape
        batch["position_ids"] = torch.arange(seq_len).unsqueeze(0).expand(batch_size, -1).contiguous()
        return batch

    return collate


def close_each_pass() -> None:
    """Make DeepSpeed's Ulysses data-loader adapter start every epoch at the start of the loader it wraps.

    UlyssesSPDataLoaderAdapter (deepspeed 0.19.8 runtime/sequence_parallel/ulysses_sp.py) is its own iterator
    (`__iter__` returns self) and learns that the wrapped loader is spent only when a `refill` after its last batch
    meets StopIteration, which it re-raises after taking a fresh iterator. The HF Trainer asks each epoch for exactly
    `len(loader) x sp` micro-batches (trainer.py `set_initial_training_values`, `_run_epoch`), so the first epoch
    never makes that extra call: the second epoch's first window gets StopIteration at once and trains nothing, its
    micro-batches shift one window late, and where the epoch ends in a partial accumulation window (len x sp not a
    multiple of the accumulation) that window's gradient is carried, unstepped, into the third epoch's first step
    (docs/ENGINE_FACTS.md, "The last accumulation window of an epoch under Ulysses SP"). Patched: `__iter__` closes
    a pass whose every batch was served (one more read of the spent iterator, which lets accelerate's DataLoaderShard
    count its epoch, so the next pass reshuffles as without SP) and starts the next from the loader's start; a pass
    left part-read is continued, as before. Idempotent."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter as Adapter

    if getattr(Adapter.__iter__, "toolkit_closes_passes", False):
        return
    refill = Adapter.refill

    def counted_refill(self):
        try:
            refill(self)
        except StopIteration:  # the adapter took a fresh iterator of the loader itself
            self.toolkit_served = 0
            raise
        self.toolkit_served = getattr(self, "toolkit_served", 0) + 1

    def __iter__(self):
        if getattr(self, "toolkit_served", 0) >= len(self.dl) and not self.micro_batches:
            for _ in self.iter:  # a spent iterator: this only runs its end (accelerate's epoch count, end())
                pass
            self.iter = iter(self.dl)
            self.toolkit_served = 0
        return self

    __iter__.toolkit_closes_passes = True
    Adapter.refill = counted_refill
    Adapter.__iter__ = __iter__


def ulysses_groups(sp: int):
    """DeepSpeed's Ulysses process groups for a run with `sp` > 1 sequence-parallel ranks, else None: the module
    deepspeed.runtime.sequence_parallel.parallel_state_sp, whose public get_sequence_parallel_group /
    _world_size / _rank and get_sequence_data_parallel_world_size read the groups that
    UlyssesSPAttentionHF.register_with_transformers built (it returns this module as the mpu accelerate hands
    deepspeed.initialize, and accelerate calls its get_sequence_parallel_group itself; docs/ENGINE_FACTS.md,
    "DeepSpeed's SP group by its public name"). Its getters assert when no SP group was built, so callers ask only
    with sp > 1 (the run's ParallelismConfig.sp_size)."""
    if sp <= 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp


def sp_gradient_factor(engine, sp: int) -> float:
    """What the SP loss's gradient must be multiplied by so that a DeepSpeed engine ends with the single-process
    gradient (docs/ENGINE_FACTS.md, "ZeRO-1/2 x Ulysses SP: the gradient counted sp times"): 1 / sp where the
    engine's config sums the SP ranks (toolkit.emit.deepspeed.sp_gradient_multiple), else 1. transformers' SP loss
    (integrations/deepspeed.py `deepspeed_sp_compute_loss`) all-gathers each rank's loss with torch's differentiable
    all_gather, whose backward sums the SP ranks' incoming gradients, so each rank's gradient of its own tokens comes
    back sp times; the plan's own JSON makes ZeRO-1/2 divide it out (average_over_sp_ranks), a config from elsewhere
    may not. `sp`: the run's SP degree (ParallelismConfig.sp_size)."""
    from toolkit.emit.deepspeed import sp_gradient_multiple

    if (groups := ulysses_groups(sp)) is None:
        return 1.0
    multiple = sp_gradient_multiple(engine._config._param_dict, sp=groups.get_sequence_parallel_world_size(),
                                    group_ranks=groups.get_sequence_data_parallel_world_size())
    return 1.0 / multiple


def scale_gradient(loss, factor: float):
    """`loss` unchanged (what the Trainer logs), its gradient multiplied by `factor`."""
    return loss if factor == 1.0 else loss.detach() + (loss - loss.detach()) * factor


class SequenceParallelGradient:
    """A Trainer mixin: under DeepSpeed SP, the training loss's gradient scaled by sp_gradient_factor (the loss the
    Trainer logs stays as computed)."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        if not (self.is_deepspeed_enabled and model.training):
            return out
        pc = self.accelerator.parallelism_config
        factor = sp_gradient_factor(self.model_wrapped, pc.sp_size if pc is not None else 1)
        return (scale_gradient(out[0], factor), *out[1:]) if return_outputs else scale_gradient(out, factor)

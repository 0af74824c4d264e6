"""What a DPO job (TRL's DPOTrainer, toolkit.inputs.preference) adds to one GPU's memory and step beside the
policy's supervised step, from how TRL 1.16 builds and prepares its reference (docs/ENGINE_FACTS.md, "DPO"):

- the policy runs chosen and rejected concatenated, one batch of 2 x micro-batch sequences (inputs.job.policy_job);
- the reference's weights, when it is a model of its own (reference kept, full fine-tuning), as its engine holds
  them: DeepSpeed casts it to the compute dtype and partitions it under ZeRO-3 only (stage 0 otherwise); FSDP2
  shards it; DDP keeps a replica in the dtype the policy was loaded in;
- the reference's forward under no_grad after the policy's forward: nothing saved, one layer's working set at a
  time (and a sharded reference's gathered layers), on top of the policy's saved activations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from toolkit.errors import UserError
from toolkit.inputs.choices import GIB, compute_bytes, weight_bytes
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.job import Job, policy_job
from toolkit.inputs.modelspec import ModelSpec
from toolkit.inputs.grpo import MODEL_PARALLEL_GRPO_PROBLEM
from toolkit.inputs.preference import MODEL_PARALLEL_DPO_PROBLEM
from toolkit.inputs.strategy import Engine, Strategy

REFERENCE_FORWARD_PHASE = "reference forward (no_grad)"
REFERENCE_SCORING_PHASE = "reference scoring (no_grad)"
"""GRPO's reference pass: its per-token log-probs of the generated completions, after generation and before the
policy's forward (grpo_trainer.py _generate_and_score_completions)."""


@dataclass(frozen=True)
class Reference:
    """The reference's share of one GPU in a DPO step."""

    weights_bytes: int
    """Its weights, resident for the whole step (0: precomputed, or the adapter-disabled policy)."""
    gathered_bytes: int
    """A sharded reference's unsharded layers while it computes (ZeRO-3 / FSDP2)."""
    forward: bool
    """It runs a forward in every micro-step (reference kept)."""
    source: str
    scores_first: bool = False
    """GRPO: its no_grad pass scores the generated completions before the policy's forward, beside what the step
    holds between steps (REFERENCE_SCORING_PHASE), not on top of saved activations."""

    def forward_bytes(self, trace) -> int:
        """Live bytes of its forward beyond what the step already holds: the largest working set under no_grad of
        a decoder layer or of the head (at most what the region saves for backward plus its own temporaries, in the
        policy's trace of the same concatenated batch; nothing is kept past the region) and its gathered layers.
        The policy is traced with TRL's chunked log-prob head (policy_job), and DPOTrainer patches the reference
        with the same add_fused_lm_head (dpo_trainer.py __init__), so the reference's head is that head: one tile
        buffer of at most 4096 tokens x 32768 vocabulary, the hidden states it projects and per-token fp32
        statistics; no whole logits."""
        if not self.forward:
            return 0
        return self.working_bytes(trace)

    def working_bytes(self, trace) -> int:
        """Its no_grad forward's working set (forward_bytes), whenever that forward runs."""
        working = max((r.saved_bytes + r.forward_extra_bytes for r in (*trace.layers, trace.head)), default=0)
        return int(working + self.gathered_bytes)


def reference_of(spec: ModelSpec, strategy: Strategy, job: Job, grid: ParallelGrid) -> Reference | None:
    """The reference of a DPO or GRPO job on one GPU, or None for a supervised job and for GRPO with beta 0 (TRL's
    GRPOTrainer.__init__ loads no reference then). A GRPO reference scores the completions under no_grad before
    the policy's forward (_generate_and_score_completions), so it adds no forward on top of saved activations."""
    dpo, grpo = job.dpo, job.grpo
    if dpo is None and (grpo is None or not grpo.reference_kept):
        return None
    if grid.model_parallel > 1 or grid.expert > 1:
        raise UserError(MODEL_PARALLEL_DPO_PROBLEM if dpo else MODEL_PARALLEL_GRPO_PROBLEM)
    after_policy = dpo is not None and dpo.reference_forward
    if job.adapter.is_adapter:
        # TRL: is_peft_model(model) and ref_model None -> self.ref_model = None; the reference forward runs the policy
        # under use_adapter(..., None), the adapters disabled (dpo_trainer.py 908-914, 1328-1336; grpo_trainer.py
        # 983-990, 2710-2730).
        return Reference(0, 0, after_policy, scores_first=dpo is None, source=
                         f"the adapter-disabled {job.adapter.method} base (PEFT): no weights of its own"
                         + ("; log-probs precomputed before training" if dpo and not dpo.reference_forward else ""))
    if dpo is not None and not dpo.reference_forward:
        # The pass itself runs before training and is not modelled here: under FSDP TRL loads a reference model
        # for it beside the policy, not yet sharded, and drops it after (dpo_trainer.py 908-914, 1033-1034).
        before = (" (the pass before training loads a reference model beside the not yet sharded policy under FSDP: "
                  "not modelled)" if strategy.engine == Engine.FSDP2 else "")
        return Reference(0, 0, False, "log-probs precomputed over the dataset before training "
                                      f"(precompute_ref_log_probs): no reference model in training{before}")
    params = spec.params
    shard = grid.shard_group
    per_param = compute_bytes(job.precision)
    if strategy.engine == Engine.DEEPSPEED:
        # trl/models/utils.py prepare_deepspeed: stage 3 kept, any other stage set to 0; the engine casts the module
        # to the bf16 / fp16 of the config (deepspeed/runtime/engine.py _configure_distributed_model).
        sharded = strategy.zero_stage == 3
        how = "ZeRO-3 partitions it over" if sharded else "stage 0 (prepare_deepspeed): a replica on each of"
    elif strategy.engine == Engine.FSDP2:
        # trl/models/utils.py prepare_fsdp: fully_shard with the plugin's policy; stored in the loaded dtype.
        sharded, per_param = True, weight_bytes(job.precision)
        how = "fully_shard (prepare_fsdp) over"
    else:
        # accelerator.prepare_model(evaluation_mode=True): the module as loaded, in the policy's dtype.
        sharded, per_param = False, weight_bytes(job.precision)
        how = "a replica (accelerator.prepare_model) on each of"
    weights = math.ceil(params / shard) * per_param if sharded else params * per_param
    if strategy.engine == Engine.FSDP2 and strategy.fsdp_mode == "grad_op":
        # reshard_after_forward False: FSDP2 reshards such a group only after its backward (_fsdp_param_group.py
        # reshard / post_forward), which the no_grad reference never runs: after its first forward every layer stays
        # unsharded in the compute dtype beside its shards.
        weights += params * compute_bytes(job.precision)
        how = (f"fully_shard over {shard} ranks, plus {compute_bytes(job.precision)} B unsharded: reshard_after_forward "
               "False (prepare_fsdp) leaves it gathered after its first forward; on each of")
    # Gathered while it computes: the module computing (at most the largest, an embedding or head matrix) and the
    # next decoder layer prefetched.
    gathered = (spec.largest_layer_params + max(spec.layer_params)) * compute_bytes(job.precision) \
        if sharded and strategy.fsdp_mode != "grad_op" else 0
    return Reference(weights, gathered, after_policy, scores_first=grpo is not None, source=
                     f"{params:,} params x {per_param} B, {how} {shard} ranks = {weights / GIB:.2f} GiB; no gradients "
                     "or optimizer states (frozen, eval mode)"
                     + ("" if dpo else "; GRPO beta != 0, its no_grad scoring runs before the policy's forward"))


def reference_terms(ref: Reference, forward_bytes: int, scoring_bytes: int = 0) -> list[tuple[str, int, str]]:
    """--explain's lines for the reference."""
    out = [("reference model", ref.weights_bytes, ref.source)]
    if ref.scores_first:
        out.append((REFERENCE_SCORING_PHASE, scoring_bytes,
                    "after generation, before the policy's forward, beside what the step holds between steps: the "
                    "largest layer's working set of one micro-batch, nothing saved, and the parameters a sharded "
                    "model gathers (the adapter-disabled policy: what its own forward gathers)"))
    if ref.forward:
        out.append((REFERENCE_FORWARD_PHASE, forward_bytes,
                    "after the policy's forward: the largest layer's working set of the concatenated batch, nothing "
                    "saved" + (", and its gathered parameters (the largest module + one decoder layer prefetched)" if ref.gathered_bytes else "")))
    return out


def no_grad_forward_s(spec: ModelSpec, job: Job, compute_s: float, trainable: int | None) -> tuple[float, float, float]:
    """A no_grad forward over the step's sequences at the policy's rate per FLOP: (seconds, its FLOPs a token, the
    training step's FLOPs a token). `compute_s`: the policy step's compute; `trainable`: an adapter's trainable
    parameters (None: full fine-tuning)."""
    from toolkit.estimate.efficiency import Recompute, flop_split

    train = flop_split(spec, job.seq_len, Recompute.of(job.checkpointing), trainable)
    forward = forward_flops(spec, job.seq_len)
    return compute_s * forward / (train.matmul + train.attention), forward, train.matmul + train.attention


def forward_flops(spec: ModelSpec, seq_len: int, head_matmul_params: int | None = None) -> float:
    """FLOPs a token of one forward of `spec` at `seq_len`: its matmul weights twice and its attention (a third of
    flop_split's training attention without recompute). `head_matmul_params`: a head other than the spec's LM head
    (a reward model's score head, hidden x 1)."""
    from toolkit.estimate.efficiency import Recompute, flop_split

    head = spec.head_matmul_params if head_matmul_params is None else head_matmul_params
    return 2 * (sum(spec.layer_matmul_params) + head) + flop_split(spec, seq_len, Recompute.of(False)).attention / 3


def dpo_step_time(spec: ModelSpec, strategy: Strategy, job: Job, hw, *, grid: ParallelGrid, **kwargs):
    """The step time of a DPO job: the policy's supervised step at the concatenated batch (timing.step_time of
    policy_job), plus, when the reference scores each batch, its forward under no_grad (the forward FLOPs of the
    concatenated batch at the policy's rate per FLOP: about a third of a full fine-tuning step's compute without
    recompute, half of a LoRA one's) and, for a sharded reference (ZeRO-3 / FSDP2), one more all-gather of its
    weights per micro-step. Tokens count chosen and rejected sequences. Precomputed: the reference's forward runs
    once over the dataset before training, stated (not in the step)."""
    from toolkit.estimate.timing import OVERLAP, _group_bandwidth, _ring, step_time

    policy = policy_job(job)
    t = step_time(spec, strategy, policy, hw, grid=grid, **kwargs)
    ref = reference_of(spec, strategy, job, grid)
    counts = None
    if job.adapter.is_adapter:
        from toolkit.inputs.lora import counts_for_spec

        counts = counts_for_spec(spec, job.adapter)
    trainable = counts.trainable_params if counts is not None else None
    forward_s, forward, train_flops = no_grad_forward_s(spec, job, t.compute_s, trainable)
    said = [f"DPO: the policy runs chosen + rejected as one batch of {policy.micro_batch} sequences per micro-step; "
            "tokens count both"]
    if not ref.forward:
        pairs_s = forward_s / (job.micro_batch * job.grad_accum)
        said.append(f"DPO reference precomputed: one no_grad forward over the dataset before training, about "
                    f"{pairs_s * 10_000 / 60:.1f} min per 10,000 pairs per data-parallel rank at the step's rate "
                    "(not in the step time; time to train adds it)")
        return replace(t, precompute_s=forward_s, assumptions=t.assumptions + tuple(said))
    gather_s = 0.0
    if grid.shard_group > 1 and (strategy.engine == Engine.FSDP2
                                 or (strategy.engine == Engine.DEEPSPEED and strategy.zero_stage == 3)):
        from toolkit.estimate.timing import data_parallel_gather_bytes

        gathered = spec.params * compute_bytes(job.precision) if counts is None \
            else data_parallel_gather_bytes(counts, job)
        gather = job.grad_accum * _ring(gathered, grid.shard_group, _group_bandwidth(hw, grid.shard_group), 1)
        gather_s = max(0.0, gather - OVERLAP[strategy.engine] * min(gather, forward_s))
        said.append(f"DPO reference: one more all-gather of {gathered / GIB:.2f} GiB per micro-step for its "
                    f"forward, {OVERLAP[strategy.engine]:.2f} of it hidden behind that forward (assumed)")
    said.append(f"DPO reference forward under no_grad: {forward_s:.3f} s a step ({forward / 1e9:.1f} GFLOP a token "
                f"against the step's {train_flops / 1e9:.1f}), at the policy's rate per FLOP")
    step = t.step_time_s + forward_s + gather_s
    tokens = t.tokens_per_s * t.step_time_s
    return replace(t, step_time_s=step, tokens_per_s=tokens / step, mfu=t.mfu * t.step_time_s / step,
                   communication_s=t.communication_s + gather_s, reference_s=forward_s,
                   assumptions=t.assumptions + tuple(said))

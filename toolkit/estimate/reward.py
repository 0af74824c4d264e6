"""What a GRPO job's reward model (--reward-model, toolkit.inputs.reward) adds to one GPU's memory and step, from how
TRL 1.16's GRPOTrainer holds and runs it (docs/ENGINE_FACTS.md, "A reward model"):

- its weights for the whole run, prepared as the reference is: under DeepSpeed prepare_deepspeed (ZeRO-3 kept and
  partitioned over the shard group, any other stage set to 0: a whole replica; the module cast to the config's
  bf16 / fp16), otherwise accelerator.prepare_model(evaluation_mode=True), which wraps nothing in evaluation mode
  (no DDP, and FSDP2 is only applied through accelerator.prepare with an optimizer): a whole replica on every
  GPU, in the dtype it was loaded in (the checkpoint's own);
- the scoring forward (_calculate_rewards): once per generation, after the completions and before the policy's
  forward, ONE forward under torch.inference_mode() over the process's whole generation batch (micro-batch x
  steps_per_generation prompt + completion sequences): nothing is saved, one decoder layer's working set at a time
  (under ZeRO-3 with that layer and the next gathered), beside the model states and the reference; the generation's
  KV cache is gone by then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from toolkit.estimate.breakdown import Breakdown, Term, reserved_bytes
from toolkit.estimate.preference import REFERENCE_SCORING_PHASE
from toolkit.inputs.choices import GIB, compute_bytes
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.job import Job
from toolkit.inputs.reward import RewardModel, reward_model_of
from toolkit.inputs.strategy import Engine, Strategy

REWARD_PHASE = "reward scoring (no_grad)"


@dataclass(frozen=True)
class RewardShare:
    """The reward model's share of one GPU."""

    weights_bytes: int
    """Resident for the whole run."""
    forward_bytes: int
    """Live only while it scores: the largest decoder layer's working set at the generation batch, and a ZeRO-3
    shard's gathered layers."""
    weights_source: str
    forward_source: str


def _bytes_per_param(strategy: Strategy, job: Job, rm: RewardModel) -> int:
    """Bytes a reward-model weight takes as held: prepare_deepspeed's engine casts it to the config's bf16 / fp16
    (fp32 keeps the loaded dtype); elsewhere the dtype it was loaded in."""
    if strategy.engine == Engine.DEEPSPEED and job.precision != "fp32":
        return compute_bytes(job.precision)
    return rm.load_bytes_per_param


def _held(strategy: Strategy, job: Job, grid: ParallelGrid, rm: RewardModel) -> tuple[bool, int, str]:
    """Whether ZeRO-3 partitions the reward model, its resident bytes on one GPU, and how it is held."""
    deepspeed = strategy.engine == Engine.DEEPSPEED
    sharded = deepspeed and strategy.zero_stage == 3
    shard = grid.shard_group if sharded else 1
    weights = math.ceil(rm.params / shard) * _bytes_per_param(strategy, job, rm)
    how = (f"ZeRO-3 partitions it over {shard} ranks (prepare_deepspeed)" if sharded else
           "stage 0 (prepare_deepspeed): a replica on each GPU" if deepspeed else
           "a replica on each GPU (accelerator.prepare_model in evaluation mode wraps nothing)")
    return sharded, weights, how


def reward_weights_bytes(strategy: Strategy, job: Job, grid: ParallelGrid) -> int:
    """The reward model's resident bytes on one GPU of `strategy` (0 without one), without tracing its forward: the
    planner's states floor (toolkit.estimate.memory.states_floor_bytes) counts it."""
    if job.grpo is None or not job.grpo.reward_model:
        return 0
    return _held(strategy, job, grid, reward_model_of(job.grpo.reward_model))[1]


def reward_share(strategy: Strategy, job: Job, grid: ParallelGrid, seqs: int) -> RewardShare:
    """The reward model's weights and scoring forward on one GPU of `strategy` (module docstring); `seqs`: the
    sequences one scoring forward takes, the process's generation batch (toolkit.estimate.grpo.generation_sequences)."""
    from toolkit.estimate.traces import scaled_trace

    rm = reward_model_of(job.grpo.reward_model)
    rs = rm.spec
    per_param = _bytes_per_param(strategy, job, rm)
    sharded, weights, how = _held(strategy, job, grid, rm)
    gathered = (max(max(rs.layer_params), rs.embedding_params) + max(rs.layer_params)) * per_param if sharded else 0
    rjob = Job(seq_len=job.grpo.seq_len, micro_batch=seqs, precision=job.precision, attention=job.attention,
               device_kind=job.device_kind, allocator_conf=job.allocator_conf)
    trace = scaled_trace(rs, rjob, strategy)
    working = max(r.saved_bytes + r.forward_extra_bytes for r in trace.layers)
    scores = seqs * job.grpo.seq_len * 4  # the score head's one label at every position, fp32 at most
    return RewardShare(
        weights_bytes=weights, forward_bytes=int(working + gathered + scores),
        weights_source=f"{rm.name}: {rm.params:,} params (AutoModelForSequenceClassification, num_labels=1) x "
                       f"{per_param} B, {how} = {weights / GIB:.2f} GiB; frozen, eval mode",
        forward_source=f"{REWARD_PHASE}, after generation, before the policy's forward: one inference_mode forward "
                       f"over {seqs} sequences x {job.grpo.seq_len} tokens, its largest decoder layer's working set "
                       f"({rs.model_type}, {rs.num_layers} layers x {rs.hidden})"
                       + (", with that layer and the next gathered (ZeRO-3)" if gathered else ""))


def with_reward(b: Breakdown, strategy: Strategy, job: Job, grid: ParallelGrid, seqs: int) -> Breakdown:
    """The GRPO training breakdown `b` with the reward model: its weights in every phase, and its scoring phase over
    `seqs` sequences, named as the peak when it is the highest; `b` itself without one."""
    if not job.grpo.reward_model:
        return b
    share = reward_share(strategy, job, grid, seqs)
    w = share.weights_bytes
    terms = list(b.terms)
    at = next((i + 1 for i, t in enumerate(terms) if t.name == "optimizer + master"), len(terms))
    terms[at:at] = [Term("reward model", w, share.weights_source),
                    Term(REWARD_PHASE, share.forward_bytes, share.forward_source)]
    peak, required = b.peak_bytes + w, b.required_bytes + w
    held = b.between_steps_bytes + w  # scoring follows generation, before the step makes its gradients
    scoring = held + b.workspace_bytes + share.forward_bytes
    phases = [(name, bytes_ + w) for name, bytes_ in b.phase_peaks]
    at = next((i + 1 for i, (name, _) in enumerate(phases) if name == REFERENCE_SCORING_PHASE), 0)
    phases[at:at] = [(REWARD_PHASE, scoring)]  # TRL scores with the reference first (_generate_and_score_completions)
    out = replace(b, peak_bytes=peak, required_bytes=required, reward_bytes=w, terms=tuple(terms),
                  phase_peaks=tuple(phases))
    if scoring <= peak:
        return out
    margin = reserved_bytes(scoring) - scoring
    return replace(out, peak_bytes=scoring, peak_phase=REWARD_PHASE, transient_bytes=share.forward_bytes,
                   margin_bytes=margin, required_bytes=scoring + b.context_bytes + margin)


def reward_step_s(strategy: Strategy, job: Job, hw, grid: ParallelGrid, s_per_flop: float) -> tuple[float, str]:
    """The reward model's share of a GRPO step and its words: its scoring forward over the step's completions
    (prompt + completion tokens, the policy's) at the policy's rate, `s_per_flop` (the policy step's compute seconds
    per FLOP a token), plus, under ZeRO-3, one all-gather of its shards per generation (one a step)."""
    from toolkit.estimate.collectives import group_bandwidth, ring_s
    from toolkit.estimate.preference import forward_flops

    rm = reward_model_of(job.grpo.reward_model)
    flops = forward_flops(rm.spec, job.grpo.seq_len, head_matmul_params=rm.spec.hidden)
    forward_s = s_per_flop * flops
    gather_s = 0.0
    if strategy.engine == Engine.DEEPSPEED and strategy.zero_stage == 3 and grid.shard_group > 1:
        gather_s = ring_s(rm.params * _bytes_per_param(strategy, job, rm), grid.shard_group,
                          group_bandwidth(hw, grid.shard_group), 1)
    words = (f"GRPO reward model {rm.name}: one no_grad forward over the step's completions, {flops / 1e9:.2f} GFLOP "
             f"a token at the policy's rate per FLOP = {forward_s:.3f} s"
             + (f", plus one all-gather of its ZeRO-3 shards {gather_s:.3f} s" if gather_s else ""))
    return forward_s + gather_s, words

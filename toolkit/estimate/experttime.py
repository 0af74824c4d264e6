"""Step-time terms of expert parallelism as transformers 5.24 runs it (DistributedConfig ep_size; docs/ENGINE_FACTS.md,
"What an expert-parallel step runs"): the routed experts' grouped GEMMs over the rows a rank's experts receive,
the token exchange of every MoE layer (all-to-all, or the masked route's all-reduce), and FSDP2's collectives over
the dense and the expert shard groups. Balanced routing throughout: every expert gets tokens x top_k / experts rows;
the busiest rank's share is a stated assumption (toolkit.estimate.expertrows.EP_WORST_RANK_SHARE, --explain).
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.estimate.collectives import all_to_all_s, group_bandwidth, recompute_factor, ring_s
from toolkit.estimate.efficiency import ComputeModel, Recompute, matmul_efficiency
from toolkit.inputs.choices import compute_bytes
from toolkit.inputs.grid import ParallelGrid
from toolkit.inputs.hardware import Hardware
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import ModelSpec
from toolkit.estimate.expertrows import EP_WORST_RANK_SHARE
from toolkit.inputs.moe import ep_token_exchange, expert_params, moe_layer_count

EP_ALL_TO_ALLS_PER_LAYER = 4
"""Token exchanges of one MoE layer under expert parallelism: dispatch and combine in forward, their gradients in
backward (transformers 5.24 distributed/expert_parallel.py AllToAllEP: all_to_all_single_autograd twice a forward,
each differentiated by another all-to-all)."""
EP_ALL_REDUCES_PER_LAYER = 2
"""The masked route (AllReduceEP, ep_router + moe_tp_experts): an all-reduce of the experts' summed output in
forward (_AllReduceForward) and one of the input gradients in backward (_AllReduceBackward)."""
GROUPED_MM_EFFICIENCY_BAND = (0.5, 1.0)
"""Unverified: torch's grouped_mm (transformers' default experts_implementation on CUDA, integrations/moe.py
grouped_mm_experts_forward) is priced as one dense GEMM with rows-per-expert tokens and the model's hidden size
(toolkit.estimate.efficiency.matmul_efficiency); no published grouped_mm rate backs it, so its speed is stated with
this band of that efficiency (half of it to all of it)."""


@dataclass(frozen=True)
class ExpertCompute:
    """One rank's expert-parallel compute for a step."""
    dense_s: float
    """Everything outside the routed experts over the tokens the rank computes (the whole shared batch when the
    expert group shares one)."""
    experts_s: float
    """The rank's grouped expert GEMMs over the rows its experts receive."""
    rows_per_expert: float
    """Rows one local expert multiplies per micro-step (balanced routing): the grouped GEMM's M."""
    efficiency: float
    """The grouped GEMMs' fraction of peak (assumed: GROUPED_MM_EFFICIENCY_BAND)."""

    @property
    def seconds(self) -> float:
        return self.dense_s + self.experts_s


def expert_flops_per_token(spec: ModelSpec, recompute: Recompute) -> float:
    """Training FLOPs of the routed experts per token: each token's top_k experts forward (2 per weight), backward
    (4) and the recomputed share of the forward."""
    if not spec.moe_experts:
        return 0.0
    active = expert_params(spec) * spec.moe_top_k / spec.moe_experts
    return 2 * active * (3 + recompute.matmul)


def tokens_per_rank(job: Job, grid: ParallelGrid) -> int:
    """Tokens of one micro-step each rank's dense modules compute: the rank's own sample(s), which the whole
    expert group computes alike when it shares one batch."""
    return job.micro_batch * job.seq_len // grid.seq_split


def expert_rows_per_rank(spec: ModelSpec, job: Job, grid: ParallelGrid) -> float:
    """Rows a rank's experts multiply per micro-step at balanced routing: tokens x top_k, a rank receiving as many
    routed rows as it sends when every rank has its own batch, and 1 / ep of the shared batch's when the group
    shares it (the masked route skips the other ranks' rows: grouped_mm_experts_forward's sentinel rows)."""
    return tokens_per_rank(job, grid) * spec.moe_top_k / grid.batch_sharers


def expert_compute(spec: ModelSpec, job: Job, grid: ParallelGrid, hw: Hardware, *, per_token_s: float,
                   recompute: Recompute, compute_model: ComputeModel) -> ExpertCompute:
    """Split one rank's compute into the dense part (at the step's own efficiency, `per_token_s` the whole model's
    seconds per token) and the experts' grouped GEMMs at the efficiency of their rows per expert."""
    tokens = tokens_per_rank(job, grid) * job.grad_accum
    peak = hw.gpu.peak_tflops(job.precision) * 1e12 or hw.gpu.fp32_tflops * 1e12
    dense_eff, _ = matmul_efficiency(hw.gpu, job.precision, job.tokens_per_micro_batch, spec.hidden, compute_model)
    expert_flops = expert_flops_per_token(spec, recompute)
    rows = expert_rows_per_rank(spec, job, grid) / (spec.moe_experts // grid.expert)
    eff, _ = matmul_efficiency(hw.gpu, job.precision, max(1, round(rows)), spec.hidden, compute_model)
    dense_s = tokens * max(0.0, per_token_s - expert_flops / (peak * dense_eff))
    experts_s = tokens * expert_flops / grid.batch_sharers / (peak * eff)
    return ExpertCompute(dense_s=dense_s, experts_s=experts_s, rows_per_expert=rows, efficiency=eff)


def expert_exchange_s(spec: ModelSpec, job: Job, grid: ParallelGrid, hw: Hardware) -> float:
    """Blocking token exchanges of expert parallelism per step, over the expert group (consecutive ranks, the
    innermost mesh dimension: the node's link while ep fits in a node, the node's network once it spans nodes,
    collectives.group_bandwidth), forward and backward, checkpointed layers exchanging again in recompute:

    - every rank its own batch (AllToAllEP): EP_ALL_TO_ALLS_PER_LAYER all-to-alls of tokens x top_k x hidden;
    - a shared batch through AllToAllEP: each rank dispatches its 1 / ep slice of the batch (the same four
      all-to-alls of tokens / ep x top_k rows), then an all-gather brings the slices back (forward), and the
      slicing's backward all-gathers the row gradients;
    - a shared batch through the masked route (AllReduceEP): EP_ALL_REDUCES_PER_LAYER all-reduces of tokens x
      hidden."""
    if grid.expert <= 1:
        return 0.0
    pb = compute_bytes(job.precision)
    tokens = tokens_per_rank(job, grid)
    bw = group_bandwidth(hw, grid.expert, grid.mesh_stride("ep"))
    if ep_token_exchange(spec, grid.expert_shared_batch) == "all_reduce":
        per = EP_ALL_REDUCES_PER_LAYER * ring_s(tokens * spec.hidden * pb, grid.expert, bw, 2)
    else:
        sent = tokens / grid.batch_sharers * spec.moe_top_k * spec.hidden * pb
        per = EP_ALL_TO_ALLS_PER_LAYER * all_to_all_s(sent, grid.expert, bw)
        if grid.expert_shared_batch:
            per += 2 * ring_s(tokens * spec.hidden * pb, grid.expert, bw, 1)
    return job.grad_accum * moe_layer_count(spec) * per * recompute_factor(job)


def expert_parallel_fsdp_comm_s(spec: ModelSpec, grid: ParallelGrid, hw: Hardware, pb: int, gathers: int) -> float:
    """One micro-step's FSDP2 collectives under expert parallelism: the dense parameters gathered (and their
    gradients reduce-scattered) over the shard group, each rank's experts / ep experts over efsdp only. Nothing when
    the shard group is one rank (transformers applies no fsdp_plan at fsdp_size 1)."""
    experts = expert_params(spec)
    dense = spec.params - experts
    dp = grid.shard_group
    # Each group on the link its members span in transformers' meshes (ParallelGrid.mesh_stride): on a shared batch
    # (tp = ep, innermost) an fsdp group's members are ep ranks apart; efsdp groups are ep ranks apart always.
    dense_s = (gathers + 1) * ring_s(dense * pb, dp, group_bandwidth(hw, dp, grid.mesh_stride("fsdp")), 1)
    efsdp = grid.expert_shard_group
    expert_s = (gathers + 1) * ring_s(experts / grid.expert * pb, efsdp,
                                      group_bandwidth(hw, efsdp, grid.mesh_stride("efsdp")), 1)
    return dense_s + expert_s


def autoep_zero_comm_s(spec: ModelSpec, grid: ParallelGrid, hw: Hardware, pb: int, stage: int, accum: int) -> float:
    """DeepSpeed AutoEP's ZeRO collectives a step (the ZeRO terms of toolkit.estimate.timing, per parameter group):
    the dense parameters' over the world, the rank's experts / ep over the expert-data-parallel group (world / ep
    ranks holding the same experts, every ep-th rank: ParallelGrid.mesh_stride, collectives.group_bandwidth). ZeRO-1/2: the gradients reduced (ZeRO-2
    every micro-step, ZeRO-1 once a step) and the updated weights all-gathered; ZeRO-3: every micro-step an all-gather
    in forward, another in backward and a reduce-scatter of the gradients, each over its own group."""
    experts = expert_params(spec)
    dp, edp = grid.shard_group, grid.shard_group // grid.expert
    passes = 3 * accum if stage == 3 else (accum if stage == 2 else 1) + 1
    dense_bw = group_bandwidth(hw, dp, grid.mesh_stride("fsdp"))
    expert_bw = group_bandwidth(hw, edp, grid.mesh_stride("efsdp"))
    dense_s = passes * ring_s((spec.params - experts) * pb, dp, dense_bw, 1)
    expert_s = passes * ring_s(experts / grid.expert * pb, edp, expert_bw, 1)
    return dense_s + expert_s


def expert_assumptions(spec: ModelSpec, job: Job, grid: ParallelGrid, hw: Hardware, part: ExpertCompute,
                       exchange_s: float) -> list[str]:
    """What the expert-parallel terms assumed, for the step's assumptions (--explain)."""
    route = ep_token_exchange(spec, grid.expert_shared_batch)
    bw = group_bandwidth(hw, grid.expert, grid.mesh_stride("ep"))
    link = f"{'node' if grid.expert <= hw.gpus_per_node else 'inter-node'} link at {bw:g} GB/s"
    batch = (f"the {grid.expert} ranks share one batch of {tokens_per_rank(job, grid):,} tokens (dense modules "
             f"computed whole on each, {part.dense_s:.3f} s)" if grid.expert_shared_batch
             else f"every rank its own {tokens_per_rank(job, grid):,} tokens (dense {part.dense_s:.3f} s)")
    said = [f"expert parallel {grid.expert}: {batch}; experts' grouped GEMMs over "
            f"{part.rows_per_expert:,.0f} rows per local expert at efficiency {part.efficiency:.2f} "
            f"({part.experts_s:.3f} s; *unverified: grouped_mm priced as a dense GEMM of that many rows, band "
            f"x{GROUPED_MM_EFFICIENCY_BAND[0]:g}-x{GROUPED_MM_EFFICIENCY_BAND[1]:g} of it); routing imbalance: "
            f"priced at balanced routing, the busiest rank at {EP_WORST_RANK_SHARE:g}x the mean rows (assumed; the "
            f"all-to-all is dropless) adds {(EP_WORST_RANK_SHARE - 1) * part.experts_s:.3f} s that every rank waits "
            "for at the combine"]
    if route == "all_reduce":
        said.append(f"expert parallel {grid.expert}: masked route, {EP_ALL_REDUCES_PER_LAYER} blocking all-reduces "
                    f"per MoE layer of tokens x hidden on the {link} ({exchange_s:.3f} s/step)")
    else:
        said.append(f"expert parallel {grid.expert}: {EP_ALL_TO_ALLS_PER_LAYER} blocking all-to-alls per MoE layer "
                    f"(dispatch + combine, forward and backward) of tokens x top-{spec.moe_top_k} x hidden"
                    f"{' (1 / ep of the shared batch each, plus its all-gathers)' if grid.expert_shared_batch else ''}"
                    f" on the {link}, balanced routing ({exchange_s:.3f} s/step); one host sync per MoE layer "
                    "(split sizes read back) not priced")
    said.append("*expert-parallel speed unverified: of the published expert-parallel steps (TRL PR#6869, "
                "benchmarks/results/moe_ep.md) the one-node row is within 35% on the route it ran, the 8-node row "
                "about 3x slower than this model")
    return said

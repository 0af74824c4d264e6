"""Seconds of one collective over a group of ranks, and which link it runs on: the bandwidth terms the step-time
model (toolkit.estimate.timing) and its expert-parallel terms (toolkit.estimate.experttime) share."""

from __future__ import annotations

from toolkit.inputs.hardware import Hardware
from toolkit.inputs.job import Job


def ring_s(bytes_: float, n: int, gbps: float, factor: float) -> float:
    """A ring collective over `n` ranks moving (n - 1) / n of `bytes_` per pass, `factor` passes (all-reduce 2,
    all-gather / reduce-scatter 1)."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    return factor * (n - 1) / n * bytes_ / (gbps * 1e9)


def group_bandwidth(hw: Hardware, group: int, stride: int = 1) -> float:
    """Bus bandwidth of a collective over one group of a mesh dimension: `group` ranks, `stride` ranks apart (the
    dimension's place in a row-major mesh: 1 innermost; ParallelGrid.mesh_stride). NVLink while the group stays in
    a node. Once it leaves the node, every group of the dimension runs its collective at the same time, and the
    node's network (Hardware.inter_node_gbps, per node) is shared by the groups that cross it: a node holds
    min(group, gpus_per_node / stride) members of each (one ring enters and leaves the node once), so each group
    gets that share of gpus_per_node. Consecutive ranks filling whole nodes get the whole network; pairs 32 ranks
    apart, one member a node, an eighth of an 8-GPU node's."""
    if (group - 1) * stride < hw.gpus_per_node:
        return hw.gpu.intra_node_gbps
    per_node = max(1, min(group, hw.gpus_per_node // stride))
    return min(hw.gpu.intra_node_gbps, hw.inter_node_gbps * per_node / hw.gpus_per_node)


def all_to_all_s(bytes_per_rank: float, n: int, gbps: float) -> float:
    """An all-to-all where each rank sends (n - 1) / n of its bytes."""
    if n <= 1 or bytes_per_rank <= 0:
        return 0.0
    return (n - 1) / n * bytes_per_rank / (gbps * 1e9)


def recompute_factor(job: Job) -> float:
    """Forward collectives run again when a checkpointed layer recomputes: half of each layer's collectives."""
    return 1.5 if job.checkpointing else 1.0

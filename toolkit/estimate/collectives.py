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


def group_bandwidth(hw: Hardware, group: int) -> float:
    """Bus bandwidth of a collective over `group` ranks: NVLink inside a node; the node's network once the
    group spans nodes (hierarchical rings leave each node once per ring)."""
    if group <= hw.gpus_per_node:
        return hw.gpu.intra_node_gbps
    return min(hw.gpu.intra_node_gbps, hw.inter_node_gbps)


def all_to_all_s(bytes_per_rank: float, n: int, gbps: float) -> float:
    """An all-to-all where each rank sends (n - 1) / n of its bytes."""
    if n <= 1 or bytes_per_rank <= 0:
        return 0.0
    return (n - 1) / n * bytes_per_rank / (gbps * 1e9)


def recompute_factor(job: Job) -> float:
    """Forward collectives run again when a checkpointed layer recomputes: half of each layer's collectives."""
    return 1.5 if job.checkpointing else 1.0

"""ZeRO-1/2's gradient partition per rank, as DeepSpeed sizes it from the parameters' order and sizes.

DeepSpeed 0.19.8 runtime/zero/stage_1_and_2.py lays each optimizer param group's parameters end to end in one flat
buffer, padded to a multiple of 2 x world elements (`nccl_start_alignment_factor` = 2; no padding between
parameters while `parameter_alignment` is off, its default), and cuts it into `world` equal partitions
(`partition_size`). A rank's partition of the fp32 master, the optimizer states and the step's fp32 gradient are
exactly `partition_size` elements. Its low-precision gradient partition is not: `get_partition_info` puts in
`params_in_partition` every parameter with any element in the rank's range, and `copy_grads_in_partition` sizes
`grads_in_partition` as the sum of their whole numels over every group, because a gradient is copied whole, never
cut at a partition border. So the rank whose range a large tensor (the LM head, the embedding) touches holds that
tensor's whole gradient beside its share: up to about two largest tensors above P/N.

Pure arithmetic over counts (ModelSpec.param_numels and param_kinds); nothing here imports torch.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

from toolkit.inputs.modelspec import PARAM_EXPERT, PARAM_NO_DECAY, PARAM_VISION

NCCL_START_ALIGNMENT = 2
"""stage_1_and_2.py `nccl_start_alignment_factor`: the flat buffer is padded to a multiple of this x world."""


def partition_size(numels: Sequence[int], world: int) -> int:
    """Elements of each rank's partition of one param group (stage_1_and_2.py: the flat buffer aligned to
    2 x world elements by align_dense_tensors, then `len(flat) // world`)."""
    alignment = NCCL_START_ALIGNMENT * world
    return math.ceil(sum(numels) / alignment) * alignment // world


def partition_tensors(numels: Sequence[int], world: int) -> list[range]:
    """For one param group, the indices of the tensors each rank's `params_in_partition` holds: every parameter
    whose range meets the rank's partition (stage_1_and_2.py get_partition_info: starting inside it, or straddling
    its first element)."""
    if not numels:
        return [range(0)] * world
    size = partition_size(numels, world)
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    out = []
    for rank in range(world):
        lo, hi = rank * size, (rank + 1) * size
        first = bisect.bisect_left(starts, lo, hi=len(numels))  # first parameter starting at or after lo
        last = bisect.bisect_left(starts, hi, hi=len(numels))  # first parameter starting at or after hi
        if first > 0 and starts[first - 1] < lo < starts[first]:  # the one straddling the partition's start
            first -= 1
        out.append(range(first, last))
    return out


def gradient_elements_per_rank(numels: Sequence[int], world: int) -> list[int]:
    """For one param group, each rank's whole-parameter gradient elements (partition_tensors' numels summed)."""
    if not numels:
        return [0] * world
    return [sum(numels[i] for i in held) for held in partition_tensors(numels, world)]


def worst_gradient_partition(groups: Sequence[Sequence[int]], world: int) -> int:
    """The largest `grads_in_partition` (elements) over the ranks: each rank's whole-parameter gradients summed
    over the groups (copy_grads_in_partition counts every group's params_in_partition into one buffer)."""
    per_rank = [0] * world
    for group in groups:
        for rank, n in enumerate(gradient_elements_per_rank(group, world)):
            per_rank[rank] += n
    return max(per_rank) if per_rank else 0


def route_groups(tensors: Sequence[tuple[int, int]]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The param groups ZeRO flattens, in order, on each route a plan runs by, from (numel, kind) in the model's
    order: the HF Trainer's optimizer (toolkit.train, a user's Trainer script: Trainer.create_optimizer, the decay
    parameters, then the rest, each in the model's order), and one group of every trainable parameter in the
    model's order (an "optimizer" block in the DeepSpeed JSON: transformers' DummyOptim, DeepSpeed's launcher)."""
    return tuple(tuple(tuple(tensors[i][0] for i in group) for group in route)
                 for route in _route_indices([k for _, k in tensors]))


def _route_indices(kinds: Sequence[int]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """route_groups as indices into `kinds`."""
    decay = tuple(i for i, k in enumerate(kinds) if not k & PARAM_NO_DECAY)
    return (decay, tuple(i for i, k in enumerate(kinds) if k & PARAM_NO_DECAY)), (tuple(range(len(kinds))),)


def backward_regions(spec: Any) -> tuple[int, ...] | None:
    """Each tensor of `spec.param_numels`, the memory model's region it belongs to counted back from the head's
    (0: final norm and head, 1: the last decoder layer, ..., layers + 1: the embedding), the order backward reduces
    their gradients in; None where the tensors do not add up region by region in the model's order."""
    bounds, total = [], 0
    for n in (spec.pre_layer_params, *spec.layer_params, spec.post_layer_params):
        total += n
        bounds.append(total)
    out, seen = [], 0
    for n in spec.param_numels:
        seen += n
        out.append(len(bounds) - 1 - bisect.bisect_left(bounds, seen))
    return tuple(out) if total == seen and min(out, default=0) >= 0 else None


def rank_gradient_partitions(spec: Any, params: int, world: int, *, expert: int = 1) -> list[tuple[int, int]] | None:
    """Each rank's ZeRO-2 gradient partition for `params` trainable parameters of `spec` over `world` ranks:
    (elements, the backward region whose reduction first copies one of its tensors in, which allocates it:
    copy_grads_in_partition; see backward_regions), on the route grouping whose worst rank holds the most
    (route_groups). None where the spec's tensors do not add up to `params` (a spec rescaled from --params, a
    tensor-parallel rank's, one cached before the tensors were recorded, adapters): the caller keeps P/N there.
    `params` may leave out a frozen vision tower. `expert` > 1 (DeepSpeed AutoEP): the dense tensors over `world`
    ranks plus the rank's local experts (each expert tensor / `expert`) over its expert-data-parallel group of
    world / expert ranks, in which rank r is r // expert (deepspeed/utils/groups.py _get_expert_parallel_ranks: the
    expert-parallel groups are consecutive ranks, the expert-data-parallel ones strided by `expert`)."""
    numels, kinds = getattr(spec, "param_numels", ()), getattr(spec, "param_kinds", ())
    if not numels or len(numels) != len(kinds):
        return None
    regions = backward_regions(spec) or (0,) * len(numels)  # unknown: allocated at the head's, the earliest
    for frozen in (0, PARAM_VISION):
        trained = [(n, k, r) for n, k, r in zip(numels, kinds, regions) if not k & frozen]
        if sum(n for n, *_ in trained) == params:
            break
    else:
        return None
    dense = [t for t in trained if not (expert > 1 and t[1] & PARAM_EXPERT)]
    local = [(n // expert, k, r) for n, k, r in trained if expert > 1 and k & PARAM_EXPERT]
    edp = max(world // expert, 1)

    def held(tensors: list, route: tuple, ranks: int) -> list[list[tuple[int, int]]]:  # each rank's (numel, region)
        out: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
        for group in route:
            for rank, indices in enumerate(partition_tensors([tensors[i][0] for i in group], ranks)):
                out[rank] += [(tensors[group[i]][0], tensors[group[i]][2]) for i in indices]
        return out

    mine = held(local, (tuple(range(len(local))),), edp)
    best: list[tuple[int, int]] = []
    for route in _route_indices([k for _, k, _ in dense]):
        ranks = [d + mine[r // expert] if expert > 1 else d for r, d in enumerate(held(dense, route, world))]
        each = [(sum(n for n, _ in t), min((r for _, r in t), default=0)) for t in ranks]
        if not best or max(each)[0] > max(best)[0]:
            best = each
    return best


def zero_gradient_partition(spec: Any, params: int, world: int, *, expert: int = 1,
                            rank: int | None = None) -> tuple[int, int] | None:
    """(elements, the backward region whose reduction allocates it) of `rank`'s ZeRO-2 gradient partition
    (rank_gradient_partitions); rank None: the worst rank's elements, allocated at the head's region (the earliest:
    what the plan prices, an upper bound over the ranks). None where rank_gradient_partitions is."""
    each = rank_gradient_partitions(spec, params, world, expert=expert)
    if each is None:
        return None
    return each[rank] if rank is not None else (max(n for n, _ in each), 0)

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


def gradient_elements_per_rank(numels: Sequence[int], world: int) -> list[int]:
    """For one param group, each rank's whole-parameter gradient elements: the numels of every parameter whose
    range meets the rank's partition (stage_1_and_2.py get_partition_info: starting inside it, or straddling its
    first element)."""
    if not numels:
        return [0] * world
    size = partition_size(numels, world)
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    out = []
    for rank in range(world):
        lo, hi = rank * size, (rank + 1) * size
        first = bisect.bisect_left(starts, lo, hi=len(numels))  # first parameter starting at or after lo
        last = bisect.bisect_left(starts, hi, hi=len(numels))  # first parameter starting at or after hi
        total = starts[last] - starts[first]
        if first > 0 and starts[first - 1] < lo < starts[first]:  # the one straddling the partition's start
            total += numels[first - 1]
        out.append(total)
    return out


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
    decay = tuple(n for n, k in tensors if not k & PARAM_NO_DECAY)
    return (decay, tuple(n for n, k in tensors if k & PARAM_NO_DECAY)), (tuple(n for n, _ in tensors),)


def zero_gradient_partition(spec: Any, params: int, world: int, *, expert: int = 1) -> int | None:
    """The worst rank's ZeRO-2 gradient partition (elements) for `params` trainable parameters of `spec` over
    `world` ranks: the larger of the two routes' groupings (route_groups). None where the spec's tensors do not add
    up to `params` (a spec rescaled from --params, a tensor-parallel rank's, one cached before the tensors were
    recorded, adapters): the caller keeps P/N there. `params` may leave out a frozen vision tower. `expert` > 1
    (DeepSpeed AutoEP): the dense tensors over `world` ranks plus the rank's local experts (each expert tensor /
    `expert`) over world / expert, each group's worst rank added (an upper bound: which dense rank shares an
    expert group is not modelled)."""
    numels, kinds = getattr(spec, "param_numels", ()), getattr(spec, "param_kinds", ())
    if not numels or len(numels) != len(kinds):
        return None
    for frozen in (0, PARAM_VISION):
        trained = [(n, k) for n, k in zip(numels, kinds) if not k & frozen]
        if sum(n for n, _ in trained) == params:
            break
    else:
        return None
    dense = [(n, k) for n, k in trained if not (expert > 1 and k & PARAM_EXPERT)]
    worst = max(worst_gradient_partition(groups, world) for groups in route_groups(dense))
    if expert > 1:
        local = tuple(n // expert for n, k in trained if k & PARAM_EXPERT)
        worst += worst_gradient_partition((local,), max(world // expert, 1))
    return worst

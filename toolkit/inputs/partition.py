"""Which decoder layers each pipeline stage runs: pure functions the planner and the runner share.

The rule for an acceptable stage count: every stage gets at least one decoder layer (1 <= stages <= layers) and the
stage count divides the world size (the rest of the grid is data parallel). The split itself need not be even:
`balanced_partition` minimises the slowest stage, and the first and last stages also carry the embeddings and the
final norm + LM head + loss, so an uneven split is often the balanced one.
"""

from __future__ import annotations

from toolkit.errors import UserError, options_text

def balanced_partition(layer_costs: list[float], stages: int, *, first_extra: float = 0.0,
                       last_extra: float = 0.0) -> list[int]:
    """Decoder-layer boundaries [0, ..., len(layer_costs)] (len stages + 1) minimising the costliest stage.

    Stage s runs layers [b[s], b[s+1]); stage 0 also pays `first_extra` (embeddings), the last stage `last_extra`
    (final norm, head, loss). Every stage gets at least one layer. Exact dynamic programme, O(stages x layers^2);
    among equally slow splits the one with the smaller sum of squared stage costs wins (smoother, fewer idle ranks).
    """
    n = len(layer_costs)
    check_stage_count(n, stages)
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def stage_cost(s: int, a: int, b: int) -> float:
        return (prefix[b] - prefix[a] + (first_extra if s == 0 else 0.0)
                + (last_extra if s == stages - 1 else 0.0))

    # best[s][i]: (max cost, sum of squares) for layers [0, i) on stages 0..s; back[s][i]: where stage s starts.
    # Ties keep the smallest start (the first met), so the split is deterministic.
    best: list[dict[int, tuple[float, float]]] = [{} for _ in range(stages)]
    back: list[dict[int, int]] = [{} for _ in range(stages)]
    for i in range(1, n - stages + 2):
        c = stage_cost(0, 0, i)
        best[0][i] = (c, c * c)
    for s in range(1, stages):
        previous = sorted(best[s - 1].items())
        for i in range(s + 1, n - (stages - 1 - s) + 1):
            chosen, start = None, 0
            for j, (worst, squares) in previous:
                if j >= i:
                    break
                c = stage_cost(s, j, i)
                option = (worst if worst > c else c, squares + c * c)
                if chosen is None or option < chosen:
                    chosen, start = option, j
            best[s][i], back[s][i] = chosen, start
    bounds = [n]
    for s in range(stages - 1, 0, -1):
        bounds.append(back[s][bounds[-1]])
    return [0] + bounds[::-1]


def stage_counts(num_layers: int, world: int | None = None) -> list[int]:
    """Stage counts that give every stage a decoder layer and (when `world` is given) divide the world size."""
    limit = num_layers if world is None else min(num_layers, world)
    return [s for s in range(1, limit + 1) if world is None or world % s == 0]


def check_stage_count(num_layers: int, stages: int, world: int | None = None) -> None:
    """Raise a UserError naming the stage counts that work when `stages` does not."""
    ok = stages in stage_counts(num_layers, world) if stages >= 1 else False
    if ok:
        return
    options = [s for s in stage_counts(num_layers, world) if s > 1] or [1]
    shown = options_text(options, limit=12)
    if stages < 1 or stages > num_layers:
        raise UserError(f"model has {num_layers} layers; --pipeline-stages {stages} cannot give each stage a "
                        f"decoder layer (try {shown})")
    raise UserError(f"--pipeline-stages {stages} does not divide {world} processes into whole data-parallel "
                    f"replicas (try {shown})")


def check_partition(boundaries: list[int], num_layers: int, stages: int) -> None:
    """A plan's partition must run 0..num_layers in increasing steps, one range per stage."""
    if (len(boundaries) != stages + 1 or boundaries[0] != 0 or boundaries[-1] != num_layers
            or any(b <= a for a, b in zip(boundaries, boundaries[1:]))):
        raise UserError(f"plan partition {boundaries} does not split {num_layers} layers into {stages} non-empty "
                        f"stages; re-plan (e.g. {balanced_partition([1.0] * num_layers, stages)})")

"""The planner's best candidate per row slot ("zero3", "fsdp2 x tp +tiled", ...), kept as the search costs them,
with the configurations it refused on a lower bound and has not costed in full.

A slot's best is the first of its candidates by `better`: the fastest that fits (then the most headroom), or, when
none fits, the one that needs the fewest bytes (its reason explains the row). A configuration short of GPU memory
before its allocator replay (toolkit.estimate.reserved.replays_left_out: the replay only adds bytes) cannot fit, so
it can only be a slot's best when nothing in the slot fits; `Deferred` holds it uncosted, and `settled` costs it in
full only there. The result is the one costing every configuration in full gives, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from toolkit.estimate.candidate import Candidate
from toolkit.estimate.ranking import need_bytes


@dataclass(frozen=True)
class Deferred:
    """A configuration refused for GPU memory on its lower bound (`lower`: costed without the allocator replays)."""

    lower: Candidate
    cost: Callable[[], Candidate]
    """Costs it in full (toolkit.estimate.search.evaluate)."""


def better(a: Candidate, b: Candidate | None) -> bool:
    if b is None:
        return True
    if a.feasible != b.feasible:
        return a.feasible
    if a.feasible:
        ka = (round(a.timing.tokens_per_s, 6), a.memory.headroom_bytes)
        kb = (round(b.timing.tokens_per_s, 6), b.memory.headroom_bytes)
        return ka > kb
    return need_bytes(a) < need_bytes(b)  # the least-infeasible explains best


class Slots:
    """Each slot's best so far (`best`: exact for every slot where a candidate fits; a slot whose every candidate
    was deferred is not in it until `settled`), and each slot's refused candidates in the order they were tried."""

    def __init__(self) -> None:
        self.best: dict[str, Candidate] = {}
        self._refused: dict[str, list[Candidate | Deferred]] = {}
        """Every slot, in the order it was first kept (the order `settled` returns), with its refusals."""

    def keep(self, slot: str, cand: Candidate | Deferred, dimension: str | None) -> None:
        refused = self._refused.setdefault(slot, [])
        if isinstance(cand, Deferred):
            refused.append(replace(cand, cost=_with_dimension(cand.cost, dimension)))
            return
        if dimension:
            cand = replace(cand, dimension=dimension)
        if not cand.feasible:
            refused.append(cand)
        if better(cand, self.best.get(slot)):
            self.best[slot] = cand

    def fits(self, slot: str) -> bool:
        return slot in self.best and self.best[slot].feasible

    def __bool__(self) -> bool:
        return bool(self._refused)

    def settled(self) -> dict[str, Candidate]:
        """Every slot's best, the deferred costed in full where no candidate of their slot fits."""
        out = {}
        for slot, refused in self._refused.items():
            if not self.fits(slot) and any(isinstance(c, Deferred) for c in refused):
                best = None
                for cand in refused:
                    cand = cand.cost() if isinstance(cand, Deferred) else cand
                    if better(cand, best):
                        best = cand
                self.best[slot] = best
            out[slot] = self.best[slot]
        return out


def _with_dimension(cost: Callable[[], Candidate], dimension: str | None) -> Callable[[], Candidate]:
    return (lambda: replace(cost(), dimension=dimension)) if dimension else cost

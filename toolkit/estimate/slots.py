"""The planner's best candidate per row slot ("zero3", "fsdp2 x tp +tiled", ...), kept as the search costs them,
with the configurations it refused on a lower bound and has not costed in full.

A slot's best is the first of its candidates by `better`: the fastest that fits (then the most headroom), or, when
none fits, the one that needs the fewest bytes (its reason explains the row). A configuration short of GPU memory
before its allocator replay (toolkit.estimate.reserved.replays_left_out: the replay only adds bytes) cannot fit, and
one slower than a best that fits cannot replace it; either can only be a slot's best when nothing in the slot fits.
`Deferred` holds it uncosted, and `settled` costs it in full only there. The result is the one costing every
configuration in full gives, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from toolkit.estimate.candidate import Candidate
from toolkit.estimate.ranking import need_bytes


@dataclass(frozen=True)
class Deferred:
    """A configuration that cannot be its slot's best while something in the slot fits (`lower`: costed without the
    allocator replays; its step time is exact)."""

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


def slower(cand: Candidate, best: Candidate | None) -> bool:
    """Whether `cand` is slower than a `best` that fits, so that it cannot replace it (its step time does not depend
    on the allocator replays it was costed without)."""
    return best is not None and best.feasible \
        and round(cand.timing.tokens_per_s, 6) < round(best.timing.tokens_per_s, 6)


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
                for cand in _least_needing(refused):
                    if better(cand, best):
                        best = cand
                self.best[slot] = best
            out[slot] = self.best[slot]
        return out


def _least_needing(refused: list[Candidate | Deferred]) -> list[Candidate]:
    """The refused candidates, in their order, that could need the fewest bytes: the deferred costed in full from the
    lowest bound up until the bound is over the fewest bytes found (a deferred one's full cost is at least its bound,
    so those left cannot need the fewest, nor tie with them)."""
    costed: dict[int, Candidate] = {i: c for i, c in enumerate(refused) if isinstance(c, Candidate)}
    fewest = min((need_bytes(c) for c in costed.values()), default=float("inf"))
    deferred = sorted((i for i, c in enumerate(refused) if isinstance(c, Deferred)),
                      key=lambda i: need_bytes(refused[i].lower))
    for i in deferred:
        if need_bytes(refused[i].lower) > fewest:
            break
        costed[i] = refused[i].cost()
        fewest = min(fewest, need_bytes(costed[i]))
    return [costed[i] for i in sorted(costed)]


def _with_dimension(cost: Callable[[], Candidate], dimension: str | None) -> Callable[[], Candidate]:
    return (lambda: replace(cost(), dimension=dimension)) if dimension else cost

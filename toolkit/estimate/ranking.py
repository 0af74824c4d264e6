"""How the planner orders the candidates it costed, and why #1 is #1.

Feasible candidates come first, by predicted tokens/s. Candidates whose speeds are closer than the step-time error
band of their GPU generation (toolkit.estimate.errorband.time_band) are ties: the model cannot tell them apart, so a
speed difference inside the band never decides for the riskier setup. Where the band is unknown (no published run on
the generation) every feasible candidate is a tie: no difference is a win. Among ties the order is robustness:

1. a plan that can resume from its checkpoints before one that cannot (toolkit.estimate.candidate.resume_problem);
2. memory headroom, in units of the row's own peak error band (errorband.band_for), counted beyond the one band the
   planner already keeps (a row inside it is refused): 0 is at the refusal line, and a row with less than one band
   to spare would run out of memory if the estimate were off by twice its band, so it is the riskier one. Headroom
   counts up to one spare band: past that, more idle memory buys nothing and
3. simplicity decides (no swapped kernels or tiling, no offload, fewer sharded / model-parallel parts, fewer stages);
4. then speed.

A faster candidate beyond the band still wins: only the ties are reordered.
"""

from __future__ import annotations

import math

from toolkit.estimate.candidate import Candidate, headroom_bands, resume_problem
from toolkit.estimate.errorband import TimeBand, time_band

SPARE_BANDS = 1.0
"""Headroom beyond the kept error band, in bands, at which a row counts as safe: below it a row is riskier and more
headroom ranks it higher; at or above it rows are equal on memory and simplicity decides."""


OFFLOAD_ORDER = {"none": 0, "cpu": 1, "nvme": 2}
KIND_ORDER = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3, "hybrid": 5, "pipeline": 5}
"""Moving parts per family: DDP keeps whole copies; ZeRO-1/2 and FSDP2 grad-op shard states; ZeRO-3 / FSDP2 gather
parameters every layer; pipelines add stages, a schedule and point-to-point sends."""


def simplicity(c: Candidate) -> tuple[int, int, int, int]:
    """Smaller is simpler: the model's own code (ALST tiling recomputes the MLPs and LM head through DeepSpeed's
    tiled functions; Liger swaps in Triton kernels) first, then offload (host RAM, PCIe, CPU Adam, NVMe; activation
    offloading's side-stream copies) first, then the family's moving parts (FSDP2's HSDP counts one more than full
    shard; a tensor / context / sequence dimension two more: collectives inside every layer), then pipeline stages
    (processes per model replica)."""
    s, job = c.strategy, c.job
    offload = max(OFFLOAD_ORDER[s.offload_optimizer], OFFLOAD_ORDER[s.offload_params]) * 2 \
        + (s.offload_params != "none") + int(job.activation_offloading)
    parts = KIND_ORDER[s.kind] + (1 if s.kind == "fsdp2" and s.fsdp_mode == "hybrid" else 0) \
        - (1 if s.kind == "fsdp2" and s.fsdp_mode == "grad_op" else 0) + (2 if c.dimension else 0)
    return int(job.tiled) + int(job.liger), offload, parts, c.pipeline_stages


def robustness(c: Candidate) -> tuple:
    """Smaller is more robust (module docstring): resumable, then headroom up to SPARE_BANDS, then simplicity."""
    return resume_problem(c) is not None, -min(headroom_bands(c), SPARE_BANDS), simplicity(c)


def need_bytes(c: Candidate) -> float:
    """How much a refused candidate needs (the least-infeasible explains best)."""
    if c.memory is not None:
        return c.memory.required_bytes
    return float("inf") if c.reason is None else 1e30


def speed_key(c: Candidate):
    if not c.feasible:
        return (1, need_bytes(c))
    return (0, -c.timing.tokens_per_s, -c.memory.headroom_bytes)


def band_of(cands: list[Candidate]) -> TimeBand:
    """The step-time band the candidates are ranked with: their GPU generation's (a plan costs one GPU); unknown
    where no published run is on it, and then every feasible candidate is a tie."""
    return time_band(next((c.gpu for c in cands if c.gpu is not None), None))


def speed_ties(ranked: list[Candidate]) -> list[Candidate]:
    """The feasible candidates whose predicted speed is within the step-time band of the fastest one (all of them
    when the band is unknown)."""
    feasible = [c for c in ranked if c.feasible]
    if not feasible:
        return []
    fastest = max(c.timing.tokens_per_s for c in feasible)
    band = band_of(feasible)
    return [c for c in feasible if c.timing.tokens_per_s >= fastest or band.ties(fastest, c.timing.tokens_per_s)]


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Feasible first by tokens/s, except that candidates inside the step-time band of the fastest are ordered by
    robustness first (module docstring): a difference the model cannot tell apart never decides for the riskier
    setup."""
    ordered = sorted(cands, key=speed_key)
    tied = speed_ties(ordered)
    if len(tied) < 2:
        return ordered
    tied_ids = {id(c) for c in tied}
    rest = [c for c in ordered if id(c) not in tied_ids]
    return sorted(tied, key=lambda c: (robustness(c), speed_key(c))) + rest


def why_first(ranked: list[Candidate]) -> str | None:
    """One line saying why the first feasible candidate of `ranked` (rank's order) is #1, or None when none fits."""
    feasible = [c for c in ranked if c.feasible]
    if not feasible:
        return None
    first, band = feasible[0], band_of(feasible)
    moe = _expert_clause(ranked)
    if len(feasible) == 1:
        return "#1: the only row that fits" + moe
    tied = speed_ties(feasible)
    if len(tied) < 2:
        second = feasible[1]
        return (f"#1: faster than #2 ({second.name}) by {_faster(first, second):.0%}, more than the step-time band "
                f"({band.width()})") + moe
    decided: dict[str, list[int]] = {"resume": [], "headroom": [], "simpler": [], "faster": []}
    for pos, c in enumerate(tied[1:], start=2):
        decided[_decider(first, c)].append(pos)
    inside = (f"within the step-time band ({band.width()}) of" if band.known else
              f"the step-time band is {band.width()}: no predicted speed difference is a win over")
    parts = [f"#1: {inside} {_positions(range(2, len(tied) + 1))}, so robustness decides"]
    if decided["resume"]:
        parts.append(f"it can resume from its checkpoints ({_positions(decided['resume'])} cannot)")
    mine = headroom_bands(first)
    if decided["headroom"]:
        worst = sorted(decided["headroom"], key=lambda p: headroom_bands(tied[p - 1]))[:2]
        others = ", ".join(f"#{p} {tied[p - 1].name}: {_bands(headroom_bands(tied[p - 1]))}" for p in worst)
        parts.append(f"memory headroom {_bands(mine)} beyond the kept error band ({others}; under "
                     f"{SPARE_BANDS:g} band is riskier)")
    elif math.isfinite(mine):
        parts.append(f"memory headroom {_bands(mine)} beyond the kept error band")
    if decided["simpler"]:
        parts.append(f"simpler than {_positions(decided['simpler'])} (untiled / own kernels, no offload, fewer "
                     "sharded or model-parallel parts, fewer stages)")
    if decided["faster"]:
        parts.append(f"as robust as {_positions(decided['faster'])} and faster")
    fastest = max(tied, key=lambda c: c.timing.tokens_per_s)
    if fastest is first:
        parts.append("and the fastest")
    else:
        pos = tied.index(fastest) + 1
        parts.append(f"#{pos} is predicted {_faster(fastest, first):.1%} faster, "
                     + ("inside the band" if band.known else "not a win with the band unknown"))
    return "; ".join(parts) + moe


def _is_expert(c: Candidate) -> bool:
    return c.grid is not None and c.grid.expert > 1


def _expert_clause(ranked: list[Candidate]) -> str:
    """For a mixture of experts whose plan has an expert-parallel row (fsdp2 x ep, feasible or not): why #1 beats
    or loses to ZeRO-3 / FSDP2, which gather every expert of a layer on every rank, against expert parallelism,
    which keeps 1/ep of them per rank and exchanges tokens instead (speed unverified, no resume). "" otherwise."""
    feasible = [c for c in ranked if c.feasible]
    experts = [c for c in feasible if _is_expert(c)]
    if not experts:
        refused = next((c for c in ranked if not c.feasible and c.dimension == "ep"), None)
        if refused is None or not feasible:
            return ""
        return f". Mixture of experts: expert parallelism ({refused.name}) is not an option: {refused.reason}"
    first = feasible[0]
    gathering = [c for c in feasible if not _is_expert(c) and c.dimension is None and c.strategy.kind in
                 ("zero3", "fsdp2") and c.strategy.offload_optimizer == "none" and c.strategy.offload_params == "none"]
    if not gathering:
        gathering = [c for c in feasible if not _is_expert(c)][:1]
    pos = {id(c): i for i, c in enumerate(feasible, start=1)}

    def versus(cs: list[Candidate]) -> str:
        return "#1 is " + ", ".join(f"{_than(first, c)} than #{pos[id(c)]} {c.name}" for c in cs)

    picks = list({c.strategy.kind: c for c in reversed(gathering)}.values())[::-1]  # the best of each family
    gathered = f"ZeRO-3 / FSDP2 gather every expert on every rank each layer: {versus(picks)}"
    if _is_expert(first):
        ep = first.grid.expert
        return (f". Mixture of experts: ep={ep} keeps 1/{ep} of each layer's experts on a rank and sends the tokens "
                f"to them (an all-to-all per MoE layer)" + (f", where {gathered}" if picks else "")
                + "; its speed is unverified (the all-to-all is unmeasured)"
                + (" and it cannot resume from its checkpoints" if resume_problem(first) else ""))
    ep = experts[0]
    why = _than(first, ep)
    if first in speed_ties(feasible) and ep in speed_ties(feasible):
        why += ", inside the step-time band" + {
            "resume": ", and #1 resumes from its checkpoints where ep cannot",
            "headroom": ", and #1 has more memory headroom", "simpler": ", and #1 is simpler (no expert dimension)"
        }.get(_decider(first, ep), "")
    elif first.timing.tokens_per_s >= ep.timing.tokens_per_s:
        why += ", beyond the step-time band"
    own = [c for c in picks if c is not first]
    others = ("; other rows that gather every expert each layer: " if first in picks else
              "; ZeRO-3 / FSDP2 gather every expert on every rank each layer: ")
    return (f". Mixture of experts: against the expert-parallel row #{pos[id(ep)]} {ep.name} (1/{ep.grid.expert} of "
            f"the experts per rank, an all-to-all per MoE layer; speed unverified) #1 is predicted {why}"
            + (others + versus(own) if own else ""))


def _than(a: Candidate, b: Candidate) -> str:
    """How a's predicted speed compares with b's: "22% slower" (1 - a/b), "13% faster" (a/b - 1) or
    "8.3x faster"."""
    ratio = a.timing.tokens_per_s / b.timing.tokens_per_s
    if ratio >= 2:
        return f"{ratio:.1f}x faster"
    return f"{ratio - 1:.0%} faster" if ratio >= 1 else f"{1 - ratio:.0%} slower"


def _decider(first: Candidate, other: Candidate) -> str:
    """Which part of the ranking key put `first` before `other` (both in the tie)."""
    a, b = robustness(first), robustness(other)
    for name, x, y in (("resume", a[0], b[0]), ("headroom", a[1], b[1]), ("simpler", a[2], b[2])):
        if x != y:
            return name
    return "faster"


def _faster(a: Candidate, b: Candidate) -> float:
    return a.timing.tokens_per_s / b.timing.tokens_per_s - 1


def _bands(x: float) -> str:
    if not math.isfinite(x):
        return "unmeasured (no peak error band)"
    shown = f"{x:.2f}" if x < SPARE_BANDS <= round(x, 1) else f"{x:.1f}"  # never "1.0" for a row under one band
    return f"{shown} band{'' if shown == '1.0' else 's'}"


def _positions(positions) -> str:
    """'#2-#4, #6' for positions 2, 3, 4, 6."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return ", ".join(f"#{r[0]}" if len(r) == 1 else f"#{r[0]}-#{r[-1]}" for r in runs)

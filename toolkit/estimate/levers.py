"""`--seq max`'s lever ladder: which long-context lever buys how many tokens (issue 32, Deliver 5).

Starting from the user's job on one strategy, the levers users pull are added one at a time in the order they pull
them (TRL's long-context guide, docs/ENGINE_FACTS.md "Long-context levers"): TRL's chunked NLL loss, RoPE scaling
past the trained positions (YaRN), the checkpointed activations offloaded to the CPU, ALST tiling, then sequence /
context parallelism. Each rung is toolkit.estimate.longest's search (the same traces, cached per octave) on the job
with that lever and every one pulled before it; a lever the job already has, or that the engines (or this planner)
refuse with the levers before it, is a rung that says why in one line and changes nothing. Tiling's rung takes the
chunked loss's place (ALST's tiled logits + loss and TRL's chunked NLL both replace the logits + loss) and swaps
TRL's offload for DeepSpeed's checkpoint offload (toolkit.estimate.savers), which can move less: a rung that would
reach fewer tokens than the one before is not pulled and says so. The split rung keeps the offloading pulled before
it (each context / sequence rank offloads its own tokens' saves).

RoPE scaling changes no memory (toolkit.inputs.rope: the same cos / sin and one inv_freq buffer whatever the
factor), so from the RoPE rung on the search runs on the model as it is with its positions raised an octave at a
time, until memory stops it or the factor reaches MAX_ROPE_FACTOR: the traces stay those of the rungs before, and
no octave past memory is traced (a chunked loss traces one op per chunk: a trace at 16M tokens costs minutes).
transformers' own rules are checked once (toolkit.inputs.rope.scaled_spec), and each rung says the --rope-factor
its length needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from toolkit import bounds
from toolkit.errors import UserError
from toolkit.inputs.choices import GIB, TRL_LOSS

if TYPE_CHECKING:
    from toolkit.estimate.longest import Longest
    from toolkit.estimate.request import Request
    from toolkit.inputs.hardware import Hardware
    from toolkit.inputs.modelspec import ModelSpec

MAX_ROPE_FACTOR = 64
"""The most the RoPE rung scales the positions (TRL's 1M-token Qwen3-8B run needs x25.6): it bounds the search's
cost, since a model that memory never stops would otherwise be traced up to bounds.SEQ (minutes per octave with a
chunked loss)."""
ROPE_TYPE = "yarn"
"""The scaling the RoPE rung applies: YaRN, as TRL's guide and Qwen's long-context recipes scale."""


@dataclass(frozen=True)
class Rung:
    """One lever added to everything above it."""

    lever: str
    """The lever in the user's words ("your job" for the first rung)."""
    flags: str
    """The command-line flags that pull it."""
    found: "Longest | None"
    """The search with it (None: not pulled, `skipped` says why)."""
    skipped: str = ""
    gain: int = 0
    """Tokens it buys over the rung before it that was pulled."""
    rope_factor: int | None = None
    """The --rope-factor its length needs (from the RoPE rung on; 1: none)."""

    @property
    def seq_len(self) -> int:
        return self.found.seq_len if self.found is not None else 0

    def to_dict(self) -> dict[str, Any]:
        c = self.found.candidate if self.found is not None else None
        return {"lever": self.lever, "flags": self.flags, "pulled": self.found is not None,
                "skipped": self.skipped or None, "row": self.found.name if self.found is not None else None,
                "longest_seq": self.seq_len, "gain": self.gain, "rope_factor": self.rope_factor,
                "required_bytes": c.memory.required_bytes if c is not None and self.seq_len else None,
                "reason": self.found.reason if self.found is not None else None}


def lever_ladder(spec: "ModelSpec", hw: "Hardware", req: "Request", strategy: str) -> list[Rung]:
    """The rungs for `strategy` (a name of --strategies), first the user's job as given (no sequence or context
    split unless the user fixed one, tiling only with --tiled)."""
    req = replace(req, strategies=(strategy,), tensor_parallel=req.tensor_parallel or 1,
                  context_parallel=req.context_parallel or 1, sequence_parallel=req.sequence_parallel or 1,
                  tiled=req.tiled is True, savers=False)
    split = max(req.context_parallel, req.sequence_parallel) > 1
    first, _ = _search(spec, hw, req, _rows(spec, hw, req, split), spec.max_positions)
    if first is None:  # no row of the strategy on these GPUs (options_for): nothing to climb from
        return []
    rungs = [Rung("your job", "", first)]
    original, scaled, cap = spec.max_positions, False, spec.max_positions
    for lever, flags, change in _levers(spec, req, split):
        try:
            new_req, had = change(spec, req)
        except UserError as exc:
            rungs.append(Rung(lever, flags, None, skipped=str(exc)))
            continue
        if had:
            rungs.append(Rung(lever, flags, None, skipped=had))
            continue
        if req.loss == TRL_LOSS and new_req.loss != TRL_LOSS:
            flags += " (in place of --loss trl: both replace the logits + loss)"
        wants_split = lever == SPLIT
        rows = _rows(spec, hw, new_req, wants_split)
        refused = _refused(hw, new_req, rows)
        if refused:
            rungs.append(Rung(lever, flags, None, skipped=refused))
            continue
        # Each lever only saves memory, so a rung reaches at least the rung before: with RoPE scaled its climb
        # starts at the positions the rung before ended at instead of the model's own.
        found, searched_to = _search(spec, hw, new_req, rows, cap, scaled=scaled or lever == ROPE)
        if found is None:
            rungs.append(Rung(lever, flags, None, skipped=f"no row of {strategy} on these GPUs runs it"))
            continue
        before = next(r for r in reversed(rungs) if r.found is not None)
        if found.seq_len < before.seq_len:  # tiling swaps TRL's offload for DeepSpeed's, which may move less
            rungs.append(Rung(lever, flags, None, skipped=(
                f"reaches {found.seq_len:,} tokens, fewer than the {before.lever} rung's {before.seq_len:,}"
                + ("; with --tiled the offload is DeepSpeed's checkpoint offload, which moves only the checkpointed "
                   "layers' inputs (nothing without checkpointing)" if lever == TILED and req.activation_offloading
                   else ""))))
            continue
        req, scaled = new_req, scaled or lever == ROPE
        cap = searched_to
        if wants_split and found.candidate is not None and found.candidate.grid is not None:
            grid = found.candidate.grid
            flags = (f"--sequence-parallel {grid.sequence}" if grid.sequence > 1 else
                     f"--context-parallel {grid.context}")
        rung = Rung(lever, flags, found, gain=found.seq_len - before.seq_len)
        if scaled:
            factor = max(1, math.ceil(found.seq_len / original))
            rung = replace(rung, rope_factor=factor, flags=f"{flags} --rope-factor {factor}" if lever == ROPE and
                           factor > 1 else flags + (" (not needed yet)" if lever == ROPE else ""))
        rungs.append(rung)
    return rungs


CHUNKED, ROPE, OFFLOAD, TILED, SPLIT = ("chunked NLL loss", "RoPE scaling", "activation offloading", "ALST tiling",
                                        "sequence / context parallelism")


def _levers(spec, req, split: bool):
    """(lever, flags, change): change(spec, req) -> (req with the lever, why it is already in the job or ""); a
    UserError: the engines refuse it."""

    def chunked(s, r):
        had = ("already in the job (--loss trl)" if r.loss == TRL_LOSS else
               "already in the job (--liger: Liger's fused linear cross-entropy, no logits)" if r.liger else "")
        return (r if had else replace(r, loss=TRL_LOSS)), had

    def rope(s, r):
        if s.rope_scaling is not None:
            return r, f"already in the job (--rope-scaling {s.rope_scaling['rope_type']})"
        if not s.config_dict().get("rope_parameters"):
            return r, f"{s.name} has no rotary position embedding to scale"
        if s.max_positions * 2 > bounds.SEQ.high:
            return r, f"{s.name}'s {s.max_positions:,} positions already reach half of {bounds.SEQ.high:,}"
        from toolkit.inputs.rope import RopeScaling, scaled_spec

        scaled_spec(s, RopeScaling(ROPE_TYPE, 2))  # transformers' rules and the model's rotary code take it
        return r, ""

    def offload(s, r):
        return replace(r, activation_offloading=True), \
            "already in the job (--activation-offloading)" if r.activation_offloading else ""

    def tiled(s, r):
        if r.tiled:
            return r, "already in the job (--tiled)"
        # ALST's tiled logits + loss and TRL's chunked NLL are two ways to never hold the whole logits (loss_problem
        # refuses both in one job): tiling's own loss takes the chunked loss's place.
        return replace(r, tiled=True, loss="model"), ""

    def parallel(s, r):
        if split:
            return r, "already in the job (a sequence / context degree was given)"
        return replace(r, sequence_parallel=None, context_parallel=None), ""

    return ((CHUNKED, "--loss trl", chunked), (ROPE, f"--rope-scaling {ROPE_TYPE}", rope),
            (OFFLOAD, "--activation-offloading", offload), (TILED, "--tiled on", tiled),
            (SPLIT, "--sequence-parallel N / --context-parallel N", parallel))


def _split(key: str) -> bool:
    return key.endswith((" x sp", " x cp"))


def _rows(spec, hw, req, split: bool) -> list:
    """options_for's rows of the job (with `split`: its sequence- / context-parallel rows), once per rung: the
    refusal check and every octave of the search read the same list."""
    from toolkit.estimate.search import options_for

    return [(key, strategy, grids) for key, strategy, grids in options_for(spec, hw, req, sequence_rule=False)
            if not split or _split(key)]


def _refused(hw, req, rows: list) -> str:
    """Why no row of the strategy runs this job (the engines' rules the planner applies, toolkit.estimate.search
    options_for), or ""."""
    if not rows:
        if hw.world_size == 1:
            return "one GPU: no ranks to split the sequence over"
        return f"{req.strategies[0]} has no sequence- or context-parallel row (ZeRO x Ulysses SP, FSDP2 x CP)"
    reasons = [grids for _, _, grids in rows if isinstance(grids, str)]
    return reasons[0] if len(reasons) == len(rows) else ""


def _search(spec, hw, req, rows: list, cap: int, scaled: bool = False) -> "tuple[Longest | None, int]":
    """The longest of `rows` with the model's positions at `cap`, and the positions it ended at; `scaled`: with
    RoPE scaled, the positions raised an octave at a time while the longest length reaches them. An octave searches
    again only the rows the one before stopped at its positions (the others' answers stand), and the curve is
    charted once, for the answer."""
    from toolkit.estimate.longest import longest_sequences, speed, with_curve

    ceiling = min(bounds.SEQ.high, spec.max_positions * MAX_ROPE_FACTOR)
    found_by: dict[str, Longest] = {}
    todo = rows
    while True:
        at = replace(spec, max_positions=cap)
        found_by.update((r.key, r) for r in longest_sequences(at, hw, req, rows=todo, charted=False))
        ranked = sorted(found_by.values(), key=lambda r: (-r.seq_len, -speed(r)))
        if not ranked:
            return None, cap
        found = ranked[0]
        if not scaled or not found.capped_by_positions or cap >= ceiling:
            return with_curve(at, hw, req, found, chart_to_cap=False), cap
        todo = [row for row in rows if found_by[row[0]].capped_by_positions]
        cap = min(ceiling, (1 << cap.bit_length()) if cap & (cap - 1) else cap * 2)


def ladder_strategy(req: "Request", best: "Longest | None") -> str | None:
    """The strategy the ladder climbs: the one --strategies names alone, else the row that fits longest's; None
    when nothing fits."""
    if len(req.strategies) == 1:
        return req.strategies[0]
    return best.candidate.strategy.name if best is not None and best.candidate is not None else None


def ladder_title(strategy: str) -> str:
    return (f"levers on {strategy}, added one at a time in the order users pull them (TRL's long-context guide; "
            "micro-batch 1):")


def ladder_json(strategy: str, rungs: list[Rung]) -> dict[str, Any]:
    return {"strategy": strategy, "rungs": [r.to_dict() for r in rungs]}


def ladder_markdown(strategy: str, rungs: list[Rung]) -> str:
    """PLAN.md's lever table (plan --seq max --out)."""
    lines = ["## Long-context levers", "", ladder_title(strategy), "",
             "| lever added | longest | buys | GiB/GPU | row / how |", "|---|---:|---:|---:|---|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rungs]
    return "\n".join(lines) + "\n"


def ladder_table(rungs: list[Rung]) -> str:
    """The lever table: lever added, longest length, tokens it buys, peak per-GPU memory there; a lever not pulled
    says why."""
    width = max(len(r.lever) for r in rungs) + 2
    head = f"{'lever added':<{width}}{'longest':>11}{'buys':>11}{'GiB/GPU':>9}  row / how"
    lines = [head, "-" * len(head)]
    for r in rungs:
        lever, longest, buys, gib, how = _cells(r)
        lines.append(f"{lever:<{width}}{longest:>11}{buys:>11}{gib:>9}  {how}")
    return "\n".join(lines)


def _cells(r: Rung) -> tuple[str, str, str, str, str]:
    """One rung's row of both tables: lever, longest, buys, GiB/GPU, row / how."""
    if r.found is None:
        return r.lever, "-", "-", "-", f"not pulled: {r.skipped}"
    return r.lever, f"{r.seq_len:,}", f"{r.gain:+,}", _gib(r), _how(r)


def _gib(r: Rung) -> str:
    c = r.found.candidate if r.found is not None else None
    return f"{c.memory.required_bytes / GIB:.1f}" if r.seq_len and c is not None and c.memory else "-"


def _how(r: Rung) -> str:
    return (r.found.name + (f"; {r.flags}" if r.flags else "") + ("" if r.seq_len else f"; {r.found.reason}")
            + (f"; RoPE x{MAX_ROPE_FACTOR}, the ladder's ceiling, stops it" if r.found.capped_by_positions and
               r.rope_factor else "; the model's positions stop it" if r.found.capped_by_positions else ""))


def ladder_text(strategy: str, rungs: list[Rung], capacity_bytes: int) -> str:
    """The ladder as plan --seq max and estimate --seq max print it: the title, the table and one chart line per
    rung pulled."""
    from toolkit.estimate.longest import text_chart

    return (f"{ladder_title(strategy)}\n{ladder_table(rungs)}\n\n"
            + text_chart(ladder_curves(rungs), capacity_bytes, top=len(rungs)))


def ladder_curves(rungs: list[Rung]) -> list["Longest"]:
    """The rungs pulled as chart lines, each named by its lever."""
    return [replace(r.found, label=f"+ {r.lever}" if i else r.lever) for i, r in enumerate(rungs)
            if r.found is not None]

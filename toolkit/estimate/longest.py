"""The long-context question: the longest sequence each strategy fits on the given GPUs, and per-GPU memory
against sequence length per strategy (`toolkit plan / estimate --seq max`).

The search runs the same evaluation as the planner (toolkit.estimate.search.evaluate: states, traced activations, buffers,
error band, host RAM) at one micro-batch per GPU, under `traces_linear_in_seq` (toolkit.estimate.memory): a length between
two powers of two is interpolated between the exact traces at both, so the model is traced once per octave a
search visits, never per probe. Lengths stop at the model's positions (max_position_embeddings), as `--seq` does.

ALST tiling is searched only when asked for (--tiled): left to the planner (Request.tiled None), --seq max stays
untiled and says when tiling could reach further (tiling_could_reach_further). Searched tiled by default, the rows
took 1.9x the time on one A100 (5.4 s to 10.3 s, first use): the tiled traces hold one op per chunk, and the chunks
grow with the length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from toolkit.errors import UserError
from toolkit.inputs.choices import GIB

if TYPE_CHECKING:
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.hardware import Hardware
    from toolkit.inputs.modelspec import ModelSpec
    from toolkit.estimate.candidate import Candidate
    from toolkit.estimate.request import Request
    from toolkit.inputs.strategy import Strategy

GRANULE = 128
"""Sequence lengths are searched in multiples of this (times what the grid's split needs): packed blocks are
multiples of 64 / 128 in practice, and kernels tile by 64 / 128."""
CHART_FROM = 1024
"""Shortest length on the chart."""


@dataclass(frozen=True)
class Longest:
    """The longest sequence one strategy (at its best degree) fits."""

    key: str
    """The planner's row key, e.g. "zero3", "zero3 x sp"."""
    seq_len: int
    """Longest length that fits (0: none does)."""
    candidate: "Candidate | None"
    """The evaluation at seq_len (or the last refusal when none fits)."""
    capped_by_positions: bool = False
    """The model's positions stop before memory does."""
    capped_by: str = ""
    """Another limit that stops the answer before memory does (the sliding window Ulysses keeps with sdpa)."""
    curve: tuple[tuple[int, int], ...] = ()
    """(sequence length, required bytes per GPU) at powers of two, for the chart."""
    label: str = ""
    """The chart's name for the line when it is not the row's (a lever of toolkit.estimate.levers)."""

    @property
    def name(self) -> str:
        return self.label or (self.candidate.name if self.candidate is not None else self.key)

    @property
    def reason(self) -> str | None:
        return None if self.seq_len else (self.candidate.reason if self.candidate else "no grid")


def seq_cap(spec: "ModelSpec", grid: "ParallelGrid | None" = None) -> int:
    """The longest length `--seq max` may try: the model's positions. A model whose positions stop before the
    shortest length the search answers (GRANULE, or on `grid` the granule its split needs) is bad input: there is
    no length to answer with."""
    if not spec.max_positions:
        raise UserError(f"--seq max needs the model's position limit, and {spec.name}'s config has no "
                        "max_position_embeddings; give --seq N")
    cap = int(spec.max_positions)
    if cap < GRANULE:
        raise UserError(f"--seq max searches lengths in steps of {GRANULE} tokens up to the model's positions, and "
                        f"{spec.name} stops at {cap}; give --seq N (at most {cap})")
    if grid is not None and cap < granule(grid):
        raise UserError(positions_stop_early(spec, grid, cap))
    return cap


def positions_stop_early(spec: "ModelSpec", grid: "ParallelGrid", cap: int) -> str:
    g = granule(grid)
    return (f"--seq max on {grid.describe()} searches lengths in multiples of {g} tokens (steps of {GRANULE}, split "
            f"evenly over the ranks), and {spec.name} stops at {cap} positions; use a degree that divides {GRANULE}, "
            f"or give --seq N (at most {cap})")


def granule(grid: "ParallelGrid") -> int:
    """Lengths a grid can split: multiples of sp, of 2 x cp (torch's load balancer), and of GRANULE."""
    return math.lcm(GRANULE, grid.sequence_multiple())


def longest_sequences(spec: "ModelSpec", hw: "Hardware", req: "Request", chart_to_cap: bool = True, *,
                      rows: list | None = None, charted: bool = True) -> list[Longest]:
    """The longest sequence per planner row (strategy, and model-parallel family at its best degree), longest
    first; rows that fit nothing last, with the reason at the shortest length tried. `chart_to_cap` False: each
    curve stops at the first power of two past 2x its longest length (positions far beyond memory, as the lever
    ladder's scaled RoPE gives, chart nothing but misses and cost a trace per octave). `rows`: options_for's rows
    (sequence_rule False) when the caller has them already; `charted` False: no curves (with_curve adds one)."""
    from toolkit.estimate.traces import traces_linear_in_seq
    from toolkit.estimate.search import options_for

    cap = seq_cap(spec)
    probe_req = replace(req, seq_len=cap - cap % GRANULE or cap)
    out: list[Longest] = []
    with traces_linear_in_seq():
        for key, strategy, grids in (options_for(spec, hw, probe_req, sequence_rule=False) if rows is None
                                     else rows):
            if isinstance(grids, str):
                from toolkit.estimate.search import refusal

                out.append(Longest(key, 0, refusal(strategy, probe_req, hw, grids, dimension=_dim(key))))
                continue
            best: Longest | None = None
            for grid in grids:
                found = _longest_within_window(spec, hw, strategy, grid, req, cap, key)
                if best is None or (found.seq_len, speed(found)) > (best.seq_len, speed(best)):
                    best = found
            if best is not None:
                out.append(with_curve(spec, hw, req, best, chart_to_cap) if charted else best)
    return sorted(out, key=lambda x: (-x.seq_len, -speed(x)))


def with_curve(spec: "ModelSpec", hw: "Hardware", req: "Request", found: Longest, chart_to_cap: bool = True) -> Longest:
    """`found` with its memory curve up to the model's positions (`chart_to_cap` False: see longest_sequences)."""
    from toolkit.estimate.traces import traces_linear_in_seq

    cap = seq_cap(spec)
    upto = cap if chart_to_cap else min(cap, 1 << (2 * max(found.seq_len, CHART_FROM) - 1).bit_length())
    strategy = found.candidate.strategy if found.candidate is not None else None
    with traces_linear_in_seq():
        return replace(found, curve=_curve(spec, hw, strategy, found, req, upto) if strategy is not None else ())


def tiling_could_reach_further(spec: "ModelSpec", req: "Request", results: list[Longest]) -> list[str]:
    """With tiling left to the planner: the rows that tiling could take longer (their strategy runs it, toolkit
    .estimate.search.auto_tiling) when no row reaches the model's positions untiled; else none."""
    from toolkit.estimate.search import auto_tiling

    if req.tiled is not None or any(r.capped_by_positions for r in results):
        return []
    return [r.name for r in results if r.candidate is not None and not r.capped_by
            and auto_tiling(spec, r.candidate.strategy, req)]


def longest_on_grid(spec: "ModelSpec", hw: "Hardware", strategy: "Strategy", grid: "ParallelGrid",
                    req: "Request") -> Longest:
    """The longest sequence one strategy fits on one grid, with its memory curve (estimate --seq max)."""
    from toolkit.estimate.traces import traces_linear_in_seq

    cap = seq_cap(spec, grid)
    with traces_linear_in_seq():
        found = _longest_within_window(spec, hw, strategy, grid, req, cap, strategy.name)
        return replace(found, curve=_curve(spec, hw, strategy, found, req, cap, grid))


def _longest_within_window(spec, hw, strategy, grid, req, cap: int, key: str) -> Longest:
    """_longest_on, stopped at the model's sliding window where Ulysses with sdpa would drop it (the rule a fixed
    --seq refuses by: toolkit.inputs.grid `check_sequence` with the model)."""
    from toolkit.inputs.attention import attention_window

    sdpa = grid.sequence > 1 and spec.effective_attention(req.attention) == "sdpa"
    window = attention_window(spec) if sdpa else None
    if not window or window >= cap or window < granule(grid):
        return _longest_on(spec, hw, strategy, grid, req, cap, key)
    found = _longest_on(spec, hw, strategy, grid, req, window, key)
    if not found.capped_by_positions:
        return found
    return replace(found, capped_by_positions=False,
                   capped_by=f"its {window}-token sliding window: Ulysses with sdpa drops it beyond; memory allows "
                             "more, --attention flash_attention_2 keeps it")


def _dim(key: str) -> str | None:
    return key.split(" x ")[1] if " x " in key else None


def speed(x: Longest) -> float:
    c = x.candidate
    return c.timing.tokens_per_s if c is not None and c.timing is not None and c.feasible else 0.0


def _evaluate(spec, hw, strategy, grid, req, seq_len: int) -> "Candidate":
    from toolkit.estimate.search import evaluate

    job = req.job(seq_len=seq_len, micro_batch=1, grad_accum=req.grad_accum or 1,
                  checkpointing=req.checkpointing is not False, tiled=req.tiled is True)
    partition = grid.partition(spec) if strategy.is_pipeline else None
    return evaluate(spec, hw, strategy, job, grid, partition)


def _longest_on(spec, hw, strategy, grid, req, cap: int, key: str) -> Longest:
    """Largest multiple of the grid's granule up to `cap` that fits: halve from the cap until one fits, then
    bisect the octave above it."""
    g = granule(grid)
    hi = cap - cap % g
    if hi < g:  # no length this grid splits is within the model's positions: refused, not evaluated beyond them
        from toolkit.estimate.search import refusal

        return Longest(key, 0, refusal(strategy, replace(req, seq_len=cap), hw,
                                       positions_stop_early(spec, grid, cap), dimension=_dim(key)))
    top = _evaluate(spec, hw, strategy, grid, req, hi)
    if top.feasible:
        return Longest(key, hi, top, capped_by_positions=True)
    fail, lo, lo_c = hi, None, top
    s = 1 << (hi.bit_length() - 1)
    if s == hi:
        s //= 2
    while s >= g:
        c = _evaluate(spec, hw, strategy, grid, req, s - s % g)
        if c.feasible:
            lo, lo_c = s - s % g, c
            break
        fail, lo_c = s - s % g, c
        s //= 2
    if lo is None:
        return Longest(key, 0, lo_c)
    while fail - lo > g:
        mid = (lo + fail) // 2
        mid -= mid % g
        if mid <= lo:
            break
        c = _evaluate(spec, hw, strategy, grid, req, mid)
        if c.feasible:
            lo, lo_c = mid, c
        else:
            fail = mid
    return Longest(key, lo, lo_c)


def _curve(spec, hw, strategy, found: Longest, req, cap: int, grid=None) -> tuple[tuple[int, int], ...]:
    """Required bytes at powers of two from CHART_FROM to the cap (and the cap), on the grid that fits longest."""
    c = found.candidate
    grid = grid or (c.grid if c is not None else None)
    if grid is None:
        return ()
    points = []
    s = CHART_FROM
    lengths = []
    while s < cap:
        lengths.append(s)
        s *= 2
    lengths.append(cap)
    g = granule(grid)
    for s in lengths:
        s -= s % g
        if s < g:
            continue
        e = _evaluate(spec, hw, strategy, grid, req, s)
        if e.memory is None:  # refused on the states floor alone: the floor is the whole curve
            break
        points.append((s, e.memory.required_bytes))
    return tuple(points)


# ----------------------------------------------------------------------------------------------------------------
# Output: a text chart for the terminal, an SVG for the plan folder (no plotting library: a few lines of SVG).


def text_chart(results: list[Longest], capacity_bytes: int, top: int = 12) -> str:
    """Per-GPU GiB at each charted length per strategy; '-' where it does not fit."""
    shown = [r for r in results if r.curve][:top]
    if not shown:
        return ""
    lengths = sorted({s for r in shown for s, _ in r.curve})
    width = max(len(r.name) for r in shown) + 2
    head = "".join(f"{_k(s):>7}" for s in lengths)
    lines = [f"per-GPU GiB by sequence length ('-': over {capacity_bytes / GIB:.0f} GiB)",
             f"{'strategy':<{width}}{head}"]
    for r in shown:
        at = dict(r.curve)
        cells = "".join(f"{(at[s] / GIB if at[s] <= capacity_bytes else float('nan')):>7.1f}" if s in at else
                        f"{'':>7}" for s in lengths).replace("nan", "  -")
        lines.append(f"{r.name:<{width}}{cells}")
    return "\n".join(lines)


def _k(s: int) -> str:
    return f"{s // 1024}k" if s % 1024 == 0 else str(s)


_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f",
            "#bcbd22")


def svg_chart(results: list[Longest], capacity_bytes: int, title: str, top: int = 10) -> str:
    """Per-GPU memory (GiB, linear) against sequence length (log2) per strategy, with the GPU's capacity."""
    shown = [r for r in results if r.curve][:top]
    W, H, L, R, T, B = 760, 420, 60, 230, 36, 44
    lengths = sorted({s for r in shown for s, _ in r.curve}) or [CHART_FROM, 2 * CHART_FROM]
    x0, x1 = math.log2(lengths[0]), math.log2(lengths[-1])
    ymax = max([capacity_bytes / GIB * 1.25] + [min(b / GIB, capacity_bytes / GIB * 2) for r in shown
                                                 for _, b in r.curve])

    def X(s: float) -> float:
        return L + (math.log2(s) - x0) / max(x1 - x0, 1e-9) * (W - L - R)

    def Y(gib: float) -> float:
        return H - B - min(gib, ymax) / ymax * (H - T - B)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="11">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{L}" y="20" font-size="13">{_esc(title)}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
    for s in lengths:
        out.append(f'<line x1="{X(s):.1f}" y1="{H - B}" x2="{X(s):.1f}" y2="{H - B + 4}" stroke="black"/>'
                   f'<text x="{X(s):.1f}" y="{H - B + 16}" text-anchor="middle">{_k(s)}</text>')
    step = 10 if ymax <= 120 else 20 if ymax <= 240 else 50
    for v in range(0, int(ymax) + 1, step):
        out.append(f'<line x1="{L - 4}" y1="{Y(v):.1f}" x2="{L}" y2="{Y(v):.1f}" stroke="black"/>'
                   f'<text x="{L - 6}" y="{Y(v) + 4:.1f}" text-anchor="end">{v}</text>')
    out.append(f'<text x="{(L + W - R) / 2:.0f}" y="{H - 8}" text-anchor="middle">sequence length (tokens)</text>')
    out.append(f'<text x="14" y="{(T + H - B) / 2:.0f}" transform="rotate(-90 14 {(T + H - B) / 2:.0f})" '
               'text-anchor="middle">per-GPU memory (GiB)</text>')
    cap = capacity_bytes / GIB
    out.append(f'<line x1="{L}" y1="{Y(cap):.1f}" x2="{W - R}" y2="{Y(cap):.1f}" stroke="black" '
               f'stroke-dasharray="6 4"/><text x="{W - R - 4}" y="{Y(cap) - 4:.1f}" text-anchor="end">GPU '
               f'{cap:.0f} GiB</text>')
    cut = 0
    for i, r in enumerate(shown):
        colour = _COLOURS[i % len(_COLOURS)]
        points, leaves = _inside_chart([(X(s), b / GIB) for s, b in r.curve], ymax)
        if len(points) > 1:
            pts = " ".join(f"{x:.1f},{Y(g):.1f}" for x, g in points)
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{pts}"/>')
        if leaves is not None:  # where the line leaves the chart: a marker there, not a clamp onto its top edge
            cut += 1
            out.append(f'<path d="M {leaves - 5:.1f} {T + 1} L {leaves + 5:.1f} {T + 1} L {leaves:.1f} {T - 8} Z" '
                       f'fill="{colour}"/>')
        y = T + 8 + i * 16
        label = f"{r.name}: {_k(r.seq_len) if r.seq_len else 'none'}"
        out.append(f'<line x1="{W - R + 10}" y1="{y}" x2="{W - R + 28}" y2="{y}" stroke="{colour}" '
                   f'stroke-width="2"/><text x="{W - R + 32}" y="{y + 4}">{_esc(label)}</text>')
    if cut:
        y = T + 8 + len(shown) * 16 + 8
        out.append(f'<path d="M {W - R + 14} {y + 2} L {W - R + 24} {y + 2} L {W - R + 19} {y - 7} Z" fill="black"/>'
                   f'<text x="{W - R + 32}" y="{y + 4}">line leaves the chart: above {ymax:.0f} GiB</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _inside_chart(points: list[tuple[float, float]], top: float) -> tuple[list[tuple[float, float]], float | None]:
    """A memory curve's (x, GiB) points up to where it crosses `top` (the crossing interpolated, memory only grows
    with length), and the x where it leaves the chart (None: it stays inside). Lines over the chart end there, each
    at its own length, instead of running along the top edge onto one point."""
    inside: list[tuple[float, float]] = []
    for x, g in points:
        if g <= top:
            inside.append((x, g))
            continue
        if not inside:
            return [], x
        x0, g0 = inside[-1]
        leaves = x0 + (x - x0) * (top - g0) / (g - g0)
        return inside + [(leaves, top)], leaves
    return inside, None


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

"""The image counterpart of `--seq max` (issue 31, Deliver 3): at the job's text length, the most images per sample
(`--images-per-sample max`, each of --image-size) or the largest square image (`--image-size max`, N of them a
sample) a strategy fits on its grid.

Every probe is the planner's own evaluation (toolkit.estimate.search.evaluate) of the job with that count or size,
under `traces_linear_in_seq` as --seq max runs: the language model is traced once per octave of its sequence the
search visits, the vision tower once per image size (its saved bytes are per image, times the count), so a count
search traces the tower once. Counts run up to the model's positions and bounds.IMAGES; sizes run in whole steps
of the processor's patch x merge size (one more merged patch a side each step: Qwen2-VL's smart_resize rounds to
that factor), from its min_pixels to its max_pixels: a larger image is resized down by the processor, so it buys
nothing. A processor that resizes every image to one size (Gemma-3's, mm_tokens_per_image fixed) has one size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from toolkit.errors import UserError

if TYPE_CHECKING:
    from toolkit.estimate.candidate import Candidate
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.hardware import Hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import ModelSpec
    from toolkit.inputs.strategy import Strategy

MAX = "max"
"""The value of --images-per-sample / --image-size that asks for the search."""
COUNT, SIZE = "images_per_sample", "image_size"
"""What a search moves (the Job's field)."""


@dataclass(frozen=True)
class ImageSteps:
    """The image sizes a processor tells apart, smallest to largest: step k (first..last) is `size(k)`."""

    step_px: int
    """Pixels a side per step (patch x merge size); 0 where the processor resizes every image to one size."""
    first: int
    last: int
    fixed: tuple[int, int] | None
    """(width, height) every image is resized to, or None."""
    limit: str
    """Why sizes stop at `last`: the processor's max_pixels or its one size (a larger image buys nothing)."""

    def size(self, k: int) -> tuple[int, int]:
        return self.fixed if self.fixed else (k * self.step_px, k * self.step_px)


def image_steps(config: Any, config_dir=None) -> ImageSteps:
    """The square sizes `config`'s image processor (toolkit.inputs.images.image_processor) gives distinct token
    counts: sides k x patch x merge with side^2 between its shortest_edge and longest_edge (min / max pixels)."""
    from toolkit.bounds import IMAGE_SIDE
    from toolkit.inputs.images import image_processor

    processor = image_processor(config, config_dir)
    name = type(processor).__name__
    size = getattr(processor, "size", None)
    patch, merge = getattr(processor, "patch_size", None), getattr(processor, "merge_size", None) or 1
    low, high = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
    if patch and low and high:
        step = int(patch) * int(merge)
        first = max(1, math.ceil(math.sqrt(low) / step))
        last = min(int(math.isqrt(int(high)) // step), int(IMAGE_SIDE.high) // step)
        side = last * step
        return ImageSteps(step, first, last, None,
                          f"{name}'s max_pixels ({int(high):,}): a larger image is resized down to about "
                          f"{side}x{side}, so it buys nothing")
    if getattr(size, "height", None) and getattr(size, "width", None):
        w, h = int(size.width), int(size.height)
        return ImageSteps(0, 1, 1, (w, h), f"{name} resizes every image to {w}x{h}: a larger one buys nothing")
    raise UserError(f"--image-size max: {name} has neither a patch grid with min / max pixels nor one fixed size; "
                    "give --image-size WIDTHxHEIGHT")


def searched_by(count: Any, size: Any) -> str | None:
    """COUNT or SIZE where the command line's value is `max` (search_start refuses both), else None."""
    return COUNT if count == MAX else SIZE if size == MAX else None


def search_start(spec: "ModelSpec", count: Any, size: Any, config_dir=None) -> tuple[Any, Any]:
    """The command line's (--images-per-sample, --image-size) with a `max` replaced by where its search starts
    (one image; the processor's smallest distinct size), for toolkit.inputs.images.image_job to check as any job.
    Both `max`, or `max` on a model without a vision encoder: one UserError line."""
    if count == MAX and size == MAX:
        raise UserError("--images-per-sample max and --image-size max: the search moves one of them; give the other "
                        "a value (e.g. --image-size 448x448, or --images-per-sample 1)")
    if MAX not in (count, size):
        return count, size
    from toolkit.inputs.images import check_image_model

    if count == MAX and size or size == MAX and count:
        check_image_model(spec)
    if count == MAX:
        return 1, size
    if not count:
        return count, size  # image_job names the missing --images-per-sample
    steps = image_steps(spec.hf_config(), config_dir)
    w, h = steps.size(steps.first)
    return count, f"{w}x{h}"


@dataclass(frozen=True)
class MostImages:
    """The largest image count or size one strategy fits on one grid."""

    searched: str
    """COUNT or SIZE."""
    candidate: "Candidate"
    """The evaluation at the answer; where none fits, the refusal at the smallest count or size."""
    found: bool
    capped_by: str = ""
    """What stops the answer before memory does: the model's positions, the bound, the processor's max_pixels."""
    probes: tuple[tuple[str, int, int, bool], ...] = ()
    """(count or WxH, image tokens a sample, required bytes per GPU (0: refused on its states alone), fits) per
    probe, fewest tokens first."""

    @property
    def value(self) -> str:
        job = self.candidate.job
        return str(job.images_per_sample) if self.searched == COUNT else job.image_size

    @property
    def flag(self) -> str:
        return "--images-per-sample" if self.searched == COUNT else "--image-size"

    def words(self) -> str:
        """One line: the answer, its sequence and memory, and the value to pass."""
        from toolkit.inputs.choices import GIB

        c, job = self.candidate, self.candidate.job
        if not self.found:
            least = "one image" if self.searched == COUNT else f"{job.image_size} images"
            return f"{c.name}: not even {least} fits ({c.reason})"
        text = job.seq_len - job.images_per_sample * job.image_tokens
        what = (f"at most {job.images_per_sample} images of {job.image_size} a sample" if self.searched == COUNT
                else f"images up to {job.image_size} ({job.images_per_sample} a sample)")
        return (f"{c.name}: {what}, {job.image_tokens} tokens each: {text:,} text + {job.images_per_sample} x "
                f"{job.image_tokens} = {job.seq_len:,} tokens, {c.memory.required_bytes / GIB:.1f} GiB per GPU "
                f"(peak {c.memory.peak_bytes / GIB:.1f}), {c.timing.tokens_per_s:,.0f} tokens/s"
                + (f"; stops at {self.capped_by}" if self.capped_by else "") + f"; pass {self.flag} {self.value}")

    def to_dict(self) -> dict[str, Any]:
        job = self.candidate.job
        return {"searched": self.searched, "found": self.found, self.searched: self.value if self.found else None,
                "images_per_sample": job.images_per_sample, "image_size": job.image_size,
                "image_tokens": job.image_tokens, "seq_len": job.seq_len,
                "text_tokens": job.seq_len - job.images_per_sample * job.image_tokens,
                "capped_by": self.capped_by or None, "reason": None if self.found else self.candidate.reason,
                "probes": [{self.searched: v, "image_tokens_per_sample": t, "required_bytes": b, "fits": f}
                           for v, t, b, f in self.probes]}


def most_images(spec: "ModelSpec", hw: "Hardware", strategy: "Strategy", grid: "ParallelGrid", job: "Job",
                searched: str, config_dir=None) -> MostImages:
    """The largest count (searched COUNT, each image job.image_size) or square size (SIZE, job.images_per_sample a
    sample) `strategy` fits on `grid` at `job`'s text tokens; `job` is the search's start (search_start)."""
    from toolkit.estimate.traces import traces_linear_in_seq
    from toolkit.inputs.images import image_tokens, parse_image_size

    text = job.seq_len - job.images_per_sample * job.image_tokens
    positions = int(spec.max_positions or 0)
    config = spec.hf_config()
    probes: list[tuple[str, int, int, bool]] = []

    def at(count: int, size: tuple[int, int]) -> "Candidate":
        from toolkit.estimate.search import evaluate

        tokens = image_tokens(config, *size, config_dir).tokens
        probe = replace(job, seq_len=text + count * tokens, images_per_sample=count,
                        image_size=f"{size[0]}x{size[1]}", image_tokens=tokens)
        c = evaluate(spec, hw, strategy, probe, grid)
        probes.append((str(count) if searched == COUNT else probe.image_size, count * tokens,
                       c.memory.required_bytes if c.memory is not None else 0, c.feasible))
        return c

    with traces_linear_in_seq():
        if searched == COUNT:
            from toolkit.bounds import IMAGES

            size = parse_image_size(job.image_size)
            last, capped = int(IMAGES.high), f"--images-per-sample's bound ({IMAGES.high:g})"
            if positions and (positions - text) // job.image_tokens < last:
                last, capped = (positions - text) // job.image_tokens, f"the model's {positions:,} positions"
            found, c = _largest(1, last, lambda n: at(n, size), doubling=True)
        else:
            steps = image_steps(config, config_dir)
            last, capped = steps.last, steps.limit
            count = job.images_per_sample
            while positions and last > steps.first and \
                    text + count * image_tokens(config, *steps.size(last), config_dir).tokens > positions:
                last, capped = last - 1, f"the model's {positions:,} positions"
            found, c = _largest(steps.first, last, lambda k: at(count, steps.size(k)), doubling=False)
        return MostImages(searched, c, found is not None, capped if found == last else "",
                          tuple(sorted(probes, key=lambda p: p[1])))


def _largest(first: int, last: int, probe: Callable[[int], "Candidate"], *, doubling: bool
             ) -> tuple[int | None, "Candidate"]:
    """The largest i in first..last whose probe fits (memory grows with i), and its candidate; (None, the refusal
    at `first`) when none does. `doubling` (counts, up to thousands): first, 2 x first, 4 x first, ... until one
    fails, then bisection between, so no probe is far past the answer (each longer sequence is a new trace);
    else (sizes, a few dozen steps, a tower trace each) bisection of first..last at once."""
    c = probe(first)
    if not c.feasible:
        return None, c
    good, good_c, fail = first, c, last + 1
    while doubling and good < last:
        i = min(2 * good, last)
        c = probe(i)
        if not c.feasible:
            fail = i
            break
        good, good_c = i, c
    while fail - good > 1:
        mid = (good + fail) // 2
        c = probe(mid)
        if c.feasible:
            good, good_c = mid, c
        else:
            fail = mid
    return good, good_c


def most_images_per_row(spec: "ModelSpec", hw: "Hardware", req: Any, searched: str, config_dir=None
                        ) -> tuple[list[MostImages], list[tuple[str, str]]]:
    """plan's `max`: per planner row (toolkit.estimate.search.options_for) the largest count or size on its best
    grid, at micro-batch 1 as --seq max searches, most image tokens first (fastest among equals); and (row, why it
    was not searched) for a row with no grid to search: the planner's refusal, or grids that split the sequence
    (their lengths must divide, and the images move the length)."""
    from toolkit.estimate.search import options_for

    job = req.job(micro_batch=1, grad_accum=req.grad_accum or 1, checkpointing=req.checkpointing is not False,
                  tiled=req.tiled is True)
    found: list[MostImages] = []
    skipped: list[tuple[str, str]] = []
    for key, strategy, grids in options_for(spec, hw, req, sequence_rule=False):
        usable = [] if isinstance(grids, str) else [g for g in grids if g.sequence_multiple() == 1]
        if not usable:
            skipped.append((key, grids if isinstance(grids, str) else
                            "its grids split the sequence, whose length the images move: plan it with values"))
            continue
        results = [most_images(spec, hw, strategy, grid, job, searched, config_dir) for grid in usable]
        found.append(max(results, key=_rank))
    return sorted(found, key=_rank, reverse=True), skipped


def _rank(r: MostImages) -> tuple[bool, int, float]:
    job, timing = r.candidate.job, r.candidate.timing
    return (r.found, job.images_per_sample * job.image_tokens if r.found else 0,
            timing.tokens_per_s if r.found and timing is not None else 0.0)

"""Allocator retries at a GPU's capacity: how many a step causes and what each gives back, replayed through
toolkit.estimate.allocator with the capacity set, and their price in the step time.

A retry (c10/cuda/CUDACachingAllocator.cpp, `malloc`: `alloc_block` fails, then `release_available_cached_blocks`
/ `release_cached_blocks` and `alloc_block` again) synchronizes the device and gives every cached block back: each
unsplit segment by cudaFree, or, with expandable segments, the free pages unmapped. The step then takes the memory
again as it grows: cudaMalloc of new segments, or pages mapped again. The price is per cudaFree / cudaMalloc
(default allocator) or per byte unmapped and mapped again (expandable segments), with the constants
benchmarks/retry_cost.py derives from the GPU day's memory-edge rows (retry_cost.json beside this module).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from toolkit.estimate.allocator import AllocatorSettings, AllocatorStats, OutOfMemory, Replayer

GIB = 1 << 30
COST_FILE = Path(__file__).with_name("retry_cost.json")


@dataclass(frozen=True)
class StepRetries:
    """One step's retries (the last replayed) and what the device gave and took within it: `device_frees` calls
    (cudaFree of a segment, or one unmapped range) giving back `freed_bytes`, and `device_allocs` calls (cudaMalloc,
    or one mapping) taking `alloc_bytes`; `oom`: the step ran out of memory even after a retry."""

    retries: int = 0
    device_frees: int = 0
    freed_bytes: int = 0
    device_allocs: int = 0
    alloc_bytes: int = 0
    expandable: bool = False
    oom: bool = False
    peak_reserved: int = field(default=0, compare=False)
    """The capped replay's reserved peak (over every step it replayed)."""
    saved_bytes: int = field(default=0, compare=False)
    """What the cap takes off the uncapped replay's reserved peak (capped_retries sets it)."""

    @classmethod
    def between(cls, before: AllocatorStats, after: AllocatorStats, *, expandable: bool,
                oom: bool = False) -> "StepRetries":
        return cls(retries=after.alloc_retries - before.alloc_retries,
                   device_frees=after.device_frees - before.device_frees,
                   freed_bytes=after.device_freed_bytes - before.device_freed_bytes,
                   device_allocs=after.device_allocs - before.device_allocs,
                   alloc_bytes=after.device_alloc_bytes - before.device_alloc_bytes, expandable=expandable, oom=oom,
                   peak_reserved=after.peak_reserved)

    def seconds(self, cost: dict | None = None) -> float:
        """The step time the retries add. In a steady state every byte a retry gives back the step takes again
        (the next step's retry gives it back once more), so: per GiB unmapped, and mapped again (expandable
        segments), or per segment freed, each a cudaFree and a cudaMalloc again (the default allocator); 0 without
        a retry."""
        if not self.retries:
            return 0.0
        cost = cost if cost is not None else retry_cost()
        if self.expandable:
            return cost["unmap_map_s_per_gib"] * self.freed_bytes / GIB
        return cost["free_malloc_s_per_call"] * 2 * self.device_frees

    def words(self, cost: dict | None = None) -> str:
        """`allocator retries N a step: +x s (...)`: the explain line."""
        if self.oom:
            return "allocator: out of memory at this capacity even after a retry"
        given = (f"{self.freed_bytes / GIB:.2f} GiB of pages unmapped and mapped again" if self.expandable else
                 f"{self.device_frees} segments ({self.freed_bytes / GIB:.2f} GiB) freed and allocated again")
        return f"allocator retries {self.retries} a step: +{self.seconds(cost):.3f} s ({given})"


def retry_cost() -> dict:
    """The constants benchmarks/retry_cost.py derived (and the rows that set them)."""
    return json.loads(COST_FILE.read_text())


def last_step(replayer: Replayer, *, oom: bool = False) -> StepRetries:
    """The step begun last in `replayer` (its `step()` mark), as StepRetries."""
    return StepRetries.between(replayer.step_start, replayer.allocator.stats,
                               expandable=replayer.allocator.settings.expandable_segments, oom=oom)


def replay_retries(events, settings: AllocatorSettings) -> StepRetries:
    """Replay `events` (toolkit.estimate.allocator.replay's format, ("step",) marking each step) at
    `settings.capacity`: the last step's retries, or `oom` where the allocator ran out."""
    r = Replayer(settings)
    handlers = {"malloc": lambda e: r.malloc(*e[1:]), "free": lambda e: r.free(e[1]),
                "record_stream": lambda e: r.record_stream(e[1], e[2]), "sync": lambda e: r.sync(e[1]),
                "reset_peak": lambda e: r.reset_peak(), "step": lambda e: r.step()}
    try:
        for event in events:
            handlers[event[0]](event)
    except OutOfMemory:
        return last_step(r, oom=True)
    return last_step(r)


_RESULTS: dict[tuple, StepRetries] = {}
"""Per process, the capped replays run or read from disk, keyed as there."""


def retries_at(regions, sizes, conf: str, capacity: int, steps: int = 2) -> StepRetries:
    """The estimate's step events (toolkit.estimate.reserved.emit_step_events) replayed with the allocator capped at
    `capacity` bytes (what the process may reserve): the last of `steps` steps' retries. Kept in this process and
    on disk (toolkit.cache) as the uncapped replay is (reserved.replayed_reserved): a repeated plan replays
    nothing."""
    from toolkit import cache
    from toolkit.estimate.reserved import emit_step_events, replay_key

    key = (replay_key(regions, sizes, conf), capacity, steps)
    if key in _RESULTS:
        return _RESULTS[key]
    retries = cache.get("retries", key, code=retries_at, decode=lambda d: StepRetries(**d))
    if retries is None:
        r = Replayer(AllocatorSettings.from_conf(conf, capacity=capacity))
        try:
            emit_step_events(regions, sizes, r, steps)
            retries = last_step(r)
        except OutOfMemory:
            retries = last_step(r, oom=True)
        cache.put("retries", key, asdict(retries), code=retries_at)
    _RESULTS[key] = retries
    return retries


def capped_retries(memory, asked, strategy, job, gpu) -> StepRetries | None:
    """The retries of the estimate's replay (`asked`: reserved.replays_asked's list) with the allocator capped at
    what the GPU leaves the replayed tensors (capacity less the CUDA context, NCCL's buffers and cuBLAS's
    workspaces), where the plan sits at its capacity
    as the planner sets it: the replayed reserved within twice the peak's error band of that cap (the band the
    planner keeps, and as much again for the replay's own error on reserved: the H200 reserved 1.253 of the FSDP2 +
    checkpointing peak where the replay said 1.040 before FSDP2's own rules (toolkit.estimate.engineevents) and 1.288
    after, benchmarks/results/gpu_memory_edge_derived.md). None elsewhere
    (a second replay only where it can differ), or where no replay ran."""
    from toolkit.estimate.errorband import band_for
    from toolkit.estimate.reserved import replayed_reserved

    if not asked or memory.stage_required_bytes:
        return None
    regions, sizes, conf = asked[-1]
    replay = replayed_reserved(regions, sizes, settings=conf)
    if replay is None or not replay.events:
        return None
    cap = memory.capacity_bytes - memory.context_bytes - memory.workspace_bytes  # cuBLAS's: cached all the run
    band = band_for(strategy.engine, job.checkpointing, gpu=gpu).headroom_bytes(memory.peak_bytes)
    if replay.peak_reserved + 2 * band <= cap:
        return None
    capped = retries_at(regions, sizes, conf, cap)
    return replace(capped, saved_bytes=max(0, replay.peak_reserved - capped.peak_reserved))


def capped_memory(memory, asked, strategy, job, gpu):
    """The estimate's memory with its allocator capped at the GPU's capacity (capped_retries) -> (memory, retries):
    where the capped replay runs, its reserved peak is the memory's (a step the uncapped replay put over the GPU runs
    on it, flushing the cache: a process never reserves more than the GPU leaves it); retries None, without a
    retry, or out of memory: the memory as it was."""
    retries = capped_retries(memory, asked, strategy, job, gpu)
    if retries is None or not retries.retries or retries.oom:
        return memory, retries
    saved = retries.saved_bytes
    terms = tuple(replace(t, bytes=t.bytes - saved, source=f"{t.source}; capped at the GPU's capacity: "
                          f"{retries.peak_reserved / GIB:.2f} GiB reserved") if t.name.startswith("allocator")
                  else t for t in memory.terms)
    return replace(memory, margin_bytes=memory.margin_bytes - saved, required_bytes=memory.required_bytes - saved,
                   terms=terms), retries


def at_capacity(memory, timing, asked, spec, strategy, job, hw, **where):
    """The plan's memory and step time with its allocator retries at the GPU's capacity (capped_memory): where the
    capped replay runs, its reserved peak is the plan's, the retries' price is added to the step (Timing.retry_s)
    and the notes say it, with the setting that avoids them where one does (the other allocator setting, or one
    micro-batch less)."""
    if timing is None:
        return memory, timing
    memory, retries = capped_memory(memory, asked, strategy, job, hw.gpu)
    if retries is None or not (retries.retries or retries.oom):
        return memory, timing
    notes = [retries.words()]
    if not retries.oom:
        extra = retries.seconds()
        step = timing.step_time_s + extra
        timing = replace(timing, step_time_s=step, tokens_per_s=timing.tokens_per_s * timing.step_time_s / step,
                         retry_s=extra)
    avoid = _avoided_by(spec, strategy, job, hw, where)
    if avoid:
        notes.append(f"allocator retries avoided by {avoid}")
    return replace(memory, notes=memory.notes + tuple(notes)), timing


def _avoided_by(spec, strategy, job, hw, where) -> str:
    """The first of: the other allocator setting, one micro-batch less, whose replay at the same capacity fits
    and retries never ('' where neither does)."""
    from toolkit.estimate.memory import estimate_memory
    from toolkit.estimate.reserved import replays_asked, replays_kept

    expandable = "expandable_segments:True" in job.allocator_conf.replace(" ", "")
    other = "" if expandable else "expandable_segments:True"
    tries = [(replace(job, allocator_conf=other),
              "torch's default allocator" if expandable else "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")]
    if job.micro_batch > 1:
        tries.append((replace(job, micro_batch=job.micro_batch - 1), f"micro-batch {job.micro_batch - 1}"))
    for changed, words in tries:
        with replays_kept(), replays_asked() as asked:
            memory = estimate_memory(spec, strategy, changed, hw, **where)
            retries = capped_retries(memory, asked, strategy, changed, hw.gpu)
        if memory.fits and (retries is None or not (retries.retries or retries.oom)):
            return words
    return ""

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
from dataclasses import dataclass
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

    @classmethod
    def between(cls, before: AllocatorStats, after: AllocatorStats, *, expandable: bool,
                oom: bool = False) -> "StepRetries":
        return cls(retries=after.alloc_retries - before.alloc_retries,
                   device_frees=after.device_frees - before.device_frees,
                   freed_bytes=after.device_freed_bytes - before.device_freed_bytes,
                   device_allocs=after.device_allocs - before.device_allocs,
                   alloc_bytes=after.device_alloc_bytes - before.device_alloc_bytes, expandable=expandable, oom=oom)

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


def retries_at(regions, sizes, conf: str, capacity: int, steps: int = 2) -> StepRetries:
    """The estimate's step events (toolkit.estimate.reserved.emit_step_events) replayed with the allocator capped at
    `capacity` bytes (what the process may reserve): the last of `steps` steps' retries."""
    from toolkit.estimate.reserved import emit_step_events

    r = Replayer(AllocatorSettings.from_conf(conf, capacity=capacity))
    try:
        emit_step_events(regions, sizes, r, steps)
    except OutOfMemory:
        return last_step(r, oom=True)
    return last_step(r)

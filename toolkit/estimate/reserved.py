"""Reserved memory (`torch.cuda.max_memory_reserved`) of a training step, by replaying the step's allocations and
frees through the caching-allocator model (toolkit.estimate.allocator) instead of a margin over the tensor peak.

The events, in the order the step runs them, two steady-state steps long (the second reuses the first's cached
segments, as every later step does):
- model states the memory model counts (parameters, fp32 master, persistent gradient partitions, engine buffers)
  allocated before the first step, one block per region in proportion to its parameters; optimizer states at the
  first optimizer step (torch and DeepSpeed create them lazily there, after the activations are freed);
- each region's traced forward and backward events (toolkit.estimate.stepevents: every storage the model's own
  code creates and frees on the traced step, copied to every layer of the same kind);
- the engine's buffers at the sizes the memory model gives them: unsharded parameters (ZeRO-3, FSDP2) gathered on
  their own stream before each region's forward and backward (FSDP2: each region's unsharded size, the root's
  kept from its forward to the end of backward; ZeRO-3: each region's share of the gathered bytes), two regions
  alive at a time (the prefetch), used on the compute stream (record_stream) and freed two regions on;
  FSDP2's reduce-scatter inputs the same way on a third stream in backward; other backward buffers (ZeRO-2's
  bucket and partition, DDP's) for the backward; the gradients backward creates (param.grad) per region after its
  backward events, freed by the step (set_to_none); the optimizer step's temporaries at the step.
The result is the replay's reserved peak over its allocated peak (what fragmentation, segment rounding and the
per-stream pools cost), added to the memory model's tensor peak. Results are kept per process and on disk
(toolkit.cache) under a key made of the events' hashes and the sizes, so a repeated plan replays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from toolkit.estimate.allocator import AllocatorSettings, replay
from toolkit.estimate.stepevents import BACKWARD, FORWARD, decode_free

COMPUTE, GATHER, REDUCE = 0, 1, 2
"""Streams: the default (compute) stream, the all-gather stream, the reduce-scatter stream."""
PREFETCH = 2
"""Gathered regions alive at once: the one computing and the one prefetched (FSDP2 forward/backward prefetch of
one group, DeepSpeed ZeRO-3's prefetch bucket); toolkit.estimate.states sizes `gathered` the same way."""


@dataclass(frozen=True)
class Replay:
    peak_allocated: int
    peak_reserved: int
    events: int
    segments: int

    @property
    def overhead(self) -> int:
        """Reserved bytes above the allocated peak: what the allocator holds that no tensor uses at the peak."""
        return max(0, self.peak_reserved - self.peak_allocated)


@dataclass(frozen=True)
class StepSizes:
    """The memory model's per-rank state and buffer bytes the replay allocates (toolkit.estimate.states.States)."""

    persistent: float
    """parameters + master + persistent gradients + persistent buffers."""
    optimizer: float
    gathered: float
    """Unsharded parameter bytes live at a time; spread over the regions by their parameters unless
    `gather_bytes_per_param` gives each region's own unsharded size."""
    reduce_buffers: float
    """Buffers alive in backward only; on the reduce-scatter stream when `reduce_stream`."""
    reduce_stream: bool
    step_gradients: float
    backward_gradients: float
    step_transient: float
    gather_bytes_per_param: float = 0.0
    kept_regions: tuple[int, ...] = ()
    """Regions whose gathered parameters stay from their forward to the end of backward (FSDP2's root module: the
    embeddings, final norm and head; every region with reshard_after_forward=False)."""


_RESULTS: dict[int, Replay] = {}


def replayed_reserved(regions, sizes: StepSizes, *, settings: str = "") -> Replay | None:
    """The replay of two steps over `regions` (memory._Region: name, params, trace); None when some region has no
    recorded events (a region traced compiled, an interpolation whose traces differ), where the caller keeps its margin."""
    if not regions or any(not (r.trace.forward_events or r.trace.backward_events) for r in regions):
        return None
    # Ints only: their hashes are the same in every process (str hashes are salted per process).
    key_parts = (tuple((hash(r.trace.forward_events), hash(r.trace.backward_events), r.params) for r in regions),
                 tuple(round(v * 16) if isinstance(v, float) else v for v in vars(sizes).values()))
    key = (hash(key_parts), settings)
    if key in _RESULTS:
        return _RESULTS[key]
    from toolkit import cache

    disk_key = [str(key_parts), settings]
    stored = cache.get("reserved", disk_key, code=replayed_reserved, decode=lambda d: Replay(**d))
    if stored is None:
        events = step_events(regions, sizes)
        stats = replay(events, AllocatorSettings.from_conf(settings))
        stored = Replay(peak_allocated=stats.peak_allocated, peak_reserved=stats.peak_reserved, events=len(events),
                        segments=stats.segments)
        cache.put("reserved", disk_key, vars(stored), code=replayed_reserved)
    _RESULTS[key] = stored
    return stored


@lru_cache(maxsize=1024)
def _decoded(window: tuple[int, ...]) -> tuple[tuple[bool, int, int, int, int], ...]:
    """(birth?, size, region offset, phase, ordinal) of each event of a window: a birth's ordinal counts the
    window's births so far, a death's names its birth (toolkit.estimate.stepevents)."""
    out, births = [], 0
    for e in window:
        if e > 0:
            out.append((True, e, 0, 0, births))
            births += 1
        else:
            offset, phase, ordinal = decode_free(e)
            out.append((False, 0, offset, phase, ordinal))
    return tuple(out)


def _shares(total: float, regions) -> list[int]:
    """`total` bytes split over the regions in proportion to their parameters (evenly when none have any)."""
    params = [r.params for r in regions]
    whole = sum(params)
    return [int(total * p / whole) if whole else int(total / len(regions)) for p in params]


def step_events(regions, sizes: StepSizes, steps: int = 2) -> list[tuple]:
    """The allocator events of `steps` training steps (toolkit.estimate.allocator.replay's format)."""
    events: list[tuple] = []
    n = len(regions)

    def blocks(name: str, total: float) -> None:
        for j, size in enumerate(_shares(total, regions)):
            if size > 0:
                events.append(("malloc", (name, j), size))

    blocks("state", sizes.persistent)
    largest = max(r.params for r in regions) or 1
    gather = [int(r.params * sizes.gather_bytes_per_param) if sizes.gather_bytes_per_param
              else int(sizes.gathered * r.params / (PREFETCH * largest)) for r in regions]
    reduce = [int(sizes.reduce_buffers * r.params / (PREFETCH * largest)) for r in regions]

    for step in range(steps):
        alive: set = set()
        rotating: list = []

        def run(j: int, phase: int, window: tuple[int, ...]) -> None:
            for birth, size, offset, born_phase, ordinal in _decoded(window):
                if birth:
                    key = ("act", j, phase, ordinal)
                    alive.add(key)
                    events.append(("malloc", key, size))
                else:
                    key = ("act", j + offset, born_phase, ordinal)
                    if key in alive:
                        alive.remove(key)
                        events.append(("free", key))

        def use(key, size: int, stream: int) -> None:
            """A buffer made on `stream`, used by the compute stream, freed PREFETCH regions later."""
            if size <= 0:
                return
            if len(rotating) == PREFETCH:  # the region before the previous one is done
                events.append(("free", rotating.pop(0)))
                events.append(("sync", COMPUTE))
            events.append(("malloc", key, size, stream))
            events.append(("record_stream", key, COMPUTE))
            rotating.append(key)

        for j, r in enumerate(regions):
            if j in sizes.kept_regions:
                if gather[j] > 0:
                    events.append(("malloc", ("kept", step, j), gather[j], GATHER))
                    events.append(("record_stream", ("kept", step, j), COMPUTE))
            else:
                use(("gather", step, FORWARD, j), gather[j], GATHER)
            run(j, FORWARD, r.trace.forward_events)
        if sizes.reduce_buffers and not sizes.reduce_stream:
            events.append(("malloc", ("reduce", step), int(sizes.reduce_buffers)))
        if sizes.backward_gradients:
            events.append(("malloc", ("partitions", step), int(sizes.backward_gradients)))
        grads = _shares(sizes.step_gradients, regions)
        for j in reversed(range(n)):
            if j not in sizes.kept_regions:
                use(("gather", step, BACKWARD, j), gather[j], GATHER)
            run(j, BACKWARD, regions[j].trace.backward_events)
            if grads[j] > 0:
                events.append(("malloc", ("grad", step, j), grads[j]))
            if sizes.reduce_stream:
                use(("reduce", step, j), reduce[j], REDUCE)
        for key in rotating:
            events.append(("free", key))
        for j in sizes.kept_regions:
            if gather[j] > 0:
                events.append(("free", ("kept", step, j)))
        events.append(("sync", COMPUTE))
        for key in sorted(alive, key=repr):
            events.append(("free", key))
        if sizes.reduce_buffers and not sizes.reduce_stream:
            events.append(("free", ("reduce", step)))
        if step == 0:
            blocks("optimizer", sizes.optimizer)
        if sizes.step_transient > 0:
            events.append(("malloc", ("step", step), int(sizes.step_transient)))
            events.append(("free", ("step", step)))
        for j, size in enumerate(grads):
            if size > 0:
                events.append(("free", ("grad", step, j)))
        if sizes.backward_gradients:
            events.append(("free", ("partitions", step)))
    return events

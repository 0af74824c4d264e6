"""Reserved memory (`torch.cuda.max_memory_reserved`) of a training step, by replaying the step's allocations and
frees through the caching-allocator model (toolkit.estimate.allocator) instead of a margin over the tensor peak.

The events, in the order the step runs them, two steady-state steps long (the second reuses the first's cached
segments, as every later step does):
- model states the memory model counts (parameters, fp32 master, persistent gradient partitions, engine buffers)
  allocated before the first step, one block per region in proportion to its parameters; optimizer states at the
  first optimizer step (torch and DeepSpeed create them lazily there, after the activations are freed);
- each region's traced forward and backward events (toolkit.estimate.stepevents: every storage the model's own
  code creates and frees on the traced step, copied to every layer of the same kind);
- where the load leaves the base whole on the GPU before the engine partitions it (ZeRO-3 QLoRA: transformers loads
  a quantized model onto every GPU, device_map {"": current device}), transformers' caching_allocator_warmup block
  of the loaded weights' bytes, allocated and freed, then the loaded base, freed region by region as the model
  states (the partitions) are made; the peaks are reset after it, so the replay's allocated peak is the step's;
- the engine's buffers at the sizes the memory model gives them: unsharded parameters (ZeRO-3, FSDP2) gathered on
  their own stream before each region's forward and backward (FSDP2: each region's unsharded size, the root's
  kept from its forward to the end of backward; ZeRO-3: each region's share of the gathered bytes), two regions
  alive at a time (the prefetch), used on the compute stream (record_stream) and freed two regions on;
  FSDP2's reduce-scatter inputs the same way on a third stream in backward; other backward buffers (ZeRO-2's
  bucket and partition) from the first region's gradients on (the bucket to the end of backward, the partition to
  the step); the gradients backward creates (param.grad) per region after its backward events, freed by the step
  (set_to_none); the optimizer step's temporaries at the step.
The result is the replay's reserved peak over its allocated peak (what fragmentation, segment rounding and the
per-stream pools cost), added to the memory model's tensor peak. Results are kept per process and on disk
(toolkit.cache) under a key made of the events' hashes and the sizes, so a repeated plan replays nothing.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache

from toolkit.estimate.allocator import AllocatorSettings, Replayer
from toolkit.estimate.engineevents import COMPUTE, GATHER, REDUCE, engine_rules
from toolkit.estimate.stepevents import BACKWARD, FORWARD, decode_free

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
    fsdp_root: bool = True
    """FSDP2's root group holds the kept regions named engineevents.ROOT_REGIONS (fully_shard on the model itself);
    False: transformers' fsdp_plan groups under TP, every region its own group (a kept one to its own post_backward)."""
    held_gathered: float = 0.0
    """Unsharded bytes gathered before the first region's forward and kept to the end of backward (ZeRO-3 with
    Liger: the LM head's weight, toolkit.estimate.states.liger_head_gathered); taken out of the parameters the
    region holding them gathers itself (the head's, or the embedding's where they are tied)."""
    tensors: tuple[tuple[int, ...], ...] = ()
    """Each region's parameter tensors (elements; toolkit.estimate.layerkinds.region_tensor_numels) where the
    engine's optimizer is torch's, per parameter: its states (zeros_like at the first step) and foreach AdamW's
    temporaries are then one block per parameter, in proportion to these, not one per region. Empty: per region
    (DeepSpeed's flat partitions)."""
    flat_partitions: tuple[int, ...] = ()
    """DeepSpeed's flat partitions (toolkit.estimate.states.flat_partitions): where given, the optimizer states are
    one block per partition and state, and the step's temporaries one per partition, each freed before the next
    partition's (stage3.py _prepare_fp32_grad_for_sub_group / _release_sub_group), in place of per-region blocks."""
    init_buffers: tuple[int, ...] = ()
    """Bytes DeepSpeed's engine allocates and frees once the states exist, before the first step: the zero fp32
    gradients initialize_optimizer_states hangs on the flat partitions (ZeRO-3 one buffer of the largest
    sub-group, stage3.py; ZeRO-1/2 one per group, stage_1_and_2.py), then sets to None. Their segments stay cached."""
    tensor_grads: bool = False
    """Backward makes one gradient per parameter (param.grad: DDP and a single process), not one per region."""
    loaded: float = 0.0
    """The frozen base as the load leaves it on the GPU before the engine partitions it (ZeRO-3 QLoRA: the quantized
    model loaded whole onto every GPU), freed region by region as each region's partition is made."""
    load_warmup: float = 0.0
    """transformers' caching_allocator_warmup before that load: one block of the loaded weights' bytes, allocated
    and freed, whose segment stays reserved for the whole run (nothing empties the cache)."""
    engine: str = ""
    """Whose backward and step rules the replay follows around the traced events (toolkit.estimate.engineevents):
    'fsdp2', 'zero3', or '' (the generic rules below)."""
    world: int = 1
    """Ranks a parameter is sharded over (FSDP2's shard group, ZeRO-3's partition group)."""
    param_bytes: float = 2.0
    """Bytes of a ZeRO-3 parameter's gradient (the module's dtype)."""
    bucket_elements: int = 0
    """ZeRO-3's reduce_bucket_size (elements)."""
    reduce_bytes: float = 0.0
    """Bytes of an element ZeRO-3 reduces in, its communication dtype (fp32 under Ulysses SP:
    toolkit.inputs.spreduce); 0: param_bytes."""
    backward_s: float = 0.0
    """Seconds of one micro-step's backward compute (toolkit.estimate.timing), spread over the regions by their
    parameters; 0: not known (ZeRO-3's gradients are then released at the latest the engine allows)."""
    reduce_s_per_byte: float = 0.0
    """Seconds the reduce stream takes per byte of a ZeRO-3 bucket's reduce-scatter (0 over one rank: a local copy)."""


def tensor_sizes(spec, regions, strategy, job, states=None) -> dict:
    """StepSizes' `tensors` and `tensor_grads` for a job: torch's optimizers (DDP or one process, FSDP2) make their
    states and foreach temporaries per parameter, so each region's parameter tensors (elements) from a meta build
    (toolkit.estimate.layerkinds.region_tensor_numels), and DDP's backward each param.grad apart; DeepSpeed's
    optimizer steps flat partitions, and an adapter's states are small: one block per region (empty). When ZeRO-3's
    reductions end (StepSizes.backward_s, reduce_s_per_byte) comes from the time model, timing.zero3_release_timing."""
    from toolkit.inputs.strategy import Engine

    if states is not None and states.flat_partitions and not job.adapter.is_adapter:
        flat = states.flat_partitions
        init = (4 * max(flat),) if strategy.zero_stage == 3 else tuple(4 * e for e in flat)
        out = {"flat_partitions": flat, "init_buffers": init}
        if strategy.zero_stage == 3 and spec is not None:  # ZeRO-3's rules make a gradient per parameter
            out.update(_region_tensors(spec, regions))
        return out
    if spec is None or strategy.engine not in (Engine.DDP, Engine.FSDP2) or job.adapter.is_adapter:
        return {}
    return {**_region_tensors(spec, regions), "tensor_grads": strategy.engine == Engine.DDP}


def _region_tensors(spec, regions) -> dict:
    """{"tensors": each region's parameter tensors (elements)} from a meta build of `spec`; {} where it fails."""
    from toolkit.estimate.layerkinds import region_tensor_numels

    try:
        pre, layers, post = region_tensor_numels(spec)
    except Exception:  # noqa: BLE001 - a model whose meta build fails keeps one block per region
        return {}
    named = {"embedding": pre, "head + loss": post}
    return {"tensors": tuple(named[r.name] if r.name in named else layers[int(r.name.split()[-1])]
                             for r in regions)}


_RESULTS: dict[str, Replay] = {}

_NO_OVERHEAD = Replay(peak_allocated=0, peak_reserved=0, events=0, segments=0)
_UNREPLAYED: ContextVar[list[int] | None] = ContextVar("unreplayed", default=None)
"""Inside `replays_left_out`: how many replays were left out (a one-item list), else None."""


@contextmanager
def replays_left_out():
    """Within: a replay that is neither in this process's results nor on disk is not run; replayed_reserved returns
    a Replay with no overhead instead, and the yielded one-item list counts them. So it does where some region has
    no events (where it returns None outside, and the caller adds its assumed margin): a scaled trace leaves out the
    events that only the replay reads when they cost a trace of their own (toolkit.estimate.traces). A replay or a
    margin only adds bytes (reserved is never under allocated), so what is computed inside is a lower bound on the
    required bytes, exact when the count stays 0. The planner refuses a configuration short of GPU memory on that
    bound without replaying it (toolkit.estimate.search): the replay is most of a first plan's CPU time and most
    configurations it costs are refused."""
    count = [0]
    token = _UNREPLAYED.set(count)
    try:
        yield count
    finally:
        _UNREPLAYED.reset(token)


_ASKED: ContextVar[list | None] = ContextVar("asked", default=None)


@contextmanager
def replays_asked():
    """Within: every replay asked of `replayed_reserved` is listed as (regions, sizes, settings), for a caller that
    replays the same step again at a capacity (toolkit.estimate.retries.retries_at)."""
    asked: list = []
    token = _ASKED.set(asked)
    try:
        yield asked
    finally:
        _ASKED.reset(token)


@contextmanager
def replays_kept():
    """Within: every replay runs, also inside `replays_left_out` (a question whose answer must not be a bound)."""
    token = _UNREPLAYED.set(None)
    try:
        yield
    finally:
        _UNREPLAYED.reset(token)


def leaving_replays_out() -> bool:
    """Whether replays are being left out (inside `replays_left_out`)."""
    return _UNREPLAYED.get() is not None


def replay_key(regions, sizes: StepSizes, settings: str) -> str:
    """One short digest of a replay's inputs (the regions' events and parameters, the step's sizes, the allocator
    settings): it keys a replay's result in this process and on disk (toolkit.cache)."""
    # Ints only: their hashes are the same in every process (str hashes are salted per process).
    key_parts = (tuple((hash(r.trace.forward_events), hash(r.trace.backward_events), r.params) for r in regions),
                 tuple(round(v * 16) if isinstance(v, float) else v for v in vars(sizes).values()), settings)
    return hashlib.sha256(repr(key_parts).encode()).hexdigest()[:32]


def replayed_reserved(regions, sizes: StepSizes, *, settings: str = "") -> Replay | None:
    """The replay of two steps over `regions` (memory._Region: name, params, trace); None when some region has no
    recorded events (a region traced compiled, an interpolation whose traces differ), where the caller keeps its margin."""
    left_out = _UNREPLAYED.get()
    if (asked := _ASKED.get()) is not None:
        asked.append((regions, sizes, settings))
    if not regions or any(not (r.trace.forward_events or r.trace.backward_events) for r in regions):
        if left_out is not None:
            left_out[0] += 1
            return _NO_OVERHEAD
        return None
    key = replay_key(regions, sizes, settings)
    if key in _RESULTS:
        return _RESULTS[key]
    from toolkit import cache

    stored = cache.get("reserved", key, code=replayed_reserved, decode=lambda d: Replay(**d))
    if stored is None and left_out is not None:
        left_out[0] += 1
        return _NO_OVERHEAD
    if stored is None:
        replayer = Replayer(AllocatorSettings.from_conf(settings))
        events = emit_step_events(regions, sizes, replayer)
        stats = replayer.allocator.stats
        stored = Replay(peak_allocated=stats.peak_allocated, peak_reserved=stats.peak_reserved, events=events,
                        segments=stats.segments + stats.expandable_segments)
        cache.put("reserved", key, vars(stored), code=replayed_reserved)
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


def _pieces(total: float, regions, tensors: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """`total` bytes split over the regions as `_shares` splits them, and each region's share over its parameter
    tensors in proportion to their elements (`tensors`; one piece per region where it is empty)."""
    out = []
    for j, share in enumerate(_shares(total, regions)):
        numels = tensors[j] if j < len(tensors) else ()
        whole = sum(numels)
        out.append([int(share * n / whole) for n in numels] if whole else [share])
    return out


def _shares(total: float, regions) -> list[int]:
    """`total` bytes split over the regions in proportion to their parameters (evenly when none have any)."""
    params = [r.params for r in regions]
    whole = sum(params)
    return [int(total * p / whole) if whole else int(total / len(regions)) for p in params]


class _EventList:
    """The events as a list, in toolkit.estimate.allocator.replay's format (a sink for `emit_step_events`)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def malloc(self, key, size: int, stream: int | None = None) -> None:
        self.events.append(("malloc", key, size) if stream is None else ("malloc", key, size, stream))

    def free(self, key) -> None:
        self.events.append(("free", key))

    def record_stream(self, key, stream: int) -> None:
        self.events.append(("record_stream", key, stream))

    def sync(self, stream: int) -> None:
        self.events.append(("sync", stream))

    def reset_peak(self) -> None:
        self.events.append(("reset_peak",))

    def step(self) -> None:
        self.events.append(("step",))


def _backward_buffers(sizes: StepSizes, step: int, malloc) -> int:
    """The buffers an engine makes at the first gradient hook of backward and keeps to the step (ZeRO-2:
    stage_1_and_2.py copy_grads_in_partition allocates grads_in_partition at the first bucket reduction, the
    reduce bucket with it; toolkit.estimate.memory._simulate counts them from the first region's gradients on, as
    measured on CPU); returns how many events."""
    count = 0
    if sizes.reduce_buffers and not sizes.reduce_stream:
        malloc(("reduce", step), int(sizes.reduce_buffers))
        count += 1
    if sizes.backward_gradients:
        malloc(("partitions", step), int(sizes.backward_gradients))
        count += 1
    return count


def _held_taken_out(regions, sizes: StepSizes) -> list[int]:
    """Each region's parameters that its own gathers make: all of them, less `held_gathered`'s from the head's
    region, then from the embedding's (a tied head is the embedding's matrix)."""
    own = [r.params for r in regions]
    if not sizes.held_gathered:
        return own
    left = int(sizes.held_gathered / sizes.param_bytes)
    where = {r.name: j for j, r in enumerate(regions)}
    for j in (where[name] for name in ("head + loss", "embedding") if name in where):
        taken = min(own[j], left)
        own[j], left = own[j] - taken, left - taken
    return own


def step_events(regions, sizes: StepSizes, steps: int = 2, step_regions=()) -> list[tuple]:
    """The allocator events of `steps` training steps (toolkit.estimate.allocator.replay's format)."""
    out = _EventList()
    emit_step_events(regions, sizes, out, steps, step_regions)
    return out.events


def emit_step_events(regions, sizes: StepSizes, sink, steps: int = 2, step_regions=()) -> int:
    """The events of `steps` training steps, in order, to `sink` (its malloc(key, size[, stream]), free(key),
    record_stream(key, stream), sync(stream), reset_peak() and step(), as each step begins: an allocator.Replayer,
    or a list); returns how
    many. `step_regions`: the regions (the same parameters, each step's own traces) whose events each step runs,
    where the steps' shapes differ (batches padded to their own longest sample); empty: `regions` every step."""
    n = len(regions)
    malloc, free, record_stream, sync = sink.malloc, sink.free, sink.record_stream, sink.sync
    count = 0
    rules = engine_rules(regions, sizes, sink)
    gathers = not rules.owns_gathers()

    def blocks(name: str, total: float, tensors: tuple[tuple[int, ...], ...] = (), after=None) -> None:
        nonlocal count
        for j, sizes_j in enumerate(_pieces(total, regions, tensors)):
            for t, size in enumerate(sizes_j):
                if size > 0:
                    malloc((name, j, t), size)
                    count += 1
            if after is not None:
                after(j)

    def load() -> None:
        """The model load before the engine starts: the warmup block, the base loaded whole, then (`unload`) each
        region's loaded weights freed once its partition exists (DeepSpeed partitions parameter by parameter)."""
        nonlocal count
        if sizes.load_warmup > 0:
            malloc(("warmup",), int(sizes.load_warmup))
            free(("warmup",))
            count += 2
        blocks("loaded", sizes.loaded)

    def unload(j: int) -> None:
        nonlocal count
        if loaded[j] > 0:
            free(("loaded", j, 0))
            count += 1

    loaded = _shares(sizes.loaded, regions)

    load()
    blocks("state", sizes.persistent, after=unload)
    for i, size in enumerate(sizes.init_buffers):  # cached from here on: the step's first tensors reuse them
        malloc(("init", i), size)
    for i, _ in enumerate(sizes.init_buffers):
        free(("init", i))
    count += 2 * len(sizes.init_buffers)
    if sizes.loaded or sizes.load_warmup:  # the step's peaks, as torch.cuda.reset_peak_memory_stats after loading
        sink.reset_peak()
        count += 1
    largest = max(r.params for r in regions) or 1
    gathered_params = _held_taken_out(regions, sizes)
    gather = [int(r.params * sizes.gather_bytes_per_param) if sizes.gather_bytes_per_param
              else int(sizes.gathered * own / (PREFETCH * largest)) for r, own in zip(regions, gathered_params)]
    reduce = [int(sizes.reduce_buffers * r.params / (PREFETCH * largest)) for r in regions]

    for step in range(steps):
        sink.step()
        traced = step_regions[step] if step_regions else regions
        alive: set = set()
        rotating: list = []
        if sizes.held_gathered > 0:
            malloc(("held", step), int(sizes.held_gathered), GATHER)
            record_stream(("held", step), COMPUTE)
            count += 2

        def run(j: int, phase: int, window: tuple[int, ...]) -> None:
            nonlocal count
            for birth, size, offset, born_phase, ordinal in _decoded(window):
                if birth:
                    key = ("act", j, phase, ordinal)
                    alive.add(key)
                    malloc(key, size)
                    count += 1
                else:
                    key = ("act", j + offset, born_phase, ordinal)
                    if key in alive:
                        alive.remove(key)
                        free(key)
                        count += 1

        def use(key, size: int, stream: int) -> None:
            """A buffer made on `stream`, used by the compute stream, freed PREFETCH regions later."""
            nonlocal count
            if size <= 0:
                return
            if len(rotating) == PREFETCH:  # the region before the previous one is done
                free(rotating.pop(0))
                sync(COMPUTE)
                count += 2
            malloc(key, size, stream)
            record_stream(key, COMPUTE)
            rotating.append(key)
            count += 2

        for j, r in enumerate(regions):
            rules.before_forward(step, j)
            if gathers and j in sizes.kept_regions:
                if gather[j] > 0:
                    malloc(("kept", step, j), gather[j], GATHER)
                    record_stream(("kept", step, j), COMPUTE)
                    count += 2
            elif gathers:
                use(("gather", step, FORWARD, j), gather[j], GATHER)
            run(j, FORWARD, traced[j].trace.forward_events)
            rules.after_forward(step, j)
        rules.end_forward(step)
        # The engine's rules make their own gradients (FSDP2's sharded ones, ZeRO-3's per parameter)
        grads = _pieces(0 if not gathers else sizes.step_gradients, regions,
                        sizes.tensors if sizes.tensor_grads else ())
        for j in reversed(range(n)):
            rules.before_backward(step, j)
            if gathers and j not in sizes.kept_regions:
                use(("gather", step, BACKWARD, j), gather[j], GATHER)
            run(j, BACKWARD, traced[j].trace.backward_events)
            for t, size in enumerate(grads[j]):
                if size > 0:
                    malloc(("grad", step, j, t), size)
                    count += 1
            rules.after_backward(step, j)
            if gathers and sizes.reduce_stream:
                use(("reduce", step, j), reduce[j], REDUCE)
            if j == n - 1:  # the first gradients exist: the engine's backward buffers appear at their first hook
                count += _backward_buffers(sizes, step, malloc)
        rules.end_backward(step)
        for key in rotating:
            free(key)
            count += 1
        for j in sizes.kept_regions if gathers else ():
            if gather[j] > 0:
                free(("kept", step, j))
                count += 1
        if sizes.held_gathered > 0:
            free(("held", step))
            count += 1
        sync(COMPUTE)
        count += 1
        for key in sorted(alive, key=repr):
            free(key)
            count += 1
        if sizes.reduce_buffers and not sizes.reduce_stream:
            free(("reduce", step))
            count += 1
        flat = sizes.flat_partitions
        if step == 0 and flat:
            # torch's Adam: each state a zeros_like of the flat partition (exp_avg, then exp_avg_sq: 4 B each)
            per_element = sizes.optimizer / sum(flat)
            states = max(1, round(per_element / 4))
            for i, elements in enumerate(flat):
                for k in range(states):
                    malloc(("optimizer", i, k), int(elements * per_element / states))
                    count += 1
        elif step == 0:
            blocks("optimizer", sizes.optimizer, sizes.tensors)
        if rules.step_temporaries(step):
            pass
        elif sizes.step_transient > 0 and flat:  # the fp32 gradient of one partition at a time
            for i, elements in enumerate(flat):
                malloc(("step", step, i), int(sizes.step_transient * elements / max(flat)))
                free(("step", step, i))
                count += 2
        elif sizes.step_transient > 0:  # foreach: one temporary per parameter, all alive until the step's last op
            temporaries = [(("step", step, j, t), size) for j, sizes_j in
                           enumerate(_pieces(sizes.step_transient, regions, sizes.tensors))
                           for t, size in enumerate(sizes_j) if size > 0]
            for key, size in temporaries:
                malloc(key, size)
            for key, _ in temporaries:
                free(key)
            count += 2 * len(temporaries)
        for j, sizes_j in enumerate(grads):
            for t, size in enumerate(sizes_j):
                if size > 0:
                    free(("grad", step, j, t))
                    count += 1
        rules.zero_grad(step)
        if sizes.backward_gradients:
            free(("partitions", step))
            count += 1
    return count + rules.emitted

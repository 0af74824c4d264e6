"""The traced step's allocations and frees, in order, cut by region: what the caching-allocator replay
(toolkit.estimate.reserved) feeds to toolkit.estimate.allocator.

The tracer's storage log (toolkit.estimate.recording.StorageLog) sees every storage an op creates and, through a
weakref, when it dies. Each region (embedding, every decoder layer, head + loss) gets the events of its forward
window and of its backward window. A birth is its size in bytes (a positive int); a death names the storage by
where it was born, relative to the region it dies in, packed into one negative int (`free_code`): the region
offset, the phase and its birth's ordinal in that window. So a layer's events can be copied to every layer of the
same kind of the full-depth model: a layer's backward frees what the same layer's forward saved, and the gradient
it passes down is freed by the next region of the copy. Plain ints only: the events travel in the trace's disk
cache (JSON) and hash fast.
"""

from __future__ import annotations

from functools import lru_cache

FORWARD, BACKWARD = 0, 1
_OFFSET = 16
"""Region offsets a death may reach, either way (a storage dies at most a few regions from where it was born)."""


def free_code(region_offset: int, phase: int, ordinal: int) -> int:
    return -(((ordinal << 6) | ((region_offset + _OFFSET) << 1) | phase) + 1)


def decode_free(code: int) -> tuple[int, int, int]:
    """(region offset, phase, ordinal) of a death `free_code` packed."""
    packed = -code - 1
    return ((packed >> 1) & 31) - _OFFSET, packed & 1, packed >> 6


def _window_of(mark: str, n: int) -> tuple[int, int] | None:
    """(region index, phase) an event window opened by `mark` belongs to; None for marks that open none.
    Regions: 0 the embedding, i + 1 decoder layer i, n + 1 the head."""
    kind, _, where = mark.partition(":")
    layer = int(where[5:]) if where.startswith("layer") else None
    if mark == "f:embedding":
        return 0, FORWARD
    if kind == "f" and layer is not None:
        return layer + 1, FORWARD
    if kind == "e" and layer == n - 1:
        return n + 1, FORWARD
    if mark == "b:begin":
        return n + 1, BACKWARD
    if kind == "b" and layer is not None:
        return layer + 1, BACKWARD
    if mark == "be:layer0":
        return 0, BACKWARD
    if mark == "b:end":
        return -1, FORWARD
    return None


def region_events(events: list[tuple[int, int]], marks: dict[str, int], n: int,
                  excluded: set) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(forward events, backward events) of each region, embedding first, from the storage log's (serial,
    +-bytes) events and its marks. Storages in `excluded` (parameter gradients: the memory model allocates them
    as the engine does) and those born outside every window (the batch, the parameters) are left out; storages
    alive when backward ends have no death here (the replay frees them at the end of the step)."""
    opened = sorted(((pos, i, w) for i, (m, pos) in enumerate(marks.items())
                     if (w := _window_of(m, n)) is not None), key=lambda x: (x[0], x[1]))
    out = [([], []) for _ in range(n + 2)]
    births: dict[int, tuple[int, int, int]] = {}
    ordinals: dict[tuple[int, int], int] = {}
    window, w = None, 0
    head = (n + 1, FORWARD)
    between = False  # the last layer has returned and the head has allocated nothing yet
    for k, (serial, delta) in enumerate(events):
        while w < len(opened) and opened[w][0] <= k:
            window, w = opened[w][2], w + 1
            between = window == head
        if window is None or window[0] < 0 or serial in excluded:
            continue
        region, phase = window
        if delta > 0:
            between = False
            ordinal = ordinals.get(window, 0)
            ordinals[window] = ordinal + 1
            births[serial] = (region, phase, ordinal)
            out[region][phase].append(delta)
        elif serial in births:
            if between:
                # What dies as the last layer returns (the decoder loop rebinding hidden_states frees the layer's
                # input) is the last layer's, as a shallower layer's dies in its own window before the next layer's
                # mark: so a copy of the last traced layer frees its own input, as it would at depth.
                region = n
            born_region, born_phase, ordinal = births.pop(serial)
            if abs(born_region - region) < _OFFSET:
                out[region][phase].append(free_code(born_region - region, born_phase, ordinal))
    return [(tuple(f), tuple(b)) for f, b in out]


@lru_cache(maxsize=4096)
def lerp_events(a: tuple[int, ...], b: tuple[int, ...], f: float) -> tuple[int, ...]:
    """Events at a point between (or past) two traces of the same step: births' sizes are interpolated where both
    traces have the same events in the same order (sizes affine in the batch or the length), else () (no events:
    the replay falls back to the margin)."""
    if len(a) != len(b) or [min(x, 0) for x in a] != [min(y, 0) for y in b]:
        return ()
    return tuple(x if x < 0 else max(1, int(round(x + (y - x) * f))) for x, y in zip(a, b))

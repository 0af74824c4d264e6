"""PyTorch's CUDA caching allocator, replayed on a sequence of allocations and frees: what
`torch.cuda.max_memory_reserved()` becomes for a step whose tensors we know, from the allocator's own rules rather
than a margin.

Written from c10/cuda/CUDACachingAllocator.cpp (the rules and their source lines are in docs/ENGINE_FACTS.md,
"The CUDA caching allocator"). What it models:
- sizes rounded to 512 bytes (or to `roundup_power2_divisions` of a power of two); requests of at most 1 MiB go to
  the small pool, carved from 2 MiB segments; larger ones to the large pool: a 1-10 MiB request opens a 20 MiB
  segment, a larger one a segment of its size rounded up to 2 MiB;
- best fit: the smallest cached block of the same stream that is large enough (ordered by stream, size, address);
  a found block is split when the rest is at least 512 bytes (small pool, or expandable segments) or more than
  1 MiB (large pool) and the request is under `max_split_size`; blocks of at least `max_split_size` serve only
  requests within 20 MiB of their size;
- a freed block merges with free neighbours of its segment; a block used on another stream (`record_stream`) is
  only freed once that stream's work is done (`sync`), at the next allocation;
- on a failed segment allocation (past `capacity`): free oversize cached blocks (with `max_split_size`), then every
  unsplit cached segment, then retry once; still failing is an out-of-memory. `capacity` is checked as
  `alloc_block` checks a memory fraction: reserved + the request's segment size (`allocation_size`), also with
  expandable segments, where it is the whole request, not the pages still to map;
- `expandable_segments`: one segment per pool and stream that maps 2 MiB (small) / 20 MiB (large) pages as it
  grows, the lowest free address first; reserved memory is the mapped pages; such a segment is not counted in
  `segments` (torch's `segment` statistic counts cudaMalloc segments only) but in `expandable_segments`;
- `garbage_collection_threshold` (only with a capacity, as PyTorch applies it only under a memory fraction): before
  a new segment, when reserved memory passes the threshold, free the unsplit cached large segments at least as old
  (in lookups) as their average, until under it.
Not modelled: CUDA graph pools, IPC, multiple devices, the free-memory callbacks.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, replace

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20
NO_LIMIT = 1 << 62


@dataclass(frozen=True)
class AllocatorSettings:
    """The allocator's settings, as PYTORCH_CUDA_ALLOC_CONF spells them (`from_conf`)."""

    expandable_segments: bool = False
    max_split_size: int = NO_LIMIT
    roundup_power2_divisions: int = 0
    garbage_collection_threshold: float = 0.0
    capacity: int | None = None
    """Bytes the process may reserve (torch.cuda.set_per_process_memory_fraction's limit: checked before every new
    segment or mapping as reserved + the request's segment size); None: no limit."""

    @classmethod
    def from_conf(cls, conf: str, *, capacity: int | None = None) -> "AllocatorSettings":
        """`expandable_segments:True,max_split_size_mb:128,...` (the keys PyTorch reads; others are refused)."""
        values: dict = {}
        for item in filter(None, (part.strip() for part in conf.split(","))):
            key, _, value = item.partition(":")
            if key == "expandable_segments":
                values[key] = value == "True"
            elif key == "max_split_size_mb":
                values["max_split_size"] = int(value) << 20
            elif key == "roundup_power2_divisions":
                values[key] = int(value)
            elif key == "garbage_collection_threshold":
                values[key] = float(value)
            else:
                raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF key {key!r} is not modelled; use expandable_segments, "
                                 "max_split_size_mb, roundup_power2_divisions or garbage_collection_threshold")
        return cls(capacity=capacity, **values)


MODELLED_KEYS = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold")


def modelled_conf(conf: str) -> tuple[str, tuple[str, ...]]:
    """`conf` with only the keys the model replays (torch's others, e.g. pinned_use_cuda_host_register, leave the
    device allocator's segments alone), and the keys left out."""
    kept, dropped = [], []
    for item in filter(None, (part.strip() for part in conf.split(","))):
        (kept if item.partition(":")[0] in MODELLED_KEYS else dropped).append(item)
    return ",".join(kept), tuple(item.partition(":")[0] for item in dropped)


@dataclass(eq=False, slots=True)
class _Block:
    stream: int
    size: int
    ptr: int
    pool: "_Pool"
    allocated: bool = False
    mapped: bool = True
    expandable: bool = False
    prev: "_Block | None" = None
    next: "_Block | None" = None
    uses: set[int] | None = None
    """Other streams the block was used on (record_stream): it is freed only when they are synced (made on the
    first record_stream: most blocks never get one)."""
    gc_base: int = 0
    requested: int = 0
    """The bytes asked for (before rounding), while allocated."""

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def free_to_merge(self) -> bool:
        return not self.allocated and not self.uses


class _Pool:
    """Cached free blocks ordered by (stream, size, address), and unmapped expandable ranges by (stream, address).
    The order's keys are ints, `stream << 128 | size << 64 | address` (sizes and addresses stay far below 2**64):
    they sort as the (stream, size, address) tuples do and compare several times faster."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}
        self.unmapped: dict[tuple[int, int], _Block] = {}
        self.lookups = 0

    def insert(self, block: _Block) -> None:
        key = block.stream << 128 | block.size << 64 | block.ptr
        insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.lookups

    def erase(self, block: _Block) -> None:
        key = block.stream << 128 | block.size << 64 | block.ptr
        del self.blocks[key]
        del self.keys[bisect_left(self.keys, key)]

    def from_key(self, stream: int, size: int):
        """Cached blocks of `stream` at least `size` large, smallest first (std::set lower_bound and onwards),
        lazily: a lookup reads only the blocks it needs."""
        keys, i = self.keys, bisect_left(self.keys, stream << 128 | size << 64)
        while i < len(keys) and keys[i] >> 128 == stream:
            yield self.blocks[keys[i]]
            i += 1


@dataclass
class AllocatorStats:
    allocated: int = 0
    """Bytes of the blocks handed out (torch.cuda.memory_allocated: rounded, with any unsplit remainder)."""
    requested: int = 0
    reserved: int = 0
    """Bytes of segments from cudaMalloc, or of mapped pages (torch.cuda.memory_reserved)."""
    peak_allocated: int = 0
    peak_requested: int = 0
    peak_reserved: int = 0
    segments: int = 0
    """cudaMalloc segments held (torch.cuda.memory_stats' `segment.all.current`, which leaves expandable ones out)."""
    expandable_segments: int = 0
    """Expandable segments (address ranges mapped page by page): not in torch's `segment` statistic."""
    device_allocs: int = 0
    device_alloc_bytes: int = 0
    """Bytes taken from the device: cudaMalloc'ed segments, or pages mapped into an expandable segment."""
    device_frees: int = 0
    """Calls giving memory back: a cached segment's cudaFree, or one unmapped range of an expandable segment."""
    device_freed_bytes: int = 0
    alloc_retries: int = 0
    ooms: int = 0

    @property
    def fragmentation(self) -> int:
        """Reserved bytes above the allocated peak at the reserved peak's high-water mark."""
        return self.peak_reserved - self.peak_allocated


class OutOfMemory(Exception):
    pass


class CachingAllocator:
    """One device's allocator. malloc() returns a handle for free() / record_stream()."""

    def __init__(self, settings: AllocatorSettings | None = None) -> None:
        self.settings = settings or AllocatorSettings()
        self.small, self.large = _Pool(True), _Pool(False)
        self.stats = AllocatorStats()
        self._next_ptr = 0
        self._handles: dict[int, _Block] = {}
        self._pending: list[_Block] = []
        self._synced: set[int] = set()
        self._next_handle = 0
        settings = self.settings  # read once: the hot path asks on every allocation
        self._plain_rounding = settings.roundup_power2_divisions <= 1
        self._expandable = settings.expandable_segments
        self._max_split = settings.max_split_size
        self._collects = settings.garbage_collection_threshold > 0 and settings.capacity is not None

    # ------------------------------------------------------------------------------------------------ rules

    def round_size(self, size: int) -> int:
        if size < MIN_BLOCK:
            return MIN_BLOCK
        divisions = self.settings.roundup_power2_divisions
        if divisions > 1 and size > MIN_BLOCK * divisions:
            if size & (size - 1) == 0:
                return size
            floor = 1 << (size.bit_length() - 1)
            step = floor >> (divisions.bit_length() - 1)
            if step == 0:
                return floor << 1
            base = size & ~(step - 1)
            return size if base == size else base + step
        return MIN_BLOCK * -(-size // MIN_BLOCK)

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return ROUND_LARGE * -(-size // ROUND_LARGE)

    # ------------------------------------------------------------------------------------------------ public

    def malloc(self, size: int, stream: int = 0) -> int:
        block = self.allocate(size, stream)
        self._next_handle += 1
        self._handles[self._next_handle] = block
        return self._next_handle

    def free(self, handle: int) -> None:
        self.release(self._handles.pop(handle))

    def record_stream(self, handle: int, stream: int) -> None:
        self.use_on(self._handles[handle], stream)

    def sync(self, stream: int) -> None:
        """The work queued on `stream` so far has completed: its recorded events are done."""
        self._synced.add(stream)

    def reset_peak(self) -> None:
        """torch.cuda.reset_peak_memory_stats: every peak down to its current value (segments stay reserved)."""
        s = self.stats
        s.peak_allocated, s.peak_requested, s.peak_reserved = s.allocated, s.requested, s.reserved

    # The same three on the block itself (what `replay` calls: no handle table in between).

    def allocate(self, size: int, stream: int = 0) -> _Block:
        if self._pending:
            self._process_events()
        if size < MIN_BLOCK:
            rounded = MIN_BLOCK
        elif self._plain_rounding:
            rounded = MIN_BLOCK * -(-size // MIN_BLOCK)
        else:
            rounded = self.round_size(size)
        pool = self.small if rounded <= SMALL_SIZE else self.large
        block = self._free_block(pool, rounded, stream)
        if block is None:
            if self._collects:
                self._garbage_collect()
            block = self._new_block(pool, rounded, stream)
            if block is None and self._release_oversize(pool, rounded, stream):
                block = self._new_block(pool, rounded, stream)
            if block is None:
                self._release_cached()
                self.stats.alloc_retries += 1
                block = self._new_block(pool, rounded, stream)
            if block is None:
                self.stats.ooms += 1
                raise OutOfMemory(f"{size} bytes on stream {stream}: {self.stats.reserved} reserved of "
                                  f"{self.settings.capacity}")
        remaining = block.size - rounded
        if (remaining >= MIN_BLOCK if pool.small or self._expandable
                else rounded < self._max_split and remaining > SMALL_SIZE):  # _should_split
            rest = _Block(stream, remaining, block.ptr + rounded, pool, expandable=block.expandable,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            pool.insert(rest)
        block.allocated = True
        block.requested = size
        s = self.stats
        s.allocated += block.size
        s.requested += size
        if s.allocated > s.peak_allocated:
            s.peak_allocated = s.allocated
        if s.requested > s.peak_requested:
            s.peak_requested = s.requested
        return block

    def release(self, block: _Block) -> None:
        block.allocated = False
        self.stats.allocated -= block.size
        self.stats.requested -= block.requested
        if block.uses:
            self._pending.append(block)  # an event per stream; freed when it completes
        else:
            self._free(block)

    def use_on(self, block: _Block, stream: int) -> None:
        if stream != block.stream:
            if block.uses is None:
                block.uses = set()
            block.uses.add(stream)
            self._synced.discard(stream)

    # ------------------------------------------------------------------------------------------------ inside

    def _process_events(self) -> None:
        if not self._pending:
            return
        for block in list(self._pending):
            block.uses -= self._synced
            if not block.uses:
                block.uses = None
                self._pending.remove(block)
                self._free(block)

    def _free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        if self._collects:
            pool.lookups += 1
        keys = pool.keys
        i = bisect_left(keys, stream << 128 | size << 64)
        if i == len(keys) or keys[i] >> 128 != stream:
            return None
        blocks = pool.blocks
        block = blocks[keys[i]]
        if block.expandable:  # walk on while the next block of the stream could grow less (unmapped space after it)
            nxt = block.next
            grows = block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
            for j in range(i + 1, len(keys)):
                if keys[j] >> 128 != stream or not block.expandable:
                    break
                other = blocks[keys[j]]
                nxt = other.next
                other_grows = other.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
                if other_grows >= grows:
                    break
                block, grows, i = other, other_grows, j
        limit = self._max_split
        if size < limit <= block.size or (size >= limit and block.size >= size + LARGE_BUFFER):
            return None
        # keys[i] is the block's (the first at or above the request, or the one the walk stopped at): no second search
        del blocks[keys[i]]
        del keys[i]
        return block

    def _new_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        alloc = self.allocation_size(size)
        # alloc_block's memory-fraction check, before either kind of segment: the whole request's segment size, even
        # where an expandable segment maps only the pages it lacks (a retry that unmaps the free pages can follow)
        if self.settings.capacity is not None and self.stats.reserved + alloc > self.settings.capacity:
            return None
        if self.settings.expandable_segments:
            return self._expandable_block(pool, size, stream)
        block = _Block(stream, alloc, self._address(alloc), pool)
        self._reserve(alloc)
        self.stats.segments += 1
        return block

    def _address(self, size: int) -> int:
        ptr = self._next_ptr
        # segments never touch (a neighbour is always one's own split), and each starts on a 20 MiB page, as
        # cuMemAddressReserve aligns an expandable segment's range to its page: a retry unmaps every whole free page
        end = ptr + size + (1 << 30)
        self._next_ptr = -(-end // LARGE_BUFFER) * LARGE_BUFFER
        return ptr

    def _reserve(self, nbytes: int) -> None:
        s = self.stats
        s.reserved += nbytes
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        s.device_allocs += 1
        s.device_alloc_bytes += nbytes

    def _free(self, block: _Block) -> None:
        if block.prev is not None:
            self._merge(block, block.prev, block.pool)
        if block.next is not None:
            self._merge(block, block.next, block.pool)
        block.pool.insert(block)

    def _merge(self, dst: _Block, src: _Block | None, pool: _Pool) -> None:
        if src is None or src.allocated or src.uses or dst.mapped != src.mapped or src in self._pending:
            return
        if src.mapped:
            pool.erase(src)
        else:
            del pool.unmapped[(src.stream, src.ptr)]
        if dst.prev is src:
            dst.ptr, dst.prev = src.ptr, src.prev
            if src.prev is not None:
                src.prev.next = dst
        else:
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size

    # ----- expandable segments

    def _page(self, pool: _Pool) -> int:
        return SMALL_BUFFER if pool.small else LARGE_BUFFER

    def _expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        candidate = None
        for (s, _), block in sorted(pool.unmapped.items()):
            if s != stream:
                continue
            start = block.prev if block.prev is not None and block.prev.free_to_merge() and block.prev.mapped \
                and block.prev not in self._pending else block
            room, b = 0, start
            # a free block still waiting on another stream's event (_pending) does not merge: the range ends there
            while b is not None and room < size and b.free_to_merge() and b not in self._pending:
                room, b = room + b.size, b.next
            if room >= size:
                candidate = start
                break
        if candidate is None:  # a new segment: address space for the whole device (1 1/8 of its memory)
            page = self._page(pool)
            space = (self.settings.capacity or (1 << 40)) * 9 // 8
            # With no device size given (a replay measuring the peak alone) the range holds any request; with one, a
            # request beyond it is refused when mapped (_map), an out-of-memory, as torch's reserve fails.
            space = max(space - space % page, page * -(-size // page))
            candidate = _Block(stream, space, self._address(space), pool, mapped=False, expandable=True)
            pool.unmapped[(stream, candidate.ptr)] = candidate
            self.stats.expandable_segments += 1
        if not candidate.mapped:
            self._map(candidate, min(candidate.size, size))
        while candidate.size < size:
            after = candidate.next
            self._map(after, min(size - candidate.size, after.size))
            candidate = after
        pool.erase(candidate)
        return candidate

    def _map(self, block: _Block, size: int) -> None:
        page = self._page(block.pool)
        nbytes = min(block.size, page * -(-size // page))
        pool = block.pool
        del pool.unmapped[(block.stream, block.ptr)]
        block.mapped = True
        if nbytes < block.size:
            rest = _Block(block.stream, block.size - nbytes, block.ptr + nbytes, pool, mapped=False,
                          expandable=True, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, nbytes
            pool.unmapped[(rest.stream, rest.ptr)] = rest
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.insert(block)
        self._reserve(nbytes)

    def _unmap(self, block: _Block) -> None:
        """Unmap the whole pages inside a free mapped block (what an out-of-memory retry returns to the device)."""
        page, pool = self._page(block.pool), block.pool
        begin = -(-block.ptr // page) * page
        end = (block.ptr + block.size) // page * page
        if end <= begin:
            return
        pool.erase(block)
        if end < block.ptr + block.size:  # a mapped tail stays
            tail = _Block(block.stream, block.ptr + block.size - end, end, pool, expandable=True, prev=block,
                          next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = end - block.ptr
            pool.insert(tail)
        if begin > block.ptr:  # a mapped head stays
            head = _Block(block.stream, begin - block.ptr, block.ptr, pool, expandable=True, prev=block.prev,
                          next=block)
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            block.ptr, block.size = begin, block.size - (begin - block.ptr)
            pool.insert(head)
        block.mapped = False
        self._give_back(block.size)
        self._merge(block, block.prev, pool)
        self._merge(block, block.next, pool)
        pool.unmapped[(block.stream, block.ptr)] = block

    # ----- giving memory back

    def _release(self, block: _Block) -> None:
        block.pool.erase(block)
        self._give_back(block.size)
        self.stats.segments -= 1

    def _give_back(self, nbytes: int) -> None:
        s = self.stats
        s.reserved -= nbytes
        s.device_frees += 1
        s.device_freed_bytes += nbytes

    def _release_oversize(self, pool: _Pool, size: int, stream: int) -> bool:
        limit = self.settings.max_split_size
        if limit == NO_LIMIT:
            return False
        key = max(size, limit)
        found = next(pool.from_key(stream, key), None)
        if found is not None:
            self._release(found)
            return True
        oversize = sorted((b for b in pool.blocks.values() if b.stream == stream and b.size >= limit),
                          key=lambda b: (b.size, b.ptr), reverse=True)
        released = 0
        for block in oversize:
            if released >= key:
                break
            released += block.size
            self._release(block)
        return released >= key

    def _release_cached(self) -> None:
        for block in list(self._pending):  # synchronize_and_free_events
            block.uses = None
            self._pending.remove(block)
            self._free(block)
        for pool in (self.large, self.small):
            for block in list(pool.blocks.values()):
                if block.expandable:
                    self._unmap(block)
                elif not block.is_split():
                    self._release(block)

    def _garbage_collect(self) -> None:
        capacity = self.settings.capacity or 0
        threshold = int(self.settings.garbage_collection_threshold * capacity)
        if self.stats.reserved <= threshold:
            return
        target, reclaimed = self.stats.reserved - threshold, 0
        pool = self.large
        freeable = [b for b in pool.blocks.values() if not b.is_split() and not b.expandable]
        while reclaimed < target and freeable:
            average = sum(pool.lookups - b.gc_base for b in freeable) / len(freeable)
            old = [b for b in freeable if pool.lookups - b.gc_base >= average]
            if not old:
                break
            for block in old:
                reclaimed += block.size
                self._release(block)
            freeable = [b for b in freeable if b not in old]


class Replayer:
    """Allocator events by the caller's names for its tensors, straight into one allocator: what `replay` does
    with a list of events, for a caller that makes them one at a time (toolkit.estimate.reserved)."""

    def __init__(self, settings: AllocatorSettings | None = None) -> None:
        self.allocator = CachingAllocator(settings)
        self.blocks: dict = {}
        self.step_start = AllocatorStats()

    def step(self) -> None:
        """A training step begins: the allocator's counters as they stand (toolkit.estimate.retries counts from here)."""
        self.step_start = replace(self.allocator.stats)

    def malloc(self, key, size: int, stream: int = 0) -> None:
        self.blocks[key] = self.allocator.allocate(size, stream)

    def free(self, key) -> None:
        self.allocator.release(self.blocks.pop(key))

    def record_stream(self, key, stream: int) -> None:
        self.allocator.use_on(self.blocks[key], stream)

    def sync(self, stream: int) -> None:
        self.allocator.sync(stream)

    def reset_peak(self) -> None:
        self.allocator.reset_peak()


def replay(events, settings: AllocatorSettings | None = None) -> AllocatorStats:
    """Replay `events` through one allocator: ("malloc", key, size[, stream]), ("free", key),
    ("record_stream", key, stream), ("sync", stream), ("reset_peak",), ("step",) (a step begins). Keys are the caller's
    names for its tensors."""
    r = Replayer(settings)
    malloc, free, record_stream, sync = r.malloc, r.free, r.record_stream, r.sync
    for event in events:
        kind = event[0]
        if kind == "malloc":
            malloc(*event[1:])
        elif kind == "free":
            free(event[1])
        elif kind == "record_stream":
            record_stream(event[1], event[2])
        elif kind == "sync":
            sync(event[1])
        elif kind == "reset_peak":
            r.reset_peak()
        elif kind == "step":
            r.step()
        else:
            raise ValueError(f"unknown allocator event {kind!r}")
    return r.allocator.stats

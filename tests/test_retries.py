"""Allocator retries at a capacity (toolkit.estimate.retries): how many a step causes and what each gives back, on
small synthetic event sequences, each against the rule c10/cuda/CUDACachingAllocator.cpp documents: a segment the
capacity refuses frees every unsplit cached segment (cudaFree), or unmaps an expandable segment's free pages, then
allocates again."""

from __future__ import annotations

from toolkit.estimate.allocator import AllocatorSettings
from toolkit.estimate.retries import StepRetries, replay_retries

MiB = 1 << 20
GIB = 1 << 30

# Two streams take turns: stream 0's 60 MiB block, then stream 1's 80 MiB one. A cached block serves only its own
# stream, so under 100 MiB each step's second request finds the other stream's segment in the way.
STEP = [("malloc", "a", 60 * MiB, 0), ("free", "a"), ("malloc", "b", 80 * MiB, 1), ("free", "b")]
TWO_STEPS = [("step",), *STEP, ("step",), *STEP]


def test_a_step_whose_streams_cannot_share_a_capped_cache_retries_twice_and_frees_both_segments():
    r = replay_retries(TWO_STEPS, AllocatorSettings(capacity=100 * MiB))
    # step 2: a (60) finds b's 80 MiB segment cached on stream 1: 80 + 60 > 100, retry, cudaFree 80, cudaMalloc 60;
    # b (80) then frees a's 60 and takes 80
    assert r == StepRetries(retries=2, device_frees=2, freed_bytes=140 * MiB, device_allocs=2, alloc_bytes=140 * MiB)


def test_expandable_segments_unmap_the_other_streams_free_pages_and_map_them_again():
    r = replay_retries(TWO_STEPS, AllocatorSettings(expandable_segments=True, capacity=100 * MiB))
    assert (r.retries, r.freed_bytes, r.alloc_bytes, r.expandable) == (2, 140 * MiB, 140 * MiB, True)


def test_a_capacity_above_the_uncapped_reserved_peak_retries_never():
    r = replay_retries(TWO_STEPS, AllocatorSettings(capacity=140 * MiB))
    assert r == StepRetries()  # both segments stay cached: step 2 takes nothing from the device
    first = replay_retries(TWO_STEPS[:5], AllocatorSettings(capacity=100 * MiB))
    assert (first.retries, first.device_allocs) == (1, 2)  # step 1 alone: the retry, and two cudaMalloc


def test_a_request_beyond_the_capacity_after_the_retry_is_out_of_memory():
    r = replay_retries([("step",), ("malloc", "a", 60 * MiB), ("malloc", "b", 60 * MiB)],
                       AllocatorSettings(capacity=100 * MiB))
    assert r.oom and r.retries == 1
    assert "out of memory" in r.words({"free_malloc_s_per_call": 1.0, "unmap_map_s_per_gib": 1.0})


def test_the_price_is_per_call_or_per_gib_unmapped_and_mapped_again():
    cost = {"free_malloc_s_per_call": 0.002, "unmap_map_s_per_gib": 0.01}
    default = replay_retries(TWO_STEPS, AllocatorSettings(capacity=100 * MiB))
    expandable = replay_retries(TWO_STEPS, AllocatorSettings(expandable_segments=True, capacity=100 * MiB))
    assert default.seconds(cost) == 0.002 * 2 * 2  # two segments, each a cudaFree and a cudaMalloc
    assert expandable.seconds(cost) == 0.01 * 140 * MiB / GIB
    assert StepRetries().seconds(cost) == 0.0
    assert default.words(cost) == ("allocator retries 2 a step: +0.008 s (2 segments (0.14 GiB) freed and "
                                   "allocated again)")

"""The caching allocator model (jobs/caching_allocator.py) against the rules of PyTorch's
c10/cuda/CUDACachingAllocator.cpp: figures worked out by hand from the source's rules."""

from __future__ import annotations

import random

import pytest

from oomguard.jobs.caching_allocator import (
    AllocatorOOM,
    AllocatorOutOfMemory,
    AllocatorSizes,
    CachingAllocator,
    MiB,
)

KiB = 1 << 10


def sizes_in(allocator: CachingAllocator) -> list[list[tuple[int, bool]]]:
    """Each segment's blocks as (size in bytes, allocated)."""
    return [[(b.size, b.allocated) for b in segment] for segment in allocator.snapshot()]


# -- sizes ------------------------------------------------------------------------------------


def test_sizes_default_to_pytorchs_constants_and_scale():
    sizes = AllocatorSizes()
    assert (sizes.min_block, sizes.small_size, sizes.small_buffer) == (512, MiB, 2 * MiB)
    assert (sizes.min_large_alloc, sizes.round_large, sizes.large_buffer) == (10 * MiB, 2 * MiB, 20 * MiB)
    assert AllocatorSizes().scaled(1) == sizes
    scaled = sizes.scaled(1024)
    assert (scaled.min_block, scaled.small_size, scaled.large_buffer) == (1, KiB, 20 * KiB)
    assert sizes.scaled(256).min_block == 2
    for bad in (0, 3, -2, 6):
        with pytest.raises(ValueError):
            sizes.scaled(bad)
    with pytest.raises(ValueError):
        sizes.scaled(1 << 22)  # 1 MiB is no multiple of 4 MiB


# -- rounding and pools -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "block", "reserved"),
    [
        (1, 512, 2 * MiB),  # round_size: under 512 -> 512; small pool, 2 MiB segment
        (512, 512, 2 * MiB),
        (513, 1024, 2 * MiB),
        (MiB, MiB, 2 * MiB),  # 1 MiB is still small
        (MiB + 1, MiB + 512, 20 * MiB),  # large pool; 1-10 MiB asks for a 20 MiB segment
        (10 * MiB - 1, 10 * MiB, 10 * MiB),  # rounds to exactly 10 MiB: no longer "< 10 MiB"
        (10 * MiB, 10 * MiB, 10 * MiB),
        (11 * MiB, 12 * MiB, 12 * MiB),  # segment 12 MiB; 1 MiB left is not > 1 MiB: unsplit
    ],
)
def test_rounding_pool_and_segment_size(nbytes, block, reserved):
    allocator = CachingAllocator(None)
    handle = allocator.malloc(nbytes)
    assert allocator.block_size(handle) == block
    assert allocator.allocated == block
    assert allocator.reserved == reserved


def test_pools_do_not_share_blocks():
    allocator = CachingAllocator(None)
    allocator.free(allocator.malloc(2 * MiB))  # a cached 20 MiB large segment
    allocator.malloc(100)  # small: needs its own 2 MiB segment
    assert allocator.reserved == 22 * MiB
    allocator.free(allocator.malloc(1000))
    allocator.malloc(MiB + 512)  # large: back in the cached 20 MiB segment
    assert allocator.reserved == 22 * MiB


def test_zero_bytes_is_a_null_handle():
    allocator = CachingAllocator(0)
    handle = allocator.malloc(0)
    assert handle == 0 and allocator.block_size(handle) == 0
    assert allocator.reserved == allocator.allocated == 0
    allocator.free(handle)
    allocator.free(handle)  # free(nullptr) is a no-op
    with pytest.raises(ValueError):
        allocator.malloc(-1)


def test_unknown_and_double_free_raise_key_error():
    allocator = CachingAllocator(None)
    handle = allocator.malloc(4096)
    allocator.free(handle)
    with pytest.raises(KeyError):
        allocator.free(handle)
    with pytest.raises(KeyError):
        allocator.free(12345)
    with pytest.raises(KeyError):
        allocator.block_size(handle)


# -- splitting, merging, best fit ---------------------------------------------------------------


def test_small_pool_splits_down_to_512_bytes():
    allocator = CachingAllocator(None)
    allocator.malloc(MiB)
    allocator.malloc(MiB - 512)  # 512 left over: >= 512, split
    assert sizes_in(allocator) == [[(MiB, True), (MiB - 512, True), (512, False)]]
    allocator.malloc(1)  # fits the 512 bytes exactly
    assert allocator.reserved == 2 * MiB and allocator.allocated == 2 * MiB


def test_large_pool_splits_only_above_1_mib():
    allocator = CachingAllocator(None)
    whole = allocator.malloc(19 * MiB)  # 20 MiB segment, 1 MiB left: not > 1 MiB
    assert allocator.block_size(whole) == 20 * MiB and allocator.allocated == 20 * MiB
    allocator.free(whole)
    split = allocator.malloc(19 * MiB - 512)  # 1 MiB + 512 left: split
    assert allocator.block_size(split) == 19 * MiB - 512
    assert sizes_in(allocator) == [[(19 * MiB - 512, True), (MiB + 512, False)]]


def test_expandable_segments_split_large_blocks_down_to_512_bytes():
    allocator = CachingAllocator(None, expandable=True)
    handle = allocator.malloc(19 * MiB)
    assert allocator.block_size(handle) == 19 * MiB
    assert sizes_in(allocator) == [[(19 * MiB, True), (MiB, False)]]


def test_freed_blocks_merge_with_free_neighbours():
    allocator = CachingAllocator(None)
    a, b, c = (allocator.malloc(4 * MiB) for _ in range(3))  # one 20 MiB segment
    allocator.free(b)
    assert sizes_in(allocator) == [[(4 * MiB, True), (4 * MiB, False), (4 * MiB, True), (8 * MiB, False)]]
    allocator.free(c)  # merges with b before and the tail after
    assert sizes_in(allocator) == [[(4 * MiB, True), (16 * MiB, False)]]
    assert allocator.largest_free_block() == 16 * MiB
    allocator.free(a)
    assert sizes_in(allocator) == [[(20 * MiB, False)]]
    assert allocator.largest_free_block() == 20 * MiB and allocator.reserved == 20 * MiB


def test_best_fit_takes_the_smallest_block_then_the_lowest_address():
    allocator = CachingAllocator(None)
    handles = [allocator.malloc(n * MiB) for n in (14, 12, 12, 16)]
    for handle in handles:
        allocator.free(handle)
    assert allocator.largest_free_block() == 16 * MiB
    allocator.malloc(11 * MiB)  # best fit: a 12 MiB segment, the first of the two
    segments = allocator.snapshot()
    assert [[b.allocated for b in s] for s in segments] == [[False], [True], [False], [False]]
    assert allocator.allocated == 12 * MiB  # 1 MiB left over is not split off


def test_reserved_allocated_and_peaks():
    allocator = CachingAllocator(None)
    a = allocator.malloc(3 * MiB)
    b = allocator.malloc(MiB // 2)
    assert (allocator.allocated, allocator.reserved) == (3 * MiB + MiB // 2, 22 * MiB)
    allocator.free(a)
    assert (allocator.allocated, allocator.reserved) == (MiB // 2, 22 * MiB)
    assert (allocator.peak_allocated, allocator.peak_reserved) == (3 * MiB + MiB // 2, 22 * MiB)
    allocator.empty_cache()
    assert allocator.reserved == 2 * MiB  # the small segment still holds b
    allocator.reset_peak()
    assert (allocator.peak_allocated, allocator.peak_reserved) == (MiB // 2, 2 * MiB)
    allocator.free(b)
    allocator.empty_cache()
    assert allocator.reserved == 0 and allocator.largest_free_block() == 0


# -- retries, empty_cache, the limit, OOM --------------------------------------------------------


def test_cached_segments_are_released_on_retry_and_counted():
    allocator = CachingAllocator(40 * MiB)
    allocator.free(allocator.malloc(14 * MiB))
    allocator.free(allocator.malloc(14 * MiB - 512))  # best-fits the cached one: no new segment
    allocator.free(allocator.malloc(16 * MiB))
    assert allocator.reserved == 30 * MiB and allocator.num_alloc_retries == 0
    handle = allocator.malloc(30 * MiB)  # 30 + 30 > 40: release both cached segments, retry
    assert allocator.num_alloc_retries == 1 and allocator.num_ooms == 0
    assert allocator.reserved == 30 * MiB and allocator.block_size(handle) == 30 * MiB


def test_empty_cache_keeps_segments_with_live_blocks():
    allocator = CachingAllocator(None)
    a = allocator.malloc(4 * MiB)
    b = allocator.malloc(4 * MiB)  # same 20 MiB segment
    allocator.free(allocator.malloc(30 * MiB))
    allocator.free(a)
    allocator.empty_cache()
    assert allocator.reserved == 20 * MiB
    assert sizes_in(allocator) == [[(4 * MiB, False), (4 * MiB, True), (12 * MiB, False)]]
    allocator.free(b)
    allocator.empty_cache()
    assert allocator.reserved == 0 and allocator.snapshot() == []


def test_a_lowered_limit_takes_nothing_away_but_refuses_new_segments():
    allocator = CachingAllocator(None)
    a = allocator.malloc(14 * MiB)
    allocator.free(allocator.malloc(14 * MiB))
    allocator.limit = 20 * MiB  # a neighbour took memory: below reserved (28 MiB)
    assert allocator.reserved == 28 * MiB
    b = allocator.malloc(14 * MiB)  # served from the cache
    with pytest.raises(AllocatorOutOfMemory) as raised:
        allocator.malloc(2 * MiB)
    assert raised.value.oom == AllocatorOOM(requested=20 * MiB, allocated=28 * MiB, reserved=28 * MiB, limit=20 * MiB)
    assert (allocator.num_alloc_retries, allocator.num_ooms) == (1, 1)
    allocator.free(a)
    allocator.free(b)
    allocator.limit = 40 * MiB
    allocator.malloc(30 * MiB)  # the retry's release gives the two cached segments back
    assert allocator.reserved == 30 * MiB and allocator.num_alloc_retries == 2


@pytest.mark.parametrize(
    ("nbytes", "requested"),
    [(100, 2 * MiB), (MiB, 2 * MiB), (4 * MiB, 20 * MiB), (11 * MiB, 12 * MiB), (60 * MiB + 1, 62 * MiB)],
)
def test_oom_reports_the_segment_size_it_tried_to_allocate(nbytes, requested):
    # "Tried to allocate" prints alloc_size = get_allocation_size(round_size(n)).
    allocator = CachingAllocator(MiB)
    with pytest.raises(AllocatorOutOfMemory) as raised:
        allocator.malloc(nbytes)
    assert raised.value.oom == AllocatorOOM(requested, 0, 0, MiB)


def test_state_is_consistent_after_an_oom():
    allocator = CachingAllocator(30 * MiB)
    a = allocator.malloc(14 * MiB)
    allocator.free(allocator.malloc(14 * MiB))
    with pytest.raises(AllocatorOutOfMemory) as raised:
        allocator.malloc(20 * MiB)
    # the cached segment was released on the way to the OOM, as PyTorch does
    assert raised.value.oom == AllocatorOOM(20 * MiB, 14 * MiB, 14 * MiB, 30 * MiB)
    assert allocator.reserved == 14 * MiB
    allocator.malloc(16 * MiB)
    allocator.free(a)
    assert allocator.allocated == 16 * MiB


# -- expandable segments --------------------------------------------------------------------------


def test_expandable_maps_pages_per_pool():
    allocator = CachingAllocator(None, expandable=True)
    allocator.malloc(MiB + 512)  # large pool: one 20 MiB page
    allocator.malloc(100)  # small pool: one 2 MiB page
    assert allocator.reserved == 22 * MiB
    big = allocator.malloc(30 * MiB)  # the free tail (18.5 MiB) and one more page
    assert allocator.reserved == 42 * MiB
    assert sizes_in(allocator)[1] == [(MiB + 512, True), (30 * MiB, True), (9 * MiB - 512, False)]
    allocator.free(big)
    allocator.empty_cache()  # pages wholly inside the free block go back
    assert allocator.reserved == 22 * MiB


def test_expandable_fills_unmapped_gaps_first():
    allocator = CachingAllocator(None, expandable=True)
    a, b, c = (allocator.malloc(20 * MiB) for _ in range(3))
    allocator.free(b)
    allocator.empty_cache()  # the middle page is unmapped: two mapped ranges
    assert sizes_in(allocator) == [[(20 * MiB, True)], [(20 * MiB, True)]]
    assert allocator.reserved == 40 * MiB
    allocator.malloc(10 * MiB)  # mapped into the gap, the lowest address that fits
    assert sizes_in(allocator) == [[(20 * MiB, True), (10 * MiB, True), (10 * MiB, False), (20 * MiB, True)]]
    assert allocator.reserved == 60 * MiB


def test_expandable_unmaps_free_pages_on_oom_and_retries():
    allocator = CachingAllocator(60 * MiB, expandable=True)
    a = allocator.malloc(20 * MiB)
    allocator.malloc(20 * MiB)
    allocator.malloc(10 * MiB)  # third page: 10 MiB free at its end
    allocator.free(a)
    assert (allocator.reserved, allocator.largest_free_block()) == (60 * MiB, 20 * MiB)
    # No free block of 30 MiB; mapping a page past 60 MiB fails; the retry's release unmaps
    # the first page (wholly free), then the tail's 10 MiB grows by one page.
    handle = allocator.malloc(30 * MiB)
    assert allocator.num_alloc_retries == 1 and allocator.num_ooms == 0
    assert (allocator.allocated, allocator.reserved) == (60 * MiB, 60 * MiB)
    assert allocator.block_size(handle) == 30 * MiB
    assert sizes_in(allocator) == [[(20 * MiB, True), (10 * MiB, True), (30 * MiB, True)]]


def test_expandable_with_a_memory_fraction_checks_the_allocation_size():
    # set_per_process_memory_fraction: alloc_block refuses when reserved + alloc_size passes
    # the allowed maximum, before mapping: the same request as above now fails.
    allocator = CachingAllocator(60 * MiB, expandable=True, fraction=True)
    a = allocator.malloc(20 * MiB)
    allocator.malloc(20 * MiB)
    allocator.malloc(10 * MiB)
    allocator.free(a)
    with pytest.raises(AllocatorOutOfMemory) as raised:
        allocator.malloc(30 * MiB)
    assert raised.value.oom == AllocatorOOM(30 * MiB, 30 * MiB, 40 * MiB, 60 * MiB)
    assert (allocator.num_alloc_retries, allocator.num_ooms) == (1, 1)


def test_expandable_best_fit_passes_over_the_block_that_can_grow():
    allocator = CachingAllocator(None, expandable=True)
    a = allocator.malloc(10 * MiB)
    allocator.malloc(4 * MiB)
    allocator.malloc(MiB * 3 // 2)  # 4.5 MiB left at the end of the first page
    allocator.free(a)  # 10 MiB free at the start
    allocator.malloc(4 * MiB)  # smallest fit is the 4.5 MiB tail, but it can grow: take the 10
    assert sizes_in(allocator) == [
        [(4 * MiB, True), (6 * MiB, False), (4 * MiB, True), (MiB * 3 // 2, True), (4 * MiB + MiB // 2, False)]
    ]


# -- the fragmentation scenario ----------------------------------------------------------------------


def test_callers_pattern_is_rescued_by_the_retry():
    # Ten 14 MiB freed, then ten 4 MiB: best fit packs three 4 MiB into each 14 MiB segment
    # (the 10 MiB, then 6 MiB remainder is the best fit), so only four segments get split and
    # six stay whole; the 60 MiB request releases them (84 MiB) and fits: no OOM.
    allocator = CachingAllocator(160 * MiB)
    for handle in [allocator.malloc(14 * MiB) for _ in range(10)]:
        allocator.free(handle)
    for _ in range(10):
        allocator.malloc(4 * MiB)
    assert (allocator.allocated, allocator.reserved) == (40 * MiB, 140 * MiB)
    allocator.malloc(60 * MiB)
    assert (allocator.allocated, allocator.reserved) == (100 * MiB, 116 * MiB)
    assert (allocator.num_alloc_retries, allocator.num_ooms) == (1, 0)


def fragment(allocator: CachingAllocator) -> None:
    """Mid-size tensors freed, smaller long-lived ones placed in their cached blocks: ten
    14 MiB, freed, then ten 8 MiB; each 8 MiB leaves 6 MiB, too small for the next one, so
    every segment gets split and none can be released."""
    for handle in [allocator.malloc(14 * MiB) for _ in range(10)]:
        allocator.free(handle)
    for _ in range(10):
        allocator.malloc(8 * MiB)


def test_fragmentation_oom_without_expandable_segments():
    allocator = CachingAllocator(160 * MiB)
    fragment(allocator)
    assert (allocator.allocated, allocator.reserved) == (80 * MiB, 140 * MiB)
    assert allocator.largest_free_block() == 6 * MiB
    with pytest.raises(AllocatorOutOfMemory) as raised:
        allocator.malloc(60 * MiB)
    oom = raised.value.oom
    assert oom == AllocatorOOM(requested=60 * MiB, allocated=80 * MiB, reserved=140 * MiB, limit=160 * MiB)
    assert oom.reserved - oom.allocated >= 60 * MiB
    assert (allocator.num_alloc_retries, allocator.num_ooms) == (1, 1)


@pytest.mark.parametrize("fraction", [False, True])
def test_fragmentation_fits_with_expandable_segments(fraction):
    allocator = CachingAllocator(160 * MiB, expandable=True, fraction=fraction)
    fragment(allocator)  # the 14 MiB tile one segment; the 8 MiB pack its start
    assert (allocator.allocated, allocator.reserved) == (80 * MiB, 140 * MiB)
    assert allocator.largest_free_block() == 60 * MiB
    allocator.malloc(60 * MiB)
    assert (allocator.allocated, allocator.reserved) == (140 * MiB, 140 * MiB)
    assert (allocator.num_alloc_retries, allocator.num_ooms) == (0, 0)


def test_callers_pattern_with_expandable_segments():
    allocator = CachingAllocator(160 * MiB, expandable=True)
    for handle in [allocator.malloc(14 * MiB) for _ in range(10)]:
        allocator.free(handle)
    for _ in range(10):
        allocator.malloc(4 * MiB)
    allocator.malloc(60 * MiB)
    assert (allocator.allocated, allocator.reserved, allocator.num_alloc_retries) == (100 * MiB, 140 * MiB, 0)


# -- invariants over random sequences ---------------------------------------------------------------


def check_invariants(allocator: CachingAllocator, live: dict[int, int], slack: int) -> None:
    assert allocator.allocated == sum(allocator.block_size(h) for h in live)
    for handle, nbytes in live.items():
        assert allocator.block_size(handle) >= nbytes
    segments = allocator.snapshot()
    assert allocator.allocated == sum(b.size for s in segments for b in s if b.allocated)
    assert allocator.reserved == sum(b.size for s in segments for b in s)
    assert 0 <= allocator.allocated <= allocator.reserved
    if allocator.limit is not None:
        assert allocator.reserved <= allocator.limit + slack
    assert allocator.peak_allocated >= allocator.allocated and allocator.peak_reserved >= allocator.reserved
    for segment in segments:
        for left, right in zip(segment, segment[1:]):
            assert left.address + left.size == right.address
            assert left.allocated or right.allocated, "two adjacent free blocks left unmerged"
    assert allocator.largest_free_block() == max((b.size for s in segments for b in s if not b.allocated), default=0)
    for pool in (allocator._small, allocator._large):  # unmapped ranges merge too
        for gap in pool.unmapped:
            assert not gap.mapped and all(n is None or n.mapped for n in (gap.prev, gap.next))


@pytest.mark.parametrize(("expandable", "fraction"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_keep_the_invariants(seed, expandable, fraction):
    rng = random.Random(seed)
    sizes = AllocatorSizes().scaled(64)  # pages of 32 KiB (small) and 320 KiB (large)
    limit = 2 * MiB
    allocator = CachingAllocator(limit, sizes, expandable, fraction=fraction)
    # fraction: the check is on alloc_size, the pages mapped may pass it by up to one page
    slack = sizes.large_buffer if fraction else 0
    live: dict[int, int] = {}
    ooms = 0
    for step in range(1500):
        roll = rng.random()
        if roll < 0.55 or not live:
            nbytes = rng.choice([0, rng.randrange(1, 2 * KiB), rng.randrange(KiB, 16 * KiB), rng.randrange(16 * KiB, 400 * KiB)])
            before = allocator.allocated
            try:
                live[allocator.malloc(nbytes)] = nbytes
            except AllocatorOutOfMemory as error:
                ooms += 1
                assert allocator.allocated == before == error.oom.allocated
                assert error.oom.reserved == allocator.reserved
                assert error.oom.requested >= nbytes
        elif roll < 0.98:
            handle = rng.choice(list(live))
            del live[handle]
            allocator.free(handle)
        else:
            allocator.empty_cache()
        check_invariants(allocator, live, slack)
    assert allocator.num_ooms == ooms > 0  # the limit was reached at least once
    for handle in list(live):
        allocator.free(handle)
    allocator.empty_cache()
    assert allocator.allocated == allocator.reserved == 0

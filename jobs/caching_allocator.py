"""A pure-Python model of PyTorch's CUDA caching allocator, on byte counts only (no torch).

One idea, one file (just past 400 lines): segments, free-block index and expandable pages are
one data structure that every operation rewrites; split, its parts would share private state.

The emulated device feeds it one ``malloc(nbytes)`` per storage allocation and one
``free(handle)`` per storage death; it answers what PyTorch would have *reserved* and refuses
(``AllocatorOutOfMemory``) where PyTorch would raise, so fragmentation counts as on a card.

Rules from c10/cuda/CUDACachingAllocator.cpp, pytorch/pytorch at commit
001074d25084fdb87a799823e395a50f5ec044d3 (``DeviceCachingAllocator``):

- ``round_size``: under 512 bytes -> 512, else up to a multiple of 512.
- Pools: rounded size <= 1 MiB -> small pool, else large. ``get_allocation_size`` (the
  segment a miss asks for, and the "Tried to allocate" figure of the OOM): <= 1 MiB -> 2 MiB;
  < 10 MiB -> 20 MiB; else rounded up to 2 MiB.
- ``get_free_block``: best fit in the request's pool, the smallest free block >= size, ties
  by address. ``should_split``: remainder >= 512 in the small pool (and in both pools with
  expandable segments), remainder > 1 MiB in the large pool; an unsplit block is handed out
  whole and counted whole in ``allocated`` (memory_allocated counts block sizes).
- ``malloc``: free block -> ``alloc_block`` (a new segment) -> ``release_available_cached_blocks``
  and retry -> ``release_cached_blocks`` and retry -> OOM. With the default max_split_size
  (unlimited) ``release_available_cached_blocks`` returns false at once, so the middle step
  never frees anything; ``num_alloc_retries`` counts the last ``alloc_block`` (``isRetry``),
  once per malloc that reaches it, whether it then succeeds or not.
- ``release_cached_blocks`` (also ``empty_cache``): cudaFree every free block that is a
  whole segment (no prev/next); with expandable segments, unmap every page lying wholly
  inside a free block.
- Note [Expandable Segments]: one segment per pool, pages of 2 MiB (small) / 20 MiB (large);
  ``find_expandable_block`` maps at the lowest address where free and unmapped space fit the
  request (gaps first, else the end); best fit walks past a block bordering unmapped space
  while the next candidate's ``expandable_size`` is smaller; reserved = mapped bytes.

Simplifications: one stream, no events or record_stream, no CUDA graphs / private pools, no
free-memory callbacks; max_split_size unlimited, roundup_power2_divisions off,
garbage_collection_threshold 0 (the defaults; none of them modelled); no >1 EB check;
segment addresses from a bump counter (cudaMalloc's are the driver's); an expandable
segment's address space unbounded (really 1 1/8 of the card) and kept when wholly unmapped
(really released and re-reserved: no figure changes).

The limit: by default it is the card's memory, so a new segment fails when reserved + segment
> limit (cudaMalloc) and a mapping fails when reserved + new pages > limit (cuMemCreate).
``fraction=True`` models set_per_process_memory_fraction instead, what limit_cuda_memory
uses on a real card: ``alloc_block`` refuses when reserved + get_allocation_size > limit, in
both modes, before mapping anything. The two agree without expandable segments; with them
the fraction check counts alloc_size, not the pages it will map, so it may refuse what free
space at the segment's end would have served, and let reserved pass the limit by under a page.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, fields, replace

__all__ = ["MiB", "AllocatorSizes", "AllocatorOOM", "AllocatorOutOfMemory", "BlockInfo", "CachingAllocator"]

MiB = 1 << 20

# Free blocks are indexed by one int per block, size << 64 | address: bisect over a list of
# ints is the fastest best fit Python offers, and the address breaks ties as in the source.
_SHIFT = 64
_SEGMENTS_BASE = 1 << 40  # cudaMalloc'd segments, bumped upwards
_EXPANDABLE_SPACE = 1 << 60  # one expandable segment's address space ("unbounded")
_EXPANDABLE_BASE = {True: 1 << 61, False: 1 << 62}  # small pool, large pool


@dataclass(frozen=True)
class AllocatorSizes:
    """The allocator's constants (PyTorch's as defaults). Expandable segments use pages of
    ``small_buffer`` in the small pool and ``large_buffer`` in the large one."""

    min_block: int = 512  # kMinBlockSize
    small_size: int = 1 * MiB  # kSmallSize
    small_buffer: int = 2 * MiB  # kSmallBuffer
    min_large_alloc: int = 10 * MiB  # kMinLargeAlloc
    round_large: int = 2 * MiB  # kRoundLarge
    large_buffer: int = 20 * MiB  # kLargeBuffer

    def scaled(self, divisor: int) -> AllocatorSizes:
        """Every size divided by ``divisor`` (a power of two >= 1), ``min_block`` never below
        1; ValueError for another divisor or one that does not divide the other sizes."""
        if not isinstance(divisor, int) or divisor < 1 or divisor & (divisor - 1):
            raise ValueError(f"the divisor must be a power of two >= 1, got {divisor!r}")
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        for name, value in values.items():
            if name != "min_block" and value % divisor:
                raise ValueError(f"{name} ({value} bytes) is not a multiple of {divisor}")
        return replace(self, **{name: max(1, value // divisor) for name, value in values.items()})


@dataclass(frozen=True)
class AllocatorOOM:
    """What the allocator knew when it refused (bytes), after releasing its cache."""

    requested: int  # get_allocation_size(round_size(nbytes)): PyTorch's "Tried to allocate"
    allocated: int  # sum of allocated block sizes (memory_allocated)
    reserved: int  # memory_reserved
    limit: int  # the limit reserved may not pass


class AllocatorOutOfMemory(Exception):
    """The model's OOM; ``.oom`` carries the figures (the message text is not PyTorch's)."""

    def __init__(self, oom: AllocatorOOM) -> None:
        super().__init__(f"caching allocator out of memory: tried to allocate {oom.requested} bytes with "
                         f"{oom.allocated} allocated and {oom.reserved} reserved of a {oom.limit}-byte limit")
        self.oom = oom


@dataclass(frozen=True)
class BlockInfo:
    """One block of a segment in ``CachingAllocator.snapshot()``."""

    address: int
    size: int
    allocated: bool


class _Block:
    # Blocks of one segment form a doubly linked list in address order, as in the source; a
    # new block splices itself in between ``prev`` and ``next`` (Block::splice).
    __slots__ = ("addr", "size", "prev", "next", "allocated", "mapped", "pool")

    def __init__(self, addr: int, size: int, prev: _Block | None, next: _Block | None, mapped: bool, pool: _Pool) -> None:
        self.addr, self.size, self.prev, self.next = addr, size, prev, next
        self.allocated, self.mapped, self.pool = False, mapped, pool
        if prev is not None:
            prev.next = self
        if next is not None:
            next.prev = self


def _grown(block: _Block) -> int:
    """expandable_size: a free block's size plus the unmapped space right after it."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


class _Pool:
    __slots__ = ("small", "keys", "free", "unmapped", "page", "base")

    def __init__(self, small: bool, page: int) -> None:
        self.small = small
        self.keys: list[int] = []  # sorted size << 64 | addr of the free, mapped blocks
        self.free: dict[int, _Block] = {}  # the same key -> block
        self.unmapped: set[_Block] = set()  # expandable mode: unmapped address ranges
        self.page = page
        self.base = _EXPANDABLE_BASE[small]


class CachingAllocator:
    """PyTorch's CUDA caching allocator on byte counts. ``limit`` (bytes, None: unlimited)
    may be changed at any time; lowering it below ``reserved`` takes nothing away, it only
    makes the next segment request fail."""

    def __init__(self, limit: int | None, sizes: AllocatorSizes = AllocatorSizes(), expandable: bool = False, *, fraction: bool = False) -> None:
        self.limit = limit
        self.sizes = sizes
        self.expandable = expandable
        self.fraction = fraction
        self._small = _Pool(True, sizes.small_buffer)
        self._large = _Pool(False, sizes.large_buffer)
        if expandable:
            for pool in (self._small, self._large):
                pool.unmapped.add(_Block(pool.base, _EXPANDABLE_SPACE, None, None, False, pool))
        self._live: dict[int, _Block] = {}  # handle -> allocated block
        self._next_handle = 0  # handles count from 1: 0 is a 0-byte allocation's null pointer
        self._next_addr = _SEGMENTS_BASE
        self._allocated = self._reserved = self._peak_allocated = self._peak_reserved = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # -- figures ----------------------------------------------------------------------------

    allocated = property(lambda self: self._allocated, doc="memory_allocated: the allocated blocks' sizes")
    reserved = property(lambda self: self._reserved, doc="memory_reserved: segments (or mapped pages)")
    peak_allocated = property(lambda self: self._peak_allocated, doc="max_memory_allocated")
    peak_reserved = property(lambda self: self._peak_reserved, doc="max_memory_reserved")

    def reset_peak(self) -> None:
        self._peak_allocated, self._peak_reserved = self._allocated, self._reserved

    def largest_free_block(self) -> int:
        """The largest cached free block (PyTorch's cacheInfo), 0 when there is none."""
        return max((pool.keys[-1] >> _SHIFT for pool in (self._small, self._large) if pool.keys), default=0)

    def block_size(self, handle: int) -> int:
        """The bytes a handle holds: its rounded size, or the whole block when not split."""
        return 0 if handle == 0 else self._live[handle].size

    def snapshot(self) -> list[tuple[BlockInfo, ...]]:
        """Segments in address order, each its blocks in address order, as
        torch.cuda.memory_snapshot reports them: an expandable segment as one segment per
        contiguous mapped range. The sizes of all blocks add up to ``reserved``."""
        blocks = list(self._live.values())
        for pool in (self._small, self._large):
            blocks += pool.free.values()
        segments = []
        for head in blocks:
            if head.prev is not None and head.prev.mapped:
                continue
            segment, block = [], head
            while block is not None and block.mapped:
                segment.append(BlockInfo(block.addr, block.size, block.allocated))
                block = block.next
            segments.append(tuple(segment))
        return sorted(segments, key=lambda s: s[0].address)

    # -- malloc and free --------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """A handle to ``nbytes`` bytes; 0 (holding nothing) for 0 bytes, as PyTorch hands
        out a null pointer. Raises AllocatorOutOfMemory, with the cache released."""
        if nbytes <= 0:
            if nbytes < 0:
                raise ValueError(f"cannot allocate {nbytes} bytes")
            return 0
        sizes = self.sizes
        unit = sizes.min_block
        size = unit if nbytes < unit else -(-nbytes // unit) * unit  # round_size
        pool = self._small if size <= sizes.small_size else self._large
        block = self._get_free_block(pool, size)
        if block is None:
            alloc_size = self._allocation_size(size)
            block = self._alloc_block(pool, size, alloc_size)
            # release_available_cached_blocks would come here: a no-op with max_split_size
            # unlimited, so straight to releasing every whole cached segment.
            if block is None:
                self._release_cached_blocks()
                self.num_alloc_retries += 1  # alloc_block(isRetry=true) counts itself
                block = self._alloc_block(pool, size, alloc_size)
                if block is None:
                    self.num_ooms += 1
                    raise AllocatorOutOfMemory(AllocatorOOM(alloc_size, self._allocated, self._reserved, self.limit))
        remaining = block.size - size
        if (remaining >= unit) if (pool.small or self.expandable) else (remaining > sizes.small_size):
            block.size = size
            self._insert(pool, _Block(block.addr + size, remaining, block, block.next, True, pool))
        block.allocated = True
        self._allocated += block.size
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        handle = self._next_handle = self._next_handle + 1
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """Return a handle's block to its pool, merged with free neighbours; handle 0 is a
        no-op (PyTorch's free of a null pointer); KeyError for an unknown or freed handle."""
        if handle == 0:
            return
        block = self._live.pop(handle)
        block.allocated = False
        self._allocated -= block.size
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(block.pool, block)

    def empty_cache(self) -> None:
        self._release_cached_blocks()

    # -- the source's private steps -----------------------------------------------------------

    def _allocation_size(self, size: int) -> int:
        sizes = self.sizes
        if size <= sizes.small_size:
            return sizes.small_buffer
        if size < sizes.min_large_alloc:
            return sizes.large_buffer
        return -(-size // sizes.round_large) * sizes.round_large

    @staticmethod
    def _insert(pool: _Pool, block: _Block) -> None:
        key = block.size << _SHIFT | block.addr
        insort(pool.keys, key)
        pool.free[key] = block

    @staticmethod
    def _remove(pool: _Pool, block: _Block) -> None:
        # Before a block's size or address changes: its key is computed from them.
        key = block.size << _SHIFT | block.addr
        del pool.keys[bisect_left(pool.keys, key)]
        del pool.free[key]

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        keys = pool.keys
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        if self.expandable:
            # A block followed by unmapped space counts as the size it can grow to, so the
            # search walks on while the next candidate's grown size is smaller (the source's
            # loop, which stops at the first one that is not).
            free = pool.free
            while i + 1 < len(keys) and _grown(free[keys[i + 1]]) < _grown(free[keys[i]]):
                i += 1
        return pool.free.pop(keys.pop(i))

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        """A new segment (or newly mapped pages) holding ``size``, taken out of the free
        index; None when the limit refuses."""
        limit = self.limit
        if self.fraction and limit is not None and self._reserved + alloc_size > limit:
            return None
        if self.expandable:
            return self._allocate_expandable(pool, size)
        if limit is not None and self._reserved + alloc_size > limit:
            return None
        block = _Block(self._next_addr, alloc_size, None, None, True, pool)
        self._next_addr += alloc_size
        self._grow_reserved(alloc_size)
        return block

    def _grow_reserved(self, nbytes: int) -> None:
        self._reserved += nbytes
        self._peak_reserved = max(self._peak_reserved, self._reserved)

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """try_merge_blocks: ``dst`` (out of the free index) absorbs a free neighbour of the
        same mapped state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove(src.pool, src)
        else:
            src.pool.unmapped.discard(src)
        if src is dst.prev:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _release_cached_blocks(self) -> None:
        for pool in (self._large, self._small):
            if self.expandable:  # only a block of a page or more can hold a whole page
                keys = pool.keys
                for key in keys[bisect_left(keys, pool.page << _SHIFT):]:
                    self._unmap(pool, pool.free[key])
                continue
            for block in [b for b in pool.free.values() if b.prev is None and b.next is None]:
                self._remove(pool, block)  # cudaFree of a whole cached segment
                self._reserved -= block.size

    # -- expandable segments ------------------------------------------------------------------

    def _allocate_expandable(self, pool: _Pool, size: int) -> _Block | None:
        """try_allocate_expandable_block: map pages from the lowest address where free and
        unmapped space together fit ``size``. Pages mapped before a later mapping fails stay
        mapped, as in the source (the retry's release unmaps them again)."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # free block -> unmapped -> ...: map and merge onwards
            following = candidate.next
            if not self._map(following, min(size - candidate.size, following.size)):
                return None
            candidate = following
        self._remove(pool, candidate)
        return candidate

    @staticmethod
    def _find_expandable_block(pool: _Pool, size: int) -> _Block:
        for gap in sorted(pool.unmapped, key=lambda b: b.addr):
            start = gap.prev if gap.prev is not None and not gap.prev.allocated else gap
            room, block = 0, start
            while room < size and block is not None and not block.allocated:
                room += block.size
                block = block.next
            if room >= size:
                return start
        raise AssertionError("an expandable segment's address space ran out")  # 2**60 bytes

    def _map(self, block: _Block, nbytes: int) -> bool:
        """map_block: back the first ``nbytes`` (rounded up to pages) of an unmapped block."""
        pool = block.pool
        mapped = -(-nbytes // pool.page) * pool.page
        if not self.fraction and self.limit is not None and self._reserved + mapped > self.limit:
            return False  # cuMemCreate fails; the source releases what this call created
        pool.unmapped.discard(block)
        block.mapped = True
        if mapped < block.size:
            pool.unmapped.add(_Block(block.addr + mapped, block.size - mapped, block, block.next, False, pool))
            block.size = mapped
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._insert(pool, block)
        self._grow_reserved(mapped)
        return True

    def _unmap(self, pool: _Pool, block: _Block) -> None:
        """unmap_block: give back every page lying wholly inside a free block; the parts of
        pages still shared with a neighbour stay mapped as free blocks of their own."""
        page, base, end = pool.page, pool.base, block.addr + block.size
        low = base + -(-(block.addr - base) // page) * page
        high = base + (end - base) // page * page
        if low >= high:
            return
        self._remove(pool, block)
        if low > block.addr:
            self._insert(pool, _Block(block.addr, low - block.addr, block.prev, block, True, pool))
        if high < end:
            self._insert(pool, _Block(high, end - high, block, block.next, True, pool))
        block.addr, block.size, block.mapped = low, high - low, False
        self._merge(block, block.prev)
        self._merge(block, block.next)
        pool.unmapped.add(block)
        self._reserved -= high - low

"""A simulation of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, 2.x,
default settings: no expandable segments, no ``max_split_size``, one stream).

``torch.cuda.max_memory_allocated`` sums *block* sizes, and a block handed out can be larger
than the request: a cached free block is split only when the remainder is worth keeping
(small pool: at least 512 bytes; large pool: more than 1 MiB), so a request served from a
block up to 1 MiB larger counts the whole block. Summing requests rounded to 512 bytes (what
:class:`memcalc.validate.tracer.StorageTracer` reports) therefore reads a little low when many large
tensors are alive; replaying the allocation sequence here gives the allocator's own figure,
and its reserved memory (``cudaMalloc`` segments). The estimator replays its simulated step
through it, and the meta-device tracer (``memcalc.validate``) its traced allocations.

Rules reproduced:

- ``round_size``: up to a multiple of 512 (``kMinBlockSize``);
- pools: requests of at most 1 MiB (``kSmallSize``) use the small pool, the rest the large;
- ``get_free_block``: the smallest cached block of the pool that fits (ties by address);
- otherwise a new segment: 2 MiB for small requests (``kSmallBuffer``), 20 MiB for requests
  under 10 MiB (``kLargeBuffer`` / ``kMinLargeAlloc``), else the request rounded to 2 MiB;
- ``should_split`` as above; freed blocks merge with free neighbours of their segment;
- with a ``capacity``, a segment that does not fit first releases every wholly free cached
  segment (``release_cached_blocks``), as the allocator does before reporting OOM; if the segment
  still does not fit, ``out_of_memory`` is set (where torch raises ``OutOfMemoryError``) and the replay
  goes on as if it had fitted.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Optional

from memcalc.core.kernels import ALLOCATOR_ROUND_BYTES

MIN_BLOCK = ALLOCATOR_ROUND_BYTES  # kMinBlockSize
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def allocation_size(n: int) -> int:
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-n // ROUND_LARGE) * ROUND_LARGE


_new = object.__new__


class _Block:
    __slots__ = ("addr", "free", "next", "prev", "seg", "size", "small")

    def __init__(self, seg: int, addr: int, size: int, small: bool) -> None:
        self.seg, self.addr, self.size, self.small = seg, addr, size, small
        self.free = True
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


class CachingAllocatorSim:
    """Replays malloc/free; ``allocated``/``reserved`` and their peaks as the CUDA stats report them."""

    def __init__(self, capacity: Optional[int] = None) -> None:
        self.capacity = capacity
        self._small: list[tuple[int, int, _Block]] = []  # the small pool's free blocks, sorted (size, addr)
        self._large: list[tuple[int, int, _Block]] = []
        self._pools: dict[bool, list[tuple[int, int, _Block]]] = {True: self._small, False: self._large}
        self._segments: dict[int, _Block] = {}  # segment id -> first block
        self._seg_size: dict[int, int] = {}
        self._next_addr = 1 << 30
        self._next_seg = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.out_of_memory = False  # a segment did not fit the capacity even after the cache was released

    # -- pools ----------------------------------------------------------------------------
    def _insert(self, b: _Block) -> None:
        insort(self._small if b.small else self._large, (b.size, b.addr, b))

    def _remove(self, b: _Block) -> None:
        pool = self._small if b.small else self._large
        i = bisect_left(pool, (b.size, b.addr))
        while pool[i][2] is not b:
            i += 1
        pool.pop(i)

    def _new_segment(self, size: int, small: bool) -> _Block:
        if self.capacity is not None and self.reserved + size > self.capacity:
            self._release_cached()
            self.out_of_memory |= self.reserved + size > self.capacity
        seg = self._next_seg
        self._next_seg += 1
        b = _Block(seg, self._next_addr, size, small)
        self._next_addr += size + ROUND_LARGE
        self._segments[seg] = b
        self._seg_size[seg] = size
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return b

    def _release_cached(self) -> None:
        for seg, first in list(self._segments.items()):
            if first.free and first.next is None:
                self._remove(first)
                self.reserved -= self._seg_size.pop(seg)
                del self._segments[seg]

    # -- API --------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Optional[_Block]:
        """A block for a request of ``nbytes`` (None for zero bytes, as CUDA returns nullptr)."""
        if nbytes == 0:
            return None
        size = MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK  # round_size, inline
        small = size <= SMALL_SIZE
        pool = self._small if small else self._large
        i = bisect_left(pool, (size, -1))
        b = pool.pop(i)[2] if i < len(pool) else self._new_segment(allocation_size(size), small)
        remaining = b.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = _new(_Block)  # _Block(b.seg, b.addr + size, remaining, small), without the __init__ call
            rest.seg, rest.addr, rest.size, rest.small, rest.free = b.seg, b.addr + size, remaining, small, True
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            self._insert(rest)
        b.free = False
        allocated = self.allocated = self.allocated + b.size
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
        return b

    def free(self, b: Optional[_Block]) -> None:
        if b is None:
            return
        self.allocated -= b.size
        b.free = True
        prev, nxt = b.prev, b.next
        if prev is not None and prev.free:  # merge into the free block before it
            self._remove(prev)
            prev.size += b.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            if self._segments.get(b.seg) is b:
                self._segments[b.seg] = prev
            b = prev
        if nxt is not None and nxt.free:  # take in the free block after it
            self._remove(nxt)
            b.size += nxt.size
            b.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = b
        insort(self._small if b.small else self._large, (b.size, b.addr, b))  # self._insert(b)

    def reset_peak(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``."""
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

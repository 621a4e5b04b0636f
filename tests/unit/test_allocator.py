"""The CUDA caching allocator replay: block sizes, splitting and segments by hand."""

from __future__ import annotations

from memcalc.core.allocator import CachingAllocatorSim

MiB = 1 << 20


def test_small_requests_share_a_2mib_segment():
    a = CachingAllocatorSim()
    b1, b2 = a.malloc(100), a.malloc(1000)
    assert a.allocated == 512 + 1024 and a.reserved == 2 * MiB
    a.free(b1)
    a.free(b2)
    assert a.allocated == 0 and a.reserved == 2 * MiB  # cached, not returned
    assert a.malloc(0) is None


def test_large_request_splits_a_20mib_segment():
    a = CachingAllocatorSim()
    a.malloc(5 * MiB)
    assert a.reserved == 20 * MiB and a.allocated == 5 * MiB
    a.malloc(5 * MiB)  # served from the 15 MiB remainder
    assert a.reserved == 20 * MiB and a.allocated == 10 * MiB


def test_reused_block_is_not_split_when_the_rest_is_at_most_1mib():
    a = CachingAllocatorSim()
    blk = a.malloc(12 * MiB)  # >= 10 MiB: its own segment, rounded to 2 MiB
    assert a.reserved == 12 * MiB
    a.free(blk)
    a.reset_peak()
    a.malloc(11 * MiB + 512 * 1024)  # 0.5 MiB too small for a split: the whole block counts
    assert a.allocated == 12 * MiB and a.peak_allocated == 12 * MiB and a.reserved == 12 * MiB


def test_freed_neighbours_merge():
    a = CachingAllocatorSim()
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)
    a.free(x)
    a.free(y)
    a.malloc(19 * MiB)  # fits only in the merged 20 MiB block
    assert a.reserved == 20 * MiB


def test_capacity_releases_cached_segments():
    a = CachingAllocatorSim(capacity=30 * MiB)
    a.free(a.malloc(20 * MiB))
    a.malloc(24 * MiB)  # the cached 20 MiB segment is released to make room
    assert a.reserved == 24 * MiB

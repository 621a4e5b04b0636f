"""Allocations replayed through the caching allocator model into a PyTorch memory snapshot (torch-free).

:class:`SnapshotBuilder` is what both writers of memcalc's snapshots share: the estimate's step
(:mod:`memcalc.snapshot.export`) and the meta-device tracer's (``memcalc.validate.snapshot_trace``).
Each ``malloc`` / ``free`` goes through :class:`memcalc.core.allocator.CachingAllocatorSim` (the
addresses, block sizes and segments a CUDA device would give) and, while ``recording``, becomes trace
entries as c10/cuda/CUDACachingAllocator.cpp records them with ``_record_memory_history`` on:
``segment_alloc`` (``alloc_block``: the new segment's address and size) before the ``alloc`` it serves
(``malloc``: the block's address, the bytes requested), ``free_requested`` then ``free_completed``
(``free`` / ``free_block``: the block's ``requested_size``). Frames are given at :meth:`snapshot` time
by ``frames_of(handle)``, so a writer may decide an allocation's labels after it has seen its life.
The field names are :mod:`memcalc.snapshot.format`'s (cited there from torch's source).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from memcalc.core.allocator import CachingAllocatorSim, _Block
from memcalc.snapshot.format import PHASE_FILENAME


#: torch's allocator_settings of a default ``PYTORCH_CUDA_ALLOC_CONF`` (torch/csrc/cuda/Module.cpp
#: THCPModule_memorySnapshot; c10/cuda/CUDAAllocatorConfig.h defaults: no max_split_size, i.e.
#: SIZE_MAX, -1 as an int64; no expandable segments), the settings memcalc.core.allocator simulates
ALLOCATOR_SETTINGS: dict[str, Any] = {
    "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
    "expandable_segments": False, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
    "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {},
}


def _in_phase(frames: list[dict[str, Any]], phase: Optional[str],
              said: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``frames`` with their phase frame (:data:`memcalc.snapshot.format.PHASE_FILENAME`) saying ``phase``
    (``said``: the phase frames made so far, one per phase)."""
    if phase is None:
        return frames
    f_phase = said.get(phase)
    if f_phase is None:
        f_phase = said[phase] = {"filename": PHASE_FILENAME, "line": 0, "name": phase}
    return [f_phase if f.get("filename") == PHASE_FILENAME else f for f in frames]


class _Recording(CachingAllocatorSim):
    """The caching allocator model, telling its builder of each new segment."""

    def __init__(self, on_segment: Callable[[_Block, int], None]) -> None:
        super().__init__()
        self.on_segment = on_segment

    def _new_segment(self, size: int, small: bool) -> _Block:
        b = super()._new_segment(size, small)
        self.on_segment(b, size)
        return b


class SnapshotBuilder:
    """malloc / free by handle (any hashable naming one allocation); ``recording`` says whether they
    enter the trace (what ran before lives on in ``segments``, as on CUDA when history recording starts
    mid-run)."""

    def __init__(self, recording: bool = True) -> None:
        self.recording = recording
        #: (action, addr, size, handle or None, the phase a free was made in or None) per trace entry
        self.entries: list[tuple[str, int, int, Any, Optional[str]]] = []
        self.alloc = _Recording(self._segment)
        self.blocks: dict[Any, _Block] = {}
        self.requested: dict[Any, int] = {}

    def _segment(self, b: _Block, size: int) -> None:
        if self.recording:
            self.entries.append(("segment_alloc", b.addr, size, None, None))

    def malloc(self, handle: Any, nbytes: int) -> None:
        """Allocate ``nbytes`` (requested, > 0) for ``handle``."""
        b = self.alloc.malloc(nbytes)
        assert b is not None, "a zero-byte request allocates nothing (CUDA returns nullptr)"
        self.blocks[handle] = b
        self.requested[handle] = nbytes
        if self.recording:
            self.entries.append(("alloc", b.addr, nbytes, handle, None))

    def free(self, handle: Any, phase: Optional[str] = None) -> None:
        """Free ``handle``'s block; ``phase``: the phase the free happens in, when it is not the one the
        allocation was made in (its entries' phase frame says it, as a real snapshot's free entries carry
        the stack of the free with ``context="all"``)."""
        b = self.blocks.pop(handle)
        n = self.requested[handle]
        if self.recording:
            self.entries.append(("free_requested", b.addr, n, handle, phase))
        self.alloc.free(b)
        if self.recording:
            self.entries.append(("free_completed", b.addr, n, handle, phase))

    def snapshot(self, frames_of: Callable[[Any], list[dict[str, Any]]]) -> dict[str, Any]:
        """The dict ``torch.cuda.memory._snapshot()`` would return now: the segments as they are, the
        trace so far (device 0, stream 0, ``time_us`` the entry's index)."""
        shared: dict[tuple[Any, Optional[str]], list[dict[str, Any]]] = {}  # one list per allocation and phase
        said: dict[str, dict[str, Any]] = {}

        def frames(h: Any, phase: Optional[str]) -> list[dict[str, Any]]:
            got = shared.get((h, phase))
            if got is None:
                got = shared[(h, phase)] = _in_phase(frames_of(h), phase, said)
            return got

        trace = [{"action": a, "addr": addr, "size": size, "stream": 0, "time_us": i,
                  "frames": [] if h is None else frames(h, phase)}
                 for i, (a, addr, size, h, phase) in enumerate(self.entries)]
        owner = {b.addr: h for h, b in self.blocks.items()}
        segments = [self._segment_dict(first, self.alloc._seg_size[seg], owner, frames_of)
                    for seg, first in sorted(self.alloc._segments.items(), key=lambda kv: kv[1].addr)]
        return {"segments": segments, "device_traces": [trace], "allocator_settings": dict(ALLOCATOR_SETTINGS),
                "external_annotations": []}

    def _segment_dict(self, first: _Block, total: int, owner: dict[int, Any],
                      frames_of: Callable[[Any], list[dict[str, Any]]]) -> dict[str, Any]:
        """One segment as torch/csrc/cuda/Module.cpp ``segmentInfoToDict`` writes it, blocks in order."""
        blocks: list[dict[str, Any]] = []
        b: Optional[_Block] = first
        while b is not None:
            h = None if b.free else owner.get(b.addr)
            if h is None:
                blocks.append({"address": b.addr, "size": b.size, "requested_size": 0, "state": "inactive",
                               "frames": []})
            else:
                blocks.append({"address": b.addr, "size": b.size, "requested_size": self.requested[h],
                               "state": "active_allocated", "frames": frames_of(h)})
            b = b.next
        allocated = sum(x["size"] for x in blocks if x["state"] == "active_allocated")
        return {"device": 0, "address": first.addr, "total_size": total, "allocated_size": allocated,
                "active_size": allocated, "requested_size": sum(x["requested_size"] for x in blocks),
                "stream": 0, "segment_type": "small" if first.small else "large", "segment_pool_id": (0, 0),
                "is_expandable": False, "frames": [], "blocks": blocks}

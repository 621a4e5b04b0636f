"""A PyTorch memory snapshot's trace replayed: every allocation's life, its phase and its memory kind.

The trace (``device_traces[d]``, torch 2.13 ``torch/cuda/memory.py`` ``_snapshot``: ``TraceEntry``
``{action, addr, size, stream, frames}``) is the caching allocator's log. The replay follows
c10/cuda/CUDACachingAllocator.cpp: ``alloc`` (``alloc_found_block``: ``record_trace(ALLOC, ptr,
orig_size)``) adds ``size`` bytes; ``free_requested`` (``free``: ``allocated_bytes`` drops, then
``record_trace(FREE_REQUESTED, ptr, requested_size)``) removes them, or ``free_completed`` when the
trace has no request for that block. The bytes are the request rounded as the allocator rounds it
(``round_size``: 512-byte multiples; :func:`memcalc.core.allocator.round_size`), what
``torch.cuda.max_memory_allocated`` and memcalc's ``peak_bytes`` count. As the viewer does
(``torch/utils/viz/MemoryViz.js`` ``process_alloc_data``), a block the trace frees but never
allocated, and an ``active_allocated`` block of ``segments`` the trace never allocated, were alive
before recording began.

Each allocation gets a phase and a kind (:func:`memcalc.snapshot.attribute.attribute`): from
memcalc's own first frame where the snapshot was written by memcalc (:mod:`memcalc.snapshot.format`),
else from the Python / C++ frames of a real CUDA run by the rules written there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from memcalc.core.allocator import round_size
from memcalc.core.errors import UserError
from memcalc.snapshot.attribute import BACKWARD, BEFORE, FORWARD, SETUP, attribute, entry_phase

#: the trace actions that end an allocation, in the order the allocator records them
_FREES = ("free_requested", "free_completed")


@dataclass
class Allocation:
    """One allocation's life in the trace: entry indices ``start`` (-1: before recording) to ``end``
    (None: alive when the snapshot was taken)."""

    addr: int
    bytes: int  # rounded as the allocator rounds the request (round_size)
    start: int
    end: Optional[int]
    frames: list
    free_frames: list = field(default_factory=list)
    phase: str = BEFORE  # the phase it was allocated in
    end_phase: Optional[str] = None  # the phase it was freed in
    kind: str = "other"
    label: str = ""
    layer: Optional[int] = None  # the decoder layer memcalc's frame names (None: a real run's, or none)

    def alive_at(self, i: int) -> bool:
        """Alive after entry ``i`` (-1: before the first entry)."""
        return self.start <= i and (self.end is None or self.end > i)


@dataclass
class Replay:
    """A device's trace replayed: its allocations, the live bytes after each entry, the phase of
    each entry, and whether memcalc wrote it (``memcalc_frames``)."""

    device: int
    allocations: list[Allocation]
    live: list[int]  # bytes alive after each entry
    phases: list[str]  # the phase of each entry
    before_bytes: int  # alive before the first entry
    memcalc_frames: bool
    has_frames: bool

    @property
    def peak(self) -> tuple[int, int]:
        """(bytes, entry index) of the highest point; index -1 when nothing was allocated in the trace."""
        best, at = self.before_bytes, -1
        for i, v in enumerate(self.live):
            if v > best:
                best, at = v, i
        return best, at

    def phase_at(self, i: int) -> str:
        return self.phases[i] if 0 <= i < len(self.phases) else BEFORE

    def by_kind_at(self, i: int) -> dict[str, int]:
        """Bytes alive after entry ``i``, by kind."""
        out: dict[str, int] = {}
        for a in self.allocations:
            if a.alive_at(i):
                out[a.kind] = out.get(a.kind, 0) + a.bytes
        return out

    def phase_peaks(self) -> dict[str, tuple[int, int]]:
        """Each phase's highest point, (bytes, entry index), in the order the phases first appear."""
        out: dict[str, tuple[int, int]] = {}
        for i, (v, ph) in enumerate(zip(self.live, self.phases, strict=True)):
            if ph not in out or v > out[ph][0]:
                out[ph] = (v, i)
        return out


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UserError(f"snapshot: {what} is not a non-negative integer ({str(v)[:40]!r})")
    return v


def pick_device(snapshot: dict[str, Any], device: Optional[int]) -> int:
    """``device``, or the one device whose trace has entries; a UserError naming the devices when
    there are several (or none)."""
    traces = snapshot["device_traces"]
    with_entries = [i for i, t in enumerate(traces) if t]
    if device is not None:
        if not 0 <= device < len(traces):
            raise UserError(f"--device {device}: the snapshot has devices 0..{len(traces) - 1}" if traces else
                            f"--device {device}: the snapshot has no device traces")
        return device
    if len(with_entries) == 1:
        return with_entries[0]
    if not with_entries:
        raise UserError("the snapshot's trace is empty: record one with torch.cuda.memory._record_memory_history() "
                        "before the step and _dump_snapshot() after it")
    raise UserError(f"the snapshot traces devices {', '.join(map(str, with_entries))}: pick one with --device")


def _frames(e: dict[str, Any]) -> list:
    f = e.get("frames")
    return f if isinstance(f, list) else []


def _pre_trace_blocks(snapshot: dict[str, Any], device: int) -> list[tuple[int, int, list]]:
    """(address, requested bytes, frames) of each ``active_allocated`` block of the device's segments
    (addresses: a block's ``address``, or its segment's ``address`` plus the sizes before it as
    MemoryViz.js ``annotate_snapshot`` computes them for older snapshots)."""
    out = []
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        addr = _int(seg.get("address", 0), "a segment's address")
        blocks = seg.get("blocks")
        for b in blocks if isinstance(blocks, list) else []:
            if not isinstance(b, dict):
                raise UserError("snapshot: a segment's block is not a dict")
            size = _int(b.get("size", 0), "a block's size")
            a = b.get("address", addr)
            if b.get("state") == "active_allocated":
                requested = _int(b.get("requested_size", size), "a block's requested_size")
                out.append((_int(a, "a block's address"), requested, _frames(b)))
            addr = (a if isinstance(a, int) else addr) + size
    return out


def replay(snapshot: dict[str, Any], device: int) -> Replay:
    """The trace of ``device`` replayed and attributed (see the module docstring)."""
    entries = snapshot["device_traces"][device]
    # the phase is read off allocations only: a free's frames may be the allocation's (``free`` records
    # ``context ? context : block->context_when_allocated``), and every other entry continues the phase
    # before it (setup before the first)
    phases: list[str] = []
    current = SETUP
    has_frames = any(_frames(e) for e in entries)
    for e in entries:
        if e.get("action") == "alloc":
            frames = _frames(e)
            if not frames and has_frames and current in (FORWARD, BACKWARD):
                current = BACKWARD  # the engine's device thread: no Python frame (attribute's docstring)
            else:
                current = entry_phase(frames) or current
        phases.append(current)
    live_allocs: dict[int, Allocation] = {}
    done: list[Allocation] = []
    before: list[Allocation] = []
    live: list[int] = []
    requested: set[int] = set()  # blocks whose free was requested and not yet completed
    total = 0
    for i, e in enumerate(entries):
        action = e.get("action")
        if action == "alloc":
            addr = _int(e.get("addr"), "an alloc's addr")
            a = Allocation(addr, round_size(_int(e.get("size"), "an alloc's size")), i, None, _frames(e),
                           phase=phases[i])
            if addr in live_allocs:  # the allocator never hands out a live block twice: the free was not recorded
                done.append(_ended(live_allocs.pop(addr), i, [], phases[i]))
                total -= done[-1].bytes
            live_allocs[addr] = a
            requested.discard(addr)
            total += a.bytes
        elif action in _FREES:
            addr = _int(e.get("addr"), f"a {action}'s addr")
            if action == "free_completed" and addr in requested:  # the second half of a free already counted
                requested.discard(addr)
            elif addr in live_allocs:
                a = live_allocs.pop(addr)
                done.append(_ended(a, i, _frames(e), phases[i]))
                total -= a.bytes
            else:  # freed, never allocated in the trace: alive before it (MemoryViz.js initially_allocated)
                b = Allocation(addr, round_size(_int(e.get("size"), f"a {action}'s size")), -1, i, _frames(e),
                               _frames(e), BEFORE, phases[i])
                before.append(b)
                total -= b.bytes
            if action == "free_requested":
                requested.add(addr)
        live.append(total)
    alive_before = {a.addr for a in before}
    pre = [Allocation(addr, round_size(size), -1, None, frames, phase=BEFORE)
           for addr, size, frames in _pre_trace_blocks(snapshot, device)
           if addr not in live_allocs and addr not in alive_before]
    before_bytes = sum(a.bytes for a in before) + sum(a.bytes for a in pre)
    live = [v + before_bytes for v in live]
    allocations = before + pre + done + list(live_allocs.values())
    rep = Replay(device, allocations, live, phases, before_bytes, memcalc_frames=False, has_frames=has_frames)
    attribute(rep)
    return rep


def _ended(a: Allocation, i: int, frames: list, phase: str) -> Allocation:
    a.end, a.free_frames, a.end_phase = i, frames, phase
    return a


__all__ = ["Allocation", "Replay", "pick_device", "replay"]

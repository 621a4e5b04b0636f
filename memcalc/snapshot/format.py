"""PyTorch's CUDA memory snapshot, as memcalc writes and reads it (torch-free).

The format is exactly what ``torch.cuda.memory._snapshot()`` returns and ``_dump_snapshot()`` pickles
(torch 2.13: ``torch/cuda/memory.py`` ``_snapshot`` documents it; ``torch/csrc/cuda/Module.cpp``
``THCPModule_memorySnapshot`` builds it; ``torch/cuda/_memory_viz.py`` and
``torch/utils/viz/MemoryViz.js``, the pytorch.org/memory_viz page, read it):

- ``segments``: the allocator's ``cudaMalloc`` segments when the snapshot was taken, each
  ``{device, address, total_size, allocated_size, active_size, requested_size, stream,
  segment_type ("small" | "large"), segment_pool_id, is_expandable, frames, blocks}``, the blocks in
  address order ``{address, size, requested_size, state ("active_allocated" |
  "active_pending_free" | "inactive"), frames}``;
- ``device_traces``: per device, the allocator's actions in order, ``{action, addr, size, stream,
  time_us, frames}`` with ``action`` one of ``alloc`` / ``free_requested`` / ``free_completed`` (``size``
  the bytes requested: c10/cuda/CUDACachingAllocator.cpp ``malloc`` records ``orig_size``, ``free``
  and ``free_block`` the block's ``requested_size``), ``segment_alloc`` / ``segment_free`` (``size`` the
  segment's), ``oom``, ``snapshot``;
- ``allocator_settings`` (``PYTORCH_CUDA_ALLOC_CONF``, ``max_split_size``, ``expandable_segments``, ...)
  and ``external_annotations``.

A frame is ``{filename, line, name}``, innermost first. memcalc's own frames (:func:`memcalc_frame`)
say which of memcalc's memory kinds (:data:`memcalc.engine.result.KINDS`) an allocation is, its
decoder layer and its label; every alloc / free entry memcalc writes (``memcalc estimate
--snapshot``, ``memcalc validate --device meta --snapshot``) carries one as its FIRST frame:
``{"filename": "memcalc/<kind>", "line": <layer index, or 0 when none>, "name": "<label>"}``, then the
phase frame and the category frame (:func:`memcalc_frames`). :func:`parse_memcalc_frame` reads the
first back (``memcalc compare``).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, NamedTuple, Optional

from memcalc.core.allocator import round_size
from memcalc.engine.result import KINDS

#: the filename of a memcalc frame is this prefix and one of KINDS
FRAME_PREFIX = "memcalc/"
#: the actions of a trace entry (torch/csrc/cuda/Module.cpp ``action_to_str``)
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot")


def memcalc_frame(kind: str, layer: Optional[int], label: str) -> dict[str, Any]:
    """The frame that says an allocation is memcalc's ``kind`` (one of KINDS), in decoder layer
    ``layer`` (None: outside the layers, written as line 0), labelled ``label``."""
    assert kind in KINDS, f"{kind!r} is not one of memcalc's kinds {KINDS}"
    return {"filename": FRAME_PREFIX + kind, "line": int(layer or 0), "name": str(label)}


#: the frame after memcalc's kind frame: ``{"filename": "memcalc", "line": 0, "name": <phase>}`` (setup,
#: forward, backward, optimizer step: the phase the entry happens in, an alloc's where it is made, a free's
#: where it is freed, as a real free entry carries the stack of the free with ``context="all"``); then ``{"filename":
#: "memcalc/category", "line": 0, "name": <the engine's category>}`` ("frozen base weights (NF4)", "logits
#: & loss", ...) where the writer has one
PHASE_FILENAME = "memcalc"
CATEGORY_FILENAME = "memcalc/category"


def memcalc_frames(kind: str, layer: Optional[int], label: str, phase: str,
                   category: Optional[str] = None) -> list[dict[str, Any]]:
    """The frames memcalc writes on an allocation, innermost first: the kind frame
    (:func:`memcalc_frame`), the phase frame, and the category frame when given."""
    out = [memcalc_frame(kind, layer, label), {"filename": PHASE_FILENAME, "line": 0, "name": phase}]
    if category:
        out.append({"filename": CATEGORY_FILENAME, "line": 0, "name": category})
    return out


def parse_memcalc_frame(frame: Any) -> Optional[tuple[str, int, str]]:
    """(kind, layer, label) of a memcalc frame (:func:`memcalc_frame`); None for any other frame
    (a real snapshot's Python / C++ frames)."""
    if not isinstance(frame, dict):
        return None
    filename = frame.get("filename")
    if not isinstance(filename, str) or not filename.startswith(FRAME_PREFIX):
        return None
    kind = filename[len(FRAME_PREFIX):]
    if kind not in KINDS:
        return None
    line = frame.get("line", 0)
    return kind, line if isinstance(line, int) else 0, str(frame.get("name", ""))


def entry_memcalc(entry: dict[str, Any]) -> Optional[tuple[str, int, str]]:
    """(kind, layer, label) of a trace entry or block whose first frame is memcalc's, else None."""
    frames = entry.get("frames") or []
    return parse_memcalc_frame(frames[0]) if frames else None


class TracePeak(NamedTuple):
    """The highest live bytes over a device's trace and the index of the entry that reached it
    (-1: before the first entry, the allocations made before recording began)."""

    peak_bytes: int
    at: int


def trace_peak(snapshot: dict[str, Any], device: int = 0, rounded: bool = True) -> TracePeak:
    """The most bytes alive at once over ``device``'s trace: what the viewer's Active Memory Timeline
    stacks (MemoryViz.js ``process_alloc_data``): each ``alloc`` adds its size, its
    ``free_completed`` takes it away; a block freed in the trace but allocated before it, and an
    allocated block of ``segments`` the trace never allocated, are alive from the start.
    ``rounded``: each size rounded up as the allocator rounds a request (c10 ``round_size``, 512-byte
    multiples), what memcalc's peak counts (``Estimate.peak_bytes``); else the bytes requested
    (what the viewer draws)."""
    entries = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    size = round_size if rounded else int
    allocated_in_trace: set[int] = set()
    before = 0  # alive before the trace began
    for e in entries:
        if e["action"] == "alloc":
            allocated_in_trace.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in allocated_in_trace:
            before += size(e["size"])
    live_at_end: set[int] = set()  # in order: an address freed and allocated again is alive
    for e in entries:
        if e["action"] == "alloc":
            live_at_end.add(e["addr"])
        elif e["action"] == "free_completed":
            live_at_end.discard(e["addr"])
    for seg in snapshot["segments"]:
        if seg.get("device", device) != device:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["address"] not in live_at_end:
                before += size(b["requested_size"])
    live = peak = before
    at = -1
    for i, e in enumerate(entries):
        if e["action"] == "alloc":
            live += size(e["size"])
            if live > peak:
                peak, at = live, i
        elif e["action"] == "free_completed":
            live -= size(e["size"])
    return TracePeak(peak, at)


def load_snapshot(path: str | Path) -> dict[str, Any]:
    """A snapshot pickle (``_dump_snapshot``'s file), read as data only
    (:func:`memcalc.snapshot.reader.read_snapshot`: no global a hostile file names is ever loaded);
    one clear :class:`UserError` when it is missing, refused or no snapshot."""
    from memcalc.snapshot.reader import read_snapshot

    return read_snapshot(path)


def write_snapshot(snapshot: dict[str, Any], path: str | Path) -> None:
    """Pickle ``snapshot`` to ``path`` as ``_dump_snapshot`` does (``pickle.dump`` of the dict)."""
    with Path(path).open("wb") as f:
        pickle.dump(snapshot, f)

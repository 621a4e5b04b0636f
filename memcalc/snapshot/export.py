"""The estimate's step written as a PyTorch CUDA memory snapshot (``memcalc estimate --snapshot``).

The step the estimate's peak comes from (the steady-state step, or the first step where it is the
higher: :func:`memcalc.estimate.peak.estimate`) is simulated again with :class:`LabelledEvents`
watching, which hears every allocation's kind, category, name, layer and requested bytes; its events
are then replayed through the caching allocator model exactly as the estimate replays them
(:func:`memcalc.estimate.peak.replay_allocator`: setup, then for the steady step a warm-up pass whose
leftovers are freed and the measured pass; :class:`memcalc.core.allocator.CachingAllocatorSim`),
and every ``malloc`` / ``free`` / new segment of that replay becomes a trace entry, as the CUDA
caching allocator records them with ``torch.cuda.memory._record_memory_history()`` on (the fields:
:mod:`memcalc.snapshot.format`, cited there from torch's source). ``segments`` is the allocator's
state after the step, as ``_snapshot()`` taken then would show it.

Every alloc / free entry's frames are memcalc's (:func:`memcalc.snapshot.format.memcalc_frames`): the
kind, decoder layer and label first, then the phase, then the engine's category ("frozen base weights
(NF4)", "logits & loss", "op workspace", ...).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from memcalc.snapshot.builder import SnapshotBuilder
from memcalc.snapshot.format import memcalc_frames

if TYPE_CHECKING:
    from memcalc.core.spec import ExperimentSpec
    from memcalc.engine.result import Estimate
    from memcalc.engine.sim import Sim

class LabelledEvents:
    """An observer (:mod:`memcalc.engine.observers`) that labels each allocation event: ``labels[uid]``
    = (kind, category, name, layer, sim label, phase, requested bytes). The block is the simulator's
    ``event_block`` when ``on_event`` hears of it; its requested bytes come with the ``on_row`` that
    follows the same allocation."""

    def __init__(self) -> None:
        self.labels: dict[int, tuple[str, str, str, Optional[int], str, str, int]] = {}
        self._pending: Optional[tuple] = None

    def bind(self, sim: Sim) -> None:
        self.sim = sim

    def on_event(self, event: tuple[int, int]) -> None:
        uid, n = event
        if not n:
            return
        sim = self.sim
        t = sim.event_block
        assert t is not None and t.uid == uid
        fwd = sim.phase != "backward"
        layer = sim.layer if fwd or sim.bwd_layer is None else sim.bwd_layer
        if layer is None and t.name.startswith("layers."):  # a parameter's own (weights, state): layers.<i>.
            head = t.name.split(".", 2)[1]
            layer = int(head) if head.isdigit() else None
        where = sim.trace_label or sim.label
        self._pending = (uid, t.kind, t.category, t.name, layer,
                         f"{where} {sim.role}" if sim.role and fwd else where, sim.phase)

    def on_row(self, row: tuple) -> None:
        p = self._pending
        if p is not None:
            self._pending = None
            self.labels[p[0]] = (*p[1:], int(row[3]))


def labelled_step(exp: ExperimentSpec, first_step: bool):
    """The step simulated as :func:`memcalc.estimate.peak.estimate` simulates it, with its events
    (uid, bytes) and each allocation's labels (:class:`LabelledEvents`)."""
    from memcalc.estimate.step import simulate

    watch = LabelledEvents()
    res = simulate(exp, first_step=first_step, record_timeline=False, events=True, observers=[watch])
    return res, watch.labels


@dataclass
class Exported:
    """A snapshot (the dict ``_snapshot()`` returns) and what its replay measured: the allocator's
    allocated and reserved peaks over the measured pass (``replay_allocator``'s), the live peak of
    the tensors (sizes rounded to 512 bytes) over the whole trace, and which step it is."""

    snapshot: dict[str, Any]
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    live_peak_bytes: int
    step: str


def _frames(lab: tuple) -> list[dict[str, Any]]:
    kind, category, name, layer, label, phase, _req = lab
    return memcalc_frames(kind, layer, name or label or category, phase, category)


def snapshot_of(events: list[tuple[int, int]], step_start: int, warm: bool, labels: dict[int, tuple],
                phases: Optional[list[tuple[int, str]]] = None) -> Exported:
    """Replay ``events`` as :func:`memcalc.estimate.peak.replay_allocator` does (without a capacity)
    through a :class:`memcalc.snapshot.builder.SnapshotBuilder`: a trace entry for every allocator
    action, and the segments left at the end. ``phases``: (index into ``events``, phase) where each phase
    begins (``SimResult.event_phases``): a free's entries name the phase it is made in."""
    frames = {uid: _frames(lab) for uid, lab in labels.items()}
    starts = sorted(phases or [])
    at = [i for i, _ in starts]

    def phase_of(i: int) -> Optional[str]:
        k = bisect_right(at, i) - 1
        return starts[k][1] if k >= 0 else None

    build = SnapshotBuilder()
    counted: dict[int, int] = {}  # uid -> the bytes the simulator counted (rounded to 512)
    live = peak = 0

    def run(lo: int, hi: int) -> None:
        nonlocal live, peak
        for i in range(lo, hi):
            uid, n = events[i]
            if n:
                build.malloc(uid, labels[uid][6])
                counted[uid] = n
                live += n
                peak = max(peak, live)
            else:
                build.free(uid, phase_of(i))
                live -= counted.pop(uid)

    run(0, step_start)
    if warm:
        before = set(build.blocks)
        run(step_start, len(events))
        for uid in [u for u in build.blocks if u not in before]:  # freed as the next step begins
            build.free(uid, phase_of(step_start))
            live -= counted.pop(uid)
    build.alloc.reset_peak()
    run(step_start, len(events))
    snap = build.snapshot(frames.__getitem__)
    return Exported(snap, build.alloc.peak_allocated, build.alloc.peak_reserved, peak, "")


def export_estimate(est: Estimate) -> Exported:
    """The step that sets ``est``'s peak as a snapshot: the steady-state step (warm: its cache left by
    a first pass, as the estimate replays it), or the first step where that is the higher."""
    exp = est.experiment
    steady, labels = labelled_step(exp, first_step=False)
    if steady.peak_bytes >= est.peak_bytes:
        out = snapshot_of(steady.events or [], steady.step_start, True, labels, steady.event_phases)
        out.step = "steady state"
    else:
        first, labels = labelled_step(exp, first_step=True)
        out = snapshot_of(first.events or [], first.step_start, False, labels, first.event_phases)
        out.step = "first step"
    out.snapshot["memcalc"] = {"experiment": exp.name, "step": out.step, "peak_bytes": est.peak_bytes,
                               "step_allocated_bytes": est.step_allocated_bytes,
                               "step_reserved_bytes": est.step_reserved_bytes}
    return out


def write_estimate_snapshot(est: Estimate, path: str) -> dict[str, Any]:
    """Write ``est``'s step to ``path`` as a PyTorch CUDA memory snapshot (the pickle
    ``torch.cuda.memory._dump_snapshot`` writes; pytorch.org/memory_viz opens it): ``memcalc estimate
    --snapshot``. Returns what was written (``--json``'s ``snapshot``): path, step, trace entries,
    segments, and the trace's peaks (the live tensors', the allocator's allocated and reserved)."""
    from memcalc.snapshot.format import write_snapshot

    out = export_estimate(est)
    write_snapshot(out.snapshot, path)
    return {"path": str(path), "step": out.step, "trace_entries": len(out.snapshot["device_traces"][0]),
            "segments": len(out.snapshot["segments"]), "peak_bytes": out.live_peak_bytes,
            "allocated_peak_bytes": out.allocated_peak_bytes, "reserved_peak_bytes": out.reserved_peak_bytes}

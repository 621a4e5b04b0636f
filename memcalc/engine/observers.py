"""What a caller may watch of a simulated step: observers registered with :meth:`Sim.watch`.

The simulator (:mod:`memcalc.engine.sim`) keeps the allocation and autograd bookkeeping and the
peak; anything else a caller wants of a step is an observer it registers, with any of these
methods (each list of hooks is checked only when non-empty, so a step nobody watches pays a test
per allocation; the per-allocation hooks get a tuple, so that ``list.append`` serves, which needs no
frame of its own: the plan's hot path traces every allocation):

- ``on_row(row)``: after each allocation that is no ghost, ``row`` = (the new running total, phase,
  label, the bytes requested: an int, or a :class:`memcalc.engine.sharding.Share` as given);
- ``on_event(event)``: ``(uid, bytes)`` for each allocation that takes memory, the block numbered
  ``uid`` from 1 (``T.uid``), and ``(uid, 0)`` when it is freed;
- ``on_peak(total)``: a new peak (it may raise, cutting the step short);
- ``on_phase(phase)``: a phase begins (:meth:`Sim.mark`);
- ``on_mark()``: the label (or phase) changed (:meth:`Sim.mark`, backward reaching another label);
- ``bind(sim)``: called once by :meth:`Sim.watch`, for an observer that reads the simulator.

A caller passes its own to :func:`memcalc.engine.timeline.simulate` (``observers``: the plan's
:class:`StopAbove`); the ones whose records make fields of the step's result
(:class:`memcalc.engine.result.SimResult`: ``timeline``, ``alloc_trace``, ``events``) it registers
itself for its ``record_timeline``, ``trace_allocs`` and ``events`` arguments. A checkpointed region's
ghost allocations are :class:`memcalc.engine.checkpoint.Ghosts`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.engine.result import TimelinePoint

if TYPE_CHECKING:
    from memcalc.engine.sim import Sim


class PeakAbove(Exception):
    """A step's running total passed its :class:`StopAbove` limit (the bytes that fit a card): its
    peak is at least ``total`` bytes, and the rest of the step was not simulated. ``grads_ready``:
    the gradients that had become ready by then (none: a fused optimizer step, which differs from
    the unfused one only from the first ready gradient on, passes the same total too)."""

    def __init__(self, total: int, grads_ready: int) -> None:
        super().__init__(total, grads_ready)
        self.total = total
        self.grads_ready = grads_ready


class StopAbove:
    """A new peak above ``limit`` raises :class:`PeakAbove`: a search that only needs to know that a
    step does not fit a card stops there (:func:`memcalc.plan.limits.need`, through
    :func:`memcalc.plan.steps.traced_step`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def bind(self, sim: Sim) -> None:
        self.sim = sim

    def on_peak(self, total: int) -> None:
        if total > self.limit:
            raise PeakAbove(total, self.sim.grads_ready)


class AllocTrace:
    """``rows``: (total bytes, phase, label, requested bytes) after every allocation, for fitting the
    step in batch and sequence length event by event (:mod:`memcalc.plan.fits`) and in depth
    (:mod:`memcalc.plan.depth`: the label says which layer an allocation belongs to; a
    :class:`memcalc.engine.sharding.Share` keeps its type, the whole it divides being what depth
    extrapolates)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, str, int]] = []
        self.on_row = self.rows.append


class AllocEvents:
    """``events``: (uid, bytes) for each allocation and (uid, 0) for each free, in order, for
    replaying the CUDA caching allocator (:mod:`memcalc.core.allocator`); ``phases``: (index into
    ``events``, phase) where each phase begins, so that a step's first-step twin can be derived
    from its events (:func:`memcalc.engine.twins.first_step_of`)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.phases: list[tuple[int, str]] = []
        self.on_event = self.events.append

    def on_phase(self, phase: str) -> None:
        self.phases.append((len(self.events), phase))


class Timeline:
    """``points``: what is alive by kind whenever the label or the phase changes (the report's
    timeline)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.points: list[TimelinePoint] = []

    def on_mark(self) -> None:
        sim = self.sim
        self.points.append(TimelinePoint(len(self.points), sim.label, sim.phase, dict(sim.by_kind)))

"""The simulations the plan asks for, cached: each step's peak (steady state or first step), its
allocation trace for a fit (:mod:`memcalc.plan.fits`), the estimate's peak from them, and the
weights-plus-state floor that rules an option out without a forward pass."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from memcalc.core.layout import layout_of
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.timeline import first_step_within_steady, floor_bytes
from memcalc.engine.result import SimResult
from memcalc.engine.sharding import uses_deepspeed
# DEPTH_CHECKED and ONE_GPU_TRACES are named here for memcalc.plan.parallel, whose workers send them back
from memcalc.plan.depth import CHECKED as DEPTH_CHECKED
from memcalc.plan.depth import ONE_GPU_TRACES  # noqa: F401
from memcalc.plan.depth import CHECKED_DEPTHS, SHALLOW_DEPTHS, applies, deep_trace, shallow, structure_key
from memcalc.plan.steps import SIM_CACHE, traced_step


def with_training(exp: ExperimentSpec, **training: Any) -> ExperimentSpec:
    """``exp`` with some training fields changed (batch, seq, gpus, ...)."""
    return exp.model_copy(update={"training": exp.training.model_copy(update=training)})


def smallest_fitting(cards: Sequence[Any], n: int, need: Callable[[int, Any], int]) -> list[Optional[int]]:
    """For each of ``cards`` (in their order), the smallest index ``i < n`` whose ``need(i, card)`` (a device
    total on that card's own GPU side, bytes, falling as ``i`` grows: more GPUs, each holding less) is within the
    card's ``capacity_bytes``, by bisection; None where even ``need(n - 1, card)`` is not. Each layout is
    simulated once at most when ``need`` caches its estimate (the plan's layout tables do); larger cards go
    first, their bisections ending lower."""
    found: dict[int, Optional[int]] = {}
    for k in sorted(range(len(cards)), key=lambda k: -cards[k].capacity_bytes):
        cap = int(cards[k].capacity_bytes)
        if need(n - 1, cards[k]) > cap:
            found[k] = None
            continue
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if need(mid, cards[k]) <= cap:
                hi = mid
            else:
                lo = mid + 1
        found[k] = lo
    return [found[k] for k in range(len(cards))]


@dataclass(frozen=True)
class Trace:
    """The running totals of one simulated step (one per allocation) and their phases."""

    totals: np.ndarray  # (E,) float64 bytes
    phases: tuple[str, ...]  # phase of each allocation
    peak_bytes: int  # the simulator's own peak (the highest total)


#: Simulated peaks by (experiment, first_step): fit points and direct checks share them.
PEAK_CACHE: dict[tuple[ExperimentSpec, bool], int] = {}
#: Step traces by (experiment, first_step, direct) (:func:`step_trace`). Like the peaks, the traces a
#: plan's worker process simulates come back to the parent (:mod:`memcalc.plan.parallel`), so that
#: a later stage in another worker (a fit whose first point is an option's batch-1 step) reuses them.
TRACE_CACHE: dict[tuple[ExperimentSpec, bool, bool], Trace] = {}
#: At most this many traces are kept (a few MB each at most).
TRACE_CACHE_SIZE = 512


def step_trace(exp: ExperimentSpec, first_step: bool, direct: bool = False) -> Trace:
    """:func:`_step_trace`, cached in :data:`TRACE_CACHE`."""
    key = (exp, first_step, direct)
    got = TRACE_CACHE.get(key)
    if got is None:
        if len(TRACE_CACHE) >= TRACE_CACHE_SIZE:
            TRACE_CACHE.clear()
        got = TRACE_CACHE[key] = _step_trace(exp, first_step, direct)
    return got


def _step_trace(exp: ExperimentSpec, first_step: bool, direct: bool = False) -> Trace:
    """One simulated step with its allocation trace (cached: plans ask for the same points).
    A deep stack is simulated at three shallow depths (periods of its layout) and extrapolated
    exactly (:func:`memcalc.plan.depth.deep_trace`); otherwise, or with ``direct``, the step is simulated
    directly (a fit over several points needs the same kind of trace at each: the extrapolated
    trace names fewer allocations than the direct one)."""
    deep = None if direct else deep_trace(exp, first_step)
    if deep is not None:
        totals, phases = deep
        peak = int(totals.max())
        if first_step:
            phases = ("first step",) * len(phases)
        _remember(exp, first_step, peak)
        return Trace(totals.astype(np.float64), phases, peak)
    r = traced_step(exp, first_step)
    tr = r.alloc_trace or []
    phases = tuple("first step" if first_step else ph for _, ph, _, _ in tr)
    _remember(exp, first_step, r.peak_bytes)
    return Trace(np.fromiter((t for t, _, _, _ in tr), dtype=np.float64, count=len(tr)), phases, r.peak_bytes)


def _remember(exp: ExperimentSpec, first_step: bool, peak: int) -> None:
    if len(PEAK_CACHE) > 200_000:
        PEAK_CACHE.clear()
    PEAK_CACHE[(exp, first_step)] = peak


def phase_peaks_of(exp: ExperimentSpec) -> Optional[dict[str, int]]:
    """The highest running total of each phase of ``exp``'s steady step, from its trace when this
    process has it (:data:`TRACE_CACHE`), else None."""
    tr = TRACE_CACHE.get((exp, False, False)) or TRACE_CACHE.get((exp, False, True))
    if tr is None:
        return None
    out: dict[str, int] = {}
    for t, ph in zip(tr.totals.tolist(), tr.phases):
        if t > out.get(ph, -1):
            out[ph] = int(t)
    return out


#: Phases whose bytes do not grow with batch or sequence (weights, state, gradients, the step's
#: temporaries): :func:`growing_peak` leaves them out.
FLAT_PHASES = ("setup", "optimizer step")


def growing_peak(exp: ExperimentSpec) -> Optional[int]:
    """The highest total of ``exp``'s steady step outside :data:`FLAT_PHASES`, from the step this
    process has simulated or extrapolated (None if it has not): what moves with batch and sequence,
    for a search to follow where a flat phase sets the peak (a full fine-tune's optimizer step
    with every gradient alive, at small sizes)."""
    pp = phase_peaks_of(exp)
    if pp is None:
        r = SIM_CACHE.get((exp.model, exp.training, exp.profile, False))
        pp = None if r is None else r.phases
    if not pp:
        return None
    vals = [v for k, v in pp.items() if k not in FLAT_PHASES]
    return max(vals) if vals else None


def trace_peak(exp: ExperimentSpec, first_step: bool = False) -> int:
    """:func:`simulated_peak`, simulating with the allocation trace (kept for a later fit)."""
    return step_trace(exp, first_step).peak_bytes


def simulated_peak(exp: ExperimentSpec, first_step: bool = False, stop_above: Optional[int] = None) -> int:
    """The allocated peak of one simulated step (steady state, or the first step), cached; the
    same number ``estimate()`` takes from the same simulation. ``stop_above``: a step simulated
    directly stops as soon as its running total passes this many bytes, raising
    :class:`memcalc.engine.observers.PeakAbove` (whose total is a lower bound of the peak); a step
    extrapolated in depth (cheap: shallow copies) runs whole."""
    key = (exp, first_step)
    if key not in PEAK_CACHE:
        if applies(exp):
            return step_trace(exp, first_step).peak_bytes
        _remember(exp, first_step, traced_step(exp, first_step, stop_above).peak_bytes)
    return PEAK_CACHE[key]


def estimated_peak(exp: ExperimentSpec) -> int:
    """``estimate(exp).peak_bytes``: the higher of the simulated steady-state and first steps, from
    the same simulations estimate() runs (cached, so fit points are not simulated twice). Where
    the first step cannot be the higher (:func:`memcalc.engine.timeline.first_step_within_steady`,
    checked by every estimate), it is not simulated."""
    if first_step_within_steady(exp):
        return simulated_peak(exp, False)
    return max(simulated_peak(exp, False), simulated_peak(exp, True))


#: The estimate's device totals by (experiment, GPU side) (:func:`device_total`); like the peaks, those a
#: worker works out come back to the parent (:mod:`memcalc.plan.parallel`).
TOTAL_CACHE: dict[tuple[ExperimentSpec, Any], int] = {}
#: Lower bounds of device totals past a card, by the same keys: a step cut short (:func:`device_total`).
TOTAL_BOUNDS: dict[tuple[ExperimentSpec, Any], int] = {}


def device_total(exp: ExperimentSpec, side: Any, limit: Optional[int] = None) -> int:
    """``estimate(exp, side=side).device_total_bytes``: the verdict ``memcalc estimate`` gives on the card of
    ``side`` (:func:`memcalc.render.report.fits_rows`: the device total of :mod:`memcalc.core.gpu_side`, whose
    reserved is the caching allocator's replay of the step, not its allocated peak), cached. ``limit`` (a
    card's capacity, for a caller that only asks whether the step fits it): the estimate stops as soon as
    the step's running total, or its replay's reserved bytes, show the total past ``limit``
    (:func:`memcalc.estimate.peak.largest_peak_within`), and a lower bound above ``limit`` comes back."""
    key = (exp, side)
    got = TOTAL_CACHE.get(key)
    if got is not None:
        return got
    bound = TOTAL_BOUNDS.get(key)
    if bound is not None and limit is not None and bound > limit:
        return bound
    from memcalc.core.gpu_side import overhead_bytes
    from memcalc.engine.observers import PeakAbove
    from memcalc.estimate.peak import largest_peak_within, replayed_device_total, steady_step

    stop = None if limit is None else largest_peak_within(limit, side)
    try:
        steady = _steady_step(exp, stop) or steady_step(exp, timeline=False, stop_above=stop)
        total = replayed_device_total(exp, steady, side, stop)
    except PeakAbove as e:  # reserved >= allocated: past the limit either way
        if len(TOTAL_BOUNDS) > 100_000:
            TOTAL_BOUNDS.clear()
        got = TOTAL_BOUNDS[key] = e.total + overhead_bytes(side)
        return got
    if len(TOTAL_CACHE) > 100_000:
        TOTAL_CACHE.clear()
    got = TOTAL_CACHE[key] = total
    return got


#: The last unfused steady step :func:`device_total` simulated whole, with the records its fused twin's events
#: are derived from (:func:`memcalc.engine.twins.fused_events_of`): the plan asks about an option's fused twin
#: right after it (the two share a fit group: :func:`memcalc.plan.search._plan_group`). Keyed by (model, training,
#: profile), as :data:`memcalc.plan.steps.SIM_CACHE` (options are named apart); only the last is kept.
UNFUSED_STEADY: dict[tuple[object, object, object], SimResult] = {}


def _steady_step(exp: ExperimentSpec, stop: Optional[int]) -> Optional[SimResult]:
    """The steady step :func:`device_total` reads, where it has its own way (None: simulated as the estimate
    does, :func:`memcalc.estimate.peak.steady_step`): a fused step
    derived from its unfused twin's when :data:`UNFUSED_STEADY` has it (cut short as the simulated step would
    be: :class:`memcalc.engine.observers.PeakAbove` at the first total above ``stop``), an unfused step whose
    twin can be derived simulated with those records (and kept). A fused step that passes ``stop`` in set-up is
    simulated (there the simulator reports a run of allocations' last total: ``Sim.alloc_many``)."""
    from memcalc.engine.observers import PeakAbove
    from memcalc.engine.twins import fused_events_of, fused_twin_applies, running_totals
    from memcalc.estimate.peak import steady_step

    tr = exp.training
    if tr.pp > 1:
        return None
    if tr.fused_optimizer:
        base = UNFUSED_STEADY.get((exp.model, tr.model_copy(update={"fused_optimizer": False}), exp.profile))
        got = None if base is None else fused_events_of(base, exp.profile.allocator_round_bytes)
        if got is None or stop is None or got.peak_bytes <= stop:
            return got
        assert got.events is not None
        at, total = next((i, t) for i, t in enumerate(running_totals(got.events)) if t > stop)
        if at < got.step_start:
            return None
        raise PeakAbove(total, 0)
    if not fused_twin_applies(exp):
        return None
    steady = steady_step(exp, timeline=False, stop_above=stop, fused_twin=True)
    UNFUSED_STEADY.clear()
    UNFUSED_STEADY[exp.model, tr, exp.profile] = steady
    return steady


def state_floor(exp: ExperimentSpec) -> int:
    """Weights plus optimizer state (plus every gradient, where all are alive together before an
    unfused optimizer step: :func:`memcalc.engine.timeline.floor_bytes`): a lower bound of the
    steady step's peak that needs no forward pass. Batch, seq and checkpointing do not change it,
    so they are fixed for the cache."""
    tr = exp.training.model_copy(update={"batch": 1, "seq": 2, "checkpoint": "none"})
    key = ExperimentSpec(model=exp.model, training=tr, profile=exp.profile)
    got = FLOOR_CACHE.get(key)
    if got is None:
        if len(FLOOR_CACHE) > 100_000:
            FLOOR_CACHE.clear()
        got = FLOOR_CACHE[key] = _state_floor_of(key)
    return got


#: Floors by setup (:func:`state_floor`); like the peaks, those a worker works out come back to the
#: parent (:mod:`memcalc.plan.parallel`).
FLOOR_CACHE: dict[ExperimentSpec, int] = {}


def _state_floor_of(exp: ExperimentSpec) -> int:
    """The floor; for a stack that repeats (:func:`memcalc.plan.depth.applies`) from its copies of 3,
    4 and 5 periods: every period allocates the same weights, state and gradients (each rounded on
    its own, nothing freed), so the bytes are affine in the periods (checked over the three; over
    the copies of 3 and 4 periods alone once the same setup at another GPU count was checked; not
    under DeepSpeed, whose flat partition is a share of the whole model, :mod:`memcalc.plan.depth`)."""
    if applies(exp) and not uses_deepspeed(exp):
        # (two depths where the same setup at another GPU count was checked at three, as for steps)
        key = ("floor", *structure_key(exp, False))
        depths = CHECKED_DEPTHS if key in DEPTH_CHECKED else SHALLOW_DEPTHS
        f = [floor_bytes(shallow(exp, d)) for d in depths]
        if len(f) == 2 or f[2] - f[1] == f[1] - f[0]:
            DEPTH_CHECKED[key] = True
            return f[0] + (layout_of(exp.model).units - depths[0]) * (f[1] - f[0])
    return floor_bytes(exp)

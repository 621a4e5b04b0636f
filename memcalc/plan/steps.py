"""The simulated steps the plan reads (with their allocation traces), cached per process, and the
steps it derives instead of simulating.

Options that differ only in the fused optimizer step come in pairs in the plan's grid, and their
searches ask about the same (batch, seq) points. A fused step is the unfused one with each
parameter's optimizer step run, and its gradient freed, where the gradient becomes ready
(:func:`memcalc.engine.twins.fused_twin_of`): so where that applies, the unfused step is
simulated once, recording where its gradients become ready, and the fused step is derived from it
in one pass over its trace (``tests/unit/test_fused_twin.py`` compares the two on 300 setups).
"""

from __future__ import annotations

from typing import Optional

from memcalc.core.spec import ExperimentSpec
from memcalc.engine.observers import PeakAbove, StopAbove
from memcalc.engine.result import SimResult
from memcalc.engine.twins import fused_twin_applies, fused_twin_of
from memcalc.estimate.step import simulate

#: Steps by (model, training, profile, first_step) (an experiment's name and notes change nothing in
#: its step, and options are named apart), each simulated with its allocation trace.
SIM_CACHE: dict[tuple[object, object, object, bool], SimResult] = {}
#: At most this many are kept (a 3-layer step's trace is a few hundred kB).
SIM_CACHE_SIZE = 1024
#: Steps cut short (``stop_above``), by the same keys as :data:`SIM_CACHE`: (the lower bound of the
#: peak, the gradients ready by then), so that a later question with a limit below the bound needs
#: no simulation.
BOUND_CACHE: dict[tuple[object, object, object, bool], tuple[int, int]] = {}


def traced_step(exp: ExperimentSpec, first_step: bool = False, stop_above: Optional[int] = None) -> SimResult:
    """``exp``'s step (steady state, or the first step) with its allocation trace: simulated, or
    for a fused optimizer step derived from the unfused step where
    :func:`memcalc.engine.twins.fused_twin_applies` (that step is simulated, or reused, in its
    place). The same trace and peak as ``simulate(exp, trace_allocs=True)``.

    ``stop_above``: raise :class:`memcalc.engine.observers.PeakAbove` instead, as soon as the step's
    running total passes it (a fused step's too when its unfused twin passes it before any
    gradient is ready: up to there the two run the same allocations)."""
    key = (exp.model, exp.training, exp.profile, first_step)
    got = SIM_CACHE.get(key)
    if got is not None:
        return got
    if stop_above is not None:
        bound = BOUND_CACHE.get(key)
        if bound is not None and bound[0] > stop_above:
            raise PeakAbove(*bound)
    tr = exp.training
    try:
        if tr.fused_optimizer and not first_step:
            unfused = exp.model_copy(update={"training": tr.model_copy(update={"fused_optimizer": False})})
            if fused_twin_applies(unfused):
                try:
                    base = traced_step(unfused, stop_above=stop_above)
                except PeakAbove as e:
                    if not e.grads_ready:
                        raise
                    base = traced_step(unfused)  # the fused step parts from it before it passed the limit
                got = fused_twin_of(base, exp.profile.allocator_round_bytes)
        if got is None:
            got = simulate(exp, first_step=first_step, record_timeline=False, trace_allocs=True, fused_twin=True,
                           observers=[StopAbove(stop_above)] if stop_above is not None else ())
    except PeakAbove as e:
        if len(BOUND_CACHE) >= SIM_CACHE_SIZE:
            BOUND_CACHE.clear()
        BOUND_CACHE[key] = (e.total, e.grads_ready)
        raise
    if len(SIM_CACHE) >= SIM_CACHE_SIZE:
        SIM_CACHE.clear()
    SIM_CACHE[key] = got
    return got

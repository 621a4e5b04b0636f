"""The simulated steps the plan reads (with their allocation traces), cached per process, and the
steps it derives instead of simulating.

Options that differ only in the fused optimizer step come in pairs in the plan's grid, and their
searches ask about the same (batch, seq) points. A fused step is the unfused one with each
parameter's optimizer step run, and its gradient freed, where the gradient becomes ready
(:func:`memcalc.engine.timeline.fused_twin_of`): so where that applies, the unfused step is
simulated once, recording where its gradients become ready, and the fused step is derived from it
in one pass over its trace (``tests/test_fused_twin.py`` compares the two on 300 setups).
"""

from __future__ import annotations

from memcalc.core.spec import ExperimentSpec
from memcalc.engine.timeline import SimResult, fused_twin_applies, fused_twin_of
from memcalc.estimate.step import simulate

#: Steps by (model, training, profile, first_step) (an experiment's name and notes change nothing in
#: its step, and options are named apart), each simulated with its allocation trace.
SIM_CACHE: dict[tuple[object, object, object, bool], SimResult] = {}
#: At most this many are kept (a 3-layer step's trace is a few hundred kB).
SIM_CACHE_SIZE = 1024


def traced_step(exp: ExperimentSpec, first_step: bool = False) -> SimResult:
    """``exp``'s step (steady state, or the first step) with its allocation trace: simulated, or
    for a fused optimizer step derived from the unfused step where
    :func:`memcalc.engine.timeline.fused_twin_applies` (that step is simulated, or reused, in its
    place). The same trace and peak as ``simulate(exp, trace_allocs=True)``."""
    key = (exp.model, exp.training, exp.profile, first_step)
    got = SIM_CACHE.get(key)
    if got is not None:
        return got
    tr = exp.training
    if tr.fused_optimizer and not first_step:
        unfused = exp.model_copy(update={"training": tr.model_copy(update={"fused_optimizer": False})})
        if fused_twin_applies(unfused):
            got = fused_twin_of(traced_step(unfused), exp.profile.allocator_round_bytes)
    if got is None:
        got = simulate(exp, first_step=first_step, record_timeline=False, trace_allocs=True, fused_twin=True)
    if len(SIM_CACHE) >= SIM_CACHE_SIZE:
        SIM_CACHE.clear()
    SIM_CACHE[key] = got
    return got

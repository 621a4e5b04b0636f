"""A step cut short once it passes a card (``stop_above``, :class:`memcalc.engine.observers.PeakAbove`)
and the searches that use it (memcalc/plan/limits.py).

A search that only needs to know that a point does not fit stops its simulation at the first
allocation that passes the card. The verdict must be the full simulation's, the bytes it reports
a lower bound of the full peak that is above the limit, and a fused step may share its unfused
twin's bound only when no gradient was ready yet (up to there the two run the same allocations).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.api import _resolve
from memcalc.core.units import GiB
from memcalc.engine.observers import PeakAbove, StopAbove
from memcalc.estimate.peak import largest_peak_within, required_bytes, step_side
from memcalc.estimate.step import simulate
from memcalc.plan import steps
from memcalc.plan.limits import largest_by_value, max_batch, max_seq, need
from memcalc.plan.simulations import with_training

# setups simulated directly (where the plan cuts steps short); each a different peak phase.
# source: memcalc/plan/depth.py applies() (sqrt, compile and shallow models are not extrapolated)
SETUPS = [
    dict(model="llama-3.1-8b", lora=True, bf16=True, checkpoint="sqrt"),  # source: sqrt segments
    dict(model="llama-3.1-8b", qlora=True, checkpoint="sqrt", fused_optimizer=True),  # source: fused, derived from unfused
    dict(model="llama-3.1-8b", lora=True, bf16=True, compile=True),  # source: compiled partition
    dict(model="gpt2", bf16=True, optimizer="adamw"),  # source: 12 layers, full fine-tune (gradients)
    dict(model="gpt2", bf16=True, optimizer="adamw", fused_optimizer=True),  # source: fused full fine-tune
]


def _exp(kw):
    return _resolve(None, dict(kw)).exp


@pytest.mark.parametrize("kw", SETUPS)
@pytest.mark.parametrize("frac", [0.5, 0.9, 0.999, 1.0, 1.5])
def test_stop_above_is_a_lower_bound_past_the_limit(kw, frac):
    exp = _exp(kw)
    full = simulate(exp, first_step=False, record_timeline=False).peak_bytes
    limit = int(full * frac)
    # source: definition: the step stops at the first total above the limit; none when the peak is within it
    if full <= limit:
        assert simulate(exp, first_step=False, record_timeline=False, observers=[StopAbove(limit)]).peak_bytes == full
    else:
        with pytest.raises(PeakAbove) as got:
            simulate(exp, first_step=False, record_timeline=False, observers=[StopAbove(limit)])
        assert limit < got.value.total <= full


@pytest.mark.parametrize("kw", SETUPS)
def test_need_verdict_is_the_same_cut_short(kw):
    exp = _exp(kw)
    for b in (1, 2, 3, 5):
        e = with_training(exp, batch=b)
        peak = max(simulate(e, first_step=False, record_timeline=False).peak_bytes,
                   simulate(e, first_step=True, record_timeline=False).peak_bytes)
        req = required_bytes(peak, step_side(e))  # the step's own GPU side (GPU count, linears' biases)
        for cap in (req - 1, req, 16 * GiB):
            steps.SIM_CACHE.clear()
            steps.BOUND_CACHE.clear()
            ok, value = need(e, cap, exact=False)
            # source: definition: fits iff the estimate's required bytes are within the card
            assert ok == (req <= cap)
            assert (value == req) if ok else (cap < value <= req)
            assert need(e, cap) == (ok, float(req)) or not ok


def test_fused_step_shares_the_bound_only_before_a_gradient():
    unfused = _exp(dict(model="gpt2", bf16=True, optimizer="adamw"))
    fused = with_training(unfused, fused_optimizer=True)
    steps.SIM_CACHE.clear()
    steps.BOUND_CACHE.clear()
    want = simulate(fused, first_step=False, record_timeline=False).peak_bytes
    for frac in (0.3, 0.6, 0.9, 0.99):
        limit = int(want * frac)
        try:
            got = steps.traced_step(fused, stop_above=limit).peak_bytes
        except PeakAbove as e:
            # source: a bound is a total the fused step reaches too
            assert limit < e.total <= want
        else:  # ran whole (or the fused step parted from its twin before the limit): the exact peak
            assert got == want


@pytest.mark.parametrize("cap", [0, 1, 512 * 2**20, 512 * 2**20 + 1, 24 * GiB, 80 * 10**9, 10**15 + 7])
def test_largest_peak_within(cap):
    p = largest_peak_within(cap)
    # source: definition: the highest peak whose required bytes fit the card
    assert p == -1 or required_bytes(p) <= cap
    assert required_bytes(p + 1) > cap


@settings(max_examples=200, deadline=None)
@given(answer=st.integers(0, 500), seed=st.integers(1, 500), known=st.lists(st.integers(1, 500), max_size=3),
       slope=st.floats(0.5, 4.0), curve=st.floats(0.0, 0.01))
def test_search_with_known_points_and_bounds_is_exact(answer, seed, known, slope, curve):
    # a monotone requirement crossing the line between ``answer`` and ``answer + 1``; the "last"
    # probe answers with a bound just past the line where the value does not matter
    line = 1000.0
    f = lambda x: line + (x - answer - 0.5) * slope + curve * (x - answer) ** 2 * (x > answer)  # noqa: E731
    probe = lambda x: (f(x) <= line, f(x))  # noqa: E731
    last = lambda x: (True, f(x)) if f(x) <= line else (False, line + 1e-9)  # noqa: E731
    pts = tuple((k, *probe(k)) for k in known)
    # source: definition: the largest x in [1, 500] whose value is within the line (0 when none)
    assert largest_by_value(probe, 1, 500, line, seed, pts, last) == max(0, min(answer, 500))


@pytest.mark.slow
@pytest.mark.parametrize("kw", SETUPS[:3])
def test_plan_searches_match_plain_searches(kw):
    # source: the same searches without known points or cut-short probes (exact either way)
    exp = _exp(kw)
    cap = 24 * GiB
    b, s = max_batch(exp, cap, anchored=True), max_seq(exp, cap, seed=4000, anchored=True)
    steps.SIM_CACHE.clear()
    steps.BOUND_CACHE.clear()
    assert b == _plain(exp, cap, "batch", 1, 1 << 16) and s == _plain(exp, cap, "seq", 2, exp.model.max_seq_len)


def _plain(exp, cap, field, lo, hi):
    fits = lambda x: need(with_training(exp, **{field: x}), cap)[0]  # noqa: E731
    if not fits(lo):
        return 0
    while lo < hi:  # bisection on the verdict alone
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def test_scaled_seeds_of_a_fit_at_its_own_peak_are_its_seeds():
    # source: definition: scaling a fit to the peak it already has at batch 1 changes nothing, so the
    # seeds are the fit's own largest batch and sequence within the card (bisection on the fit)
    import numpy as np

    from memcalc.plan.fits import fit_step
    from memcalc.plan.search import _scaled_seeds

    exp = _exp(dict(model="llama-3.1-8b", lora=True, bf16=True, checkpoint="full"))
    fit = fit_step(exp)
    cap = 24 * GiB
    own = int(fit.peak(np.array([1.0]), np.array([float(exp.training.seq)]))[0])
    from memcalc.inputs.gpus import get_gpu

    h100 = get_gpu("h100-80gb")  # the reference card, whose GPU side fit.required counts
    mb, ms = _scaled_seeds(fit, exp, own, cap, h100)
    req = lambda b, t: float(fit.required(np.array([float(b)]), np.array([float(t)]))[0])  # noqa: E731
    assert req(mb, exp.training.seq) <= cap < req(mb + 1, exp.training.seq)
    assert req(1, ms) <= cap < req(1, ms + 1)
    # a higher peak at batch 1 (more saved per token) gives lower seeds
    mb2, ms2 = _scaled_seeds(fit, exp, int(own * 1.1), cap, h100)
    assert mb2 <= mb and ms2 < ms


@pytest.mark.parametrize("seq", [512, 2048, 8192])
def test_steering_value_keeps_the_verdict(seq):
    # source: definition (memcalc/plan/limits.py need, steer): the verdict is the estimate's; the
    # bytes are those of the peak outside the flat phases where they agree with it
    from memcalc.plan.simulations import FLAT_PHASES

    exp = _exp(dict(model="llama-3.1-8b", bf16=True, checkpoint="sqrt", optimizer="adamw", seq=seq))
    r = simulate(exp, first_step=False, record_timeline=False)
    growing = max(v for k, v in r.phases.items() if k not in FLAT_PHASES)
    from memcalc.plan.simulations import PEAK_CACHE

    for cap in (required_bytes(r.peak_bytes), required_bytes(growing), required_bytes(growing) - 1):
        steps.SIM_CACHE.clear()
        PEAK_CACHE.clear()
        ok, value = need(exp, cap, steer=True)
        assert ok == need(exp, cap)[0]
        if (required_bytes(growing) <= cap) == ok:
            assert value == required_bytes(growing)

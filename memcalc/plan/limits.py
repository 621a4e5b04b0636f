"""Exact answers by direct estimates: does a setup fit a card (:func:`fits_in`), its largest batch
and sequence (:func:`max_batch`, :func:`max_seq`, also ``estimate --max-batch/--max-seq`` through
:func:`estimate_limits`), and the monotone searches they use."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec
from memcalc.estimate.peak import required_bytes
from memcalc.plan.simulations import estimated_peak, simulated_peak, state_floor, with_training

#: Largest batch the search considers.
BATCH_CAP = 1 << 16
#: Options whose fitted requirement is within this fraction of the card are checked directly.
CONFIRM_MARGIN = 0.02


def fits_in(exp: ExperimentSpec, capacity_bytes: int) -> bool:
    """Whether ``estimate(exp).required_bytes <= capacity_bytes``. Two exact shortcuts come first:
    weights plus optimizer state (no forward pass) and the steady-state step alone; when either
    does not fit, the estimate (at least as high) cannot either."""
    if required_bytes(state_floor(exp)) > capacity_bytes:  # weights + state alone: no simulation
        return False
    if required_bytes(simulated_peak(exp)) > capacity_bytes:
        return False
    return required_bytes(estimated_peak(exp)) <= capacity_bytes


def largest_true(pred, lo: int, hi: int) -> int:
    """The largest integer x in [lo, hi] with ``pred(x)`` true, for a predicate that is true up to
    some point and false after it; ``lo - 1`` if ``pred(lo)`` is false. Vectorised callers pass
    arrays of lo/hi; see :func:`largest_true_array`."""
    if not pred(lo):
        return lo - 1
    if pred(hi):
        return hi
    while hi - lo > 1:  # pred(lo) true, pred(hi) false
        mid = (lo + hi) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_true_array(pred, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`largest_true` for many monotone predicates at once: ``pred(x)`` takes an int array
    (one candidate per row) and returns a bool array."""
    lo = np.asarray(lo, dtype=np.int64).copy()
    hi = np.asarray(hi, dtype=np.int64).copy()
    ok_lo = pred(lo)
    ok_hi = pred(hi)
    res = np.where(ok_hi, hi, np.where(ok_lo, -1, lo - 1))
    todo = ok_lo & ~ok_hi
    a, b = lo.copy(), hi.copy()
    while True:
        active = todo & (b - a > 1)
        if not active.any():
            break
        mid = (a + b) // 2
        ok = pred(mid)
        a = np.where(active & ok, mid, a)
        b = np.where(active & ~ok, mid, b)
    return np.where(todo, a, res)


def _gallop_up(pred: Callable[[int], bool], a: int, hi: int, step: int) -> int:
    """The largest x in [a, hi] with pred(x), given pred(a): steps of ``step``, doubling, then bisection."""
    while True:
        b = min(hi, a + step)
        if b == a:
            return a
        if not pred(b):
            return largest_true(pred, a, b - 1) if b - 1 > a else a
        a, step = b, step * 2


def largest_exact(pred: Callable[[int], bool], lo: int, hi: int, seed: Optional[int] = None) -> int:
    """The largest x in [lo, hi] with pred(x) (pred monotone: true, then false), ``lo - 1`` if none.
    With a ``seed`` (a fitted guess) it checks seed and seed + 1 first and gallops outward only
    when the guess is off."""
    if seed is None or seed < lo or seed > hi:
        if not pred(lo):
            return lo - 1
        return _gallop_up(pred, lo, hi, 1)
    if pred(seed):
        if seed == hi or not pred(seed + 1):
            return seed
        return _gallop_up(pred, seed + 1, hi, 2)
    b, step = seed, 1  # gallop down: pred(b) false
    while True:
        a = max(lo, b - step)
        if pred(a):
            return largest_true(pred, a, b - 1) if b - 1 > a else a
        if a == lo:
            return lo - 1
        b, step = a, step * 2


def max_batch(exp: ExperimentSpec, capacity_bytes: int, seed: Optional[int] = None) -> int:
    """The largest batch (at ``exp``'s seq, everything else as given) whose required bytes fit
    ``capacity_bytes``; 0 if batch 1 does not fit; at most :data:`BATCH_CAP`. Exact: a galloping
    binary search over direct estimates (the estimate is monotone in batch)."""
    return largest_exact(lambda b: fits_in(with_training(exp, batch=int(b)), capacity_bytes), 1, BATCH_CAP, seed)


def max_seq(exp: ExperimentSpec, capacity_bytes: int, seed: Optional[int] = None) -> int:
    """The largest sequence (at ``exp``'s batch) whose required bytes fit ``capacity_bytes``, at most
    the model's ``max_seq_len``; 0 if not even 2 tokens fit. Exact: binary search over direct
    estimates (monotone in seq)."""
    hi = exp.model.max_seq_len
    if seed is None:  # bisect between 2 and the model's maximum
        pred = lambda t: fits_in(with_training(exp, seq=int(t)), capacity_bytes)  # noqa: E731
        r = largest_true(pred, 2, hi)
        return r if r >= 2 else 0
    r = largest_exact(lambda t: fits_in(with_training(exp, seq=int(t)), capacity_bytes), 2, hi, seed)
    return r if r >= 2 else 0


def check_one_gpu(gpu: Optional[Sequence[str]], flag: str):
    """The single GPU that ``--max-batch``/``--max-seq`` answer for (UserError otherwise)."""
    from memcalc.inputs.gpus import get_gpu

    names = list(gpu or [])
    if len(names) != 1:
        got = "none" if not names else f"{len(names)} ({', '.join(names)})"
        raise UserError(f"{flag} needs exactly one --gpu (the card to fit), got {got}")
    return get_gpu(names[0])


def estimate_limits(exp: ExperimentSpec, gpu: Any, want_batch: bool, want_seq: bool) -> dict[str, Any]:
    """``estimate --max-batch/--max-seq``: the exact answers on one ``gpu``, and the required bytes
    at the answer and one past it (what makes the answer the answer)."""
    cap = int(gpu.capacity_bytes)
    out: dict[str, Any] = {"gpu": gpu.name, "capacity_bytes": cap}
    tr = exp.training
    if want_batch:
        b = max_batch(exp, cap)
        out["max_batch"] = b
        out["max_batch_seq"] = tr.seq
        out["max_batch_required_bytes"] = required_bytes(estimated_peak(with_training(exp, batch=b))) if b else None
        out["next_batch_required_bytes"] = (required_bytes(estimated_peak(with_training(exp, batch=b + 1)))
                                            if b < BATCH_CAP else None)
    if want_seq:
        t = max_seq(exp, cap)
        out["max_seq"] = t
        out["max_seq_batch"] = tr.batch
        out["max_seq_required_bytes"] = required_bytes(estimated_peak(with_training(exp, seq=t))) if t else None
        out["next_seq_required_bytes"] = (required_bytes(estimated_peak(with_training(exp, seq=t + 1)))
                                          if 2 <= t < exp.model.max_seq_len else None)
    return out

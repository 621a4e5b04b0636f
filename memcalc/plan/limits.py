"""Exact answers by direct estimates: does a setup fit a card (:func:`fits_in`), its largest batch
and sequence (:func:`max_batch`, :func:`max_seq`, also ``estimate --max-batch/--max-seq`` through
:func:`estimate_limits`), and the monotone searches they use."""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import numpy as np

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.observers import PeakAbove
from memcalc.estimate.peak import card_side, largest_peak_within, required_bytes, step_side
from memcalc.plan.simulations import (device_total, estimated_peak, growing_peak, simulated_peak, state_floor,
                                      with_training)

#: Largest batch the search considers.
BATCH_CAP = 1 << 16
#: Options whose fitted requirement is within this fraction of the card are checked directly.
CONFIRM_MARGIN = 0.02


def side_of(exp: ExperimentSpec, gpu: Any = None):
    """The GPU side the required bytes count on: ``gpu``'s own (a ``data/gpus.yaml`` entry), else the
    estimate's reference card (:func:`memcalc.estimate.peak.step_side`)."""
    return step_side(exp) if gpu is None else card_side(exp, gpu)


def fits_in(exp: ExperimentSpec, capacity_bytes: int) -> bool:
    """Whether ``estimate(exp).required_bytes <= capacity_bytes`` (:func:`need`'s verdict)."""
    return need(exp, capacity_bytes)[0]


def need(exp: ExperimentSpec, capacity_bytes: int, exact: bool = True, steer: bool = False,
         gpu: Any = None, replayed: bool = False) -> tuple[bool, float]:
    """Whether ``estimate(exp)`` fits ``capacity_bytes``, with its required bytes: with ``replayed`` the
    estimate's own verdict (the device total, whose reserved is the caching allocator's replay:
    :func:`memcalc.plan.simulations.device_total`), else that total with reserved taken as allocated (a
    lower bound of it: no replay per probe). Exact shortcuts come first, each a lower bound: weights plus
    optimizer state (no forward pass), the steady-state step alone (and, ``replayed``, the estimate's
    allocated peak); when one does not fit, the estimate cannot either, and the shortcut's bytes come
    back instead. Without ``exact`` (a
    caller that only asks whether it fits) a step simulated directly stops as soon as it passes
    the card (:func:`memcalc.estimate.peak.largest_peak_within`), and the bytes that come back for
    a step that does not fit are those at that moment (a lower bound too).

    ``steer`` (a search over batch or sequence): the bytes that come back are those of the step's
    peak outside the phases that do not grow with them (:func:`memcalc.plan.simulations.growing_peak`)
    where that agrees with the verdict, so that a search follows what moves. ``gpu``: the card whose GPU
    side counts (:func:`side_of`)."""
    side = side_of(exp, gpu)
    got = required_bytes(state_floor(exp), side)
    if got > capacity_bytes:
        return False, float(got)
    try:
        stop = None if exact else largest_peak_within(capacity_bytes, side)
        got = required_bytes(simulated_peak(exp, stop_above=stop), side)
    except PeakAbove as e:
        return False, float(required_bytes(e.total, side))
    if got <= capacity_bytes:
        got = required_bytes(estimated_peak(exp), side)
    if got <= capacity_bytes and replayed:  # the allocated peak fits: the estimate's verdict (its replay) decides
        got = device_total(exp, side, None if exact else capacity_bytes)
    ok = got <= capacity_bytes
    if steer:
        g = growing_peak(exp)
        if g is not None and (required_bytes(g, side) <= capacity_bytes) == ok:
            return ok, float(required_bytes(g, side))
    return ok, float(got)


def largest_true_array(pred, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The largest x in [lo, hi] with ``pred(x)`` true (``lo - 1`` if none), for many predicates that
    are each true up to some point and false after it, by bisection: ``pred(x)`` takes an int array
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


Probe = Callable[[int], tuple[bool, float]]
#: a probed point: (x, ok, value)
Point = tuple[int, bool, float]


def largest_by_value(probe: Probe, lo: int, hi: int, line: float, seed: Optional[int] = None,
                     known: Sequence[tuple[int, bool, float]] = (), last: Optional[Probe] = None) -> int:
    """The largest x in [lo, hi] whose ``probe(x)`` is ``(True, ...)``, ``lo - 1`` if none.

    ``probe(x)`` returns (ok, value): ok is true up to some x and false after it (monotone), and is
    decided by the value crossing ``line`` (the required bytes against a card's capacity; a lower
    bound of the value is fine where ok is false). The answer is decided by ``ok`` alone, so it
    is exact whatever the values; they only choose where to look next. From the ``seed`` (a
    fitted guess) it checks the guess and its neighbour; when the guess is off it steps to where
    the line through the last two values meets ``line`` (a secant step, falling back to doubling
    steps when the values do not help), then narrows the bracket by regula falsi. A smooth
    requirement is found in a few probes where a search on ok alone takes about 2 log2(distance).

    ``known``: points whose ``probe(x)`` is already at hand (x, ok, value), e.g. the option's own
    batch-1 estimate. Where the line through the nearest of them and the seed's value meets
    ``line`` more than :data:`JUMP_FRACTION` of the seed away (a rough guess: a compiled option
    seeded with its eager twin's answer), the search steps there at once instead of first checking
    the seed's neighbour (which settles an exact seed in two probes).

    ``last``: the same verdicts as ``probe``, for a point just above one that fits (where a
    verdict of "does not fit" ends the search, so its value is not needed and may be any lower
    bound past ``line``: :func:`need` without ``exact``)."""
    s = _ValueSearch(probe, last, lo, hi, line, {k[0]: (k[1], k[2]) for k in known})
    x = s.at(lo if seed is None else min(max(seed, lo), hi))
    far = _far_guess(x, known, s.cross)
    # where the values do not help (the same at both points: a phase that does not grow with x,
    # such as the optimizer step, sets them), steps of twice the last, from a fiftieth of the seed
    first_gap = max(1, int(abs(x[0]) * JUMP_FRACTION) // 2)
    found = s.step_up(x, far, first_gap) if x[1] else s.step_down(x, far, first_gap)
    return found if isinstance(found, int) else s.narrow(*found)


class _ValueSearch:
    """The state of one :func:`largest_by_value`: the points probed (and known), and its steps."""

    def __init__(self, probe: Probe, last: Optional[Probe], lo: int, hi: int, line: float,
                 seen: dict[int, tuple[bool, float]]) -> None:
        self.probe, self.last, self.lo, self.hi, self.line = probe, last, lo, hi, line
        self.seen = seen  # x -> (ok, value), the known points included
        self.probed: list[Point] = []  # the points probed here, in order

    def at(self, x: int) -> Point:
        """``probe(x)``, once per x (``last`` just above a point that fits)."""
        if x not in self.seen:
            below = self.seen.get(x - 1)
            self.seen[x] = (self.last if self.last is not None and below is not None and below[0] else self.probe)(x)
            self.probed.append((x,) + self.seen[x])
        return (x,) + self.seen[x]

    def cross(self, p: Point, q: Point) -> Optional[float]:
        """Where the line through ``p`` and ``q`` meets ``line`` (None where it is flat)."""
        if q[0] == p[0] or q[2] == p[2]:
            return None
        return p[0] + (self.line - p[2]) * (q[0] - p[0]) / (q[2] - p[2])

    def step_up(self, x: Point, far: Optional[tuple[Point, float]], gap: int) -> int | tuple[Point, Point]:
        """From ``x``, which fits, step up until a point does not: the answer where a step finds it,
        else the bracket (fits, does not) to narrow."""
        if x[0] == self.hi:
            return self.hi
        if far is not None and far[1] > x[0]:  # the seed is far below the answer: no neighbour check
            prev, a = far[0], x
        else:
            a = self.at(x[0] + 1)
            if not a[1]:
                return x[0]
            prev = x
        while True:
            t = self.cross(prev, a)
            guess = math.floor(t) + 1 if t is not None and t >= a[0] else a[0] + 2 * gap
            n = self.at(min(self.hi, max(guess, a[0] + 1)))
            if not n[1]:
                return a, n
            if n[0] == self.hi:
                return self.hi
            gap, prev, a = max(2 * gap, n[0] - a[0]), a, n

    def step_down(self, x: Point, far: Optional[tuple[Point, float]], gap: int) -> int | tuple[Point, Point]:
        """From ``x``, which does not fit, step down until a point does: the answer where a step
        finds it, else the bracket (fits, does not) to narrow."""
        if x[0] == self.lo:
            return self.lo - 1
        if far is not None and far[1] < x[0]:  # the seed is far above the answer: no neighbour check
            prev, b = far[0], x
        else:
            b = self.at(x[0] - 1)
            if b[1]:
                return b[0]
            prev = x
        while True:
            t = self.cross(b, prev)
            guess = math.floor(t) if t is not None and t < b[0] else b[0] - 2 * gap
            n = self.at(max(self.lo, min(guess, b[0] - 1)))
            if n[1]:
                return n, b
            if n[0] == self.lo:
                return self.lo - 1
            gap, prev, b = max(2 * gap, b[0] - n[0]), b, n

    def narrow(self, a: Point, b: Point) -> int:
        """The answer between ``a`` (fits) and ``b`` (does not): regula falsi on the values (Illinois:
        an end kept twice in a row has its distance to the line halved, so a curved requirement
        does not converge from one side only), except where the last two values probed lie on one
        side of the line (:meth:`_next`). The tightest bracket seen first (a known point may lie
        inside the one the steps found)."""
        pts = [(x,) + v for x, v in self.seen.items()]
        a = max((p for p in pts if p[1] and a[0] <= p[0] < b[0]), default=a)
        b = min((p for p in pts if not p[1] and a[0] < p[0] <= b[0]), default=b)
        fa, fb = a[2] - self.line, b[2] - self.line
        kept = 0  # +1: the fitting end moved last, -1: the other
        while b[0] - a[0] > 1:
            n = self.at(self._next(a, b, fa, fb))
            if n[1]:
                a, fa = n, n[2] - self.line
                if kept == 1:
                    fb /= 2
                kept = 1
            else:
                b, fb = n, n[2] - self.line
                if kept == -1:
                    fa /= 2
                kept = -1
        return a[0]

    def _next(self, a: Point, b: Point, fa: float, fb: float) -> int:
        """The next point inside the bracket: regula falsi on ``fa``, ``fb``; or, where the last two
        values probed lie on one side of the line, the line through those two while it meets
        ``line`` inside the bracket (a local slope: a requirement with a step in it, a compiled
        partition that changes with the size, is straight on each side). An exact interpolation
        lands on the answer, and the next step then checks its neighbour."""
        t = a[0] + (b[0] - a[0]) * (-fa / (fb - fa)) if fb > fa else (a[0] + b[0]) / 2
        if len(self.probed) >= 2 and self.probed[-1][1] == self.probed[-2][1]:
            s = self.cross(self.probed[-2], self.probed[-1])
            if s is not None and a[0] < s < b[0]:
                t = s
        return min(max(math.floor(t), a[0] + 1), b[0] - 1)


#: A known point's line jumps past the seed's neighbour check when it puts the answer more than this
#: fraction of the seed (and more than 2) away from the seed.
JUMP_FRACTION = 0.02


def _far_guess(x: tuple[int, bool, float], known: Sequence[tuple[int, bool, float]],
               cross: Callable) -> Optional[tuple[tuple[int, bool, float], float]]:
    """(the known point nearest the seed ``x``, where the line through both meets the capacity),
    when that is far from the seed (:data:`JUMP_FRACTION`); else None."""
    near = [k for k in known if k[0] != x[0] and k[2] != x[2]]
    if not near:
        return None
    k = min(near, key=lambda p: abs(p[0] - x[0]))
    t = cross(k, x)
    if t is None or abs(t - x[0]) <= max(2.0, JUMP_FRACTION * abs(x[0])):
        return None
    return k, t


def smallest_by_value(probe: Probe, lo: int, hi: int, line: float, seed: Optional[int] = None) -> Optional[int]:
    """The smallest x in [lo, hi] whose ``probe(x)`` is ``(True, ...)``, None if none, where ok is
    false and then true as x grows and the value falls (the required bytes per GPU as the GPUs
    grow): :func:`largest_by_value` over the reflected range ``lo + hi - x``."""
    x = largest_by_value(lambda x: probe(lo + hi - x), lo, hi, line,
                         lo + hi - seed if seed is not None and lo <= seed <= hi else None)
    return None if x < lo else lo + hi - x


def fit_probe(exp_at: Callable[[int], ExperimentSpec], capacity_bytes: int, exact: bool = True,
              steer: bool = False, gpu: Any = None, replayed: bool = False) -> Probe:
    """``probe(x)``: :func:`need` of ``exp_at(x)`` on ``capacity_bytes`` (``exact``, ``steer``, ``gpu``,
    ``replayed``: as there)."""
    return lambda x: need(exp_at(x), capacity_bytes, exact, steer, gpu, replayed)


def max_batch(exp: ExperimentSpec, capacity_bytes: int, seed: Optional[int] = None, anchored: bool = False,
              gpu: Any = None, replayed: bool = False) -> int:
    """The largest batch (at ``exp``'s seq, everything else as given) whose required bytes fit
    ``capacity_bytes``; 0 if batch 1 does not fit; at most :data:`BATCH_CAP`. Exact: a search over
    direct estimates (the estimate is monotone in batch), :func:`largest_by_value`; ``anchored``:
    ``exp``'s own batch is a known point of it (:func:`_own_point`); ``replayed``: by the estimate's own
    verdict (:func:`need`)."""
    at = lambda b: with_training(exp, batch=int(b))  # noqa: E731
    known = _own_point(exp, exp.training.batch, capacity_bytes, gpu) if anchored else ()
    return largest_by_value(fit_probe(at, capacity_bytes, steer=True, gpu=gpu, replayed=replayed), 1, BATCH_CAP,
                            capacity_bytes, seed, known,
                            last=fit_probe(at, capacity_bytes, exact=False, steer=True, gpu=gpu, replayed=replayed))


def max_seq(exp: ExperimentSpec, capacity_bytes: int, seed: Optional[int] = None, anchored: bool = False,
            gpu: Any = None, replayed: bool = False) -> int:
    """The largest sequence (at ``exp``'s batch) whose required bytes fit ``capacity_bytes``, at most
    the model's ``max_seq_len``; 0 if not even 2 tokens fit. Exact: a search over direct estimates
    (monotone in seq), :func:`largest_by_value`, from the seed or else from the middle of the range;
    ``anchored``: ``exp``'s own seq is a known point of it (:func:`_own_point`); ``replayed``: by the
    estimate's own verdict (:func:`need`)."""
    hi = exp.model.max_seq_len
    at = lambda t: with_training(exp, seq=int(t))  # noqa: E731
    known = _own_point(exp, exp.training.seq, capacity_bytes, gpu) if anchored else ()
    r = largest_by_value(fit_probe(at, capacity_bytes, steer=True, gpu=gpu, replayed=replayed), 2, hi, capacity_bytes,
                         seed if seed is not None else (2 + hi) // 2, known,
                         last=fit_probe(at, capacity_bytes, exact=False, steer=True, gpu=gpu, replayed=replayed))
    return r if r >= 2 else 0


def _own_point(exp: ExperimentSpec, x: int, capacity_bytes: int, gpu: Any = None) -> tuple[tuple[int, bool, float]]:
    """``exp`` itself as a known point ``(x, *need(exp))`` of a search over its batch or seq (its
    estimate is at hand: the plan has just made it)."""
    return ((x, *need(exp, capacity_bytes, steer=True, gpu=gpu)),)


def check_one_gpu(gpu: Optional[Sequence[str]], flag: str):
    """The single GPU that ``--max-batch``/``--max-seq`` answer for (UserError otherwise)."""
    from memcalc.inputs.gpus import get_gpu

    names = list(gpu or [])
    if len(names) != 1:
        got = "none" if not names else f"{len(names)} ({', '.join(names)})"
        raise UserError(f"{flag} needs exactly one --gpu (the card to fit), got {got}")
    return get_gpu(names[0])


def estimate_limits(exp: ExperimentSpec, gpu: Any, want_batch: bool, want_seq: bool) -> dict[str, Any]:
    """``estimate --max-batch/--max-seq``: the exact answers on one ``gpu``, and the device totals
    (the estimate's, :func:`memcalc.plan.simulations.device_total`) at the answer and one past it (what
    makes the answer the answer)."""
    tr = exp.training
    if tr.first_seq is not None:  # the searches fit the steady step in batch and sequence (memcalc.plan.fits)
        raise UserError(f"{'--max-batch' if want_batch else '--max-seq'} searches the steady step; with --first-seq "
                        "the run's first step can set the peak: leave one of them out")
    cap = int(gpu.capacity_bytes)
    out: dict[str, Any] = {"gpu": gpu.name, "capacity_bytes": cap}
    side = card_side(exp, gpu)
    if want_batch:
        b = max_batch(exp, cap, gpu=gpu, replayed=True)
        out["max_batch"] = b
        out["max_batch_seq"] = tr.seq
        out["max_batch_required_bytes"] = device_total(with_training(exp, batch=b), side) if b else None
        out["next_batch_required_bytes"] = (device_total(with_training(exp, batch=b + 1), side)
                                            if b < BATCH_CAP else None)
    if want_seq:
        t = max_seq(exp, cap, gpu=gpu, replayed=True)
        out["max_seq"] = t
        out["max_seq_batch"] = tr.batch
        out["max_seq_required_bytes"] = device_total(with_training(exp, seq=t), side) if t else None
        out["next_seq_required_bytes"] = (device_total(with_training(exp, seq=t + 1), side)
                                          if 2 <= t < exp.model.max_seq_len else None)
    return out

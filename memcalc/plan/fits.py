"""Closed forms of the simulated step: its peak as a function of batch and sequence length
(:func:`fit_step`) or of the data-parallel degree under ZeRO (:func:`fit_gpus`).

``memcalc plan`` asks thousands of "does it fit?" questions; simulating each one op by op
(:func:`memcalc.estimate.step.simulate`, 5-80 ms) would take minutes. Instead we simulate a few
points with ``trace_allocs=True`` and fit the running total after *every allocation* of the
step. Every allocation's size is a polynomial in the batch ``B`` and the sequence ``T``
(activations are ``B x T x width``; math attention's scores ``B x H x T^2``; ALiBi masks
``H x T^2`` in forward and a ``B x H x T^2`` broadcast gradient in backward; the loss's shifted
copy ``B x (T - 1) x V``), and the sequence of allocations and frees does not depend on
``B`` or ``T``. So the memory alive after allocation ``e`` is exactly

    total_e(B, T) = a + b*B + c*T + d*B*T + e*T^2 + f*B*T^2

up to the allocator's 512-byte rounding, and the peak of a phase is the maximum of these
polynomials over the phase's allocations. A single polynomial per phase does *not* fit: in
backward the peak moves from the start (logit gradients, large at big ``B x T``) to the end
(all gradients alive, which wins at small ``B x T``), so a fitted phase is the maximum of the
few allocations that can set its peak anywhere in the domain (typically 1-3 per phase). Phases:
``setup``/``forward``/``backward``/``optimizer step`` of the steady-state step and the whole
``first step`` (no optimizer state yet), as :func:`memcalc.estimate.peak.estimate` takes both;
the first step only where it can be the higher
(:func:`memcalc.engine.timeline.first_step_within_steady`: under DeepSpeed).

The fit is linear in ``B`` (exact: two batch sizes) and, when the simulated allocations show
no curvature in ``T`` at batch 2 (three sequence lengths), linear in ``T`` too (flash and
memory-efficient attention, RoPE, learned positions); otherwise quadratic (a sixth point).
Under ZeRO the per-GPU state is ``ceil(bytes / N)``: :func:`fit_gpus` fits ``a + b / N``.

Accuracy: within the allocator rounding (a few MiB on a multi-GiB peak; the tests require
1% against :func:`memcalc.estimate.peak.estimate` on held-out points). Callers confirm the answers
they print with a direct estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

import numpy as np

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.blocks.attention_variants import eager
from memcalc.engine.timeline import first_step_within_steady
from memcalc.core.gpu_side import biased_linears, reference_side
from memcalc.estimate.peak import required_bytes, step_side
from memcalc.plan.simulations import Trace, step_trace, with_training

#: Names of the (B, T) features, in coefficient order.
FEATURES = ("1", "B", "T", "B*T", "T^2", "B*T^2")
#: The batch range the fitted candidates are selected over (larger batches are extrapolated).
BATCH_DOMAIN = (1, 1 << 16)
#: The two batch sizes the fit simulates (see fit_step: the step has one shape from batch 2 on).
FIT_BATCHES = (2, 3)
#: Relative residual (of the largest total) above which the T-linear fit is rejected.
CURVATURE_TOL = 2e-6


def sorted_unique(a) -> np.ndarray:
    """``np.unique(a)`` for a plain array: sorted, without repeats. (numpy 2's ``np.unique`` imports
    ``numpy.ma`` on its first call, ~40 ms of a plan's start.)"""
    a = np.sort(np.asarray(a).ravel())
    return a[np.concatenate(([True], a[1:] != a[:-1]))] if len(a) else a


def bt_features(B, T, t_scale: float) -> np.ndarray:
    """Feature matrix (..., 6) for batch ``B`` and sequence ``T`` (T scaled by ``t_scale``
    so the coefficients stay well conditioned); broadcasts B against T."""
    B = np.asarray(B, dtype=np.float64)
    t = np.asarray(T, dtype=np.float64) / t_scale
    B, t = np.broadcast_arrays(B, t)
    one = np.ones_like(B)
    return np.stack([one, B, t, B * t, t * t, B * t * t], axis=-1)


def _traces(exps: Sequence[ExperimentSpec], first_step: bool) -> list[Trace]:
    """The step traces of ``exps`` (fit points), all of one kind: depth-extrapolated where every
    point allows it, else all simulated directly (the two name different numbers of allocations)."""
    got = [step_trace(e, first_step) for e in exps]
    if len({len(t.totals) for t in got}) > 1:  # some points extrapolated in depth, some not
        got = [step_trace(e, first_step, True) for e in exps]
    return got


def _stack(traces: Sequence[Trace], what: str) -> tuple[np.ndarray, tuple[str, ...]]:
    n = {len(t.totals) for t in traces}
    if len(n) != 1 or len({t.phases for t in traces}) != 1:
        raise RuntimeError(f"{what}: the simulated step changes shape between fit points; cannot fit it")
    return np.stack([t.totals for t in traces]), traces[0].phases


def _candidates(coef: np.ndarray, phases: tuple[str, ...], grid: np.ndarray,
                corners: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per phase, the allocations whose fitted total is the phase's maximum somewhere on ``grid``
    (G, F); returns phase -> (K, F) coefficient rows.

    ``corners``: when every total is multilinear in the domain's coordinates (a box), an
    allocation whose successor in the same phase is at least as high at every corner is at least
    as high everywhere in the box, so it can never set the peak; those are dropped first."""
    ph = np.array(phases)
    keep = np.ones(len(phases), dtype=bool)
    if corners is not None and len(phases) > 1:
        at = corners @ coef.T  # (C, E)
        same = ph[1:] == ph[:-1]
        dominated = same & np.all(at[:, 1:] >= at[:, :-1], axis=0)
        keep[:-1] &= ~dominated
    out: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(phases):
        idx = np.flatnonzero((ph == name) & keep)
        vals = grid @ coef[idx].T  # (G, k)
        best = sorted_unique(idx[np.argmax(vals, axis=1)])
        out[name] = coef[best]
    return out


# --------------------------------------------------------------------------- batch x seq


@dataclass(frozen=True)
class StepFit:
    """The peak of one training setup as a function of (batch, seq).

    ``phases[name]`` is a (K, 6) array: that phase's peak is the maximum over its K rows of
    ``row . bt_features(B, T, t_scale)``. ``peak`` is the maximum over phases (the steady step's
    phases and, under DeepSpeed, the first step), as ``estimate()`` reports it.
    """

    exp: ExperimentSpec
    phases: dict[str, np.ndarray]
    t_scale: float
    t_max: int
    quadratic: bool
    points: tuple[tuple[int, int], ...] = field(default=())

    @property
    def coefficients(self) -> np.ndarray:
        """All candidate rows of all phases, (K, 6)."""
        return np.concatenate(list(self.phases.values()))

    def phase_peaks(self, B, T) -> dict[str, np.ndarray]:
        f = bt_features(B, T, self.t_scale)
        return {k: (f @ c.T).max(axis=-1) for k, c in self.phases.items()}

    def peak(self, B, T) -> np.ndarray:
        """Fitted allocated peak in bytes (float array; broadcasts B against T)."""
        f = bt_features(B, T, self.t_scale)
        return (f @ self.coefficients.T).max(axis=-1)

    def required(self, B, T) -> np.ndarray:
        """Fitted required bytes: the device total of the fitted peak (:func:`required_bytes`)."""
        return required_bytes(self.peak(B, T), step_side(self.exp))


def fit_points(exp: ExperimentSpec) -> tuple[int, int, int]:
    """The three sequence lengths the fit simulates: T3 = min(2048, max_seq_len) rounded down to
    a multiple of 128 (where flash attention's 128-row rounding is exact), T3/2 and T3/4; for an
    SDPA sliding window between T3/4 and T3, the window, 4x the window (at most max_seq_len) and
    their midpoint (the step has one shape on each side of the window)."""
    t3 = min(2048, exp.model.max_seq_len)
    if t3 >= 512:
        t3 -= t3 % 128
    t1 = max(2, t3 // 4)
    t2 = max(t1 + 1, t3 // 2)
    w = exp.model.sliding_window
    if w is not None and t1 < w <= t3 and not eager(exp.model) and w + 2 <= exp.model.max_seq_len:
        # the step changes shape at T = window (SDPA gets an explicit sliding mask from there on,
        # memcalc.engine.blocks.attention_variants): fit at and above it; below the window the fit then
        # also counts the masks (an over-estimate the direct estimate corrects)
        t1, t3 = w, min(4 * w, exp.model.max_seq_len)
        t2 = (t1 + t3) // 2
    if not t1 < t2 < t3:
        raise UserError(f"{exp.model.name}: max_seq_len {exp.model.max_seq_len} is too short to fit in "
                        "sequence length (needs at least 4)")
    return t1, t2, t3


@lru_cache(maxsize=1024)
def fit_step(exp: ExperimentSpec) -> StepFit:
    """Fit ``exp``'s step (its own batch and seq are ignored) in batch and sequence length.

    Simulates the steady-state step at (2, T1), (3, T1), (2, T3), (3, T3) and (2, T2) (see
    :func:`fit_points` and FIT_BATCHES), and at (3, T2) too when the totals curve in T; the first step (only
    where it can set the peak) at the same points less (1, T2) when they do not. Cached per
    experiment within the process.
    """
    t1, t2, t3 = fit_points(exp)
    scale = float(t3)
    # batches 2 and 3, not 1: at batch 1 a broadcast add's gradient is the incoming one itself
    # (GPT-2's wte(x) + wpe(pos): AddBackward0 hands it through when the shapes are equal, Node.passes_grad),
    # from batch 2 on it is reduced into a new tensor: one allocation more, so the step changes shape
    # at B = 1 -> 2. Fitted from B >= 2, batch 1 is over-estimated by that one reduction, which the
    # callers' direct estimate corrects.
    b1, b2 = FIT_BATCHES
    pts = [(b1, t1), (b2, t1), (b1, t3), (b2, t3), (b1, t2)]
    lin = [0, 1, 2, 3]

    def solve(points, first_step, cols):
        Y, phases = _stack(_traces([with_training(exp, batch=b, seq=t) for b, t in points], first_step), exp.name)
        X = bt_features([p[0] for p in points], [p[1] for p in points], scale)[:, cols]
        c, *_ = np.linalg.lstsq(X, Y, rcond=None)
        coef = np.zeros((Y.shape[1], len(FEATURES)))
        coef[:, cols] = c.T
        resid = np.abs(X @ c - Y).max() / max(1.0, Y.max())
        return coef, phases, resid

    # the steady step: T-linear unless its totals curve in T at batch 2 (three sequence lengths)
    coef_s, ph_s, resid = solve(pts, False, lin)
    quadratic = bool(resid > CURVATURE_TOL)
    if quadratic:
        pts.append((b2, t2))
        coef_s, ph_s, _ = solve(pts, False, list(range(len(FEATURES))))
    # the first step runs the same forward and backward, so the same terms; it is fitted only where
    # it can set the peak (memcalc.engine.timeline.first_step_within_steady)
    coef, phases_all = coef_s, ph_s
    if not first_step_within_steady(exp):
        coef_f, ph_f, _ = solve(pts if quadratic else pts[:4], True, list(range(len(FEATURES))) if quadratic else lin)
        coef, phases_all = np.concatenate([coef_s, coef_f]), ph_s + ph_f
    t_max = exp.model.max_seq_len
    bs = sorted_unique(np.round(np.geomspace(BATCH_DOMAIN[0], BATCH_DOMAIN[1], 25)))
    ts = sorted_unique(np.concatenate([np.round(np.geomspace(2, max(t_max, 4), 25)), [t1, t2, t3]]))
    grid = bt_features(bs[:, None], ts[None, :], scale).reshape(-1, len(FEATURES))
    corners = None if quadratic else bt_features(
        np.array([BATCH_DOMAIN[0], BATCH_DOMAIN[1]])[:, None], np.array([2, max(t_max, 4)])[None, :], scale
    ).reshape(-1, len(FEATURES))
    phases = _candidates(coef, phases_all, grid, corners)
    return StepFit(exp, phases, scale, t_max, quadratic, tuple(pts))


# --------------------------------------------------------------------------- ZeRO degree


@dataclass(frozen=True)
class GpusFit:
    """The peak of one setup at a fixed (batch, seq) as a function of the ZeRO degree N >= 2:
    the maximum over candidate rows (a, b) of ``a + b / N``. N = 1 (nothing sharded, nothing
    gathered: a different step) is not covered; ``peak(1)`` is NaN."""

    exp: ExperimentSpec
    rows: np.ndarray  # (K, 2)

    def peak(self, n) -> np.ndarray:
        n = np.asarray(n, dtype=np.float64)
        f = np.stack([np.ones_like(n), 1.0 / np.maximum(n, 1)], axis=-1)
        out = (f @ self.rows.T).max(axis=-1)
        return np.where(n >= 2, out, np.nan)

    def required(self, n) -> np.ndarray:
        """The device total at each N >= 2 (NCCL's buffers do not depend on N: one ring)."""
        return required_bytes(self.peak(n), reference_side(2, biased_linears(self.exp), self.exp.training.compile))


#: ZeRO degrees the N-fit simulates (two would do; the third checks the fit).
GPU_FIT_POINTS = (2, 8, 64)


@lru_cache(maxsize=256)
def fit_gpus(exp: ExperimentSpec, n_max: int = 1024) -> GpusFit:
    """Fit ``exp``'s peak in the data-parallel degree N >= 2 (its ``gpus`` is ignored; ``zero``
    should be >= 1 for N to matter). Cached per experiment within the process."""
    # (the two kinds of step have different lengths; the first step only where it can set the peak:
    # memcalc.engine.timeline.first_step_within_steady)
    points = [with_training(exp, gpus=n) for n in GPU_FIT_POINTS]
    Y, phases = _stack(_traces(points, False), exp.name)
    if not first_step_within_steady(exp):
        yf, ph_f = _stack(_traces(points, True), exp.name)
        Y, phases = np.concatenate([Y, yf], axis=1), phases + ph_f
    n = np.array(GPU_FIT_POINTS, dtype=np.float64)
    X = np.stack([np.ones_like(n), 1.0 / n], axis=-1)
    coef, *_ = np.linalg.lstsq(X, Y, rcond=None)
    ns = np.arange(2, n_max + 1, dtype=np.float64)
    grid = np.stack([np.ones_like(ns), 1.0 / ns], axis=-1)
    corners = np.array([[1.0, 1.0 / 2], [1.0, 1.0 / n_max]])  # a + b/N is linear in 1/N
    cands = _candidates(coef.T, phases, grid, corners)
    return GpusFit(exp, np.concatenate(list(cands.values())))


__all__ = ["FEATURES", "StepFit", "GpusFit", "fit_step", "fit_gpus", "bt_features", "fit_points", "sorted_unique"]

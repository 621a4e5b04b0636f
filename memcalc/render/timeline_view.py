"""The step as chart columns: what the terminal chart and the HTML timeline draw.

The columns are the estimate's timeline points from the first forward point to
the end of the optimizer step (the "setup" points, weights and optimizer state
being created before the step, are left out), with the peak placed among them.
No byte is computed here: every column is a timeline point, or the peak itself.

Where the peak goes. The simulator records a point when a labelled segment of
the step starts (e.g. "fwd layer 3"): the memory alive at that instant. The
peak is reached *inside* a segment, so it is usually above both the point that
opens the segment and the one that closes it. We find the segment by its label:

1. the points whose label equals ``est.peak_label`` without its
   " (steady state)" / " (first step)" suffix and whose phase equals
   ``est.peak_phase`` (if none, the label alone);
2. when several points share that label (backward revisits a layer to
   recompute it, micro-batches repeat), the one whose segment ends highest,
   i.e. the highest ``max(point, next point)``;
3. if no point has the label, the highest point.

The peak becomes its own column right after that point when it is above both
neighbours (``est.components_by_kind`` is its stack); otherwise (the peak is
exactly a recorded point) the higher neighbour is marked as the peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.engine.result import KINDS, Estimate, TimelinePoint

PEAK_SUFFIXES = (" (steady state)", " (first step)")


@dataclass(frozen=True)
class Column:
    """One column of a step chart: a timeline point, or the peak itself."""

    label: str
    phase: str
    by_kind: dict[str, int]
    is_peak: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(self.by_kind.values())


def bare_peak_label(label: str) -> str:
    """``'fwd layer 3 (steady state)'`` -> ``'fwd layer 3'``."""
    for suffix in PEAK_SUFFIXES:
        if label.endswith(suffix):
            return label[: -len(suffix)]
    return label


def step_points(est: Estimate) -> list[TimelinePoint]:
    """The timeline's points of the step itself (no "setup" points)."""
    return [p for p in est.timeline if p.phase != "setup"]


def peak_anchor(est: Estimate, points: list[TimelinePoint]) -> int:
    """Index into ``points`` of the point that opens the peak's segment (see module docstring)."""
    if not points:
        return -1
    label = bare_peak_label(est.peak_label)

    def seg_top(i: int) -> int:
        nxt = points[i + 1].total_bytes if i + 1 < len(points) else 0
        return max(points[i].total_bytes, nxt)

    matches = [i for i, p in enumerate(points) if p.label == label and p.phase == est.peak_phase]
    matches = matches or [i for i, p in enumerate(points) if p.label == label]
    if matches:
        return max(matches, key=lambda i: (seg_top(i), -i))
    return max(range(len(points)), key=lambda i: (points[i].total_bytes, -i))


def step_columns(est: Estimate) -> list[Column]:
    """The step's points as columns, with the peak marked or inserted (see module docstring)."""
    points = step_points(est)
    cols = [Column(p.label, p.phase, {k: p.by_kind.get(k, 0) for k in KINDS}) for p in points]
    if not cols:
        return [Column(bare_peak_label(est.peak_label), est.peak_phase, dict(est.components_by_kind), True)]
    i = peak_anchor(est, points)
    after = cols[i + 1].total_bytes if i + 1 < len(cols) else 0
    if est.peak_bytes > max(cols[i].total_bytes, after):
        peak = Column(bare_peak_label(est.peak_label), cols[i].phase, {k: est.components_by_kind.get(k, 0) for k in KINDS}, True)
        return cols[: i + 1] + [peak] + cols[i + 1 :]
    j = i + 1 if after > cols[i].total_bytes else i
    c = cols[j]
    cols[j] = Column(c.label, c.phase, c.by_kind, True)
    return cols


def phase_runs(cols: list[Column]) -> list[tuple[str, int, int]]:
    """Contiguous runs of one phase as ``(phase, start, end)`` (end exclusive)."""
    runs: list[tuple[str, int, int]] = []
    for i, c in enumerate(cols):
        if runs and runs[-1][0] == c.phase:
            runs[-1] = (c.phase, runs[-1][1], i + 1)
        else:
            runs.append((c.phase, i, i + 1))
    return runs


def _widths(sizes: list[int], width: int, min_width: int) -> list[int]:
    """Split ``width`` columns among runs: each at least ``min_width``, the rest by size (largest remainder)."""
    n = len(sizes)
    floor = min(min_width, width // n) if n else 0
    spare = width - floor * n
    total = sum(sizes) or 1
    shares = [spare * s / total for s in sizes]
    out = [floor + int(s) for s in shares]
    by_rest = sorted(range(n), key=lambda k: shares[k] - int(shares[k]), reverse=True)
    for k in by_rest[: width - sum(out)]:
        out[k] += 1
    return out


def resample(cols: list[Column], width: int, min_phase_width: int = 8) -> list[Column]:
    """Exactly ``width`` columns (chart geometry): each phase run gets at least ``min_phase_width``
    columns and the rest by its number of points; several points in one column keep the highest
    (so the peak is never lost), one point over several columns repeats."""
    if width <= 0 or not cols:
        return []
    runs = phase_runs(cols)
    if len(runs) > width:  # more phase runs than columns: one bucket per column, phases ignored
        runs = [("", 0, len(cols))]
    out: list[Column] = []
    for (_, a, b), w in zip(runs, _widths([b - a for _, a, b in runs], width, min_phase_width)):
        n = b - a
        for j in range(w):
            lo = a + j * n // w
            hi = max(a + (j + 1) * n // w, lo + 1)
            out.append(max(cols[lo:hi], key=lambda c: (c.total_bytes, c.is_peak)))
    return out


__all__ = ["Column", "step_columns", "resample", "phase_runs", "peak_anchor", "bare_peak_label"]

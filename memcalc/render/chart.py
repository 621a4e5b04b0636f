"""A terminal chart of memory across one training step, stacked by kind.

``timeline_chart(est, capacity_bytes)`` draws the columns of
:mod:`memcalc.render.timeline_view` (the step from its first forward point to the end
of the optimizer step, with the peak as its own column) resampled to the
width: each character cell is split into eighths with the lower block
characters ``▁▂▃▄▅▆▇█``, the kind below a boundary in the foreground colour
and the kind above it in the background colour. The peak is marked ``▼`` with
its value and phase, a GPU capacity is a red horizontal line, the y axis is in
GiB and the x axis is labelled by phase. Only chart geometry and unit
conversion happen here.
"""

from __future__ import annotations

import math
from typing import Optional

from rich.console import Group
from rich.style import Style
from rich.text import Text

from memcalc.engine.result import KIND_NAMES, KINDS, Estimate
from memcalc.render.timeline_view import Column, phase_runs, resample, step_columns
from memcalc.core.units import GiB, gib

#: One colour per kind, shared with the HTML report (Tableau 10).
KIND_COLORS = {
    "weights": "#4e79a7",
    "optimizer_state": "#b07aa1",
    "gradients": "#f28e2b",
    "activations": "#59a14f",
    "temporaries": "#edc948",
}
CAPACITY_COLOR = "#e15759"
PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer step": "optim"}
LOWER = " ▁▂▃▄▅▆▇█"  # LOWER[n]: the lower n eighths of a cell filled

Cell = tuple[str, Optional[Style]]


def nice_step(approx: float) -> float:
    """The smallest of 1, 2, 2.5, 5 x 10^k that is >= ``approx`` (approx > 0)."""
    exp = 10 ** math.floor(math.log10(approx))
    for m in (1, 2, 2.5, 5, 10):
        if m * exp >= approx * (1 - 1e-9):
            return m * exp
    return 10 * exp


def _tick_text(value_gib: float, step_gib: float) -> str:
    decimals = 0
    while abs(round(step_gib, decimals) - step_gib) > 1e-9 * step_gib and decimals < 6:
        decimals += 1
    return f"{value_gib:.{decimals}f}"


def _kind_at(col: Column, y: float) -> Optional[str]:
    """The kind drawn at height ``y`` (bytes) of a stacked column, or None above it."""
    top = 0
    for k in KINDS:
        top += col.by_kind.get(k, 0)
        if y < top and col.by_kind.get(k, 0):
            return k
    return None


def _cell(col: Column, row: int, unit: float) -> Cell:
    """One character cell of a column: the lower kind in the foreground, the upper in the background."""
    levels = [_kind_at(col, (row + (s + 0.5) / 8) * unit) for s in range(8)]
    bottom, top = levels[0], levels[7]
    if bottom is None:
        return " ", None
    if top == bottom:
        return "█", Style(color=KIND_COLORS[bottom], bgcolor=KIND_COLORS[bottom])
    if top is None:
        return LOWER[sum(1 for lv in levels if lv is not None)], Style(color=KIND_COLORS[bottom])
    return LOWER[levels.index(top)], Style(color=KIND_COLORS[bottom], bgcolor=KIND_COLORS[top])


def _pack(items: list[Text], width: int, sep: str = "  ") -> list[Text]:
    """Lay legend items out in lines no wider than ``width``."""
    lines: list[Text] = []
    cur = Text()
    for it in items:
        if cur.plain and len(cur.plain) + len(sep) + len(it.plain) > width:
            lines.append(cur)
            cur = Text()
        if cur.plain:
            cur.append(sep)
        cur.append_text(it)
    if cur.plain:
        lines.append(cur)
    for ln in lines:
        ln.truncate(width)
    return lines


def timeline_chart(est: Estimate, capacity_bytes: int | None = None, width: int = 80, height: int = 14) -> Group:
    """A rich renderable: memory across one training step of ``est``, at most ``width`` columns wide.

    ``capacity_bytes`` (one GPU's memory) draws a horizontal line; ``height`` is the plot's
    approximate number of rows.
    """
    cols = step_columns(est)
    peak = est.peak_bytes
    # -- y axis: a nice step in GiB, room above the peak for its marker ---------------------
    top = max(peak * (1 + 2.0 / height), (capacity_bytes or 0) * 1.04, GiB / 1024)
    step_gib = nice_step(gib(int(top)) / 4)
    n_ticks = max(1, math.ceil(gib(int(top)) / step_gib - 1e-9))
    per_tick = max(1, round(height / n_ticks))
    rows = per_tick * n_ticks
    unit = step_gib * GiB / per_tick  # bytes per row
    labels = {r: _tick_text((r + 1) // per_tick * step_gib, step_gib) for r in range(per_tick - 1, rows, per_tick)}
    lw = max(len(s) for s in [*labels.values(), "GiB"])
    plot_w = max(8, width - lw - 2)
    view = resample(cols, plot_w)

    grid: list[list[Cell]] = [[_cell(c, r, unit) for c in view] for r in range(rows)]
    # -- the capacity line ------------------------------------------------------------------
    if capacity_bytes:
        r_cap = min(int(capacity_bytes / unit), rows - 1)
        frac = capacity_bytes / unit - r_cap
        ch = "▁" if frac < 0.3 else ("─" if frac < 0.7 else "▔")
        for x, c in enumerate(view):
            under = _kind_at(c, capacity_bytes)
            grid[r_cap][x] = (ch, Style(color=CAPACITY_COLOR, bold=True, bgcolor=KIND_COLORS[under] if under else None))
    # -- the peak marker --------------------------------------------------------------------
    xs = [x for x, c in enumerate(view) if c.is_peak]
    x_peak = xs[len(xs) // 2] if xs else max(range(len(view)), key=lambda x: view[x].total_bytes)
    r_mark = min(int(peak / unit) + 1, rows - 1)
    tag = f" peak {gib(peak):.2f} GiB, {est.peak_phase}"
    mark_style = Style(bold=True)
    grid[r_mark][x_peak] = ("▼", mark_style)
    if x_peak + 1 + len(tag) <= plot_w:
        spots = range(x_peak + 1, x_peak + 1 + len(tag))
    else:
        tag = tag.strip() + " "
        spots = range(max(0, x_peak - len(tag)), x_peak)
        tag = tag[-len(spots):] if len(spots) else ""
    for x, ch in zip(spots, tag):
        grid[r_mark][x] = (ch, mark_style)

    lines: list[Text] = []
    title = Text(f"{est.experiment.name}: memory across one training step", style="bold")
    title.truncate(width, overflow="ellipsis")
    lines.append(title)
    sub = Text(f"{'GiB':>{lw}}")
    sub.append(f"   peak {gib(peak):.2f} GiB in {est.peak_phase}, at {est.peak_label}", style="dim")
    sub.truncate(width, overflow="ellipsis")
    lines.append(sub)
    for r in range(rows - 1, -1, -1):
        ln = Text()
        ln.append(f"{labels[r]:>{lw}} ┤" if r in labels else f"{'':>{lw}} │", style="dim")  # the gutter only
        for ch, st in grid[r]:
            ln.append(ch, st)
        lines.append(ln)
    runs = phase_runs(view)
    axis = ["─"] * len(view)
    for _, a, _b in runs[1:]:
        axis[a] = "┴"
    lines.append(Text(f"{'0':>{lw}} └" + "".join(axis), style="dim"))
    names = [" "] * len(view)
    for phase, a, b in runs:
        name = next((s for s in (phase, PHASE_SHORT.get(phase, phase)) if len(s) <= b - a), phase[: b - a])
        start = a + (b - a - len(name)) // 2
        names[start : start + len(name)] = list(name)
    lines.append(Text(" " * (lw + 2) + "".join(names).rstrip(), style="bold"))
    legend = []
    for k in KINDS:
        item = Text("██", style=KIND_COLORS[k])
        item.append(f" {KIND_NAMES[k]} {gib(est.components_by_kind.get(k, 0)):.2f}")
        legend.append(item)
    if capacity_bytes:
        item = Text("──", style=Style(color=CAPACITY_COLOR, bold=True))
        item.append(f" GPU {gib(capacity_bytes):.2f}")
        legend.append(item)
    legend.append(Text("(GiB at the peak)", style="dim"))
    lines.extend(_pack(legend, width))
    for ln in lines:
        ln.no_wrap = True
        ln.overflow = "crop"
    return Group(*lines)


__all__ = ["timeline_chart", "KIND_COLORS", "KIND_NAMES", "CAPACITY_COLOR", "nice_step"]

"""Inline SVG charts for the HTML reports: the step timeline, the peak breakdown, grouped bars.

Every drawn quantity carries its integer bytes in the DOM (``data-bytes``,
``data-kind``, ``data-peak-bytes``) so tests read back exactly what the
Estimate holds. Only chart geometry (stacking, scaling to pixels) and unit
conversion happen here; every text is escaped.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Iterable, Optional

from memcalc.render.chart import CAPACITY_COLOR, KIND_COLORS, KIND_NAMES, PHASE_SHORT, nice_step
from memcalc.engine.result import KINDS, Estimate
from memcalc.render.timeline_view import Column, phase_runs, step_columns
from memcalc.core.units import GiB, gib

SERIES_COLORS = {"predicted": "#4e79a7", "measured": "#2f3640", "published": "#b8bfc7"}
CHAR_PX = 7.0  # approximate width of one character of the 12-13 px labels, for placing them


def e(x: Any) -> str:
    """Escape text (and attribute values) for HTML/SVG."""
    return escape(str(x), quote=True)


def _f(x: float) -> str:
    return f"{x:.1f}"


def _axis(top_bytes: int, n: int = 5) -> tuple[float, list[float]]:
    """A nice y range: (max in GiB, tick values in GiB) covering ``top_bytes``."""
    top = max(gib(top_bytes), 1 / 1024)
    step = nice_step(top / n)
    k = max(1, math.ceil(top / step - 1e-9))
    return k * step, [i * step for i in range(k + 1)]


def _tick(v: float) -> str:
    return f"{v:g}"


def _y_axis(ticks: list[float], y_of, x0: float, x1: float) -> list[str]:
    out = []
    for t in ticks:
        y = y_of(t * GiB)
        out.append(f'<line class="grid" x1="{_f(x0)}" x2="{_f(x1)}" y1="{_f(y)}" y2="{_f(y)}"/>')
        out.append(f'<text class="tick" x="{_f(x0 - 6)}" y="{_f(y + 4)}" text-anchor="end">{e(_tick(t))}</text>')
    return out


def timeline_svg(est: Estimate, capacity_bytes: Optional[int] = None, capacity_name: str = "GPU",
                 svg_id: str = "timeline", width: int = 960, height: int = 360) -> str:
    """Memory across the step as stacked areas by kind, with the peak marked and an optional capacity line."""
    cols: list[Column] = step_columns(est)
    left, right, top_m, bottom = 64, 18, 34, 44
    pw, ph = width - left - right, height - top_m - bottom
    y_max, ticks = _axis(int(max(est.peak_bytes * 1.1, (capacity_bytes or 0) * 1.05)))
    n = len(cols)

    def x_of(i: float) -> float:
        return left + (pw * i / (n - 1) if n > 1 else pw / 2)

    def y_of(b: float) -> float:
        return top_m + ph - ph * gib(int(b)) / y_max

    out = [f'<svg id="{e(svg_id)}" class="chart timeline" viewBox="0 0 {width} {height}" '
           f'role="img" data-peak-bytes="{est.peak_bytes}" '
           f'data-columns="{n}" aria-label="{e(f"memory across one training step of {est.experiment.name}")}">']
    # phase bands
    for j, (phase, a, b) in enumerate(phase_runs(cols)):
        xa = left if a == 0 else (x_of(a - 1) + x_of(a)) / 2
        xb = left + pw if b == n else (x_of(b - 1) + x_of(b)) / 2
        out.append(f'<rect class="phase band{j % 2}" x="{_f(xa)}" y="{top_m}" width="{_f(xb - xa)}" height="{ph}" data-phase="{e(phase)}"/>')
        name = phase if len(phase) * CHAR_PX <= xb - xa + 24 else PHASE_SHORT.get(phase, phase)
        xc = min(max((xa + xb) / 2, left + len(name) * CHAR_PX / 2), left + pw - len(name) * CHAR_PX / 2)
        out.append(f'<text class="phase-label" x="{_f(xc)}" y="{top_m + ph + 30}" text-anchor="middle">'
                   f'<title>{e(phase)}</title>{e(name)}</text>')
    out += _y_axis(ticks, y_of, left, left + pw)
    out.append(f'<text class="axis-title" x="{left - 6}" y="{top_m - 14}" text-anchor="end">GiB</text>')
    # stacked areas
    base = [0] * n
    peak_i = next((i for i, c in enumerate(cols) if c.is_peak), 0)
    for k in KINDS:
        vals = [c.by_kind.get(k, 0) for c in cols]
        if not any(vals):
            continue
        upper = [b + v for b, v in zip(base, vals)]
        pts = [f"{_f(x_of(i))},{_f(y_of(upper[i]))}" for i in range(n)]
        pts += [f"{_f(x_of(i))},{_f(y_of(base[i]))}" for i in range(n - 1, -1, -1)]
        if n == 1:  # a lone column: a bar
            pts = [f"{_f(left)},{_f(y_of(upper[0]))}", f"{_f(left + pw)},{_f(y_of(upper[0]))}",
                   f"{_f(left + pw)},{_f(y_of(0))}", f"{_f(left)},{_f(y_of(0))}"]
        out.append(f'<path class="area" d="M{" L".join(pts)} Z" fill="{KIND_COLORS[k]}" data-kind="{k}" '
                   f'data-bytes="{vals[peak_i]}" data-series="{" ".join(map(str, vals))}">'
                   f'<title>{e(KIND_NAMES[k])}: {gib(vals[peak_i]):.3f} GiB at the peak</title></path>')
        base = upper
    # x axis
    out.append(f'<line class="axis" x1="{left}" x2="{left + pw}" y1="{_f(y_of(0))}" y2="{_f(y_of(0))}"/>')
    # capacity line
    if capacity_bytes:
        y = y_of(capacity_bytes)
        out.append(f'<g id="{e(svg_id)}-capacity" class="capacity" data-capacity-bytes="{capacity_bytes}">'
                   f'<line x1="{left}" x2="{left + pw}" y1="{_f(y)}" y2="{_f(y)}" stroke="{CAPACITY_COLOR}"/>'
                   f'<text x="{left + pw - 4}" y="{_f(y - 5)}" text-anchor="end" fill="{CAPACITY_COLOR}">'
                   f'{e(capacity_name)} {gib(capacity_bytes):.2f} GiB</text></g>')
    # hover targets: one per column, with its total
    half = pw / (2 * (n - 1)) if n > 1 else pw / 2
    for i, c in enumerate(cols):
        tip = f"{c.label} ({c.phase}): {gib(c.total_bytes):.3f} GiB" + "".join(
            f"\n  {KIND_NAMES[k]} {gib(c.by_kind.get(k, 0)):.3f}" for k in KINDS if c.by_kind.get(k, 0))
        flag = ' data-peak="1"' if c.is_peak else ""
        out.append(f'<rect class="col" x="{_f(x_of(i) - half)}" y="{top_m}" width="{_f(2 * half)}" height="{ph}" '
                   f'data-bytes="{c.total_bytes}" data-label="{e(c.label)}" data-phase="{e(c.phase)}"'
                   f'{flag}><title>{e(tip)}</title></rect>')
    # peak marker
    xp, yp = x_of(peak_i), y_of(est.peak_bytes)
    tag = f"peak {gib(est.peak_bytes):.2f} GiB · {est.peak_phase} · {est.peak_label}"
    anchor = "start" if xp + 8 + len(tag) * CHAR_PX <= left + pw else "end"
    dx = -8 if anchor == "end" else 8
    out.append(f'<g id="{e(svg_id)}-peak" class="peak-marker" data-peak-bytes="{est.peak_bytes}" '
               f'data-phase="{e(est.peak_phase)}" data-label="{e(est.peak_label)}">'
               f'<line x1="{_f(xp)}" x2="{_f(xp)}" y1="{_f(yp - 14)}" y2="{_f(y_of(0))}"/>'
               f'<circle cx="{_f(xp)}" cy="{_f(yp)}" r="4"/>'
               f'<text x="{_f(xp + dx)}" y="{_f(yp - 8)}" text-anchor="{anchor}">'
               f'{e(tag)}</text></g>')
    out.append("</svg>")
    return "".join(out)


def breakdown_svg(est: Estimate, svg_id: str = "breakdown", width: int = 960, height: int = 56) -> str:
    """The peak as one horizontal bar stacked by kind."""
    out = [f'<svg id="{e(svg_id)}" class="chart breakdown" viewBox="0 0 {width} {height}" '
           f'role="img" data-peak-bytes="{est.peak_bytes}" '
           f'aria-label="alive at the peak, by kind">']
    x = 0.0
    for k in KINDS:
        b = est.components_by_kind.get(k, 0)
        if not b:
            continue
        w = width * b / est.peak_bytes
        out.append(f'<rect x="{_f(x)}" y="0" width="{_f(w)}" height="{height - 20}" fill="{KIND_COLORS[k]}" '
                   f'data-kind="{k}" data-bytes="{b}"><title>{e(KIND_NAMES[k])}: {gib(b):.3f} GiB</title></rect>')
        if w > 70:
            out.append(f'<text class="in-bar" x="{_f(x + 6)}" y="{(height - 20) / 2 + 5:.1f}">{gib(b):.2f}</text>')
        x += w
    out.append(f'<text class="tick" x="0" y="{height - 4}">0</text>'
               f'<text class="tick" x="{width}" y="{height - 4}" text-anchor="end">{gib(est.peak_bytes):.2f} GiB</text>')
    out.append("</svg>")
    return "".join(out)


def grouped_bars_svg(groups: list[dict[str, Any]], svg_id: str = "validate-chart", width: int = 960) -> str:
    """Grouped bars, one group per config: ``{"config", "predicted", "measured", "published", "kinds"}``
    (bytes or None; ``kinds`` splits the predicted bar by kind when known)."""
    series = ("predicted", "measured", "published")
    height = 350
    left, right, top_m, bottom = 64, 18, 30, 84
    pw, ph = width - left - right, height - top_m - bottom
    top = max([g[s] for g in groups for s in series if g.get(s)] or [GiB])
    y_max, ticks = _axis(int(top * 1.08))

    def y_of(b: float) -> float:
        return top_m + ph - ph * gib(int(b)) / y_max

    gw = pw / max(1, len(groups))
    bw = min(44.0, gw * 0.8 / 3)
    out = [f'<svg id="{e(svg_id)}" class="chart bars" viewBox="0 0 {width} {height}" '
           f'role="img" aria-label="predicted vs measured peak per config">']
    out += _y_axis(ticks, y_of, left, left + pw)
    out.append(f'<text class="axis-title" x="{left - 6}" y="{top_m - 12}" text-anchor="end">GiB</text>')
    for gi, g in enumerate(groups):
        cx = left + gw * (gi + 0.5)
        out.append(f'<g class="group" data-config="{e(g["config"])}">')
        for si, s in enumerate(series):
            b = g.get(s)
            if b is None:
                continue
            x = cx + (si - 1.5) * bw
            kinds = g.get("kinds") if s == "predicted" else None
            out.append(f'<g class="bar" data-series="{s}" data-config="{e(g["config"])}" data-bytes="{b}">'
                       f'<title>{e(g["config"])} {s}: {gib(b):.3f} GiB</title>')
            if kinds and sum(kinds.values()) == b:
                y0 = y_of(0)
                acc = 0
                for k in KINDS:
                    v = kinds.get(k, 0)
                    if not v:
                        continue
                    y1 = y_of(acc + v)
                    out.append(f'<rect x="{_f(x)}" y="{_f(y1)}" width="{_f(bw)}" height="{_f(y0 - y1)}" '
                               f'fill="{KIND_COLORS[k]}" data-kind="{k}" data-bytes="{v}"/>')
                    acc += v
                    y0 = y1
            else:
                out.append(f'<rect x="{_f(x)}" y="{_f(y_of(b))}" width="{_f(bw)}" height="{_f(y_of(0) - y_of(b))}" '
                           f'fill="{SERIES_COLORS[s]}"/>')
            out.append("</g>")
        if isinstance(g.get("error_pct"), (int, float)):
            hi = max(g[s] for s in series if g.get(s))
            out.append(f'<text class="err" x="{_f(cx)}" y="{_f(y_of(hi) - 6)}" text-anchor="middle">{g["error_pct"]:+.1f}%</text>')
        out.append(f'<text class="xlabel" transform="translate({_f(cx)},{_f(y_of(0) + 14)}) rotate(-30)" '
                   f'text-anchor="end">{e(g["config"])}</text></g>')
    out.append(f'<line class="axis" x1="{left}" x2="{left + pw}" y1="{_f(y_of(0))}" y2="{_f(y_of(0))}"/>')
    out.append("</svg>")
    return "".join(out)


def legend(items: Iterable[tuple[str, str, str]]) -> str:
    """An HTML legend: (colour, name, value text) per item."""
    lis = "".join(f'<li><span class="sw" style="background:{c}"></span>{e(name)}'
                  f'{f" <b>{e(v)}</b>" if v else ""}</li>' for c, name, v in items)
    return f'<ul class="legend">{lis}</ul>'


__all__ = ["timeline_svg", "breakdown_svg", "grouped_bars_svg", "legend", "e", "SERIES_COLORS"]

"""Self-contained HTML reports: one file, inline SVG and CSS, no network, no JavaScript.

``estimate_html(est, res, gpus)`` shows the inputs, the step's timeline, what
is alive at the peak and which GPUs it fits; ``validate_html(records,
estimates)`` shows predicted vs measured (and published) peaks per config and
the records. Numbers are in the DOM as integer bytes (``data-bytes``,
``data-kind``, ``data-peak-bytes``) for tests and scripts. Pages print on A4
(light colours, no section split across pages). Only unit conversion here.
"""

from __future__ import annotations

from typing import Any, Optional

from rich.text import Text

from memcalc.render.chart import KIND_COLORS, KIND_NAMES
from memcalc.inputs.resolve import Resolved
from memcalc.render.report import fits_rows, inputs_table, peak_rows, recompute_pct
from memcalc.engine.result import KINDS, Estimate
from memcalc.render.svg import SERIES_COLORS, breakdown_svg, e, grouped_bars_svg, legend, timeline_svg
from memcalc.plan.remedies import gpu_word
from memcalc.core.units import MiB, fmt_auto, fmt_bytes, fmt_count, gib

CSS = """
:root { --fg:#1f2328; --muted:#59636e; --line:#d1d9e0; --soft:#f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1040px; padding: 24px 28px 40px; color: var(--fg); background: #fff;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
h1 { font-size: 24px; margin: 0 0 2px; } h2 { font-size: 17px; margin: 0 0 10px; }
h3 { font-size: 14px; margin: 14px 0 6px; }
.sub, .muted { color: var(--muted); } .sub { margin: 0 0 16px; }
section { margin: 22px 0; padding-top: 4px; break-inside: avoid; page-break-inside: avoid; }
section#timelines, section#records-section { break-inside: auto; page-break-inside: auto; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0 8px; }
.card { flex: 1 1 200px; border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; background: var(--soft); }
.card .k { color: var(--muted); font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 22px; font-weight: 650; font-variant-numeric: tabular-nums; }
.card .d { color: var(--muted); font-size: 12.5px; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid var(--line); padding: 5px 10px; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; }
td.num, th.num { text-align: right; white-space: nowrap; }
tr.total td { font-weight: 650; border-top: 2px solid var(--fg); }
table.kv th { width: 150px; background: none; }
.yes { color: #1a7f37; font-weight: 650; } .no { color: #cf222e; font-weight: 650; }
.grid2 { display: grid; grid-template-columns: 1fr 1fr; gap: 18px; }
svg.chart { width: 100%; height: auto; display: block; font-family: inherit; }
svg .grid { stroke: #e4e8ec; stroke-width: 1; } svg .axis { stroke: #57606a; stroke-width: 1; }
svg .tick, svg .axis-title, svg .xlabel { font-size: 11.5px; fill: #57606a; }
svg .phase.band0 { fill: #f6f8fa; } svg .phase.band1 { fill: #ffffff; }
svg .phase-label { font-size: 12.5px; font-weight: 600; fill: #424a53; }
svg .area { stroke: #fff; stroke-width: .6; stroke-opacity: .7; }
svg .col { fill: transparent; } svg .col:hover { fill: rgba(31,35,40,.07); }
svg .capacity line { stroke-width: 2; stroke-dasharray: 7 4; } svg .capacity text { font-size: 12px; font-weight: 600; }
svg .peak-marker line { stroke: #1f2328; stroke-width: 1; stroke-dasharray: 3 3; }
svg .peak-marker circle { fill: #fff; stroke: #1f2328; stroke-width: 2; }
svg .peak-marker text { font-size: 12.5px; font-weight: 650; fill: #1f2328; paint-order: stroke; stroke: #fff; stroke-width: 3px; }
svg .in-bar { font-size: 12px; fill: #fff; font-weight: 600; }
svg .err { font-size: 11px; fill: #424a53; font-weight: 600; }
ul.legend { list-style: none; padding: 0; margin: 8px 0 0; display: flex; flex-wrap: wrap; gap: 6px 18px; font-size: 13px; }
ul.legend .sw { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px; vertical-align: -1px; }
ul.notes { margin: 6px 0; padding-left: 20px; } ul.notes li { margin: 2px 0; }
.status { font-weight: 600; }
footer { margin-top: 30px; color: var(--muted); font-size: 12px; border-top: 1px solid var(--line); padding-top: 8px; }
@page { size: A4; margin: 12mm; }
@media print {
  body { max-width: none; padding: 0; font-size: 10.5pt; }
  * { -webkit-print-color-adjust: exact; print-color-adjust: exact; }
  section { margin: 12px 0; }
  .page-break { break-before: page; page-break-before: always; }
  h2 { break-after: avoid; page-break-after: avoid; }
  tr { break-inside: avoid; page-break-inside: avoid; }
  svg .col:hover { fill: transparent; }
}
"""


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{e(title)}</title><style>{CSS}</style></head><body>\n{body}\n"
            "<footer>Generated by memcalc. GiB = 2<sup>30</sup> bytes; every number is also in the page as integer bytes "
            "(<code>data-bytes</code>).</footer>\n</body></html>\n")


def _gib_td(b: Optional[int], digits: int = 3) -> str:
    if b is None:
        return '<td class="num muted">&mdash;</td>'
    return f'<td class="num" data-bytes="{b}">{gib(b):,.{digits}f}</td>'


def _card(key: str, value_html: str, detail: str = "", attrs: str = "") -> str:
    return (f'<div class="card"{attrs}><div class="k">{e(key)}</div><div class="v">{value_html}</div>'
            f'<div class="d">{e(detail)}</div></div>')


def kinds_legend(est: Estimate) -> str:
    """The kinds with their bytes at the peak."""
    return legend((KIND_COLORS[k], KIND_NAMES[k], f"{gib(est.components_by_kind.get(k, 0)):.2f} GiB") for k in KINDS)


def _inputs(est: Estimate, res: Resolved) -> str:
    """The rows of the terminal report's inputs table, as plain text."""
    t = inputs_table(est, res)
    cells = [list(c.cells) for c in t.columns]
    rows = "".join(f"<tr><th>{e(Text.from_markup(str(k)).plain)}</th><td>{e(Text.from_markup(str(v)).plain)}</td></tr>"
                   for k, v in zip(*cells))
    notes = "".join(f"<li>{e(n)}</li>" for n in res.notes)
    return f'<table class="kv" id="inputs">{rows}</table>' + (f'<h3>Inferred</h3><ul class="notes">{notes}</ul>' if notes else "")


def _components(est: Estimate) -> str:
    """The peak by kind and, under each, by component (the terminal report's rows: ``peak_rows``)."""
    rows = "".join(f'<tr class="{"part" if part else "kind"}"><td>{"&emsp;" if part else ""}{e(name)}</td>{_gib_td(b)}'
                   f'<td class="num">{b / MiB:,.1f}</td></tr>' for name, part, b in peak_rows(est))
    total = (f'<tr class="total"><td>total (allocated peak)</td>{_gib_td(est.peak_bytes)}'
             f'<td class="num">{est.peak_bytes / MiB:,.1f}</td></tr>')
    return ('<table id="components"><thead><tr><th>kind: component</th><th class="num">GiB</th>'
            '<th class="num">MiB</th></tr>'
            f"</thead><tbody>{rows}{total}</tbody></table>")


def _phases(est: Estimate) -> str:
    rows = "".join(f'<tr data-phase="{e(p)}"><td>{e(p)}</td>{_gib_td(b)}</tr>' for p, b in est.phases.items())
    rows += (f'<tr data-phase="first step"><td>first step (optimizer state created, {e(est.first_step_peak_phase)})</td>'
             f"{_gib_td(est.first_step_peak_bytes)}</tr>")
    bpp = "".join(f"<tr><td>{e(k.replace('_', ' '))}</td><td class=\"num\">{v:g}</td></tr>" for k, v in est.bytes_per_param.items())
    return (f'<div class="grid2"><div><h3>Peak of each phase (steady-state step)</h3><table id="phases"><thead><tr><th>phase</th>'
            f'<th class="num">GiB</th></tr></thead><tbody>{rows}</tbody></table></div>'
            f'<div><h3>Bytes per trainable parameter</h3><table id="bpp"><thead><tr><th>state</th><th class="num">bytes</th></tr>'
            f"</thead><tbody>{bpp}</tbody></table></div></div>")


def _fits(est: Estimate, gpus: list[Any]) -> str:
    rows = []
    for g, r in zip(gpus, fits_rows(est, gpus)):
        ok = r["fits"]
        rows.append(f'<tr data-gpu="{e(r["name"])}" data-fits="{str(ok).lower()}"><td>{e(getattr(g, "display_name", g.name))}</td>'
                    f'{_gib_td(r["capacity_bytes"], 2)}<td class="{"yes" if ok else "no"}">{"yes" if ok else "no"}</td>'
                    f'{_gib_td(r["headroom_bytes"], 2)}</tr>')
    parts = est.device_parts
    return (f'<p class="muted">Needs {e(fmt_bytes(est.required_bytes))} on {e(est.device)} = reserved '
            f'{e(fmt_bytes(est.reserved_peak_bytes))} (allocated {e(fmt_bytes(est.allocated_peak_bytes))}) + CUDA context '
            f'{e(fmt_bytes(parts["cuda_context_bytes"]))} + loaded by the step '
            f'{e(fmt_bytes(parts.get("step_loaded_bytes", 0)))} + NCCL {e(fmt_bytes(parts["nccl_bytes"]))}.</p>'
            f'<table id="fits"><thead><tr><th>GPU</th><th class="num">memory (GiB)</th><th>fits</th>'
            f'<th class="num">headroom (GiB)</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _verdict(est: Estimate, gpus: list[Any], asked: bool, remedies: Any) -> tuple[str, str]:
    """The first card (the terminal report's verdict lines, :func:`memcalc.render.verdict.verdict_items`)
    and, under the cards, the changes that make it fit with their commands."""
    from memcalc.render.verdict import verdict_items

    rows = fits_rows(est, gpus)
    yes = sum(r["fits"] for r in rows)
    value = ("yes" if yes else "no") if len(rows) == 1 else f"{yes} of {len(rows)} GPUs"
    lines = [Text.from_markup(x).plain if isinstance(x, str) else x.plain
             for x in verdict_items(est, gpus, asked, None)]
    card = _card("fits?", f'<span class="{"yes" if yes else "no"}">{e(value)}</span>', lines[0], ' id="verdict"')
    fixes = ""
    words = {g.name: gpu_word(g) for g in gpus}  # what --gpu takes back (a capacity as typed)
    for name, xs in (remedies or {}).items():
        items = "".join(f"<li><b>{e(x.flags)}</b>: {e(fmt_auto(x.headroom_bytes))} to spare (peak "
                        f"{e(fmt_auto(x.peak_bytes))})" + (f"<br><code>{e(x.command)}</code>" if x.command else "")
                        + "</li>" for x in xs)
        fixes += (f'<h3>To make it fit {e(name)}</h3><ul class="notes" data-gpu="{e(name)}">{items}</ul>' if xs else
                  f"<p>To make it fit {e(name)}: no single change memcalc tries is enough; "
                  f"<code>memcalc plan --gpu {e(words.get(name, name))}</code> searches every combination.</p>")
    return card, (f'<div id="to-make-it-fit">{fixes}</div>' if fixes else "")


def estimate_html(est: Estimate, res: Resolved, gpus: list[Any], asked: bool = False, remedies: Any = None) -> str:
    """The estimate report as one self-contained HTML page (see module docstring); its first card is
    the verdict (``asked``: the cards were asked for, ``--gpu``), then what makes it fit (``remedies``:
    ``EstimateResult.to_make_it_fit``)."""
    exp = est.experiment
    cap = gpus[0].capacity_bytes if len(gpus) == 1 else None
    cap_name = getattr(gpus[0], "display_name", gpus[0].name) if len(gpus) == 1 else "GPU"
    first, fixes = _verdict(est, gpus, asked, remedies)
    cards = [
        first,
        _card("allocated peak", f'<span data-bytes="{est.peak_bytes}">{gib(est.peak_bytes):.2f} GiB</span>',
              f"{est.peak_phase}, at {est.peak_label}", ' id="peak"'),
        _card("needs on the GPU", f'<span data-bytes="{est.required_bytes}">{gib(est.required_bytes):.2f} GiB</span>',
              "device total: reserved + CUDA context + NCCL", ' id="required"'),
        _card("parameters", e(fmt_count(est.params)), f"trainable {fmt_count(est.trainable_params)}"),
    ]
    if exp.published_peak_bytes:
        cards.append(_card("published peak", f'<span data-bytes="{exp.published_peak_bytes}">{gib(exp.published_peak_bytes):.2f} GiB</span>',
                           exp.published_source or "", ' id="published"'))
    rec = est.extra.get("recompute")
    if rec and rec.get("forward_flops"):
        pct = recompute_pct(rec)
        comp = est.extra.get("compiled")
        sub = (f"saves {fmt_bytes(comp['saved_bytes'])} for backward (budget 1.0: {fmt_bytes(comp['default_saved_bytes'])})"
               if comp else e(rec["by"]))
        cards.append(_card("recomputed in backward", f'<span data-pct="{pct:.2f}">{pct:.1f}% of the forward</span>',
                           f"{e(rec['by'])}; {sub}" if comp else sub, ' id="recompute"'))
    body = f"""<header><h1>memcalc estimate: {e(exp.name)}</h1>
<p class="sub">{e(exp.description or exp.model.name)} &middot; {e(exp.model.name)}, batch {exp.training.batch} &times; seq {exp.training.seq}, {e(exp.training.precision)}, {e(exp.training.optimizer)}</p>
<div class="cards">{"".join(cards)}</div>{fixes}</header>
<section id="timeline-section"><h2>Memory across one training step</h2>
{timeline_svg(est, cap, cap_name)}{kinds_legend(est)}
<p class="muted">Columns are the simulator's points at layer boundaries, from the first forward point to the end of the optimizer step; the peak, reached inside a segment, is its own column. Hover a column for its numbers.</p></section>
<section id="breakdown-section"><h2>Alive at the peak: {gib(est.peak_bytes):.2f} GiB in {e(est.peak_phase)}</h2>
{breakdown_svg(est)}{kinds_legend(est)}<h3>By component</h3>{_components(est)}</section>
<section id="fits-section"><h2>Fits on which GPU?</h2>{_fits(est, gpus)}</section>
<section id="inputs-section" class="page-break"><h2>Inputs</h2>{_inputs(est, res)}</section>
<section id="phases-section">{_phases(est)}</section>
<section id="assumptions"><h2>Assumptions</h2><ul class="notes">{"".join(f"<li>{e(a)}</li>" for a in est.assumptions)}</ul></section>"""
    return _page(f"memcalc estimate: {exp.name}", body)


def _group_name(r: dict[str, Any], many_devices: bool) -> str:
    return f"{r.get('config')} ({r.get('device')})" if many_devices and r.get("device") else str(r.get("config"))


def _records(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        err = r.get("error_pct")
        err_td = f'<td class="num">{err:+.1f}%</td>' if isinstance(err, (int, float)) else '<td class="num muted">&mdash;</td>'
        notes = "; ".join(str(r[k]) for k in ("note", "notes", "message", "reason") if r.get(k))
        status = str(r.get("status", ""))
        rows.append(f'<tr data-config="{e(r.get("config"))}"><td>{e(r.get("config"))}</td><td>{e(r.get("device", ""))}</td>'
                    f'{_gib_td(r.get("predicted_bytes"))}{_gib_td(r.get("measured_bytes"))}{_gib_td(r.get("published_bytes"))}'
                    f'{err_td}<td>{e(r.get("peak_phase", ""))}</td>'
                    f'<td class="status status-{e(status.lower().replace(" ", "-"))}">{e(status)}</td><td>{e(notes)}</td></tr>')
    return ('<table id="records"><thead><tr><th>config</th><th>device</th><th class="num">predicted (GiB)</th>'
            '<th class="num">measured (GiB)</th><th class="num">published (GiB)</th><th class="num">error</th>'
            f'<th>peak phase</th><th>status</th><th>notes</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')


def validate_html(records: list[dict[str, Any]], estimates: Optional[dict[str, Estimate]] = None) -> str:
    """The validate report: predicted vs measured (and published) per config, the records, and each
    config's timeline when its Estimate is given (``estimates`` by config name)."""
    estimates = estimates or {}
    many = len({r.get("device") for r in records}) > 1
    groups = []
    for r in records:
        est = estimates.get(str(r.get("config")))
        groups.append({"config": _group_name(r, many), "predicted": r.get("predicted_bytes"),
                       "measured": r.get("measured_bytes"), "published": r.get("published_bytes"),
                       "error_pct": r.get("error_pct"), "kinds": est.components_by_kind if est else None})
    plain = [s for s in ("predicted", "measured", "published") if any(r.get(f"{s}_bytes") is not None for r in records)]
    if all(g["kinds"] for g in groups):  # every predicted bar is stacked by kind
        plain = [s for s in plain if s != "predicted"]
    series = [(SERIES_COLORS[s], s, "") for s in plain]
    kinds = [(KIND_COLORS[k], f"predicted: {KIND_NAMES[k]}", "") for k in KINDS] if estimates else []
    devices = sorted({str(r.get("device")) for r in records if r.get("device")})
    body = [f"""<header><h1>memcalc validate</h1>
<p class="sub">{len(records)} record{"" if len(records) == 1 else "s"}{f" on {e(', '.join(devices))}" if devices else ""}: the predicted peak beside the measured one (<code>torch.cuda.max_memory_allocated</code> on CUDA, the traced peak on meta) and the published one.</p></header>
<section id="chart-section"><h2>Predicted vs measured peak per config</h2>
{grouped_bars_svg(groups)}{legend(series + kinds)}
<p class="muted">Labels above each group: the record's error (predicted vs measured).</p></section>
<section id="records-section"><h2>Records</h2>{_records(records)}</section>"""]
    shown = [(r.get("config"), estimates[str(r.get("config"))]) for r in records if str(r.get("config")) in estimates]
    seen: set[str] = set()
    figs = []
    for i, (name, est) in enumerate(shown):
        if str(name) in seen:
            continue
        seen.add(str(name))
        figs.append(f'<section class="config-timeline" data-config="{e(name)}"><h3>{e(name)}: predicted peak '
                    f'{gib(est.peak_bytes):.2f} GiB in {e(est.peak_phase)}</h3>{timeline_svg(est, svg_id=f"timeline-{i}", height=300)}</section>')
    if figs:
        body.append(f'<section id="timelines" class="page-break"><h2>Predicted timelines</h2>{kinds_legend_plain()}{"".join(figs)}</section>')
    return _page("memcalc validate", "\n".join(body))


def kinds_legend_plain() -> str:
    """The kinds' colours, without values."""
    return legend((KIND_COLORS[k], KIND_NAMES[k], "") for k in KINDS)


def write_report(path: str, text: str) -> None:
    """Write an HTML report and say so on stderr; a path that cannot be written is a user error (one
    line, exit 2)."""
    from pathlib import Path

    from memcalc.core.errors import UserError

    import sys

    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as err:  # after the work (checked before it): keep the report in a fallback file
        import os
        import tempfile

        fd, fallback = tempfile.mkstemp(prefix="memcalc-report-", suffix=".html")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        raise UserError(f"cannot write --html {path}: {err.strerror or err}; the report is in {fallback}") from None
    sys.stderr.write(f"memcalc: wrote {path} ({len(text.encode('utf-8')) / 1024:,.0f} KiB)\n")  # stderr: --json stays clean


__all__ = ["estimate_html", "validate_html", "write_report"]

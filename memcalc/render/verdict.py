"""The answer first: the lines ``memcalc estimate`` opens with (and the HTML report's first card).

Whether the step fits each card asked (``--gpu``; else the catalog, summed up: how many fit, the
smallest that does, the largest that does not), the headroom, the peak and the phase that sets it;
then, for a card it does not fit, the smallest changes that do, each with the bytes it needs and the
``memcalc estimate`` command that shows it (:mod:`memcalc.plan.remedies`). The verdict per card is
:func:`memcalc.render.report.fits_rows`'s, the one place that decides "fits". Lines of rich
markup; a command is a :class:`rich.text.Text` that is never wrapped (it must paste whole).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from memcalc.core.units import fmt_auto
from memcalc.engine.result import Estimate
from memcalc.render.report import fits_rows

#: up to this many cards asked get a line each; more are summed up as the catalog is
CARD_LINES = 4


def _room(row: Mapping[str, Any]) -> str:
    h = row["headroom_bytes"]
    return f"{fmt_auto(h)} to spare" if h >= 0 else f"{fmt_auto(-h)} short"


def _card_lines(est: Estimate, row: Mapping[str, Any], word: str) -> list[str]:
    """A card's verdict line (``word``: the card as the user named it, :func:`memcalc.plan.remedies.gpu_word`);
    a card the step misses but runs on once the caching allocator releases its cache
    (``fits_after_cache_release``) says so on a line of its own."""
    ok = row["fits"]
    paging = ok and row.get("paged_state_resident") is False
    answer = ("[yellow]yes, the paged optimizer state pages to the host[/yellow]" if paging
              else "[green]yes[/green]" if ok else "[red]no[/red]")
    out = [f"[bold]Fits {word}?[/bold] {answer}: needs {fmt_auto(row['device_total_bytes'])} of its "
           f"{fmt_auto(row['capacity_bytes'])}, {_room(row)}"]
    if row.get("fits_after_cache_release"):
        out.append("  [yellow]it runs once the allocator releases its cache[/yellow] (slower: cudaMalloc retries)")
    return out


def _runs_as(row: Mapping[str, Any]) -> str:
    """`` (in fp16: no bf16)`` for a card that runs the step in another precision (``fits_rows``' ``runs_as``:
    the same bytes), else nothing."""
    return f" (in {row['runs_as']}: no bf16)" if row.get("runs_as") else ""


def _catalog_lines(est: Estimate, rows: Sequence[Mapping[str, Any]], words: Mapping[str, str]) -> list[str]:
    """The catalog in two lines: how many cards fit and the smallest that does; the largest that
    does not (``words``: each card as the user named it)."""
    yes = [r for r in rows if r["fits"]]
    no = [r for r in rows if not r["fits"]]
    if not yes:
        big = max(no, key=lambda r: r["capacity_bytes"])
        return [f"Fits [red]none[/red] of {len(rows)} GPUs; the largest, {words[big['name']]}{_runs_as(big)}: "
                f"needs {fmt_auto(big['device_total_bytes'])}, {_room(big)}"]
    small = min(yes, key=lambda r: r["capacity_bytes"])
    head = "all" if not no else f"{len(yes)} of"
    out = [f"Fits [green]{head} {len(rows)} GPUs[/green]; smallest {words[small['name']]}{_runs_as(small)}: "
           f"needs {fmt_auto(small['device_total_bytes'])}, {_room(small)}"]
    if no:
        big = max(no, key=lambda r: r["capacity_bytes"])
        out.append(f"Does [red]not[/red] fit {words[big['name']]}{_runs_as(big)} "
                   f"({fmt_auto(big['capacity_bytes'])}, {_room(big)})"
                   + (f" or {len(no) - 1} other GPU{'s' if len(no) > 2 else ''}" if len(no) > 1 else ""))
    return out


def verdict_items(est: Estimate, gpus: Sequence[Any], asked: bool,
                  remedies: Optional[Mapping[str, Sequence[Any]]] = None) -> list[Any]:
    """The verdict lines, the peak line and the changes that make it fit (markup, and each command
    as an unwrapped ``Text``)."""
    from rich.text import Text

    from memcalc.plan.remedies import gpu_word

    rows = fits_rows(est, list(gpus))
    words = {g.name: gpu_word(g) for g in gpus}  # what --gpu was given (a capacity as typed), not its slug
    each = asked and len(rows) <= CARD_LINES
    out: list[Any] = ([x for r in rows for x in _card_lines(est, r, words[r["name"]])] if each
                      else [*_catalog_lines(est, rows, words)])
    label, phase = est.peak_label, est.peak_phase
    at = f"[bold]{label}[/bold]" if label.startswith(phase) else f"[bold]{phase}[/bold], at {label}"
    out.append(f"Peak {fmt_auto(est.peak_bytes)} allocated in {at}")
    for card, fixes in (remedies or {}).items():
        word = words.get(card, card)
        if not fixes:
            out.append(f"[bold]To make it fit {word}[/bold]: no single change memcalc tries is enough (with "
                       f"--checkpoint full too); `memcalc plan --gpu {word}` searches every "
                       "combination")
            continue
        out.append(f"[bold]To make it fit {word}[/bold] (the smallest change; `memcalc plan` lists others):")
        for x in fixes:
            spare = f"{fmt_auto(x.headroom_bytes)} to spare (peak {fmt_auto(x.peak_bytes)})"
            out.append(f"  [cyan]{x.flags}[/cyan]: {spare}")
            if x.command:
                out.append(Text("    " + x.command, no_wrap=True, overflow="ignore"))
    return out


__all__ = ["CARD_LINES", "verdict_items"]

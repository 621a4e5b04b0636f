"""The estimate's text report without rich, byte for byte what rich prints when it prints no styles.

Importing rich and laying out its tables is about a tenth of a second of ``memcalc estimate``
(issue 15). When rich would write plain text (stdout is no terminal and no variable forces one:
a pipe, a file, a CI log), :func:`render_plain` lays out the same tables and lines itself, following
rich's algorithms (rich 15.0: ``rich/table.py`` column widths and rows, ``rich/_wrap.py`` word wrap,
``rich/containers.py`` justify, ``rich/text.py`` truncate, ``rich/box.py`` boxes). It handles
printable ASCII and memcalc's own markup tags only, and returns None for anything else (a
terminal, a non-UTF-8 stdout, a tab, a ``[`` or an emoji code left after the tags, a column too
narrow to pad): the report then goes through rich as before. ``tests/test_plain_render.py``
compares both over many setups and widths.

A table is a :class:`TableSpec` (title, columns, rows of markup strings); ``TableSpec.to_rich``
builds the same rich ``Table``, so each table is written once, in :mod:`memcalc.render.report`.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Optional

#: the markup memcalc's report uses (rich prints no style when it writes plain text)
_TAGS = re.compile(r"\[/?(?:dim|bold|yellow|bold red|green|red)\]")
#: rich's emoji codes (``rich/_emoji_replace.py``): any ``:name:`` sends the report through rich
_EMOJI = re.compile(r":\S*?:")
_WORD = re.compile(r"\s*\S+\s*")  # rich/_wrap.py re_word
_TRAILING_WS = re.compile(r"\s+$")
#: the variables that make rich treat the output as a terminal, or size it for Jupyter
_TERMINAL_ENV = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES")


class Unsupported(Exception):
    """Something the plain renderer does not lay out exactly as rich does: use rich."""


class Column:
    """A column: its header, justify, style and overflow (rich Column's default: ellipsis)."""

    __slots__ = ("header", "justify", "style", "overflow")

    def __init__(self, header: str, justify: str = "left", style: Optional[str] = None,
                 overflow: str = "ellipsis") -> None:
        self.header, self.justify, self.style, self.overflow = header, justify, style, overflow


class TableSpec:
    """A rich ``Table(title=..., title_justify="left")`` with the default box and padding.
    (Plain classes, not dataclasses: a dataclass costs about a millisecond to define.)"""

    def __init__(self, title: str, show_header: bool = True) -> None:
        self.title = title
        self.show_header = show_header
        self.columns: list[Column] = []
        self.rows: list[list[str]] = []

    def add_column(self, header: str, **kw: Any) -> None:
        self.columns.append(Column(header, **kw))

    def add_row(self, *cells: str) -> None:
        self.rows.append(list(cells))

    def to_rich(self) -> Any:
        from rich.table import Table

        t = Table(title=self.title, show_header=self.show_header, title_justify="left")
        for c in self.columns:
            kw: dict[str, Any] = {"justify": c.justify}
            if c.style is not None:
                kw["style"] = c.style
            if c.overflow != "ellipsis":
                kw["overflow"] = c.overflow
            t.add_column(c.header, **kw)
        for r in self.rows:
            t.add_row(*r)
        return t


# --------------------------------------------------------------------------- where rich writes plain text


def plain_width() -> Optional[int]:
    """The width rich's ``Console()`` would lay out to, when it would write no styles to stdout
    (rich/console.py ``is_terminal``, ``size``); None when it might write styles, or when the
    output is not UTF-8 (rich then draws ASCII boxes)."""
    if sys.platform == "win32" or any(k in os.environ for k in _TERMINAL_ENV) or "IPython" in sys.modules:
        return None
    out = sys.stdout
    try:
        if out is None or out.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    if not (getattr(out, "encoding", None) or "utf-8").lower().startswith("utf"):
        return None
    width = None
    for fd in (0, 1, 2):  # rich asks stdin, stdout, stderr for the terminal size
        try:
            width = os.get_terminal_size(fd)[0]
        except (AttributeError, ValueError, OSError):
            continue
        break
    columns = os.environ.get("COLUMNS")
    if columns is not None and columns.isdigit():
        width = int(columns)
        if width < 8:  # rich then lays out to COLUMNS as given, even 0: left to rich
            return None
    return width or 80


# --------------------------------------------------------------------------- text


def plain(markup: str) -> str:
    """The text rich prints for ``markup`` (our tags dropped), or :class:`Unsupported`."""
    text = _TAGS.sub("", markup)
    if not (text.isascii() and text.isprintable()) or "[" in text or "\\" in text or _EMOJI.search(text):
        raise Unsupported(markup)
    return text


def _divide(text: str, width: int, fold: bool) -> list[str]:
    """rich/_wrap.py ``divide_line`` and ``Text.divide``: the line's pieces."""
    breaks: list[int] = []
    offset = 0
    for m in _WORD.finditer(text):
        start, word = m.start(), m.group(0)
        length = len(word.rstrip())
        if width - offset >= length:
            offset += len(word)
        elif length > width:
            if fold:
                chunks = [word[i:i + width] for i in range(0, len(word), width)] or [word]
                for i, chunk in enumerate(chunks):
                    if start:
                        breaks.append(start)
                    if i == len(chunks) - 1:
                        offset = len(chunk)
                    else:
                        start += len(chunk)
            else:
                if start:
                    breaks.append(start)
                offset = len(word)
        elif offset and start:
            breaks.append(start)
            offset = len(word)
    bounds = [0, *breaks, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _truncate(line: str, width: int, overflow: str, pad: bool = False) -> str:
    length = len(line)
    if length > width:
        line = line[:width - 1] + "\u2026" if overflow == "ellipsis" else line[:width]
    if pad and length < width:
        line += " " * (width - length)
    return line


def wrap(text: str, width: int, justify: str, overflow: str) -> list[str]:
    """rich ``Text.wrap`` of one line of plain text (no tabs, no newlines)."""
    if width < 1:
        raise Unsupported(width)
    lines = _divide(text, width, fold=overflow == "fold")
    out = []
    for line in lines:
        if len(line) > width:  # Text.rstrip_end
            ws = _TRAILING_WS.search(line)
            if ws is not None:
                line = line[:len(line) - min(len(ws.group(0)), len(line) - width)]
        if justify == "left":
            line = _truncate(line, width, overflow, pad=True)
        elif justify in ("right", "center"):
            line = _truncate(line.rstrip(), width, overflow)
            lead = width - len(line) if justify == "right" else (width - len(line)) // 2
            line = " " * lead + line
            line += " " * (width - len(line))
        out.append(_truncate(line, width, overflow))
    return out


# --------------------------------------------------------------------------- tables


def _measure(text: str, max_width: int) -> tuple[int, int]:
    """Measurement.get of a cell (Padding (0, 1) around the text) at ``max_width``."""
    if max_width < 1:
        return 0, 0

    def norm(lo: int, hi: int) -> tuple[int, int]:
        lo = min(max(0, lo), hi)
        return max(0, lo), max(0, max(lo, hi))

    if max_width - 2 < 1:
        lo, hi = max_width, max_width
    else:
        words = text.split()
        hi = len(text)
        lo = max(len(w) for w in words) if words else hi
        lo, hi = norm(lo, hi)
        lo, hi = min(lo, max_width), min(hi, max_width)
        if hi < 1:
            lo, hi = 0, 0
        else:
            lo, hi = norm(lo, hi)
        lo, hi = min(lo + 2, max_width), min(hi + 2, max_width)
    lo, hi = norm(lo, hi)
    lo, hi = min(lo, max_width), min(hi, max_width)
    if hi < 1:
        return 0, 0
    return norm(lo, hi)


def _column_range(cells: list[str], max_width: int) -> tuple[int, int]:
    if max_width < 1:
        return 0, 0
    ms = [_measure(c, max_width) for c in cells]
    lo = max(m[0] for m in ms) if ms else 1
    hi = max(m[1] for m in ms) if ms else max_width
    return min(lo, max_width), min(hi, max_width)


def _ratio_reduce(total: int, ratios: list[int], maximums: list[int], values: list[int]) -> list[int]:
    ratios = [r if m else 0 for r, m in zip(ratios, maximums)]
    total_ratio = sum(ratios)
    if not total_ratio:
        return values[:]
    remaining = total
    out = []
    for r, m, v in zip(ratios, maximums, values):
        if r and total_ratio > 0:
            d = min(m, round(r * remaining / total_ratio))
            out.append(v - d)
            remaining -= d
            total_ratio -= r
        else:
            out.append(v)
    return out


def _collapse(widths: list[int], max_width: int) -> list[int]:
    total = sum(widths)
    excess = total - max_width
    while total and excess > 0:  # every column wraps (none is no_wrap or fixed)
        top = max(widths)
        second = max((w if w != top else 0) for w in widths)
        ratios = [1 if w == top else 0 for w in widths]
        if not any(ratios) or not top - second:
            break
        widths = _ratio_reduce(excess, ratios, [min(excess, top - second)] * len(widths), widths)
        total = sum(widths)
        excess = total - max_width
    return widths


def _widths(columns: list[list[str]], max_width: int) -> list[int]:
    """Table._calculate_column_widths (no expand, no fixed widths, every column may wrap)."""
    widths = [_column_range(cells, max_width)[1] or 1 for cells in columns]
    if sum(widths) > max_width:
        widths = _collapse(widths, max_width)
        if sum(widths) > max_width:
            widths = _ratio_reduce(sum(widths) - max_width, [1] * len(widths), widths, widths)
        widths = [_column_range(cells, w)[1] or 0 for cells, w in zip(columns, widths)]
    return widths


def _cell_lines(text: str, width: int, justify: str, overflow: str) -> list[str]:
    """A cell (Padding (0, 1), expand) rendered at ``width``: its lines, each ``width`` long."""
    if width - 2 < 1:
        raise Unsupported(width)
    return [f" {line} " for line in wrap(text, width - 2, justify, overflow)]


def render_table(t: TableSpec, console_width: int) -> list[str]:
    """The lines rich prints for the table (rich/table.py ``__rich_console__``, ``_render``)."""
    ncol = len(t.columns)
    extra = 2 + ncol - 1
    cols = [[plain(c.header)] if t.show_header else [] for c in t.columns]
    body = [[plain(cell) for cell in row] for row in t.rows]
    for row in body:
        for i, cell in enumerate(row):
            cols[i].append(cell)
    widths = _widths(cols, console_width - extra)
    table_width = sum(widths) + extra
    lines = [wline for wline in wrap(plain(t.title), table_width, "left", "fold")] if t.title else []
    heavy = t.show_header
    lines.append(("┏" + "┳".join("━" * w for w in widths) + "┓") if heavy
                 else ("┌" + "┬".join("─" * w for w in widths) + "┐"))
    rows = ([[c.header for c in t.columns]] if t.show_header else []) + [list(r) for r in t.rows]
    for index, row in enumerate(rows):
        header = t.show_header and index == 0
        cells = [_cell_lines(plain(text), w, c.justify, c.overflow) for text, w, c in zip(row, widths, t.columns)]
        height = max(len(c) for c in cells)
        for i, c in enumerate(cells):
            blank = [" " * widths[i]] * (height - len(c))
            cells[i] = blank + c if header else c + blank  # the header aligns to the bottom
        bar = "┃" if header else "│"
        for n in range(height):
            lines.append(bar + bar.join(c[n] for c in cells) + bar)
        if header:
            lines.append("┡" + "╇".join("━" * w for w in widths) + "┩")
    lines.append("└" + "┴".join("─" * w for w in widths) + "┘")
    return [line[:console_width] for line in lines]


def render_line(markup: str, console_width: int) -> list[str]:
    """``Console.print(markup)``: wrapped at the console width, not padded."""
    return [line[:console_width] for line in wrap(plain(markup), console_width, "default", "fold")]


def render_plain(items: list[Any], console_width: int) -> Optional[str]:
    """The report (tables and markup lines, in order) as rich would print it, or None."""
    out: list[str] = []
    try:
        for item in items:
            out += render_table(item, console_width) if isinstance(item, TableSpec) else render_line(item, console_width)
    except Unsupported:
        return None
    return "".join(line + "\n" for line in out)

"""The estimate's text report without rich, byte for byte what rich prints when it prints no styles.

Importing rich and laying out its tables is about a tenth of a second of ``memcalc estimate``
(issue 15). When rich would write plain text (stdout is no terminal and no variable forces one:
a pipe, a file, a CI log), :func:`render_plain` lays out the same tables and lines itself, following
rich's algorithms (rich 15.0: ``rich/table.py`` column widths and rows, ``rich/_wrap.py`` word wrap,
``rich/containers.py`` justify, ``rich/text.py`` truncate and no_wrap, ``rich/box.py`` boxes). It
handles printable ASCII, the Latin letters and signs rich counts one cell wide without its width
table (``rich/cells.py`` ``_SINGLE_CELL_UNICODE_RANGES``: the plan's `` · ``) and memcalc's own
markup tags only, and returns None for anything else (a terminal, a non-UTF-8 stdout, a tab, a
character rich looks up in its width table, a ``[`` or an emoji code left after the tags, a closing
tag with nothing open): the report then goes through rich as before. ``tests/test_plain_render.py`` and
``tests/test_plain_plan_render.py`` compare both over many setups and widths.

A table is a :class:`TableSpec` (title, caption, box, columns, rows of markup strings);
``TableSpec.to_rich`` builds the same rich ``Table``, so each table is written once, in
:mod:`memcalc.render.report` (the estimate) and :mod:`memcalc.render.plan_report` (``memcalc plan``).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Optional

#: the markup memcalc's reports use (rich prints no style when it writes plain text)
_TAGS = re.compile(r"\[/?(?:dim|bold|yellow|bold red|green|red)\]")
#: a character rich may measure otherwise than one cell each: outside printable ASCII and the
#: Latin-1 signs and Latin letters of ``rich/cells.py`` ``_SINGLE_CELLS`` (U+00AD, the soft hyphen,
#: is a format character; U+00A0 is whitespace rich's word wrap and ``str.split`` treat alike, but
#: left to rich all the same)
_NOT_ONE_CELL = re.compile("[^ -~\u00a1-\u00ac\u00ae-\u02ff]")
#: rich's emoji codes (``rich/_emoji_replace.py``): any ``:name:`` sends the report through rich
_EMOJI = re.compile(r":\S*?:")
_WORD = re.compile(r"\s*\S+\s*")  # rich/_wrap.py re_word
_TRAILING_WS = re.compile(r"\s+$")
#: the variables that make rich treat the output as a terminal, or size it for Jupyter
_TERMINAL_ENV = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "JUPYTER_COLUMNS", "JUPYTER_LINES")


class Unsupported(Exception):
    """Something the plain renderer does not lay out exactly as rich does: use rich."""


#: rich/box.py's boxes, as ``Box`` reads them (eight lines of four: edge, fill, divider, edge):
#: top, head, head row, mid, row, foot row, foot, bottom
BOXES = {
    "heavy_head": "┏━┳┓\n┃ ┃┃\n┡━╇┩\n│ ││\n├─┼┤\n├─┼┤\n│ ││\n└─┴┘\n",
    "square": "┌─┬┐\n│ ││\n├─┼┤\n│ ││\n├─┼┤\n├─┼┤\n│ ││\n└─┴┘\n",
    "simple_head": "    \n    \n ── \n    \n    \n    \n    \n    \n",
}
#: rich/box.py ``PLAIN_HEADED_SUBSTITUTIONS``: the box of a table without a header
_PLAIN_HEADED = {"heavy_head": "square"}


class Column:
    """A column: its header, justify, style, overflow (rich Column's default: ellipsis) and no_wrap."""

    __slots__ = ("header", "justify", "style", "overflow", "no_wrap")

    def __init__(self, header: str, justify: str = "left", style: Optional[str] = None,
                 overflow: str = "ellipsis", no_wrap: bool = False) -> None:
        self.header, self.justify, self.style, self.overflow = header, justify, style, overflow
        self.no_wrap = no_wrap


class TableSpec:
    """A rich ``Table(title=..., title_justify=...)`` (left unless given) with the default padding
    (0, 1); by default rich's default box (HEAVY_HEAD) with its edge and no caption. ``box`` names a key of
    :data:`BOXES`; ``caption``, ``caption_justify``, ``show_edge`` and ``collapse_padding`` are
    rich Table's. A row's style (``add_row(..., style="dim")``) only styles it: plain text is the same.
    (Plain classes, not dataclasses: a dataclass costs about a millisecond to define.)"""

    def __init__(self, title: str, show_header: bool = True, caption: Optional[str] = None,
                 caption_justify: str = "center", box: str = "heavy_head", show_edge: bool = True,
                 collapse_padding: bool = False, title_justify: str = "left") -> None:
        if box not in BOXES:
            raise ValueError(f"box {box!r}: one of {', '.join(BOXES)}")
        if title_justify not in ("left", "center", "right"):
            raise ValueError(f"title_justify {title_justify!r}: one of left, center, right")
        self.title, self.title_justify = title, title_justify
        self.show_header = show_header
        self.caption, self.caption_justify = caption, caption_justify
        self.box, self.show_edge, self.collapse_padding = box, show_edge, collapse_padding
        self.columns: list[Column] = []
        self.rows: list[list[str]] = []
        self.row_styles: list[Optional[str]] = []

    def add_column(self, header: str, **kw: Any) -> None:
        self.columns.append(Column(header, **kw))

    def add_row(self, *cells: str, style: Optional[str] = None) -> None:
        self.rows.append(list(cells))
        self.row_styles.append(style)

    def to_rich(self) -> Any:
        from rich.table import Table

        kw: dict[str, Any] = {}
        if self.caption is not None:
            kw.update(caption=self.caption, caption_justify=self.caption_justify)
        if self.box != "heavy_head":  # rich's default
            from rich import box

            kw["box"] = getattr(box, self.box.upper())
        if not self.show_edge:
            kw["show_edge"] = False
        if self.collapse_padding:
            kw["collapse_padding"] = True
        t = Table(title=self.title, show_header=self.show_header, title_justify=self.title_justify, **kw)
        for c in self.columns:
            kw = {"justify": c.justify}
            if c.style is not None:
                kw["style"] = c.style
            if c.overflow != "ellipsis":
                kw["overflow"] = c.overflow
            if c.no_wrap:
                kw["no_wrap"] = True
            t.add_column(c.header, **kw)
        for r, style in zip(self.rows, self.row_styles):
            t.add_row(*r, style=style)
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
    """The text rich prints for ``markup`` (our tags dropped), or :class:`Unsupported`: also for a
    closing tag with no such tag open, where rich's ``markup.render`` raises a MarkupError."""
    if "[/" in markup:
        opened: list[str] = []
        for m in _TAGS.finditer(markup):
            tag = m.group(0)
            if tag[1] != "/":
                opened.append(tag[1:-1])
            elif tag[2:-1] in opened:  # rich pops the innermost open tag of that name
                del opened[len(opened) - 1 - opened[::-1].index(tag[2:-1])]
            else:
                raise Unsupported(markup)
    text = _TAGS.sub("", markup)
    if (_NOT_ONE_CELL.search(text) is not None or "[" in text or "\\" in text
            or _EMOJI.search(text)):
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


def wrap(text: str, width: int, justify: str, overflow: str, no_wrap: bool = False) -> list[str]:
    """rich ``Text.wrap`` of one line of plain text (no tabs, no newlines); with ``no_wrap`` the line
    stays whole and the justify's truncate cuts it (to ``…`` under overflow "ellipsis")."""
    if width < 1 or justify == "full":
        raise Unsupported(width)
    lines = [text] if no_wrap else _divide(text, width, fold=overflow == "fold")
    out = []
    for line in lines:
        if len(line) > width and not no_wrap:  # Text.rstrip_end
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


def _measure(text: str, max_width: int, pad: int) -> tuple[int, int]:
    """Measurement.get of a cell (``Padding`` adding ``pad`` columns to the text) at ``max_width``:
    ``Padding.__rich_measure__`` around ``Text.__rich_measure__``."""
    if max_width < 1:
        return 0, 0

    def norm(lo: int, hi: int) -> tuple[int, int]:
        lo = min(max(0, lo), hi)
        return max(0, lo), max(0, max(lo, hi))

    if max_width - pad < 1:
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
        lo, hi = min(lo + pad, max_width), min(hi + pad, max_width)
    lo, hi = norm(lo, hi)
    lo, hi = min(lo, max_width), min(hi, max_width)
    if hi < 1:
        return 0, 0
    return norm(lo, hi)


def _column_range(cells: list[str], max_width: int, pad: int) -> tuple[int, int]:
    """Table._measure_column of a column without a fixed, minimum or maximum width."""
    if max_width < 1:
        return 0, 0
    ms = [_measure(c, max_width, pad) for c in cells]
    lo = max(m[0] for m in ms) if ms else 1
    hi = max(m[1] for m in ms) if ms else max_width
    return min(lo, max_width), min(hi, max_width)


def _ratio_reduce(total: int, ratios: list[int], maximums: list[int], values: list[int]) -> list[int]:
    """rich/_ratio.py ``ratio_reduce``."""
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


def _collapse(widths: list[int], wrapable: list[bool], max_width: int) -> list[int]:
    """Table._collapse_widths: the widest columns that may wrap (not no_wrap) shrink first."""
    total = sum(widths)
    excess = total - max_width
    if any(wrapable):
        while total and excess > 0:
            top = max(w for w, ok in zip(widths, wrapable) if ok)
            second = max((w if ok and w != top else 0) for w, ok in zip(widths, wrapable))
            ratios = [1 if (w == top and ok) else 0 for w, ok in zip(widths, wrapable)]
            if not any(ratios) or not top - second:
                break
            widths = _ratio_reduce(excess, ratios, [min(excess, top - second)] * len(widths), widths)
            total = sum(widths)
            excess = total - max_width
    return widths


def _widths(columns: list[list[str]], pads: list[int], wrapable: list[bool], max_width: int) -> list[int]:
    """Table._calculate_column_widths (no expand, no fixed, minimum or maximum widths)."""
    widths = [_column_range(cells, max_width, pad)[1] or 1 for cells, pad in zip(columns, pads)]
    if sum(widths) > max_width:
        widths = _collapse(widths, wrapable, max_width)
        if sum(widths) > max_width:  # last resort: every column, no_wrap or not, evenly
            widths = _ratio_reduce(sum(widths) - max_width, [1] * len(widths), widths, widths)
        widths = [_column_range(cells, w, pad)[1] or 0 for cells, w, pad in zip(columns, widths, pads)]
    return widths


def _cell_lines(text: str, width: int, left: int, right: int, c: Column) -> list[str]:
    """A cell (``Padding`` (0, ``right``, 0, ``left``), expand) rendered at ``width``: its lines,
    each ``width`` long. A cell squeezed to its padding or less has no lines (``Console.render``
    renders nothing under one column; ``ConsoleOptions.update_width`` stops at 0): the row fills it
    with blank lines."""
    if width - left - right < 1:
        return []
    lpad, rpad = " " * left, " " * right
    return [lpad + line + rpad for line in wrap(text, width - left - right, c.justify, c.overflow, c.no_wrap)]


def render_table(t: TableSpec, console_width: int) -> list[str]:
    """The lines rich prints for the table: ``Table.__rich_console__`` (title, table, caption, each
    wrapped at the table's width), ``_calculate_column_widths``, ``_get_cells`` (padding (0, 1);
    under collapse_padding a column after the first has no left padding) and ``_render`` (the box's
    top and bottom only with show_edge; the rows of the header, the middle and the last row take
    the dividers of the box's head, mid and foot lines; a head row under the header)."""
    ncol = len(t.columns)
    if not ncol or any(len(r) != ncol for r in t.rows):
        raise Unsupported(ncol)
    box_name = t.box if t.show_header else _PLAIN_HEADED.get(t.box, t.box)  # Box.get_plain_headed_box
    top, head, head_row, mid, _, _, foot, bottom = BOXES[box_name].splitlines()
    edge = t.show_edge
    extra = (2 if edge else 0) + ncol - 1  # Table._extra_width
    lefts = [1 if i == 0 or not t.collapse_padding else 0 for i in range(ncol)]  # Table._get_cells
    pads = [left + 1 for left in lefts]
    headers = [plain(c.header) for c in t.columns] if t.show_header else []
    cols = [[h] for h in headers] if t.show_header else [[] for _ in t.columns]
    body = [[plain(cell) for cell in row] for row in t.rows]
    for row in body:
        for i, cell in enumerate(row):
            cols[i].append(cell)
    widths = _widths(cols, pads, [not c.no_wrap for c in t.columns], console_width - extra)
    table_width = sum(widths) + extra
    lines = wrap(plain(t.title), table_width, t.title_justify, "fold") if t.title else []
    if edge:  # Box.get_top
        lines.append(top[0] + top[2].join(top[1] * w for w in widths) + top[3])
    rows = ([headers] if t.show_header else []) + body
    for index, row in enumerate(rows):
        header = t.show_header and index == 0
        cells = [_cell_lines(text, w, left, 1, c) for text, w, left, c in zip(row, widths, lefts, t.columns)]
        height = max(1, *(len(c) for c in cells))  # Table._render: max_height starts at 1
        for i, c in enumerate(cells):
            blank = [" " * widths[i]] * (height - len(c))
            cells[i] = blank + c if header else c + blank  # the header aligns to the bottom
        bars = head if index == 0 else foot if index == len(rows) - 1 else mid
        left, bar, right = (bars[0], bars[2], bars[3]) if edge else ("", bars[2], "")
        for n in range(height):
            lines.append(left + bar.join(c[n] for c in cells) + right)
        if header:  # Box.get_row(widths, "head", edge)
            lines.append((head_row[0] if edge else "") + head_row[2].join(head_row[1] * w for w in widths)
                         + (head_row[3] if edge else ""))
    if edge:  # Box.get_bottom
        lines.append(bottom[0] + bottom[2].join(bottom[1] * w for w in widths) + bottom[3])
    if t.caption:
        lines += wrap(plain(t.caption), table_width, t.caption_justify, "fold")
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


def print_items(items: list[Any], console: Any = None) -> None:
    """Print tables (:class:`TableSpec`) and markup lines in order: on ``console``, else on stdout,
    without rich where it prints no styles (the estimate's report and the plan's tables)."""
    if console is None:
        width = plain_width()
        text = render_plain(items, width) if width is not None else None
        if text is not None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        from rich.console import Console

        console = Console()
    for item in items:
        console.print(item.to_rich() if isinstance(item, TableSpec) else item)

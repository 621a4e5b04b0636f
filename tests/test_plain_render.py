"""The estimate's text report printed without rich (``memcalc.render.plain``) is byte for byte what
rich prints without styles, at every width; anything it does not lay out itself goes to rich."""

from __future__ import annotations

from pathlib import Path

import pytest

from memcalc.estimate.peak import estimate
from memcalc.inputs.gpus import get_gpu, list_gpus
from memcalc.inputs.resolve import Options, resolve
from memcalc.render import plain
from memcalc.render.plain import plain_width, render_plain
from memcalc.render.report import render, report_items

from conftest import rich_output

HF_GPT2 = str(Path(__file__).parent / "fixtures" / "hf" / "gpt2.json")

#: setups whose reports use every kind of row: inferred-model notes, a model file's path (a long
#: value folded), default reasons, checkpointing's recompute line, several GPUs or a capacity
SETUPS = [
    dict(params="125M", seq=64, lora=True),  # source: README, `estimate --params 7e9 --bf16 --lora` in small
    dict(model=HF_GPT2, seq=32, checkpoint="full", optimizer="adamw-8bit"),  # source: tests/fixtures/hf/gpt2.json
]
#: console widths: narrow (columns fold or fall back to rich), the default 80, wide
WIDTHS = (24, 52, 80, 131)


@pytest.fixture(scope="module")
def reports() -> list[list]:
    out = []
    for kw in SETUPS:
        res = resolve(Options(**kw))
        est = estimate(res.exp)
        out.append(report_items(est, res, list_gpus()))
        out.append(report_items(est, res, [get_gpu("48GiB"), get_gpu("rtx-4090")]))
    return out


@pytest.mark.parametrize("width", WIDTHS)
def test_plain_report_is_what_rich_prints(reports, width):
    laid_out = 0
    for items in reports:
        got = render_plain(items, width)
        if got is not None:
            laid_out += 1
            assert got == rich_output(items, width)
    assert laid_out or width < 30, "the plain renderer gave every report to rich"


@pytest.mark.slow  # a width every 3 columns from 8 to 160: the quick lane samples four
def test_plain_report_is_what_rich_prints_at_every_width(reports):
    for width in range(8, 161, 3):
        for items in reports:
            got = render_plain(items, width)
            assert got is None or got == rich_output(items, width), width


@pytest.mark.parametrize("line", [
    "a [link] in brackets",  # rich markup it would parse
    "tab\there",
    "\u5bbd wide (two cells: rich measures them)",  # source: rich/cells.py, East Asian wide characters
    "a soft hy\u00adphen",  # source: rich/cells.py _SINGLE_CELL_UNICODE_RANGES skips U+00AD
    "\u2192 an arrow",  # source: rich/cells.py, U+2192 lies outside _SINGLE_CELL_UNICODE_RANGES
    "[dim]a note[/red]",  # source: rich/markup.py render raises MarkupError on a closing tag with nothing open
    "an emoji code :smile: here",
    "a path C:\\\\x",
])
def test_what_it_does_not_lay_out_goes_to_rich(line):
    assert render_plain([line], 80) is None
    assert render_plain(["[yellow]note:[/yellow] plain text"], 80) == "note: plain text\n"


@pytest.mark.parametrize("env", ["FORCE_COLOR", "TTY_COMPATIBLE", "JUPYTER_COLUMNS"])
def test_a_terminal_or_forced_colour_goes_to_rich(monkeypatch, env):
    monkeypatch.setenv(env, "1")
    assert plain_width() is None


def test_render_prints_the_same_report_either_way(reports, monkeypatch, capsys):
    res = resolve(Options(**SETUPS[0]))
    est = estimate(res.exp)
    cards = list_gpus()
    for k in plain._TERMINAL_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    render(est, res, cards)
    fast = capsys.readouterr().out
    monkeypatch.setattr("memcalc.render.plain.plain_width", lambda: None)  # the rich path
    render(est, res, cards)
    assert capsys.readouterr().out == fast == rich_output(report_items(est, res, cards), 80)

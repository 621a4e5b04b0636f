"""``memcalc plan``'s two tables (the one-GPU plan with its caption, the cluster plan's edgeless
SIMPLE_HEAD table with collapsed padding and no_wrap columns) and ``estimate --max-batch/--max-seq``'s
lines, printed without rich (``memcalc.render.plain``), are byte for byte what rich prints without
styles, at every width; what the plain renderer does not lay out goes to rich.

The plans are built here from made-up rows (a real search takes seconds): fitting and not fitting
options, labels long enough to wrap, a capped batch, the model's own maximum sequence, counts over
the search's cap, notes.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memcalc.inputs.gpus import get_gpu, list_gpus
from memcalc.inputs.presets import load_preset
from memcalc.plan.cluster import GPU_CAP, ClusterPlan, ClusterRow
from memcalc.plan.limits import BATCH_CAP
from memcalc.plan.options import Technique
from memcalc.plan.search import GpuPlan, OptionResult
from memcalc.render import plain
from memcalc.render.plain import BOXES, TableSpec, render_plain
from memcalc.render.plan_report import (cluster_plan_items, gpu_plan_items, limits_lines, render_cluster_plan,
                                        render_gpu_plan, render_limits)

from conftest import rich_output

GiB = 1 << 30
#: console widths: narrow (columns squeezed to their padding, or left to rich), the default 80, wide
WIDTHS = (24, 52, 80, 131, 200)


def _option(tech: Technique, peak_gib: float, fits: bool, max_batch: int, max_seq: int,
            cost: float | None) -> OptionResult:
    peak = int(peak_gib * GiB)
    return OptionResult(technique=tech, peak_bytes=peak, required_bytes=peak + peak // 20 + 512 * 2**20, fits=fits,
                        max_batch=max_batch, max_seq=max_seq, relative_cost=cost, confirmed=True)


def _gpu_plans() -> list[GpuPlan]:
    m = load_preset("gpt2")  # max_seq_len 1024
    opts = [
        # source: plan_gpu's rows: a fitting option at the model's maximum sequence ("(max)")
        _option(Technique("qlora", "16", "adamw", "none", False), 0.52, True, 217, m.max_seq_len, 0.87),
        # source: the search's batch cap (plan/limits.py BATCH_CAP): shown with a "+"
        _option(Technique("lora", "amp", "paged-adamw-8bit", "selective", True), 0.61, True, BATCH_CAP, 900, 1.0),
        # source: `plan --compile`: the longest labels, wrapped in the option column
        _option(Technique("none", "16+master", "adamw-8bit", "every-k", True, budget=0.25), 11.2, True, 3, 5_000, 1.34),
        # source: `plan --all`: options that do not fit (dim rows, "-" for the number and the cost)
        _option(Technique("none", "fp32", "adafactor", "full", False), 140.0, False, 0, 0, None),
        _option(Technique("none", "16", "sgd-momentum", "sqrt", False), 17.9, False, 0, 96, None),
    ]
    notes = ["kernel profile hf-torch-2.8-cuda: framework hf (default: most users fine-tune with Hugging Face "
             "transformers + PEFT; --framework to change), PyTorch 2.8 (default)",
             "a note with Latin letters \u00e9 and \u00b7 (one cell each) and a very-long-hyphenated-word-"
             "that-folds-at-narrow-widths"]
    t4, fake = get_gpu("t4"), get_gpu("48GiB")
    return [
        GpuPlan(model=m, gpu=t4, seq=128, half="fp16", options=opts, evaluated=1234, notes=notes, considered=112),
        # source: render_gpu_plan's "nothing fits" line, on a GPU given as a capacity
        GpuPlan(model=m, gpu=fake, seq=1024, half="bf16", options=opts[3:], evaluated=10, notes=[], considered=0),
    ]


def _cluster_plans() -> list[ClusterPlan]:
    m = load_preset("llama-3.2-1b")
    gpus = list_gpus()

    def row(g, full, tp, ck_full, req_full, lora, ck_lora, req_lora) -> ClusterRow:
        return ClusterRow(gpu=g, min_gpus={"full": full, "lora": lora}, checkpoint={"full": ck_full, "lora": ck_lora},
                          required_bytes={"full": req_full, "lora": req_lora},
                          layout={"full": None if tp is None else {"dp": full // tp, "tp": tp}})

    rows = [
        # source: plan_cluster's rows: counts, tp degrees, checkpointing, per-GPU needs
        row(gpus[0], 104, 8, "full", int(14.4 * GiB), 52, "full", int(15.0 * GiB)),
        row(gpus[3], 7, None, "none", int(15.3 * GiB), 1, "full", int(9.9 * GiB)),  # source: rtx-4060-ti-16gb, the longest name
        # source: more than GPU_CAP GPUs: ">1024", no layout, no checkpointing, no need
        row(gpus[1], None, None, None, None, None, None, None),
        row(gpus[-1], 1, 1, "none", int(181.3 * GiB), 1, "none", int(145.0 * GiB)),
    ]
    notes = ["kernel profile hf-torch-2.8-cuda: framework hf (default: most users fine-tune with Hugging Face "
             "transformers + PEFT; --framework to change), PyTorch 2.8 (default)",
             "searched 1..1024 GPUs; the minimal integer count is exact (direct estimates)"]
    return [ClusterPlan(model=m, seq=2048, rows=rows, params=1_235_814_400, notes=notes),
            ClusterPlan(model=m, seq=512, rows=rows[2:3], params=1_235_814_400, notes=[])]


def _limits() -> list[tuple]:
    m, g = load_preset("gpt2"), get_gpu("rtx-4090")
    cap = g.capacity_bytes
    return [
        # source: estimate --max-batch --max-seq: both found, each with the next value's need
        ({"capacity_bytes": cap, "max_batch": 37, "max_batch_seq": 1024, "max_batch_required_bytes": 23 * GiB,
          "next_batch_required_bytes": 25 * GiB, "max_seq": 1024, "max_seq_batch": 1,
          "max_seq_required_bytes": 3 * GiB, "next_seq_required_bytes": None}, g, m),
        # source: estimate_limits: batch 1 does not fit, not even 2 tokens fit
        ({"capacity_bytes": cap, "max_batch": 0, "max_batch_seq": 1024, "max_seq": 0, "max_seq_batch": 8}, g, m),
        # source: the batch search's cap (BATCH_CAP), no next batch
        ({"capacity_bytes": cap, "max_batch": BATCH_CAP, "max_batch_seq": 16, "max_batch_required_bytes": 20 * GiB,
          "next_batch_required_bytes": None}, get_gpu("48GiB"), m),
    ]


@pytest.fixture(scope="module")
def reports() -> dict[str, list[list]]:
    return {"gpu": [gpu_plan_items(p) for p in _gpu_plans()],
            "cluster": [cluster_plan_items(p) for p in _cluster_plans()],
            "limits": [limits_lines(*args) for args in _limits()]}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", ["gpu", "cluster", "limits"])
def test_plain_plan_is_what_rich_prints(reports, kind, width):
    laid_out = 0
    for items in reports[kind]:
        got = render_plain(items, width)
        if got is not None:
            laid_out += 1
            assert got == rich_output(items, width)
    assert laid_out == len(reports[kind]), "the plain renderer gave a plan to rich"


@pytest.mark.slow  # every width from 8 to 220: the quick lane samples five
@pytest.mark.parametrize("kind", ["gpu", "cluster", "limits"])
def test_plain_plan_is_what_rich_prints_at_every_width(reports, kind):
    for width in range(8, 221):
        for items in reports[kind]:
            got = render_plain(items, width)
            assert got is None or got == rich_output(items, width), width


def test_both_plans_are_laid_out_without_rich_at_80(reports):
    for kind in ("gpu", "cluster"):
        for items in reports[kind]:
            assert render_plain(items, 80) is not None, kind


@pytest.mark.parametrize("kind, width", [
    ("cluster", 46),  # source: `plan --model llama-3.1-70b` with COLUMNS=60: no_wrap columns cut to "…", some to nothing
    ("gpu", 50),  # source: `plan --model gpt2 --gpu t4` with COLUMNS=50: the option column squeezed to no width
])
def test_a_plan_squeezed_below_its_columns_is_what_rich_prints(reports, kind, width):
    items = reports[kind][0]
    got = render_plain(items, width)
    assert got is not None and "\u2026" in got
    assert got == rich_output(items, width)


@pytest.mark.parametrize("render, plans", [
    (render_gpu_plan, _gpu_plans),  # source: memcalc/cli/plan_cmd.py, `plan --model M --gpu G`
    (render_cluster_plan, _cluster_plans),  # source: memcalc/cli/plan_cmd.py, `plan --model M`
])
def test_render_prints_the_same_plan_without_importing_rich(monkeypatch, capsys, render, plans):
    p = plans()[0]
    items = cluster_plan_items(p) if render is render_cluster_plan else gpu_plan_items(p)
    want = rich_output(items, 80)
    monkeypatch.setattr(plain, "plain_width", lambda: 80)
    for mod in [m for m in sys.modules if m == "rich" or m.startswith("rich.")] + ["rich"]:
        monkeypatch.setitem(sys.modules, mod, None)  # an import of rich raises ImportError
    render(p)
    assert capsys.readouterr().out == want
    monkeypatch.undo()
    monkeypatch.setattr(plain, "plain_width", lambda: None)  # the rich path
    render(p)
    assert capsys.readouterr().out == want


def test_a_console_given_prints_through_rich():
    from rich.console import Console

    p = _cluster_plans()[0]
    buf = io.StringIO()
    render_cluster_plan(p, Console(file=buf, width=80))
    assert buf.getvalue() == rich_output(cluster_plan_items(p), 80)
    buf = io.StringIO()
    render_limits(*_limits()[0], console=Console(file=buf, width=80))
    assert buf.getvalue() == rich_output(limits_lines(*_limits()[0]), 80)


def test_to_rich_builds_the_tables_the_plans_print():
    # the rich Tables render_gpu_plan and render_cluster_plan built before the plain path (a row's
    # style, no_wrap, the box: what plain text does not show)
    from rich import box

    p = _gpu_plans()[0]
    t = gpu_plan_items(p)[0].to_rich()
    assert (t.title_justify, t.caption_justify, t.box, t.show_edge, t.collapse_padding) == (
        "left", "left", box.HEAVY_HEAD, True, False)
    assert t.caption.startswith("peak, needs: GiB at batch 1 x seq 128")
    assert [(c.header, c.justify, c.no_wrap) for c in t.columns] == [
        ("#", "right", True), ("option", "left", False), ("peak", "right", True), ("needs", "right", True),
        ("max batch", "right", True), ("max seq", "right", True), ("cost", "right", True)]
    assert [r.style for r in t.rows] == [None if o.fits else "dim" for o in p.options] and not p.options[-1].fits
    t = cluster_plan_items(_cluster_plans()[0])[0].to_rich()
    assert (t.title_justify, t.caption, t.box, t.show_edge, t.collapse_padding) == (
        "left", None, box.SIMPLE_HEAD, False, True)
    assert [c.no_wrap for c in t.columns] == [True] * 11 and [r.style for r in t.rows] == [None] * 4


def test_the_plan_report_loads_no_rich():
    # a fresh interpreter: the module and the reports printed to a pipe leave rich unloaded
    code = ("import sys; sys.path.insert(0, 'tests'); import test_plain_plan_render as t; "
            "from memcalc.render import plan_report as r; r.render_cluster_plan(t._cluster_plans()[0]); "
            "r.render_gpu_plan(t._gpu_plans()[0]); r.render_limits(*t._limits()[0]); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'rich'))")
    env = {k: v for k, v in os.environ.items() if k not in plain._TERMINAL_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1], env={**env, "COLUMNS": "80"}).stdout
    assert "sharding assumed" in out and "max batch" in out and out.endswith("[]\n"), out[-300:]


def test_the_boxes_are_rich_boxes():
    from rich import box

    for name, text in BOXES.items():
        assert getattr(box, name.upper())._box == text, name
    for name, sub in plain._PLAIN_HEADED.items():
        assert box.PLAIN_HEADED_SUBSTITUTIONS[getattr(box, name.upper())] is getattr(box, sub.upper())
    assert box.SIMPLE_HEAD not in box.PLAIN_HEADED_SUBSTITUTIONS


def _table(box: str, show_edge: bool, collapse: bool, header: bool, caption_justify: str) -> TableSpec:
    t = TableSpec(title="a title long enough to wrap at narrow widths", show_header=header,
                  caption="a caption under the table, long enough to wrap too", caption_justify=caption_justify,
                  box=box, show_edge=show_edge, collapse_padding=collapse)
    t.add_column("name")
    t.add_column("wraps", justify="center")
    t.add_column("n", justify="right", no_wrap=True)
    t.add_column("kept whole", no_wrap=True)
    t.add_row("t4", "a few words that wrap", "1", "one two three")
    t.add_row("[dim]caf\u00e9[/dim]", "x", "1,024 (max)", "-", style="dim")
    t.add_row("", "averyveryverylongwordthatfolds", "12", "a")
    return t


@pytest.mark.parametrize("box, show_edge, collapse, header, caption_justify", [
    ("heavy_head", True, False, True, "left"),  # source: render_gpu_plan's table
    ("simple_head", False, True, True, "center"),  # source: render_cluster_plan's table, rich's default caption_justify
    ("heavy_head", False, True, False, "right"),  # source: rich/table.py, show_header False takes the SQUARE box
    ("simple_head", True, False, False, "left"),  # source: rich/box.py, SIMPLE_HEAD draws blank edges
])
def test_table_options_are_what_rich_prints(box, show_edge, collapse, header, caption_justify):
    t = _table(box, show_edge, collapse, header, caption_justify)
    for width in (8, 12, 20, 31, 45, 80):
        got = render_plain([t], width)
        assert got is not None and got == rich_output([t], width), width


def test_gpu_cap_and_batch_cap_show_in_the_tables(reports):
    # the rows above exercise the ">" and "+" cells: checks that the made-up rows still reach them
    assert f">{GPU_CAP}" in render_plain(reports["cluster"][0], 80)
    assert f"{BATCH_CAP:,}+" in render_plain(reports["gpu"][0], 131)


@pytest.mark.parametrize("cmd", ["models", "configs", "gpus", "profiles"])
@pytest.mark.parametrize("width", [24, 60, 80, 131])
def test_listings_print_what_rich_prints(cmd, width, monkeypatch):
    # source: rich's Table(title centred, box SIMPLE_HEAD, show_edge=False, collapse_padding=True),
    # what memcalc/cli/listing.py printed through rich before
    from click.testing import CliRunner

    from memcalc.cli import app

    for k in plain._TERMINAL_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("COLUMNS", str(width))
    laid_out = []
    real = plain.render_plain
    monkeypatch.setattr(plain, "render_plain", lambda items, w: laid_out.append(real(items, w)) or laid_out[-1])
    fast = CliRunner().invoke(app, [cmd])
    monkeypatch.setattr(plain, "plain_width", lambda: None)  # the rich path
    slow = CliRunner().invoke(app, [cmd])
    assert fast.exit_code == slow.exit_code == 0
    assert fast.stdout == slow.stdout
    assert width < 60 or laid_out[0] is not None  # laid out without rich where it fits
    if cmd == "gpus" and width == 80:  # the title centred over the table, as the listings always had it
        first = fast.stdout.splitlines()[0]
        assert first.strip() == "GPU catalog" and first.startswith(" " * 20)

"""The terminal timeline chart and the columns it draws (memcalc.render.timeline_view)."""

from __future__ import annotations

import io

import pytest
from rich.cells import cell_len
from rich.console import Console

from memcalc.render.chart import nice_step, timeline_chart
from memcalc.inputs.configs import load_config
from memcalc.estimate.peak import estimate
from memcalc.engine.result import KINDS
from memcalc.render.timeline_view import bare_peak_label, phase_runs, resample, step_columns
from memcalc.core.units import GiB, gib

from conftest import experiment

CAP_CHARS = "▁─▔"


@pytest.fixture(scope="module")
def control():
    return estimate(load_config("control"))


@pytest.fixture(scope="module")
def small():
    return estimate(experiment(batch=2, seq=256, optimizer="adamw"))


def render(est, capacity=None, width=80) -> list[str]:
    c = Console(width=width, record=True, file=io.StringIO(), color_system="truecolor", force_terminal=True)
    c.print(timeline_chart(est, capacity, width=width))
    return c.export_text(styles=False).rstrip("\n").split("\n")


def capacity_row(lines: list[str]) -> str | None:
    """The plot row drawn entirely in one capacity-line character, if any."""
    for ln in lines:
        body = ln.split("┤", 1)[-1].split("│", 1)[-1] if ("┤" in ln or "│" in ln) else ""
        if len(body) >= 40 and len(set(body)) == 1 and body[0] in CAP_CHARS:
            return ln
    return None


def test_80_columns_with_peak_label(control):
    lines = render(control)
    assert max(cell_len(ln) for ln in lines) <= 80
    text = "\n".join(lines)
    assert f"peak {gib(control.peak_bytes):.2f} GiB" in text
    assert "▼" in text
    assert "forward" in text and "backward" in text
    for k in KINDS:
        assert k.replace("_", " ") in text  # legend
    assert capacity_row(lines) is None


def test_capacity_line_drawn(control):
    lines = render(control, capacity=24 * GiB)
    assert max(cell_len(ln) for ln in lines) <= 80
    assert capacity_row(lines) is not None
    assert "GPU 24.00" in "\n".join(lines)


def test_capacity_below_the_peak_crosses_the_stack(control):
    lines = render(control, capacity=16 * GiB)
    assert capacity_row(lines) is not None


@pytest.mark.parametrize("width", [50, 80, 120])
def test_fits_any_width(small, width):
    lines = render(small, capacity=2 * GiB, width=width)
    assert max(cell_len(ln) for ln in lines) <= width
    assert f"{gib(small.peak_bytes):.2f} GiB" in "\n".join(lines)


@pytest.mark.parametrize("name", ["control", *[pytest.param(n, marks=pytest.mark.slow)  # full-size estimates
                                               for n in ("bf16_fused_chkpt", "checkpoint")]])
def test_reference_configs_render(name):
    est = estimate(load_config(name))
    lines = render(est, capacity=24 * GiB)
    assert max(cell_len(ln) for ln in lines) <= 80
    assert est.peak_phase in "\n".join(lines)


def test_grad_accum_repeats_phases():
    est = estimate(experiment(batch=1, seq=128, grad_accum=4))
    runs = [p for p, _, _ in phase_runs(step_columns(est))]
    assert runs[:4] == ["forward", "backward", "forward", "backward"]
    assert max(cell_len(ln) for ln in render(est)) <= 80


# -- the columns -------------------------------------------------------------------------


def test_setup_points_are_skipped(control):
    cols = step_columns(control)
    assert all(c.phase != "setup" for c in cols)
    assert any(p.phase == "setup" for p in control.timeline)


def test_exactly_one_peak_column_with_the_estimates_bytes(control):
    cols = step_columns(control)
    peaks = [c for c in cols if c.is_peak]
    assert len(peaks) == 1
    assert peaks[0].total_bytes == control.peak_bytes
    assert max(c.total_bytes for c in cols) == control.peak_bytes
    assert peaks[0].by_kind == {k: control.components_by_kind[k] for k in KINDS}
    assert peaks[0].phase == control.peak_phase


def test_peak_sits_after_its_labelled_point(control):
    cols = step_columns(control)
    i = next(i for i, c in enumerate(cols) if c.is_peak)
    label = bare_peak_label(control.peak_label)
    if cols[i].label == label and i > 0 and cols[i - 1].label != label:
        return  # the peak was a recorded point: marked in place
    assert cols[i - 1].label == label


@pytest.mark.parametrize("width", [3, 8, 20, 37, 76, 200, 500])
def test_resample_never_loses_the_peak(control, width):
    cols = resample(step_columns(control), width)
    assert len(cols) == width
    assert max(c.total_bytes for c in cols) == control.peak_bytes
    assert any(c.is_peak for c in cols)


def test_resample_gives_each_phase_room(control):
    cols = resample(step_columns(control), 76)
    for phase, a, b in phase_runs(cols):
        assert b - a >= 8, phase


def test_bare_peak_label():
    assert bare_peak_label("fwd layer 3 (steady state)") == "fwd layer 3"
    assert bare_peak_label("optimizer step (first step)") == "optimizer step"
    assert bare_peak_label("bwd layer 0") == "bwd layer 0"


@pytest.mark.parametrize("approx, step", [(0.3, 0.5), (1, 1), (1.2, 2), (2.2, 2.5), (4, 5), (6, 10), (23, 25)])
def test_nice_step(approx, step):
    assert nice_step(approx) == pytest.approx(step)

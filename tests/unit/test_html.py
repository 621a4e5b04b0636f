"""The self-contained HTML reports: well-formed, offline, escaped, numbers in the DOM."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest

from memcalc.inputs.configs import load_config
from memcalc.estimate.peak import estimate
from memcalc.render.html import estimate_html, validate_html
from memcalc.render.report import fits_rows, peak_rows
from memcalc.inputs.resolve import Resolved
from memcalc.engine.result import KINDS
from memcalc.core.units import GiB

from conftest import experiment

VOID = {"meta", "br", "img", "input", "link", "hr", "col", "source", "wbr"}
SVG_EMPTY = {"line", "rect", "circle", "path"}  # written with explicit end tags or children


@dataclass
class El:
    tag: str
    attrs: dict
    children: list = field(default_factory=list)
    text: str = ""

    def iter(self):
        yield self
        for c in self.children:
            yield from c.iter()

    def find_all(self, tag=None, **attrs):
        return [e for e in self.iter() if (tag is None or e.tag == tag)
                and all(e.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def by_id(self, id_):
        hits = [e for e in self.iter() if e.attrs.get("id") == id_]
        assert len(hits) == 1, f"{len(hits)} elements with id {id_}"
        return hits[0]

    def all_text(self) -> str:
        return self.text + "".join(c.all_text() for c in self.children)


class Tree(HTMLParser):
    """A strict little tree builder: every non-void element must be closed in order."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = El("#root", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        el = El(tag, dict(attrs))
        self.stack[-1].children.append(el)
        if tag not in VOID:
            self.stack.append(el)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(El(tag, dict(attrs)))

    def handle_endtag(self, tag):
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].text += data


def parse(doc: str) -> El:
    t = Tree()
    t.feed(doc)
    t.close()
    assert t.stack == [t.root], f"unclosed: {[e.tag for e in t.stack[1:]]}"
    return t.root


def assert_offline(doc: str) -> None:
    low = doc.lower()
    assert "http" not in low and "//" not in low
    assert "<script" not in low
    assert " src=" not in low and "@import" not in low and "url(" not in low
    assert "<link" not in low


GPUS = [SimpleNamespace(name="rtx-4090", display_name="NVIDIA RTX 4090", capacity_bytes=24 * GiB),
        SimpleNamespace(name="h100-80gb", display_name="NVIDIA H100 80GB", capacity_bytes=80 * GiB)]


@pytest.fixture(scope="module")
def control():
    exp = load_config("control")
    return estimate(exp), Resolved(exp, {"model": "config"}, [])


def test_estimate_page_is_well_formed_and_offline(control):
    est, res = control
    doc = estimate_html(est, res, GPUS)
    assert doc.startswith("<!DOCTYPE html>")
    root = parse(doc)
    assert_offline(doc)
    assert "@media print" in doc
    assert root.find_all("title")[0].all_text() == "memcalc estimate: control"


def test_timeline_numbers_in_the_dom(control):
    est, res = control
    root = parse(estimate_html(est, res, GPUS))
    svg = root.by_id("timeline")
    assert svg.tag == "svg"
    assert int(svg.attrs["data-peak-bytes"]) == est.peak_bytes
    areas = {a.attrs["data-kind"]: int(a.attrs["data-bytes"]) for a in svg.find_all("path") if "data-kind" in a.attrs}
    assert areas == {k: b for k, b in est.components_by_kind.items() if any(p.by_kind[k] for p in est.timeline if p.phase != "setup")}
    cols = [int(r.attrs["data-bytes"]) for r in svg.find_all("rect", **{"class": "col"})]
    assert max(cols) == est.peak_bytes
    marker = root.by_id("timeline-peak")
    assert int(marker.attrs["data-peak-bytes"]) == est.peak_bytes
    assert marker.attrs["data-phase"] == est.peak_phase
    # more than one GPU: no capacity line
    assert not [e for e in root.iter() if e.attrs.get("id") == "timeline-capacity"]


def test_one_gpu_draws_its_capacity(control):
    est, res = control
    root = parse(estimate_html(est, res, GPUS[:1]))
    cap = root.by_id("timeline-capacity")
    assert int(cap.attrs["data-capacity-bytes"]) == 24 * GiB
    assert "NVIDIA RTX 4090" in cap.all_text()


def test_breakdown_components_and_fits(control):
    est, res = control
    root = parse(estimate_html(est, res, GPUS))
    bars = root.by_id("breakdown").find_all("rect")
    assert {b.attrs["data-kind"]: int(b.attrs["data-bytes"]) for b in bars} == {k: v for k, v in est.components_by_kind.items() if v}
    comp = root.by_id("components")
    cells = [int(td.attrs["data-bytes"]) for td in comp.find_all("td") if "data-bytes" in td.attrs]
    # each kind (KIND_NAMES), then its components: the terminal table's rows (render.report.peak_rows)
    assert cells[:-1] == [b for _, _, b in peak_rows(est)] and cells[-1] == est.peak_bytes
    kinds = [int(tr.find_all("td")[1].attrs["data-bytes"]) for tr in comp.find_all("tr")
             if tr.attrs.get("class") == "kind"]
    assert kinds == [v for v in est.components_by_kind.values() if v]
    assert int(root.by_id("peak").find_all("span")[0].attrs["data-bytes"]) == est.peak_bytes
    assert int(root.by_id("required").find_all("span")[0].attrs["data-bytes"]) == est.required_bytes
    rows = root.by_id("fits").find_all("tr", data_gpu="rtx-4090")
    need = fits_rows(est, [g for g in GPUS if g.name == "rtx-4090"])[0]["device_total_bytes"]  # the card's own
    assert len(rows) == 1 and rows[0].attrs["data-fits"] == str(need <= 24 * GiB).lower()
    tds = [td for td in rows[0].find_all("td") if "data-bytes" in td.attrs]
    assert int(tds[0].attrs["data-bytes"]) == 24 * GiB
    assert int(tds[1].attrs["data-bytes"]) == 24 * GiB - need


def test_text_is_escaped():
    exp = experiment(batch=1, seq=64).model_copy(update={"name": '<script>alert("x")</script>&', "description": "<b>bold</b>"})
    est = estimate(exp)
    doc = estimate_html(est, Resolved(exp), GPUS)
    parse(doc)
    assert "<script>" not in doc and "<b>bold" not in doc
    assert "&lt;script&gt;" in doc
    recs = [{"config": "<i>x</i>", "device": "meta", "predicted_bytes": 1, "measured_bytes": 2, "published_bytes": None,
             "error_pct": -50.0, "peak_phase": "forward", "status": "<ok>"}]
    vdoc = validate_html(recs, None)
    parse(vdoc)
    assert "<i>x" not in vdoc and "<ok>" not in vdoc


def records_for(names):
    recs, ests = [], {}
    for i, n in enumerate(names):
        exp = load_config(n)
        est = ests[n] = estimate(exp)
        measured = None if i == len(names) - 1 else est.peak_bytes + (i + 1) * 10 * 2**20
        recs.append({"config": n, "device": "meta", "predicted_bytes": est.peak_bytes, "measured_bytes": measured,
                     "published_bytes": exp.published_peak_bytes, "error_pct": None if measured is None else -0.5 * (i + 1),
                     "peak_phase": est.peak_phase, "status": "ok" if measured else "skipped", "trace_s": 0.1})
    return recs, ests


@pytest.fixture(scope="module")
def three_records():
    """Records and estimates of three reference configs, built once for both pages below."""
    return records_for(["control", "checkpoint", "bf16_fused_chkpt"])


@pytest.mark.slow  # three full-size estimates; test_text_is_escaped renders a validate page fast
@pytest.mark.parametrize("with_estimates", [True, False])
def test_validate_page(with_estimates, three_records):
    recs, ests = three_records
    doc = validate_html(recs, ests if with_estimates else None)
    root = parse(doc)
    assert_offline(doc)
    chart = root.by_id("validate-chart")
    for r in recs:
        bars = {b.attrs["data-series"]: int(b.attrs["data-bytes"]) for b in chart.find_all("g", **{"class": "bar"})
                if b.attrs["data-config"] == r["config"]}
        want = {s: r[f"{s}_bytes"] for s in ("predicted", "measured", "published") if r[f"{s}_bytes"] is not None}
        assert bars == want
    stacked = [e for e in chart.iter() if "data-kind" in e.attrs]
    if with_estimates:
        assert sum(int(e.attrs["data-bytes"]) for e in stacked) == sum(r["predicted_bytes"] for r in recs)
        for i, r in enumerate(recs):
            svg = root.by_id(f"timeline-{i}")
            assert int(svg.attrs["data-peak-bytes"]) == ests[r["config"]].peak_bytes
    else:
        assert not stacked and "timeline-0" not in doc
    table = root.by_id("records")
    rows = table.find_all("tr", data_config="checkpoint")
    assert [int(td.attrs["data-bytes"]) for td in rows[0].find_all("td") if "data-bytes" in td.attrs] == [
        recs[1]["predicted_bytes"], recs[1]["measured_bytes"], recs[1]["published_bytes"]]
    assert "skipped" in table.all_text()


def test_validate_page_with_no_records():
    root = parse(validate_html([], None))
    assert root.by_id("records").find_all("tbody")


# -- the command line ----------------------------------------------------------------------


def cli(args):
    pytest.importorskip("memcalc.inputs.gpus")
    from typer.testing import CliRunner

    from memcalc.cli import app

    return CliRunner().invoke(app, args)


def test_cli_estimate_html_and_timeline(tmp_path, control):
    out = tmp_path / "r.html"
    r = cli(["estimate", "--config", "control", "--timeline", "--html", str(out)])
    assert r.exit_code == 0, r.output
    assert "memory across one training step" in r.output and "▼" in r.output
    root = parse(out.read_text(encoding="utf-8"))
    est, _ = control  # estimate(load_config("control"))
    assert int(root.by_id("timeline").attrs["data-peak-bytes"]) == est.peak_bytes


def test_cli_timeline_with_json_prints_json_only(tmp_path, control):
    r = cli(["estimate", "--config", "control", "--timeline", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["peak_bytes"] == control[0].peak_bytes  # estimate(load_config("control"))
    assert set(KINDS) <= set(json.loads(r.stdout)["components_by_kind"])


def test_cli_html_bad_path_is_one_line(tmp_path):
    r = cli(["estimate", "--config", "control", "--html", str(tmp_path / "no" / "such" / "dir.html")])
    assert r.exit_code == 2
    assert "cannot write --html" in r.output


@pytest.mark.parametrize("name,by", [
    ("memory_budget_05", "torch.compile, memory budget 0.05"),  # source: the partitioner's knapsack
    ("checkpoint", "activation checkpointing full"),  # source: each layer's forward again
])
def test_recomputation_card(name, by):
    exp = load_config(name)
    est = estimate(exp, timeline=False)
    doc = estimate_html(est, Resolved(exp, {"model": "config"}, []), GPUS)
    rec = est.extra["recompute"]
    assert 'id="recompute"' in doc and by in doc
    assert f'data-pct="{100 * rec["flops"] / rec["forward_flops"]:.2f}"' in doc


def test_no_recomputation_card_without_recomputation(control):
    est, res = control
    assert 'id="recompute"' not in estimate_html(est, res, GPUS)

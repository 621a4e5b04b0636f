"""The HTML reports in a real headless Chromium: they load without console errors, the SVG charts
are laid out, the numbers the browser parsed equal the Estimate's bytes, and each report kind is
saved as a screenshot under artifacts/ (gitignored) for a human to look at.

Driven with selenium + chromedriver when both are there, else with ``chromium --dump-dom`` and
``--screenshot``. Skipped (whole module) when there is no Chromium; CI installs it (.ci/run).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from memcalc.inputs.configs import load_config
from memcalc.estimate.peak import estimate
from memcalc.render.html import estimate_html, validate_html
from memcalc.inputs.resolve import Resolved

# starts headless Chromium (seconds per page): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow
from memcalc.core.units import GiB

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
DRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
except ImportError:  # pragma: no cover - CI installs the test extra
    webdriver = None

if CHROMIUM is None:
    pytest.skip("no Chromium (apt-get install chromium chromium-driver)", allow_module_level=True)

USE_SELENIUM = webdriver is not None and DRIVER is not None
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1"]
WIDTH = 1100
GPU = SimpleNamespace(name="rtx-4090", display_name="NVIDIA RTX 4090", capacity_bytes=24 * GiB)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The two report kinds written to files: {kind: (path, estimates)}."""
    d = tmp_path_factory.mktemp("html")
    exp = load_config("control")
    est = estimate(exp)
    (d / "estimate.html").write_text(estimate_html(est, Resolved(exp, {"model": "config"}, []), [GPU]), encoding="utf-8")
    recs, ests = [], {}
    for n in ("control", "checkpoint", "bf16_fused_chkpt"):
        e = ests[n] = estimate(load_config(n))
        pub = load_config(n).published_peak_bytes
        recs.append({"config": n, "device": "meta", "predicted_bytes": e.peak_bytes, "measured_bytes": pub,
                     "published_bytes": pub, "error_pct": 100 * (e.peak_bytes - pub) / pub, "peak_phase": e.peak_phase,
                     "status": "ok"})
    (d / "validate.html").write_text(validate_html(recs, ests), encoding="utf-8")
    return {"estimate": (d / "estimate.html", {"control": est}), "validate": (d / "validate.html", ests)}


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if not USE_SELENIUM:
        pytest.skip("selenium or chromedriver missing: the --dump-dom tests cover the DOM")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chrome')}", f"--window-size={WIDTH},900"]:
        opts.add_argument(f)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=DRIVER))
    yield drv
    drv.quit()


def load(drv, path: Path) -> None:
    drv.get(path.as_uri())
    assert drv.execute_script("return document.readyState") == "complete"


def screenshot(drv, name: str) -> Path:
    """The whole page (window resized to its height) as artifacts/<name>.png."""
    height = drv.execute_script("return document.documentElement.scrollHeight")
    drv.set_window_size(WIDTH, min(int(height) + 40, 8000))
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / f"{name}.png"
    drv.save_screenshot(str(out))
    drv.set_window_size(WIDTH, 900)
    return out


def console_errors(drv) -> list[str]:
    try:
        logs = drv.get_log("browser")
    except Exception:  # pragma: no cover - a driver without the log endpoint
        return []
    return [m["message"] for m in logs if m.get("level") == "SEVERE"]


JS_NUMBERS = """
const q = (s) => Array.from(document.querySelectorAll(s));
const svg = (id) => document.getElementById(id);
return {
  timelines: q('svg.timeline').map(s => ({id: s.id, peak: s.dataset.peakBytes, w: s.getBoundingClientRect().width,
      h: s.getBoundingClientRect().height,
      areas: Object.fromEntries(q('#' + s.id + ' path.area').map(p => [p.dataset.kind, p.dataset.bytes])),
      cols: q('#' + s.id + ' rect.col').map(r => r.dataset.bytes),
      marker: (svg(s.id + '-peak') || {dataset: {}}).dataset.peakBytes,
      markerInside: (() => { const m = svg(s.id + '-peak'); if (!m) return false;
          const a = m.getBoundingClientRect(), b = s.getBoundingClientRect();
          return a.left >= b.left - 1 && a.right <= b.right + 1 && a.top >= b.top - 1 && a.bottom <= b.bottom + 1; })(),
      capacity: (svg(s.id + '-capacity') || {dataset: {}}).dataset.capacityBytes})),
  breakdown: q('#breakdown rect').map(r => [r.dataset.kind, r.dataset.bytes]),
  bars: q('#validate-chart g.bar').map(g => [g.dataset.config, g.dataset.series, g.dataset.bytes, g.getBoundingClientRect().height]),
  overflowX: document.documentElement.scrollWidth > window.innerWidth + 1,
};
"""


@pytest.mark.skipif(not USE_SELENIUM, reason="selenium or chromedriver missing")
def test_estimate_report_in_chromium(driver, reports):
    path, ests = reports["estimate"]
    est = ests["control"]
    load(driver, path)
    assert console_errors(driver) == []
    got = driver.execute_script(JS_NUMBERS)
    assert not got["overflowX"]
    (tl,) = got["timelines"]
    assert tl["id"] == "timeline" and tl["w"] > 600 and tl["h"] > 150
    assert int(tl["peak"]) == est.peak_bytes == int(tl["marker"])
    assert max(map(int, tl["cols"])) == est.peak_bytes
    assert {k: int(v) for k, v in tl["areas"].items()} == {k: v for k, v in est.components_by_kind.items() if k in tl["areas"]}
    assert "activations" in tl["areas"] and "weights" in tl["areas"]
    assert tl["markerInside"], "the peak label runs out of the chart"
    assert int(tl["capacity"]) == 24 * GiB
    assert {k: int(v) for k, v in got["breakdown"]} == {k: v for k, v in est.components_by_kind.items() if v}
    pdf = driver.execute_cdp_cmd("Page.printToPDF", {"printBackground": True})
    assert len(pdf["data"]) > 1000
    assert screenshot(driver, "estimate").stat().st_size > 10_000


@pytest.mark.skipif(not USE_SELENIUM, reason="selenium or chromedriver missing")
def test_validate_report_in_chromium(driver, reports):
    path, ests = reports["validate"]
    load(driver, path)
    assert console_errors(driver) == []
    got = driver.execute_script(JS_NUMBERS)
    assert not got["overflowX"]
    assert len(got["timelines"]) == len(ests)
    for tl, (name, est) in zip(got["timelines"], ests.items()):
        assert int(tl["peak"]) == est.peak_bytes == int(tl["marker"]), name
        assert tl["markerInside"], f"{name}: the peak label runs out of the chart"
    predicted = {c: int(b) for c, s, b, h in got["bars"] if s == "predicted"}
    assert predicted == {n: e.peak_bytes for n, e in ests.items()}
    assert all(h > 0 for *_, h in got["bars"])
    assert screenshot(driver, "validate").stat().st_size > 10_000


def run_chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'ud'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("kind", ["estimate", "validate"])
def test_dump_dom_keeps_the_numbers(reports, kind, tmp_path):
    """Without selenium too: the DOM as Chromium parsed it carries the Estimate's bytes."""
    from test_html import parse

    path, ests = reports[kind]
    r = run_chromium(tmp_path, "--dump-dom", path.as_uri())
    assert r.returncode == 0, r.stderr[-2000:]
    assert "<svg" in r.stdout
    root = parse(r.stdout)
    svgs = [e for e in root.iter() if e.tag == "svg" and "timeline" in e.attrs.get("class", "")]
    assert [int(s.attrs["data-peak-bytes"]) for s in svgs] == [e.peak_bytes for e in ests.values()]
    if not USE_SELENIUM:
        ARTIFACTS.mkdir(exist_ok=True)
        out = ARTIFACTS / f"{kind}.png"
        run_chromium(tmp_path, f"--window-size={WIDTH},2400", f"--screenshot={out}", path.as_uri())
        assert out.stat().st_size > 10_000

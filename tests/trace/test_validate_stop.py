"""``memcalc validate`` keeps going past a config that fails, and stops cleanly on SIGINT/SIGTERM
(issue 16): a failing config is a record with ``status: error`` and a one-line reason; a signal
prints the records that finished (valid JSON with ``--json``), keeps them in ``--output`` and
exits 128 + signal, never swallowed by a weakref finalizer (validate/interrupt.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app

pytestmark = pytest.mark.slow

MEMCALC = [sys.executable, "-m", "memcalc.cli"]


def test_a_failing_config_is_an_error_record_and_the_run_goes_on(tmp_path: Path):
    # source: torch 2.13 registers no Meta kernel for aten::_fused_sgd_ (NotImplementedError on meta)
    bad = tmp_path / "sgd-fused.yaml"
    bad.write_text("name: sgd-fused\nmodel: gpt2\ntraining:\n  batch: 1\n  seq: 64\n"
                   "  optimizer: sgd\n  optimizer_impl: fused\n")
    out = tmp_path / "out.json"
    r = CliRunner().invoke(app, ["validate", "--config", "control", "--config", str(bad), "--config", "fused",
                                 "--device", "meta", "--scale-layers", "1", "--output", str(out), "--json"])
    assert r.exit_code == 0, r.output
    recs = json.loads(r.stdout)
    assert recs == json.loads(out.read_text())
    assert [x["status"] for x in recs] == ["ok", "error", "ok"]
    reason = recs[1]["reason"]
    assert reason.startswith("NotImplementedError: aten::_fused_sgd_") and "\n" not in reason
    assert recs[1]["measured_bytes"] is None and recs[1]["predicted_bytes"] is not None


def test_a_config_that_cannot_be_read_is_a_record_among_several(tmp_path: Path):
    """Input errors of one of several configs (LoRA targets its model lacks) are its record; with
    one config they stay a one-line error before any work (tests/unit/test_robustness.py)."""
    bad = tmp_path / "badlora.yaml"
    bad.write_text("name: badlora\nmodel: gpt2\ntraining:\n  seq: 64\n  lora: {targets: [gate]}\n")
    r = CliRunner().invoke(app, ["validate", "--config", str(bad), "--config", "control", "--device", "meta",
                                 "--scale-layers", "1", "--json"])
    assert r.exit_code == 0, r.output
    first, second = json.loads(r.stdout)
    assert first["status"] == "error" and first["reason"].startswith("UserError: ") and "no gate" in first["reason"]
    assert first["predicted_bytes"] is None and second["status"] == "ok"
    alone = CliRunner().invoke(app, ["validate", "--config", str(bad), "--device", "meta"])
    assert alone.exit_code == 2 and alone.stderr.startswith("memcalc: error: ")


def test_a_zero_budget_with_nothing_saved_is_a_record():
    """--memory-budget 0 on a one-layer model: PyTorch's partitioner saves nothing; the comparison
    says so instead of dividing by zero."""
    r = CliRunner().invoke(app, ["validate", "--config", "compile", "--memory-budget", "0", "--device", "meta",
                                 "--scale-layers", "1", "--json"])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(r.stdout)
    assert rec["status"] == "skipped" and "Error" not in rec["reason"], rec["reason"]


def _as_in_a_terminal() -> None:
    """The child as a foreground command gets it: SIGINT and SIGTERM at their defaults. A suite run as a
    background job (``.ci/run &``) ignores SIGINT, the child inherits that, and memcalc leaves a signal
    its parent ignores ignored (validate/interrupt.py ``stoppable``): the Ctrl-C under test would not come."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_the_run_and_prints_what_finished(tmp_path: Path, sig: int, code: int):
    out = tmp_path / "out.json"
    env = dict(os.environ, COLUMNS="100")
    p = subprocess.Popen(MEMCALC + ["validate", "--all", "--device", "meta", "--scale-layers", "1", "--json",
                                    "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, preexec_fn=_as_in_a_terminal)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.stat().st_size) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before the signal"
    time.sleep(0.3)  # inside the next config's trace
    p.send_signal(sig)
    t0 = time.monotonic()
    stdout, stderr = p.communicate(timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == code, stderr
    assert took < 10, took  # about 0.3 s to the message, then the interpreter's own exit
    recs = json.loads(stdout)  # valid JSON: the records that finished
    assert 1 <= len(recs) < 11
    assert json.loads(out.read_text()) == recs
    assert f"stopped by {signal.Signals(sig).name} after {len(recs)} of 11 configs" in " ".join(stderr.split())
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr

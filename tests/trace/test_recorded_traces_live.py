"""The recorded validator peaks (``tests/traces/recorded.json``) against a live trace of each row.

``tests/unit/test_recorded_traces.py`` compares the estimate with the recording in the quick lane; this
traces every row again, with the validator the row names (as ``tests/traces/record.py`` does), and
requires the same peak to the byte and the same phase: the traces are deterministic (meta and fake
tensors; no data-dependent sizes), so a recording that no longer equals the trace is stale, and
``python tests/traces/record.py --only NAME`` records it again.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")

from traces.record import trace  # noqa: E402
from traces.rows import spec_of  # noqa: E402

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "traces", "recorded.json")
with open(PATH, encoding="utf-8") as _f:
    RECORDED: list[dict] = json.load(_f)["rows"]
NEEDS = {"hf": ("transformers", "peft"), "deepspeed": ("deepspeed",), "torchtune": ("torchtune", "torchao"),
         "litgpt": ("litgpt", "lightning"), "trl": ("trl", "peft")}
TRAINER_ROWS = [r for r in RECORDED if r["validator"] in ("torchtune", "litgpt", "trl")]


@pytest.mark.parametrize("rec", RECORDED, ids=[r["name"] for r in RECORDED])
def test_recording_equals_the_live_trace(rec):
    for module in NEEDS.get(rec["validator"], ()):
        pytest.importorskip(module)
    peak, phase = trace(rec)
    assert (peak, phase) == (rec["traced_peak_bytes"], rec["traced_phase"]), (
        f"{rec['name']}: traced {peak:,} B ({phase}), recorded {rec['traced_peak_bytes']:,} B "
        f"({rec['traced_phase']}) with {rec['versions']}; record it again: "
        f"python tests/traces/record.py --only {rec['name']}")


@pytest.mark.parametrize("rec", [r for r in RECORDED if r["validator"] == "hf"], ids=lambda r: r["name"])
def test_hf_rows_estimate_what_the_hf_tests_estimate(rec):
    """The HF slow tests estimate ``hf_estimator_spec(exp)`` (the profile's framework set to hf); the
    recorded rows resolve ``--framework hf``, which is that spec already, so the quick lane's
    ``memcalc.estimate`` of the row estimates the same step."""
    from memcalc.validate.hf_grid import hf_estimator_spec

    exp = spec_of(rec)
    assert hf_estimator_spec(exp) == exp


@pytest.mark.parametrize("rec", TRAINER_ROWS, ids=lambda r: r["name"])
def test_trainer_rows_estimate_what_the_trainer_tests_estimate(rec):
    """The trainers' grids estimate ``target_spec(exp, None, NAME)`` (the trainer's profile rules and model,
    ``trainer_estimator_spec``); the recorded rows resolve ``--framework NAME``, which is that spec already."""
    from memcalc.validate.record import target_spec

    exp = spec_of(rec)
    assert exp.profile.framework == rec["validator"]
    assert target_spec(exp, None, rec["validator"]) == exp


#: one row per validator whose rows have a command line (see traces.rows.cli_of)
CLI_ROWS = [next(r for r in RECORDED if r["validator"] == v and r["cli"]) for v in ("replica", "hf", "fsdp")]


@pytest.mark.parametrize("rec", CLI_ROWS, ids=lambda r: r["name"])
def test_the_rows_command_line_traces_the_recorded_peak(rec):
    """The recorded ``cli`` is the row: ``memcalc validate`` with it traces the recorded bytes."""
    import shlex

    from typer.testing import CliRunner

    from memcalc.cli import app

    for module in NEEDS.get(rec["validator"], ()):
        pytest.importorskip(module)
    words = shlex.split(rec["cli"])
    assert words[:2] == ["memcalc", "validate"]
    r = CliRunner().invoke(app, [*words[1:], "--json"])
    assert r.exit_code == 0, r.output
    (record,) = json.loads(r.stdout)
    assert record["status"] == "ok", record["reason"]
    assert record["measured_bytes"] == rec["traced_peak_bytes"]

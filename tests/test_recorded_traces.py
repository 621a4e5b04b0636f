"""The estimate against the validator's recorded peaks, in the quick lane (issue 26).

``tests/traces/recorded.json`` holds, per row of ``tests/traces/rows.py``, the peak the validator
traced (memcalc's PyTorch replica, the real transformers + PEFT step, one rank of FSDP2 / FSDP1,
tensor parallelism or DeepSpeed, on meta or fake tensors) with the inputs it was traced for and
the tolerance of the slow test the row comes from. Each row here estimates the same inputs through
``memcalc.estimate`` and compares: the estimator is checked against the validator on every run,
without torch. ``python tests/traces/record.py`` records the peaks again;
``tests/test_recorded_traces_live.py`` (slow) checks the recording equals a live trace.
"""

from __future__ import annotations

import json
import os

import pytest
from traces.rows import ROWS, TOLERANCES, cli_of, spec_of, tolerance_constant

import memcalc

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces", "recorded.json")
with open(PATH, encoding="utf-8") as _f:
    RECORDED: list[dict] = json.load(_f)["rows"]
VALIDATORS = {"replica", "hf", "fsdp", "tp", "deepspeed"}


def test_every_row_is_recorded_as_defined():
    """issue 26: at least 30 rows (here 40 or more), every validator; the recording is of the rows as
    ``rows.py`` defines them now (a changed row must be recorded again)."""
    assert len(RECORDED) >= 40
    assert [r["name"] for r in RECORDED] == [r["name"] for r in ROWS]
    assert {r["validator"] for r in RECORDED} == VALIDATORS
    for rec, row in zip(RECORDED, ROWS, strict=True):
        pct, path, const = TOLERANCES[row["tolerance"]]
        assert (rec["validator"], rec["inputs"], rec["scale_layers"], rec["model"], rec["cli"]) == (
            row["validator"], row["inputs"], row["scale_layers"], row["model"], cli_of(row)), rec["name"]
        assert (rec["tolerance_pct"], rec["tolerance_source"]) == (pct, f"{path} {const}"), rec["name"]
        assert isinstance(rec["traced_peak_bytes"], int) and rec["traced_peak_bytes"] > 0, rec["name"]
        assert rec["versions"]["torch"], rec["name"]


@pytest.mark.parametrize("key", sorted(TOLERANCES))
def test_tolerance_is_the_slow_tests_constant(key):
    """Each tolerance is the value of the constant it names in its slow test (read from the source)."""
    assert tolerance_constant(key) == TOLERANCES[key][0]


@pytest.mark.parametrize("rec", RECORDED, ids=[r["name"] for r in RECORDED])
def test_estimate_matches_recorded_trace(rec):
    est = memcalc.estimate(spec=spec_of(rec))
    traced = rec["traced_peak_bytes"]
    gap = 100 * (est.peak_bytes - traced) / traced
    assert abs(gap) <= rec["tolerance_pct"], (
        f"{rec['name']}: estimate {est.peak_bytes:,} B ({est.phase}) vs recorded trace {traced:,} B "
        f"({rec['traced_phase']}): {gap:+.2f}%, tolerance {rec['tolerance_pct']}% ({rec['tolerance_source']})")

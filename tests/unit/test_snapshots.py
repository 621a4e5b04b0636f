"""Behaviour is unchanged by refactoring: `estimate --json` and `plan --json` equal the stored
snapshots byte for byte (tests/snapshots/cases.py says what each case covers and how to
regenerate them when a change is meant to move numbers)."""

from __future__ import annotations

import pytest

from snapshots.cases import CASES, path_of, run_case


@pytest.mark.parametrize(
    "stem,args",
    [pytest.param(stem, args, marks=[pytest.mark.slow] if slow else [], id=stem) for stem, args, slow in CASES],
)
def test_output_equals_snapshot(stem, args):
    code, out = run_case(args)
    assert code == 0, out
    # source: the snapshot written before the reorganisation (tests/snapshots/<stem>.json); tolerance: none
    assert out == path_of(stem).read_text(), f"{stem}: output differs from tests/snapshots/{stem}.json"

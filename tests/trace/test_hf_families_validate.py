"""The validator on the Hugging Face families of issue 12 (slow: ``memcalc validate`` imports torch; the
readers are ``tests/unit/test_hf_families.py``, the traces ``tests/trace/test_hf_families_trace.py``)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_validator_refuses_layouts_it_does_not_build() -> None:
    """What the replica does not build (gpt-oss's experts: biases, clamped gate), validate says so instead
    of tracing another model."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    r = CliRunner().invoke(app, ["validate", "--framework", "plain", "--model", "gpt-oss-20b", "--seq", "64"])
    # one config: its record says why (status error), as every failing config's does
    assert "error" in r.output and "does not build gpt-oss experts" in r.output, r.output

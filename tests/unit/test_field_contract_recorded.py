"""The field contract's two sides in the quick lane (issue 26): for every recorded row, the estimator's
delta (setup -> perturbed, ``tests/contract_tables.py`` ``PERTURB``) against the traced delta the
validator recorded in ``tests/traces/field_contract.json`` (``python tests/traces/field_contract_record.py``),
with the tolerance and the known gaps of ``tests/contract_tables.py``, which
``tests/trace/test_field_contract_trace.py`` traces live (slow). No torch here: the estimate runs, the
trace is read.
"""

from __future__ import annotations

import pytest
from contract_tables import (KNOWN_GAPS, PERTURB, PHASE_GAPS, TRACED, UNTRACED, assert_deltas_agree,
                             assert_phase_deltas_agree, build, perturbed, recorded)

from memcalc.estimate.peak import estimate

RECORDED: dict[str, dict] = recorded()


def test_every_row_has_a_decision() -> None:
    stale = [k for k in (*UNTRACED, *KNOWN_GAPS, *PHASE_GAPS) if k not in PERTURB]
    assert not stale, f"entries for rows that are not in PERTURB: {stale}"
    assert not set(UNTRACED) & (set(KNOWN_GAPS) | set(PHASE_GAPS))
    assert all(len(r) > 10 for r in (*UNTRACED.values(), *KNOWN_GAPS.values(), *PHASE_GAPS.values()))


def test_every_traced_row_is_recorded_as_defined() -> None:
    """Every row the replica traces is recorded, for the value ``PERTURB`` has now (a changed row is
    recorded again), with integer peaks and the torch version that traced it."""
    assert sorted(RECORDED) == sorted(TRACED), "record again: python tests/traces/field_contract_record.py"
    for key, rec in RECORDED.items():
        assert rec["value"] == repr(PERTURB[key][1]), f"{key}: PERTURB's value changed; record the row again"
        assert isinstance(rec["traced_base_bytes"], int) and rec["traced_base_bytes"] > 0, key
        assert isinstance(rec["traced_perturbed_bytes"], int) and rec["traced_perturbed_bytes"] > 0, key
        assert rec["torch"], key
        assert rec["traced_base_phases"] and rec["traced_perturbed_phases"], key


@pytest.mark.parametrize("key", [pytest.param(k, marks=[pytest.mark.xfail(reason=KNOWN_GAPS[k], strict=True)]
                                              if k in KNOWN_GAPS else []) for k in TRACED if k in RECORDED])
def test_estimated_delta_matches_recorded_traced_delta(key: str) -> None:
    setup, value = PERTURB[key]
    base = build(setup)
    eb, ep = (estimate(e, timeline=False, replay=False).peak_bytes for e in (base, perturbed(base, key, value)))
    rec = RECORDED[key]
    assert_deltas_agree(key, eb, ep, rec["traced_base_bytes"], rec["traced_perturbed_bytes"])


@pytest.mark.parametrize("key", [pytest.param(k, marks=[pytest.mark.xfail(reason=PHASE_GAPS[k], strict=True)]
                                              if k in PHASE_GAPS else []) for k in TRACED if k in RECORDED])
def test_estimated_phase_deltas_match_recorded_traced_phase_deltas(key: str) -> None:
    setup, value = PERTURB[key]
    base = build(setup)
    eb, ep = (estimate(e, timeline=False, replay=False).phases for e in (base, perturbed(base, key, value)))
    rec = RECORDED[key]
    assert_phase_deltas_agree(key, eb, ep, rec["traced_base_phases"], rec["traced_perturbed_phases"])

"""The field contract's other side: every field that moves the estimate moves the traced peak by the
same amount (issue 26: "every config field perturbed moves the simulated and the traced bytes by the
same amount").

Each ``PERTURB`` row of ``tests/contract_tables.py`` (a setup and one field's perturbed value; the
estimate's side is ``tests/unit/test_field_contract.py``) is estimated and traced twice, setup and
perturbed, by memcalc's own replica (``framework plain``, ``memcalc.validate.runner.measure`` on
``meta``). The estimated delta and the traced delta must agree within ``contract_tables.delta_tolerance``,
and a field that moves the estimate must move the trace the same way. Rows the replica cannot trace are
in ``contract_tables.UNTRACED`` with the reason, so a new row without a decision fails
(``tests/unit/test_field_contract_recorded.py``). ``tests/traces/field_contract_record.py`` records the
traced peaks for the quick lane (``tests/unit/test_field_contract_recorded.py``).
"""

from __future__ import annotations

import pytest
from contract_tables import KNOWN_GAPS, PERTURB, TRACED, assert_deltas_agree, build, perturbed, recorded


@pytest.mark.slow
@pytest.mark.parametrize("key", [pytest.param(k, marks=[pytest.mark.xfail(reason=KNOWN_GAPS[k], strict=True)]
                                              if k in KNOWN_GAPS else []) for k in TRACED])
def test_traced_delta_matches_estimated_delta(key: str) -> None:
    pytest.importorskip("torch")
    from memcalc.estimate.peak import estimate
    from traces.field_contract_record import trace_pair

    setup, value = PERTURB[key]
    base = build(setup)
    pert = perturbed(base, key, value)
    eb, ep = (estimate(e, timeline=False).peak_bytes for e in (base, pert))
    tb, tp = trace_pair(key)
    assert_deltas_agree(key, eb, ep, tb, tp)
    rec = recorded().get(key)
    if rec is not None:  # the recording the quick lane reads is current (else: tests/traces/field_contract_record.py)
        assert (rec["traced_base_bytes"], rec["traced_perturbed_bytes"]) == (tb, tp), f"{key}: record the row again"

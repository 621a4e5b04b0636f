"""Trace both sides of every field-contract row and record the traced peaks in ``field_contract.json``.

    python tests/traces/field_contract_record.py              # every traceable row (a minute or two on 2 cores)
    python tests/traces/field_contract_record.py --only Lora  # the rows whose field contains "Lora"

A row is a ``PERTURB`` entry of ``tests/contract_tables.py`` (a setup and one field's perturbed
value) that memcalc's own replica can trace (``tests/contract_tables.py`` ``UNTRACED`` lists
the others with the reason). Per row the validator (``memcalc.validate.runner.measure``, ``meta``)
traces the setup and the perturbed setup; the file holds both traced peaks in bytes and the torch
version. After each row the file is written again (rows not traced this time keep their recorded
values), so an interruption loses nothing already traced. ``tests/unit/test_field_contract_recorded.py``
compares the estimator's delta with the recorded traced delta in the quick lane;
``tests/trace/test_field_contract_trace.py`` (slow) traces live.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from contract_tables import PERTURB, build, perturbed
from traces.recording import write_rows

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "field_contract.json")


def trace_pair(key: str) -> tuple[int, int]:
    """(base, perturbed) peaks of the row's setup traced on ``meta`` by memcalc's replica."""
    (tb, _), (tp, _) = trace_pair_phases(key)
    return tb, tp


#: the traced setups of this process, by the experiment's JSON: many rows share a setup (44 of 103 the
#: default one), and a meta trace is a function of its experiment alone (no data-dependent sizes), so each
#: setup is traced once per process; every perturbed side is traced by its own row
_SETUP_TRACES: dict[str, tuple[int, dict[str, int]]] = {}


def _trace(exp) -> tuple[int, dict[str, int]]:
    from memcalc.validate.runner import measure

    meas = measure(exp, "meta")
    if meas.status != "ok":
        raise RuntimeError(f"{meas.status}: {meas.reason}")
    return int(meas.measured_bytes), {k: int(v) for k, v in meas.phase_peaks.items()}


def trace_pair_phases(key: str) -> tuple[tuple[int, dict[str, int]], tuple[int, dict[str, int]]]:
    """(peak, peak per phase) of the row's setup and of the perturbed setup, traced on ``meta``."""
    setup, value = PERTURB[key]
    base = build(setup)
    pert = perturbed(base, key, value)
    name = base.model_dump_json()
    if name not in _SETUP_TRACES:
        _SETUP_TRACES[name] = _trace(base)
    tb, pb = _SETUP_TRACES[name]
    return (tb, dict(pb)), _trace(pert)


def load() -> dict[str, dict[str, Any]]:
    if not os.path.exists(PATH):
        return {}
    with open(PATH, encoding="utf-8") as f:
        return {r["field"]: r for r in json.load(f)["rows"]}


def write(done: dict[str, dict[str, Any]]) -> None:
    write_rows(PATH, "validator peaks (bytes) of each tests/contract_tables.py PERTURB row, setup and perturbed, "
                     "traced on meta by memcalc's replica; written by python tests/traces/field_contract_record.py; "
                     "compared with the estimator's delta by tests/unit/test_field_contract_recorded.py",
               [done[k] for k in PERTURB if k in done])


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    from memcalc.estimate.peak import estimate
    from contract_tables import UNTRACED, delta_tolerance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="trace only the rows whose field contains this")
    args = ap.parse_args(argv)
    keys = [k for k in PERTURB if k not in UNTRACED and (args.only is None or args.only in k)]
    done, failed = load(), []
    for n, key in enumerate(keys, 1):
        print(f"[{n}/{len(keys)}] {key} ...", end=" ", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            (tb, phb), (tp, php) = trace_pair_phases(key)
        except Exception as e:  # one row failing is reported; the others go on
            print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(key)
            continue
        setup, value = PERTURB[key]
        done[key] = {"field": key, "value": repr(value), "traced_base_bytes": tb, "traced_perturbed_bytes": tp,
                     "traced_base_phases": phb, "traced_perturbed_phases": php, "torch": torch.__version__}
        write(done)
        base = build(setup)
        eb, ep = (estimate(e, timeline=False, replay=False).peak_bytes for e in (base, perturbed(base, key, value)))
        gap = (ep - eb) - (tp - tb)
        tol = delta_tolerance(tb)
        print(f"traced {tp - tb:+,} B, estimated {ep - eb:+,} B (gap {gap:+,}, tolerance {tol:,}) in "
              f"{time.perf_counter() - t0:.1f} s{'' if abs(gap) <= tol else '  OUTSIDE THE TOLERANCE'}",
              file=sys.stderr)
    print(f"{len(keys) - len(failed)} of {len(keys)} rows recorded in {os.path.relpath(PATH)}"
          + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

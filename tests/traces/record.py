"""Trace every row of ``rows.py`` with the validator and write its peak to ``recorded.json``.

    python tests/traces/record.py                 # every row, in order (a few minutes on 2 cores)
    python tests/traces/record.py --only fsdp2    # the rows whose name contains "fsdp2"
    python tests/traces/record.py --list          # the rows and their ``memcalc validate`` command lines

One process traces the rows one after another; after each row the file is written again (rows not
traced this time keep their recorded values), so an interruption loses nothing already traced.
Per row the file holds the inputs (``memcalc validate``'s options), the traced peak in bytes, the
phase it sits in, the library versions that traced it, and the tolerance with the slow test it comes
from. ``tests/unit/test_recorded_traces.py`` compares the estimate with these peaks in the quick lane;
``tests/trace/test_recorded_traces_live.py`` traces the rows again and checks the recording is current.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: traces.rows

from traces.recording import write_rows
from traces.rows import ROWS, TOLERANCES, cli_of, spec_of

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded.json")
LIBRARIES = ("torch", "transformers", "peft", "deepspeed")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def trace(row: dict[str, Any]) -> tuple[int, str]:
    """(peak bytes, peak phase) of the row's step, traced by the validator its slow test calls."""
    exp = spec_of(row)
    kind = row["validator"]
    if kind == "fsdp":
        from memcalc.validate.sharded import trace_rank

        r = trace_rank(exp, rank=0)
        return int(r["peak_bytes"]), str(r["phase"])
    if kind == "replica":
        from memcalc.validate.runner import measure

        meas = measure(exp, "meta")
    elif kind == "hf":
        from memcalc.validate.hf_runner import measure_hf

        meas = measure_hf(exp, "meta")
    elif kind == "tp":
        from memcalc.validate.sharded.tp import measure_tp

        meas = measure_tp(exp)
    elif kind == "ep":
        from memcalc.validate.sharded.expert_parallel import measure_ep

        meas = measure_ep(exp)
    elif kind == "deepspeed":
        from memcalc.validate.deepspeed_trace import trace_deepspeed

        meas = trace_deepspeed(exp)
    elif kind in ("torchtune", "litgpt", "trl"):
        from memcalc.validate.trainers import load as load_trainer

        meas = load_trainer(kind).measure(exp, "meta")
    else:
        raise ValueError(f"unknown validator {kind!r}")
    if meas.status != "ok":
        raise RuntimeError(f"{meas.status}: {meas.reason}")
    return int(meas.measured_bytes), str(meas.peak_phase or "")


def entry(row: dict[str, Any], peak: int, phase: str, libs: dict[str, str | None]) -> dict[str, Any]:
    pct, path, const = TOLERANCES[row["tolerance"]]
    return {"name": row["name"], "validator": row["validator"], "cli": cli_of(row), "inputs": row["inputs"],
            "scale_layers": row["scale_layers"], "model": row["model"], "traced_peak_bytes": peak,
            "traced_phase": phase, "tolerance_pct": pct, "tolerance_source": f"{path} {const}",
            "row_source": row["source"], "versions": libs}


def load() -> dict[str, dict[str, Any]]:
    if not os.path.exists(PATH):
        return {}
    with open(PATH, encoding="utf-8") as f:
        return {r["name"]: r for r in json.load(f)["rows"]}


def write(done: dict[str, dict[str, Any]]) -> None:
    write_rows(PATH, "validator peaks of the rows of tests/traces/rows.py (bytes); written by "
                     "python tests/traces/record.py; compared with the estimate by tests/unit/test_recorded_traces.py",
               [done[r["name"]] for r in ROWS if r["name"] in done])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="trace only the rows whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    args = ap.parse_args(argv)
    rows = [r for r in ROWS if args.only is None or args.only in r["name"]]
    if args.list:
        for r in rows:
            print(f"{r['name']:45s} {cli_of(r) or '(model fields: ' + json.dumps(r['model']) + ')'}")
        return 0
    if not rows:
        print(f"no row's name contains {args.only!r}", file=sys.stderr)
        return 2
    from memcalc.estimate.peak import estimate

    libs = versions()
    done, failed = load(), []
    for k, row in enumerate(rows, 1):
        print(f"[{k}/{len(rows)}] {row['name']} ({row['validator']}) ...", end=" ", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            peak, phase = trace(row)
        except Exception as e:  # one row failing is reported; the others go on
            print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(row["name"])
            continue
        done[row["name"]] = entry(row, peak, phase, libs)
        write(done)
        est = estimate(spec_of(row), timeline=False).peak_bytes
        gap = 100 * (est - peak) / peak
        tol = TOLERANCES[row["tolerance"]][0]
        print(f"{peak:,} B ({phase}) in {time.perf_counter() - t0:.1f} s; estimate {gap:+.2f}% "
              f"(tolerance {tol}%){'' if abs(gap) <= tol else '  OUTSIDE THE TOLERANCE'}", file=sys.stderr)
    print(f"{len(rows) - len(failed)} of {len(rows)} rows recorded in {os.path.relpath(PATH)}"
          + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What every trainer's grid module shares: one record per setup (the trainer's trace on meta
beside memcalc's estimate), the Markdown table of its docs page, and the command line
(``--only TEXT``, ``--json``). Each grid module (``torchtune_grid``, ``litgpt_grid``) keeps its own
setups and says how its estimate is asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Optional

from memcalc.core.spec import ExperimentSpec

Items = list[tuple[str, ExperimentSpec]]


def run_rows(items: Items, measure: Callable, predict: Callable[[ExperimentSpec], tuple[int, str]],
             progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """One record per setup: ``measure(exp, "meta")`` beside ``predict(exp)`` = (peak bytes, phase),
    the gap in percent (2 decimals), the phases."""
    rows = []
    for k, (name, exp) in enumerate(items):
        if progress:
            progress(f"[{k + 1}/{len(items)}] {name}")
        meas = measure(exp, "meta")
        pred, phase = predict(exp)
        gap = None if not meas.measured_bytes else round((pred - meas.measured_bytes) / meas.measured_bytes * 100, 2)
        rows.append(dict(config=name, status=meas.status, reason=meas.reason, measured_bytes=meas.measured_bytes,
                         predicted_bytes=pred, error_pct=gap, measured_phase=meas.peak_phase, peak_phase=phase))
    return rows


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows (MiB = 2**20)."""
    from memcalc.core.units import MiB

    lines = ["| setup | traced MiB | estimated MiB | gap | traced phase | estimated phase |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        meas = "-" if r["measured_bytes"] is None else f"{r['measured_bytes'] / MiB:.2f}"
        gap = "-" if r["error_pct"] is None else f"{r['error_pct']:+.2f}%"
        lines.append(f"| {r['config']} | {meas} | {r['predicted_bytes'] / MiB:.2f} | {gap} | "
                     f"{r['measured_phase'] or r['status']} | {r['peak_phase']} |")
    return "\n".join(lines)


def main(doc: Optional[str], grid: Callable[[Optional[str]], Items],
         run_grid: Callable[..., list[dict]], argv: Optional[list[str]] = None) -> int:
    """The grid module's command line: the table (or ``--json`` records) of ``run_grid(grid(only))``."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--only", help="keep setups whose name contains this")
    ap.add_argument("--json", action="store_true", help="print the records as JSON")
    args = ap.parse_args(argv)
    rows = run_grid(grid(args.only), progress=lambda s: print(s, file=sys.stderr))
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0

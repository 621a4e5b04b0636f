"""Print every published row against its estimate, and the summary the issues quote.

    python tests/published_report.py            # the table and the summary
    python tests/published_report.py --trainer litgpt

Rows with an unknown input (or a metric memcalc cannot name) are printed but left out of the
summary. Error = (estimate - published) / published, on the row's own metric; "alloc GiB" is the
estimate's allocated peak whatever the metric (for rows whose metric memcalc cannot name yet).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from published_rows import GiB, Result, known, pass_line, rows, run


def _line(res: Result) -> str:
    r = res.row
    pub = res.published_bytes / GiB
    est = "-" if res.estimate_bytes is None else f"{res.estimate_bytes / GiB:8.2f}"
    err = "" if res.error_pct is None else f"{res.error_pct:+7.1f}%"
    alloc = "-" if res.doc is None else f"{res.doc['peak_bytes'] / GiB:8.2f}"
    if not known(r):
        status = "unknown input" if r.get("unknown") else f"metric {r['metric']}"
    elif res.error_pct is None:
        status = f"no estimate: {res.error}"
    else:
        ok, _ = pass_line(r, res.error_pct)
        status = "pass" if ok else "FAIL"
    return f"{r['id']:46s} {r['metric']:12s} {pub:8.2f} {est:>8s} {err:>9s} {alloc:>9s}  {status}"


def summary(results: list[Result]) -> list[str]:
    counted = [x for x in results if known(x.row) and x.error_pct is not None]
    lines = [f"rows pinned: {len(results)}; every input known: {sum(known(x.row) for x in results)}; "
             f"estimated and counted: {len(counted)}"]
    by_trainer: dict[str, list[int]] = {}
    for x in results:
        c = by_trainer.setdefault(x.row["trainer"], [0, 0])
        c[0] += 1
        c[1] += known(x.row)
    per = ", ".join(f"{t} {a}/{b}" for t, (a, b) in sorted(by_trainer.items()))
    lines.append(f"per trainer (pinned / known): {per}")
    if counted:
        errs = [x.error_pct for x in counted]
        mean = sum(errs) / len(errs)
        mabs = sum(abs(e) for e in errs) / len(errs)
        low = min(counted, key=lambda x: x.error_pct)
        high = max(counted, key=lambda x: x.error_pct)
        passed = sum(pass_line(x.row, x.error_pct)[0] for x in counted)
        lines.append(f"signed mean error {mean:+.1f}%, mean |error| {mabs:.1f}%, passing {passed}/{len(counted)}, "
                     f"low {sum(e < 0 for e in errs)}/{len(errs)}")
        groups: dict[str, list[float]] = {}
        for x in counted:
            key = x.row["trainer"] + (" QLoRA" if x.row["qlora"] else "")
            groups.setdefault(key, []).append(x.error_pct)
        lines.append("signed mean by group: " + ", ".join(
            f"{k} {sum(v) / len(v):+.1f}% ({len(v)})" for k, v in sorted(groups.items())))
        lines.append(f"worst low: {low.row['id']} {low.error_pct:+.1f}%; "
                     f"worst high: {high.row['id']} {high.error_pct:+.1f}%")
    refused = [x for x in results if known(x.row) and x.error_pct is None]
    if refused:
        lines.append(f"known rows without an estimate: {len(refused)} ({', '.join(x.row['id'] for x in refused)})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", help="only this trainer's rows")
    a = p.parse_args(argv)
    results = [run(r) for r in rows() if not a.trainer or r["trainer"] == a.trainer]
    print(f"{'row':46s} {'metric':12s} {'pub GiB':>8s} {'est GiB':>8s} {'error':>9s} {'alloc GiB':>9s}  status")
    for res in results:
        print(_line(res))
    print()
    print("\n".join(summary(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

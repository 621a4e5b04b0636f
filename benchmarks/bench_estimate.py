"""Benchmark: process wall time of `memcalc estimate --params 7e9 --bf16 --lora` (target < 0.5 s).

Runs the installed console script (a fresh process each time, imports included)
and prints the median and the best of N runs. Not a test: speed targets live here.

    python benchmarks/bench_estimate.py [-n 7]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

ARGS = ["estimate", "--params", "7e9", "--bf16", "--lora"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=7, help="runs")
    n = ap.parse_args().n
    exe = shutil.which("memcalc")
    cmd = [exe, *ARGS] if exe else [sys.executable, "-m", "memcalc.cli", *ARGS]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(f"memcalc {' '.join(ARGS)}: median {med:.3f} s, best {min(times):.3f} s over {n} runs "
          f"(target < 0.5 s) {'OK' if med < 0.5 else 'SLOW'}")


if __name__ == "__main__":
    main()

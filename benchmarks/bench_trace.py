"""Benchmark: a full-size meta trace of the Deep One 1.6B control config (target <= 10 s on 2 cores).

Times ``memcalc.validate.runner.measure(control, "meta")`` in-process: model construction on
meta, the warm-up step and the measured step (both traced), imports excluded. Prints each
run's seconds, the traced peak, and the median. Not a test: speed targets live here.

    python benchmarks/bench_trace.py [-n 3] [--config control] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=3, help="runs")
    ap.add_argument("--config", default="control", help="reference config name")
    ap.add_argument("--profile", action="store_true", help="cProfile one run, print the top 25 functions")
    a = ap.parse_args()

    from memcalc.inputs.configs import load_config
    from memcalc.core.units import gib
    from memcalc.validate.runner import measure

    exp = load_config(a.config)
    if a.profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        measure(exp, "meta")
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
        return
    times = []
    for i in range(a.n):
        t0 = time.perf_counter()
        m = measure(exp, "meta")
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"run {i + 1}: {dt:6.2f} s  traced peak {gib(m.measured_bytes):.3f} GiB ({m.peak_phase}, {m.peak_label})")
    print(f"{a.config} full-size meta trace: median {statistics.median(times):.2f} s, best {min(times):.2f} s "
          f"over {a.n} runs (target <= 10 s on 2 cores)")


if __name__ == "__main__":
    main()

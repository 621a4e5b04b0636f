"""Benchmark: the vectorised plan search (configurations per second, target >= 10,000/s) and the
wall time of `memcalc plan --model llama-3.1-8b --gpu rtx-4090`.

1. Fits every technique combination of ``memcalc plan`` (112) for llama-3.1-8b (fit time is
   reported too: it is simulation, not search), then times :func:`memcalc.plan.search.evaluate_grid`
   over options x batches x seqs (the whole grid the plan evaluates at once) and reports the
   configurations (option, batch, seq) evaluated per second.
2. Runs the installed console script (a fresh process each time, imports included) and reports
   the median and best wall time.

    python benchmarks/bench_plan.py [-n 3]

Not a test: speed targets live here.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

ARGS = ["plan", "--model", "llama-3.1-8b", "--gpu", "rtx-4090"]
TARGET_CONFIGS_PER_S = 10_000


def search_speed(repeat: int = 5) -> None:
    from memcalc.plan.fits import fit_step
    from memcalc.plan.options import techniques
    from memcalc.plan.parallel import parallel_map, workers
    from memcalc.plan.search import StackedFits, batch_grid, evaluate_grid, seq_grid
    from memcalc.inputs.presets import load_preset
    from memcalc.core.spec import ExperimentSpec

    m = load_preset("llama-3.1-8b")
    techs = techniques()
    exps = [ExperimentSpec(model=m, training=t.training(1, 2048)) for t in techs]
    t0 = time.perf_counter()
    fits = parallel_map(fit_step, exps)
    fit_s = time.perf_counter() - t0
    stack = StackedFits.of(fits)
    bs, ts = batch_grid(), seq_grid(m, 2048)
    n_cfg = len(techs) * len(bs) * len(ts)
    evaluate_grid(stack, bs, ts)  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        evaluate_grid(stack, bs, ts)
        times.append(time.perf_counter() - t0)
    best = min(times)
    rate = n_cfg / best
    print(f"fits: {len(techs)} technique combinations of llama-3.1-8b in {fit_s:.1f} s "
          f"({workers()} worker processes; {sum(len(f.coefficients) for f in fits)} candidate rows)")
    print(f"vectorised search: {len(techs)} options x {len(bs)} batches x {len(ts)} seqs = {n_cfg:,} configurations "
          f"in {best * 1e3:.1f} ms: {rate:,.0f} configurations/s (target >= {TARGET_CONFIGS_PER_S:,}/s) "
          f"{'OK' if rate >= TARGET_CONFIGS_PER_S else 'SLOW'}")


#: ``memcalc plan`` commands timed as a user runs them (budget: < 5 s wall on the CI machine, 2 cores); process CPU
#: time (user + system, the worker processes included) is printed beside the wall time, the figure to compare on a
#: shared machine. Best of 3, bytecode cached, this sandbox under load: ``--gpu h100-80gb`` 10.97 s CPU at
#: 2a72f84 (every confirmed row's estimate with its allocator replays) -> 9.46 s (a row not shown, one that does
#: not fit without --all, gets a verdict cut short past the card and no max-seq search); ``--seq 4096 --gpu
#: rtx-4090`` 1.27 -> 1.26 s. No output byte moved.
PLAN_COMMANDS = [
    ARGS,
    ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb"],
    ["plan", "--model", "llama-3.1-8b", "--seq", "4096", "--gpu", "rtx-4090"],
]


def cli_wall_time(n: int) -> None:
    exe = shutil.which("memcalc")
    for args in PLAN_COMMANDS:
        cmd = [exe, *args] if exe else [sys.executable, "-m", "memcalc.cli", *args]
        times, cpus = [], []
        for _ in range(n):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)  # the plan's worker processes count too
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            times.append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        print(f"memcalc {' '.join(args)}: median {statistics.median(times):.2f} s, best {min(times):.2f} s, "
              f"best CPU {min(cpus):.2f} s over {n} runs ({os.cpu_count()} CPUs; target < 5 s wall on 2 cores)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=3, help="CLI runs")
    n = ap.parse_args().n
    search_speed()
    cli_wall_time(n)


if __name__ == "__main__":
    main()

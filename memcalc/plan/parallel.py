"""The plan's simulations over worker processes (each is pure Python, so processes, not threads)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from typing import Any, Callable, Sequence

from memcalc.core.errors import UserError
from memcalc.plan import simulations


def workers() -> int:
    """Worker processes for the simulations: the CPUs this process may use, or
    ``MEMCALC_WORKERS`` (1 = run everything in this process)."""
    env = os.environ.get("MEMCALC_WORKERS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise UserError(f"MEMCALC_WORKERS must be a whole number, got {env!r}") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _run_keeping_peaks(job: tuple[Callable[[Any], Any], Any]) -> tuple[Any, dict]:
    fn, arg = job
    before = set(simulations.PEAK_CACHE)
    out = fn(arg)
    return out, {k: v for k, v in simulations.PEAK_CACHE.items() if k not in before}


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` over forked worker processes (each simulation is pure Python, so
    processes, not threads); the simulated peaks they find are merged into this process's cache.
    Serial when there is one CPU, one item, or no ``fork``. ``fn`` must be a module-level function."""
    items = list(items)
    n = min(workers(), len(items))
    if n <= 1 or not sys.platform.startswith("linux"):  # fork is the cheap, safe start method there
        return [fn(x) for x in items]
    with mp.get_context("fork").Pool(n) as pool:
        out = pool.map(_run_keeping_peaks, [(fn, x) for x in items], chunksize=1)
    for _, peaks in out:
        simulations.PEAK_CACHE.update(peaks)
    return [r for r, _ in out]

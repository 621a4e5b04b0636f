"""The plan's simulations over worker processes (each is pure Python, so processes, not threads)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from itertools import islice
from typing import Any, Callable, Optional, Sequence

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


#: What a worker's job adds to these caches of :mod:`memcalc.plan.simulations` comes back to the
#: parent process (``DEPTH_CHECKED``: the structures checked at three depths; ``ONE_GPU_TRACES``:
#: the one-GPU shallow traces a ZeRO step's extrapolation compares with, plan/depth.py; ``TOTAL_CACHE`` /
#: ``TOTAL_BOUNDS``: the estimate's device totals, simulations.device_total).
_SHARED = ("PEAK_CACHE", "TRACE_CACHE", "FLOOR_CACHE", "DEPTH_CHECKED", "ONE_GPU_TRACES", "TOTAL_CACHE", "TOTAL_BOUNDS")


def _run_keeping_peaks(job: tuple[Callable[[Any], Any], Any]) -> tuple[Any, list[dict]]:
    fn, arg = job
    caches = [getattr(simulations, name) for name in _SHARED]
    before = [(len(c), next(iter(c), None)) for c in caches]
    out = fn(arg)
    return out, [_added(c, n, first) for c, (n, first) in zip(caches, before)]


def _added(cache: dict, n: int, first: Any) -> dict:
    """The entries ``cache`` gained since it held ``n`` with ``first`` its first key: a dict keeps
    its keys in the order they came, so they are the ones after the first ``n`` (found without
    hashing every key, a spec's hash walks all its fields); all of them if it was cleared since (a
    full cache starts over: its first key is another one, or it holds fewer)."""
    if len(cache) >= n and (n == 0 or next(iter(cache)) is first):
        return dict(islice(cache.items(), n, None))
    return dict(cache)


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any],
                 heavy: Optional[Callable[[Any], bool]] = None) -> list[Any]:
    """``[fn(x) for x in items]`` over forked worker processes (each simulation is pure Python, so
    processes, not threads); the simulated peaks they find are merged into this process's cache.
    Serial when there is one CPU, one item, or no ``fork``. The step traces they simulate
    and floors come back too (:data:`_SHARED`). ``fn`` must be a module-level function.
    ``heavy(x)``: the items known to take longest (simulated at full depth), handed out first so
    that no worker is left with one at the end while the others wait."""
    items = list(items)
    n = min(workers(), len(items))
    if n <= 1 or not sys.platform.startswith("linux"):  # fork is the cheap, safe start method there
        return [fn(x) for x in items]
    order = sorted(range(len(items)), key=lambda i: not heavy(items[i])) if heavy else list(range(len(items)))
    with mp.get_context("fork").Pool(n) as pool:
        out = pool.map(_run_keeping_peaks, [(fn, items[i]) for i in order], chunksize=1)
    for _, added in out:
        for name, new in zip(_SHARED, added):
            getattr(simulations, name).update(new)
    got: list[Any] = [None] * len(items)
    for i, (r, _) in zip(order, out):
        got[i] = r
    return got

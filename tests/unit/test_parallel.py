"""memcalc.plan.parallel: what a worker's job adds to the shared caches comes back to the parent."""

from __future__ import annotations

import sys

import pytest

from memcalc.plan import parallel, simulations
from memcalc.plan.parallel import _added, parallel_map


def test_added_is_what_came_after():
    # source: definition (a dict keeps its keys in insertion order)
    c = {("a",): 1, ("b",): 2}
    n, first = len(c), next(iter(c))
    c[("c",)] = 3
    c[("a",)] = 9  # an update of a key the parent has: not sent, as before
    assert _added(c, n, first) == {("c",): 3}
    assert _added({}, 0, None) == {}


def test_added_after_a_clear_is_everything():
    # source: memcalc.plan.simulations caches clear when full (TRACE_CACHE_SIZE): then all is new
    c = {("a",): 1, ("b",): 2}
    n, first = len(c), next(iter(c))
    c.clear()
    c.update({("x",): 1, ("y",): 2, ("z",): 3})
    assert _added(c, n, first) == {("x",): 1, ("y",): 2, ("z",): 3}
    c.clear()
    c[("w",)] = 4
    assert _added(c, n, first) == {("w",): 4}


def _job(i: int) -> int:
    simulations.FLOOR_CACHE[("parallel-test", i)] = i * 10  # type: ignore[index]
    return i + 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers: Linux")
def test_workers_send_their_cache_entries_back(monkeypatch):
    monkeypatch.setenv("MEMCALC_WORKERS", "2")
    monkeypatch.setattr(simulations, "FLOOR_CACHE", {("parallel-test", -1): -10})
    assert parallel.workers() == 2
    assert parallel_map(_job, [1, 2, 3, 4, 5]) == [2, 3, 4, 5, 6]
    assert simulations.FLOOR_CACHE == {("parallel-test", i): i * 10 for i in (-1, 1, 2, 3, 4, 5)}

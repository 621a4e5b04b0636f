"""When the cyclic garbage collector runs in the ``memcalc`` process (see :mod:`memcalc.__main__`,
which turns it off before anything is imported)."""

from __future__ import annotations

import gc

#: (generation 0, 1, 2) thresholds for a command's long work; Python's defaults are (700, 10, 10):
#: a plan's search makes many short-lived objects, and a collection every 700 net allocations,
#: each traversing the survivors of the last, spent 40-70 ms of a plan on collections that free
#: little. The simulator pauses the collector while it runs a step (``memcalc.engine.timeline``).
GC_THRESHOLDS = (50_000, 20, 100)


def for_long_work() -> None:
    """Turn the collector back on for a command whose work is long or unbounded (``plan``'s
    searches, ``validate``'s traces), where the entry point turned it off: first the objects alive
    so far (the imported modules, classes and registries, alive as long as the process) are
    frozen, so that no collection traverses them again (and a forked worker does not copy their
    pages by touching them), then the collector runs at :data:`GC_THRESHOLDS`. Where the
    collector is on (the command run in-process, as by tests), nothing changes."""
    if gc.isenabled():
        return
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    gc.enable()

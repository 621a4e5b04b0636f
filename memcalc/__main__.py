"""The ``memcalc`` command: the console script's entry point, and ``python -m memcalc``.

Before anything is imported it makes the cyclic garbage collector run less often
(:data:`GC_THRESHOLDS`): importing click and pydantic and building the spec models allocate
hundreds of thousands of objects that live as long as the process, and a plan's search makes many
short-lived ones, so the default thresholds (a collection every 700 net allocations, each one of
them traversing the survivors of the last) spend 10 ms of an estimate and 40-70 ms of a plan on
collections that free little. Collections still run; a plan's peak memory is unchanged (the
simulator itself pauses the collector while it runs a step, ``memcalc.engine.timeline``).
"""

from __future__ import annotations

import gc

#: (generation 0, 1, 2) thresholds for the command's process; Python's defaults are (700, 10, 10)
GC_THRESHOLDS = (50_000, 20, 100)


def main() -> None:
    gc.set_threshold(*GC_THRESHOLDS)
    from memcalc.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()

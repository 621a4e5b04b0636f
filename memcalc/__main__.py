"""The ``memcalc`` command: the console script's entry point, and ``python -m memcalc``.

Before anything is imported it turns the cyclic garbage collector off. Start-up (click,
pydantic, the spec models, the engine's modules) allocates hundreds of thousands of objects that
live as long as the process, and with the collector on, the first collection after them traverses
them all, to free almost nothing: 10-15 ms of an estimate (``benchmarks/bench_speed.py``). An
estimate then runs without it (bounded work; its peak memory is unchanged, with ``--max-batch``
too). A command whose work is long or unbounded (``plan``, ``validate``) turns it back on, with
raised thresholds, after freezing what is alive by then out of its way
(:func:`memcalc.cli.collector.for_long_work`).
"""

from __future__ import annotations

import gc


def main() -> None:
    gc.disable()
    from memcalc.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()

"""Benchmark: process wall time of ``memcalc estimate`` and ``memcalc --help`` (issue 15: the
estimate under 0.2 s on the CI machine), as a user runs them: a fresh process each time, imports
included, stdout to a pipe.

Prints the best (minimum) and the median wall time over ``-n`` runs of each command, beside a bare
``python -c pass`` and ``python -c "import numpy"``. ``--baseline EXE`` also times another
``memcalc`` executable (for example main's ``.venv/bin/memcalc``), its runs interleaved with this
one's so that the load of a shared machine falls on both alike, and prints the ratio.

    python benchmarks/bench_estimate.py [-n 7] [--baseline /path/to/other/memcalc]

Not a test: speed targets live here.

Where the time goes (stop 24's end; wall clock in one process, 2-core shared machine, bytecode
cached; ``estimate --params 7e9 --bf16 --lora``, 0.24 s in all): Python's start with the editable
install's finder ~20 ms; the command line ~20 ms (click ~15 ms, memcalc's option tables); pydantic
~75-85 ms (``from pydantic import BaseModel, Field``: pydantic_core's schema types, the fields'
annotated_types and pydantic.types, the validators; what any pydantic model costs before memcalc's
own code runs) and the nine spec models' class-time schemas ~17 ms; memcalc's other modules
~23 ms; then the work: resolving the inputs ~3 ms, the one full-depth simulation ~20-24 ms, the
caching-allocator replay of the steady step (twice: a warm-up, then the measured one) and of the
first step ~25 ms, ``first_step_of`` ~3 ms, the report ~3 ms. ``bench_speed.py`` prints the
start-up part (click, + pydantic, + the spec models: 0.16 s of the 0.23 s at stop 24's end).
Without cached bytecode (``PYTHONDONTWRITEBYTECODE=1``, as on the development machine) memcalc's
own modules are compiled from source on every run: about 0.1 s more.

What issue 15 changed in the start-up (``estimate-fast``), all without changing a printed byte:
``memcalc.cli`` is a package whose import loads click and memcalc's pydantic-free core only (the
option choices come from ``memcalc.core.choices``; until stop 24 it was typer, whose 0.2x
releases coerce every option value, given or not, through a pydantic TypeAdapter built on each
run: ~35 ms of an estimate); each command imports the pipeline it runs;
``--params`` no longer imports the presets, the Hugging Face hub client (http, ssl, email) or
YAML; the shipped YAML files are read from ``data/_parsed.json`` while their text is unchanged
(no YAML parser, 35 ms); ``--json`` imports no rich; the text report is laid out without rich
where rich would print no styles (a pipe, a file: ``memcalc.render.plain``, byte for byte rich's
layout; importing rich and laying out its tables took 0.1 s), in a terminal rich prints it as
before; the console script starts with the cyclic garbage collector off (its first collection
traversed every start-up object, ~10 ms; ``memcalc/__main__.py``). ``tests/test_lazy_imports.py``
and ``tests/test_estimate_imports.py`` keep it so. Issue 26 ("simple over clever") took the plain
renderer out again (rich lays out every table: about 45 ms of CPU more on a piped estimate) and
the parse cache ``data/_parsed.json`` (the YAML files are parsed when read: PyYAML's import and
the GPU catalog's parse, about 10 ms of CPU more).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = [
    ["estimate", "--params", "7e9", "--bf16", "--lora"],
    ["estimate", "--model", "llama-3.1-8b", "--json"],
    ["--help"],
    ["estimate", "--help"],
]


def _memcalc() -> list[str]:
    exe = shutil.which("memcalc", path=str(Path(sys.executable).parent)) or shutil.which("memcalc")
    return [exe] if exe else [sys.executable, "-m", "memcalc.cli"]


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=7, help="runs of each command (best and median reported)")
    ap.add_argument("--baseline", help="another memcalc executable to time the same way, interleaved")
    a = ap.parse_args()
    mine = _memcalc()
    for label, cmd in (("python -c pass", [sys.executable, "-c", "pass"]),
                       ('python -c "import numpy"', [sys.executable, "-c", "import numpy"])):
        ts = [_wall(cmd) for _ in range(a.n)]
        print(f"{label:<52} best {min(ts):6.3f} s  median {statistics.median(ts):6.3f} s")
    for args in COMMANDS:
        _wall(mine + args)  # warm the file cache (and the bytecode cache, where it is written)
        if a.baseline:
            _wall([a.baseline, *args])
        ts, base = [], []
        for _ in range(a.n):
            ts.append(_wall(mine + args))
            if a.baseline:
                base.append(_wall([a.baseline, *args]))
        line = f"memcalc {' '.join(args):<44} best {min(ts):6.3f} s  median {statistics.median(ts):6.3f} s"
        if base:
            line += f"   baseline best {min(base):6.3f} s  median {statistics.median(base):6.3f} s  ({min(base) / min(ts):.2f}x)"
        target = "  (target < 0.2 s on the CI machine)" if args[:2] == ["estimate", "--params"] else ""
        print(line + target, flush=True)


if __name__ == "__main__":
    main()

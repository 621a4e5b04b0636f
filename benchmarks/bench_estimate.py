"""Benchmark: process wall time of ``memcalc estimate`` and ``memcalc --help`` (issue 15: the
estimate under 0.2 s on the CI machine), as a user runs them: a fresh process each time, imports
included, stdout to a pipe.

Prints the best (minimum) and the median wall time over ``-n`` runs of each command, beside a bare
``python -c pass`` and ``python -c "import numpy"``. ``--baseline EXE`` also times another
``memcalc`` executable (for example main's ``.venv/bin/memcalc``), its runs interleaved with this
one's so that the load of a shared machine falls on both alike, and prints the ratio.

    python benchmarks/bench_estimate.py [-n 7] [--baseline /path/to/other/memcalc]

Not a test: speed targets live here.

Where the time goes (``python -X importtime`` and cProfile, 2-core shared machine, bytecode
cached; ``estimate --params 7e9 --bf16 --lora``): the two full-depth simulations and the
caching-allocator replay about 0.3 s (``memcalc.engine``); importing pydantic about 0.13 s
(typer >= 0.2x imports it too: it coerces every option value, given or not, through a pydantic
TypeAdapter, 30 of them for ``estimate``, about 25 ms) and building the spec models about
0.04 s (importing ``pydantic.plugin._loader`` also imports ``importlib.metadata``, 25 ms; the
entry-point scan that ``PYDANTIC_DISABLE_PLUGINS`` skips is only 10 ms of it, so it is left
on); typer 0.07 s and building the click commands 0.02 s; the engine's modules 0.03 s; Python
itself with the editable install's finder 0.05 s. Without cached bytecode
(``PYTHONDONTWRITEBYTECODE=1``, as on the development machine) memcalc's own modules are
compiled from source on every run: about 0.1 s more.

What issue 15 changed in the start-up (``estimate-fast``), all without changing a printed byte:
``memcalc.cli`` is a package whose import loads typer and memcalc's pydantic-free core only (the
option choices come from ``memcalc.core.choices``); each command imports the pipeline it runs;
``--params`` no longer imports the presets, the Hugging Face hub client (http, ssl, email) or
YAML; the shipped YAML files are read from ``data/_parsed.json`` while their text is unchanged
(no YAML parser, 35 ms); ``--json`` imports no rich; the text report is laid out without rich
where rich would print no styles (a pipe, a file: ``memcalc.render.plain``, byte for byte rich's
layout; importing rich and laying out its tables took 0.1 s), in a terminal rich prints it as
before; the group's ``--help`` option defaults to False, so that typer does not import pydantic
to coerce it (``memcalc estimate --help``). ``tests/test_lazy_imports.py`` keeps it so.
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

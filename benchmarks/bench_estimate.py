"""Benchmark: process wall time of ``memcalc estimate`` and ``memcalc --help`` (issue 26's latency
budget: the estimate under 0.5 s on the CI machine; issue 15 had asked 0.2 s), as a user runs them:
a fresh process each time, imports included, stdout to a pipe.

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
each command imports the pipeline it runs; ``--params`` no longer imports the presets, the Hugging
Face hub client (http, ssl, email) or YAML; ``--json`` imports no rich. Issue 26 took out what was
clever for its gain and set the 0.5 s budget instead: the command line is typer's again (typer
0.29 builds a pydantic TypeAdapter for every option on each run; stop 24 had moved to bare click
for ~30 ms), the tables are rich's (``render/plain.py`` gone), pydantic's plugin loader is no
longer stubbed out, the cyclic GC stays on and the process exits normally (no ``os._exit``).
Measured at stop 26 on this sandbox under a load average of 6-9 (bare numpy 0.34 s instead of
0.10 s), stop 24's code (a2a3c0e) against main, alternated, best of 7: ``estimate --params 7e9
--bf16 --lora`` 0.54 -> 1.07 s (its text tables now import rich), ``--json`` 0.59 -> 1.02 s,
``memcalc --help`` 0.15 -> 0.23 s, ``memcalc estimate --help`` 0.19 -> 0.68 s (typer loads
pydantic to coerce the options). ``tests/unit/test_lazy_imports.py`` and ``tests/unit/test_estimate_imports.py``
keep what each command loads.

A setup that does not fit the card asked prints "To make it fit" (memcalc/plan/remedies.py): each candidate
change is screened by an estimate cut short as soon as its simulated running total, or its allocator replay's
reserved bytes, pass what the card holds (``estimate(stop_above=largest_peak_within(...))``: exact, the device
total is the reserved peak plus the card's overhead), and the first ``SHOWN`` that fit are confirmed by a whole
estimate with its replays (0.05-0.1 s each for an 8B model). Stop 27 made the screens cheaper without changing
a byte: a change whose allocated peak fits but whose reserved does not stops inside its replay (and no longer
gets the verdict's capacity-limited after-release replay); a step cut short is freed by reference counting
(``Sim.abandon_graph``) instead of leaving its graph and events to the cyclic collector; the pipeline's ranks run
with the collector paused, as one step does. Process CPU seconds after ``import memcalc.cli`` (in-process,
bytecode cached): ``--model llama-3.1-8b --lora --seq 4096 --gpu rtx-4090`` 0.59 -> 0.45, ``--model qwen3-8b
--gpu h100-80gb`` 0.51 -> 0.39, ``--model llama-3.1-70b --pp 8 --microbatches 16 --batch 16 --gpus 8`` 3.03 ->
2.54 (then every rank was simulated). What is left of a no-fit estimate is the candidates' own simulations and
replays (about 0.25 s in-process for the 8B LoRA case: 12 screens, 2 confirmed); showing one change per card
(``SHOWN = 1``) would take it to about 0.1 s, an output change. ``--cpu`` prints each command's process CPU time
beside its wall time: on a machine shared with other jobs the wall time follows their load, the CPU time much
less.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

COMMANDS = [
    ["estimate", "--params", "7e9", "--bf16", "--lora"],
    ["estimate", "--model", "llama-3.1-8b", "--json"],
    ["estimate", "--model", "llama-3.1-8b", "--qlora", "--seq", "4096", "--gpu", "rtx-4090"],
    # setups that do not fit the card asked: the verdict, then "to make it fit" (changes screened, then confirmed by
    # estimates): 12 screens, a reserved-only failure, 2 confirmed; 14 screens, 2 confirmed
    ["estimate", "--model", "llama-3.1-8b", "--lora", "--seq", "4096", "--gpu", "rtx-4090"],
    ["estimate", "--model", "qwen3-8b", "--gpu", "h100-80gb"],
    # pipeline parallelism: the simulated ranks' steps (memcalc.engine.pipeline), and its changes
    ["estimate", "--model", "llama-3.1-70b", "--pp", "8", "--microbatches", "16", "--batch", "16", "--gpus", "8"],
    ["--help"],
    ["estimate", "--help"],
]


def _memcalc() -> list[str]:
    exe = shutil.which("memcalc", path=str(Path(sys.executable).parent)) or shutil.which("memcalc")
    return [exe] if exe else [sys.executable, "-m", "memcalc.cli"]


def _wall(cmd: list[str]) -> float:
    return _run(cmd)[0]


def _run(cmd: list[str]) -> tuple[float, float]:
    """The command's wall time and its process's CPU time (user + system), in seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=7, help="runs of each command (best and median reported)")
    ap.add_argument("--baseline", help="another memcalc executable to time the same way, interleaved")
    ap.add_argument("--cpu", action="store_true", help="also print each command's best process CPU time")
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
        runs, base_runs = [], []
        for _ in range(a.n):
            runs.append(_run(mine + args))
            if a.baseline:
                base_runs.append(_run([a.baseline, *args]))
        ts, base = [w for w, _ in runs], [w for w, _ in base_runs]
        line = f"memcalc {' '.join(args):<44} best {min(ts):6.3f} s  median {statistics.median(ts):6.3f} s"
        if a.cpu:
            line += f"  cpu {min(c for _, c in runs):6.3f} s"
        if base:
            line += f"   baseline best {min(base):6.3f} s  median {statistics.median(base):6.3f} s  ({min(base) / min(ts):.2f}x)"
            if a.cpu:
                line += f"  cpu {min(c for _, c in base_runs):6.3f} s"
        target = "  (target < 0.5 s on the CI machine)" if args[0] == "estimate" and "--help" not in args else ""
        print(line + target, flush=True)


if __name__ == "__main__":
    main()

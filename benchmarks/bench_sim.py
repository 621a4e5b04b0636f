"""Benchmark: CPU time of one simulated step (``memcalc.estimate.step.simulate``), as the plan runs it
(no timeline, with the allocation trace) at full depth and on a 3-layer copy, and as ``estimate``
runs it (timeline and allocator events), for a handful of the plan's options on llama-3.1-8b.

    python benchmarks/bench_sim.py [-n 5] [--profile]

The lower of two means of ``-n`` runs in a row (``time.process_time``), in ms. Not a test (pytest
does not collect this folder). ``benchmarks/sim_equality.py`` checks that the results stay the same.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from memcalc.core.spec import ExperimentSpec
from memcalc.estimate.step import simulate
from memcalc.inputs.presets import load_preset
from memcalc.inputs.profiles import DEFAULT_PROFILE, get_profile
from memcalc.plan.depth import shallow
from memcalc.plan.options import Technique

OPTIONS = [
    Technique("none", "16", "adamw", "none", False),
    Technique("none", "16+master", "adamw", "full", True),
    Technique("none", "amp", "adamw-8bit", "selective", False),
    Technique("none", "fp32", "adafactor", "sqrt", False),
    Technique("lora", "16", "adamw", "full", False),
    Technique("qlora", "16", "adamw", "sqrt", True),
]


def cases() -> list[tuple[str, ExperimentSpec]]:
    model = load_preset("llama-3.1-8b")
    prof = get_profile(DEFAULT_PROFILE)
    out = []
    for t in OPTIONS:
        exp = ExperimentSpec(model=model, training=t.training(batch=2, seq=2048), profile=prof)
        out.append((t.key(), exp))
    return out


def best(fn, n: int, rounds: int = 2) -> float:
    """The lower of ``rounds`` means over ``n`` runs in a row (a mean, so that garbage collection
    that a run leaves to the next one is counted)."""
    means = []
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        means.append((time.process_time() - t0) / n)
    return min(means) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="cProfile the whole run instead, top 30 by tottime")
    a = ap.parse_args()
    rows = []
    prof = cProfile.Profile() if a.profile else None
    if prof:
        prof.enable()
    tot = {"full": 0.0, "depth3": 0.0, "estimate": 0.0}
    for key, exp in cases():
        e3 = shallow(exp, 3)
        full = best(lambda: simulate(exp, record_timeline=False, trace_allocs=True), a.n)
        d3 = best(lambda: simulate(e3, record_timeline=False, trace_allocs=True), a.n)
        est = best(lambda: (simulate(exp, record_timeline=True, events=True),
                            simulate(exp, first_step=True, record_timeline=False, events=True)), max(1, a.n // 2))
        tot["full"] += full
        tot["depth3"] += d3
        tot["estimate"] += est
        rows.append(f"{key:32s} {full:8.1f} {d3:8.2f} {est:9.1f}")
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    print(f"{'option':32s} {'full ms':>8s} {'3-layer':>8s} {'estimate':>9s}")
    print("\n".join(rows))
    print(f"{'total':32s} {tot['full']:8.1f} {tot['depth3']:8.2f} {tot['estimate']:9.1f}")


if __name__ == "__main__":
    main()

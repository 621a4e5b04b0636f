"""Benchmark: CPU time of one simulated step (``memcalc.estimate.step.simulate``), as the plan runs it
(no timeline, with the allocation trace) at full depth and on a 3-layer copy, and as ``estimate``
runs it (timeline and allocator events), for a handful of the plan's options on llama-3.1-8b.

    python benchmarks/bench_sim.py [-n 5] [--profile]

The lower of two means of ``-n`` runs in a row (``time.process_time``), in ms. Not a test (pytest
does not collect this folder). ``benchmarks/sim_equality.py`` checks that the results stay the same.

Checkpointed steps (2026-11-23, branch ckpt-fast; the branch point and the change alternated in the
same minutes, four rounds each of ``-n 5``, ms, full depth / 3-layer copy): a checkpointed region's
forward code ran three times (the first forward, a dry run in backward that only found where the
recompute may stop, the recompute); the first forward now counts that point itself
(``memcalc.engine.checkpoint``: ``Sim.node`` with grad disabled does to ``requires_grad`` and
``last_save_count`` what it will do in the recompute, ``Sim.hook_allocs`` leaves out FSDP's
forward-only unshard), so the dry run is left to ``selective-op`` and activation offloading; and
``Sim.alloc`` lost a few tests per call. none/bf16/adamw/none 28.8-29.1 -> 28.3-29.1 (no
checkpointing: unchanged); bf16+master/full/fused 48.0-51.3 -> 39.3-44.8 (1.18x); amp/8-bit/selective
37.0-37.9 -> 34.3-35.3 (1.08x); fp32/adafactor/sqrt 50.6-52.6 -> 39.8-42.7 (1.25x); lora/full
67.3-72.3 -> 50.9-56.4 (1.30x); qlora/sqrt/fused 74.1-84.5 -> 56.3-61.5 (1.35x); total 312.6-320.7 ->
251.5-266.4 ms (1.22x), 3-layer copies 32.5-35.6 -> 26.2-28.7 (1.24x), ``estimate``'s two steps
654-727 -> 538-586 (1.23x). ``MEMCALC_WORKERS=1`` CPU (``bench_speed.py --count``, two rounds):
``plan --model llama-3.1-8b --gpu rtx-4090`` 5.67-6.26 -> 4.80-4.81 s (1.25x), ``plan --model
llama-3.1-70b`` 3.62-3.77 -> 3.49-3.72 s, ``plan --gpu rtx-4090 --compile`` (each compiled layer a
checkpointed region) 26.7-31.0 -> 25.0-28.4 s. Every byte the same: ``sim_equality.py`` 59/59
setups identical (18 checkpointed setups added), and with ``memcalc.engine.checkpoint.CHECK_STOP``
the dry run runs too and agrees with the counted stop in all 59 setups, full depth and 3 layers,
steady and first step (``tests/unit/test_checkpoint_stop.py`` keeps 14 of them). Left: the
first forward and the recompute still run the op code twice (a replay of the first forward's
allocations would need a sound key for identical layers), and every allocation still costs about
2.5 us of Python (``Sim.alloc``: a slotted block, its totals, the trace), a third of a step.
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

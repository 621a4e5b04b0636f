"""Steps derived from another step's records instead of simulated: the first step from the steady
step's allocation events (:func:`first_step_of`), and the step with its optimizer fused into
backward from the unfused step's trace (:func:`fused_twin_of`, where :func:`fused_twin_applies`).
:func:`memcalc.engine.timeline.simulate` records what they need (``events``, ``fused_twin``);
``tests/unit/test_first_step.py`` and ``tests/unit/test_fused_twin.py`` compare them with simulated steps.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate, pairwise
from operator import itemgetter
from typing import Optional

from memcalc.core.optimizers import OPTIMIZERS
from memcalc.core.spec import ExperimentSpec
from memcalc.core.units import round_up
from memcalc.engine.result import GradReady, SimResult
from memcalc.engine.sharding import uses_deepspeed


def first_step_of(steady: SimResult) -> Optional[SimResult]:
    """The first step of a steady-state step simulated with ``events`` (outside DeepSpeed), without
    simulating it: the same events in the same order with the same sizes, except the optimizer
    state, which the steady step allocates in setup and the first step creates inside the step, each
    parameter's at the first :meth:`memcalc.engine.optimizers.OptimizerSim.create_state` call for it
    (:func:`first_step_within_steady`). So the first step's events are the steady step's with the
    state's allocations moved from setup to those points (a parameter whose state the step never
    creates has none), and its running totals, peak and peak phase follow from them. Gives what
    ``estimate()`` reads of a first step: the peak, its phase, the events (the caching-allocator
    replay) and the offloading / paged-state figures (the same events make the same ones; paged
    state counts the steady step's, the higher, as ``estimate()`` takes the maximum); the peak's
    breakdown and label are left empty (the first step cannot be the higher outside DeepSpeed).
    ``tests/unit/test_first_step.py`` compares it with simulated first steps. None without the
    recorded moves (DeepSpeed, or a step simulated without events)."""
    if steady.state_moves is None or steady.events is None or steady.event_phases is None:
        return None
    setup_state, moves = steady.state_moves
    evs, start = steady.events, steady.step_start
    # the events: setup less the state, then the step with each parameter's state where it is made
    kept = [e[0] not in setup_state for e in evs[:start]]
    out = [e for e, k in zip(evs[:start], kept, strict=True) if k]
    step_start = len(out)
    kept_before = list(accumulate(kept, initial=0))  # kept_before[m]: setup events kept before index m
    made_at = [i for i, _ in moves]  # ascending; every index is in the step (recorded after setup)
    inserted = [0]  # inserted[k]: state events made before the k-th move's index
    prev = start
    for i, made in moves:
        out += evs[prev:i]
        out += made
        prev = i
        inserted.append(inserted[-1] + len(made))
    out += evs[prev:]
    # what an earlier step left (SimResult.prior_step): made at the steady step's start, never in a first step
    prior = steady.prior_step
    dropped = list(accumulate((e[0] in prior for e in out), initial=0)) if prior else None
    if prior:
        out = [e for e in out if e[0] not in prior]

    def derived(m: int) -> int:
        """Where the steady step's event index ``m`` lands (a phase mark there precedes any state
        made at the same index: the optimizer step's phase begins, then its state is made)."""
        if m <= start:
            return kept_before[m]
        at = m - (start - step_start) + inserted[bisect_left(made_at, m)]
        return at - dropped[at] if dropped is not None else at

    peak, peak_phase, phases = _peaks(out, [(derived(m), ph) for m, ph in steady.event_phases])
    return SimResult(
        peak_bytes=peak, peak_phase=peak_phase, peak_label="", peak_categories={}, peak_kinds={},
        phases=phases, timeline=[],
        max_activation_bytes=steady.max_activation_bytes,
        events=out, step_start=step_start, host_offload=steady.host_offload,
        paged_state_bytes=steady.paged_state_bytes)


def running_totals(events: list[tuple[int, int]]) -> list[int]:
    """The bytes alive after each event (a free gives back its allocation's bytes)."""
    size = {uid: n for uid, n in events if n}
    return list(accumulate(n or -size[uid] for uid, n in events))


def _peaks(events: list[tuple[int, int]], starts: list[tuple[int, str]]) -> tuple[int, str, dict[str, int]]:
    """The peak, its phase and each phase's peak (setup's left out) of a step's ``events`` whose phases begin at
    ``starts`` ((index into events, phase)): per phase stretch, the highest total an allocation reaches
    (Sim.alloc: the peak is the first highest; Sim.mark starts a phase's peak at the total when it begins)."""
    totals = running_totals(events)
    alloc_totals = [t if e[1] else 0 for t, e in zip(totals, events, strict=True)]
    phases: dict[str, int] = {}
    peak = 0
    peak_phase = ""
    for (a, ph), (b, _) in pairwise([*starts, (len(events), "")]):
        phases.setdefault(ph, totals[a - 1] if a else 0)
        if a < b:
            top = max(alloc_totals[a:b])
            if top > phases[ph]:
                phases[ph] = top
            if top > peak:
                peak, peak_phase = top, ph
    return peak, peak_phase, {k: v for k, v in phases.items() if k != "setup"}


def fused_twin_applies(exp: ExperimentSpec) -> bool:
    """Whether :func:`fused_twin_of` may derive ``exp``'s step with a fused optimizer from its
    unfused one: a single-GPU eager step (no ZeRO sharding, DeepSpeed, tensor parallelism or
    torch.compile, whose gradients leave the backward together), one micro-step, the optimizer
    state on the GPU, the steady state (a fused first step makes its state inside backward), and not
    GaLore (its fused step runs its own loop, :func:`memcalc.engine.galore.galore_step`, not the
    parameter's ``per_param_temps``)."""
    tr = exp.training
    return (not tr.fused_optimizer and tr.grad_accum == 1 and not tr.compile and not tr.offload_optimizer
            and tr.tp == 1 and (tr.zero == 0 or tr.gpus == 1) and not uses_deepspeed(exp)
            and not tr.activation_offload and OPTIMIZERS[tr.optimizer].step != "galore")


def fused_twin_of(unfused: SimResult, round_bytes: int) -> Optional[SimResult]:
    """The steady step with the optimizer fused into backward, from the same step unfused (simulated
    with ``fused_twin``), without simulating it. The two run the same events up to each gradient
    becoming ready; there the fused step runs that parameter's step temporaries
    (``per_param_temps``, allocated and freed in order, the rest freed at the end:
    :meth:`OptimizerSim.run_events`) and frees the gradient (:meth:`memcalc.engine.timeline._Step.fused_step`), and it
    has no optimizer-step phase. So every later total is the unfused one less the gradients freed
    so far, and the temporaries' totals follow from the total when the gradient was ready.

    Gives the allocation trace (``alloc_trace``), the peak, its phase and label: what the plan
    reads; the phase peaks, breakdown, events and timeline are left empty.
    ``tests/unit/test_fused_twin.py`` compares it with simulated fused steps. None without the
    records."""
    ready, trace = unfused.grads_ready, unfused.alloc_trace
    if ready is None or trace is None:
        return None
    out: list[tuple[int, str, str, int]] = []
    freed = 0

    def step(g: GradReady) -> None:
        nonlocal freed
        cur = g.total - freed
        live: dict[int, int] = {}
        for i, (what, val) in enumerate(g.temps):
            if what == "alloc":
                n = round_up(val, round_bytes)
                live[i] = n
                cur += n
                out.append((cur, g.phase, g.label, val))
            else:
                cur -= live.pop(val)
        freed += g.grad_bytes

    end = len(trace)
    while end and trace[end - 1][1] == "optimizer step":  # the unfused step's last phase
        end -= 1
    at = 0
    for g in ready:  # the trace between gradients, less what has been freed (in order)
        stop = min(g.trace_at, end)
        if freed:
            out += [(t - freed, ph, lab, req) for t, ph, lab, req in trace[at:stop]]
        else:
            out += trace[at:stop]
        at = max(at, stop)
        step(g)
    out += [(t - freed, ph, lab, req) for t, ph, lab, req in trace[at:end]]
    peak, peak_phase, peak_label = 0, "", ""
    if out:
        top = max(out, key=itemgetter(0))  # the first highest, as Sim.alloc keeps it
        if top[0] > 0:
            peak, peak_phase, peak_label = top[0], top[1], top[2]
    return SimResult(peak_bytes=peak, peak_phase=peak_phase, peak_label=peak_label, peak_categories={},
                     peak_kinds={}, phases={}, timeline=[], max_activation_bytes=unfused.max_activation_bytes,
                     alloc_trace=out)


def fused_events_of(unfused: SimResult, round_bytes: int) -> Optional[SimResult]:
    """The steady step with the optimizer fused into backward, as :func:`fused_twin_of` derives it, but
    its allocation events (what ``estimate()``'s allocator replay and :func:`first_step_of` read) from the
    unfused step's (simulated with ``events`` and ``fused_twin``): the same events up to each gradient
    becoming ready; there the fused step runs that parameter's step temporaries (allocated and freed in
    order, the rest freed at the end: :meth:`memcalc.engine.optimizers.OptimizerSim.run_events`), then frees
    the gradient (:meth:`memcalc.engine.timeline._Step.fused_step`), and it has no optimizer-step phase (the
    unfused events from its start are left out). Its first :meth:`OptimizerSim.create_state` call for a
    parameter, where a first step would create the state (``state_moves``), is where the gradient is ready.
    The temporaries get block ids of their own (after the unfused step's). Gives the events, phases, state
    moves, peak, its phase and the phase peaks; the peak's label and breakdown are left empty (a caller
    that reads the device total alone: :func:`memcalc.plan.simulations.device_total`).
    ``tests/unit/test_fused_twin.py`` compares it with simulated fused steps. None without the records."""
    ready, evs, marks = unfused.grads_ready, unfused.events, unfused.event_phases
    if ready is None or evs is None or marks is None or unfused.state_moves is None:
        return None
    if any(g.event_at < 0 for g in ready):
        return None
    # the unfused step's optimizer step: its events and phase marks are not the fused step's
    end_mark = next((j for j, (_, ph) in enumerate(marks) if ph == "optimizer step"), len(marks))
    end = marks[end_mark][0] if end_mark < len(marks) else len(evs)
    uid = max((u for u, _ in evs), default=0)
    out: list[tuple[int, int]] = []
    moves: list[tuple[int, list[tuple[int, int]]]] = []
    inserted: list[tuple[int, int]] = []  # (phase marks before a gradient's step, events it inserts)
    at = 0
    for g in ready:
        out += evs[at:g.event_at]
        at = g.event_at
        before = len(out)
        moves.append((before, list(g.state)))
        live: dict[int, int] = {}
        for i, (what, val) in enumerate(g.temps):
            if what == "alloc":
                n = round_up(val, round_bytes)
                if n:
                    uid += 1
                    live[i] = uid
                    out.append((uid, n))
                else:
                    live[i] = 0
            else:
                u = live.pop(val)
                if u:
                    out.append((u, 0))
        out += [(u, 0) for u in live.values() if u]
        if g.grad_uid:
            out.append((g.grad_uid, 0))
        inserted.append((g.phase_at, len(out) - before))
    out += evs[at:end]
    starts = []
    for j, (m, ph) in enumerate(marks[:end_mark]):
        starts.append((m + sum(k for phase_at, k in inserted if phase_at <= j), ph))
    peak, peak_phase, phases = _peaks(out, starts)
    setup_state, _ = unfused.state_moves
    return SimResult(
        peak_bytes=peak, peak_phase=peak_phase, peak_label="", peak_categories={}, peak_kinds={},
        phases=phases, timeline=[], max_activation_bytes=unfused.max_activation_bytes,
        events=out, step_start=unfused.step_start, host_offload=unfused.host_offload,
        paged_state_bytes=unfused.paged_state_bytes, event_phases=starts, state_moves=(setup_state, moves))

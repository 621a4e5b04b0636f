"""The training step as a timeline: setup, forward, backward, optimizer step.

``simulate(exp, first_step)`` runs one step on the simulator:
- steady state (``first_step=False``): weights and optimizer state exist, no
  gradients (``zero_grad(set_to_none=True)`` ran after the previous step);
- first step: no optimizer state yet; it is created inside the step (all at once
  for a foreach step, per parameter for a per-parameter or fused step).
Gradient accumulation runs the first micro-step (no gradients alive) and a
later one (all gradients alive, each new gradient allocated and added in
place); micro-steps after the second repeat the second exactly.
A fused optimizer steps each parameter in its post-accumulate-grad hook and
frees its gradient at once.
"""

from __future__ import annotations

import gc
from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from operator import itemgetter
from typing import TYPE_CHECKING, Callable, Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec
from memcalc.core.optimizers import OPTIMIZERS
from memcalc.core.units import round_up
from memcalc.engine.checkpoint import layer_strategy
from memcalc.engine.forward import Forward
from memcalc.engine.fsdp import FSDP2, optimizer_training
from memcalc.engine.optimizers import OptimizerSim
from memcalc.engine.params import param_inventory
from memcalc.engine.offload import ActivationOffload
from memcalc.engine.result import TimelinePoint
from memcalc.engine.sharding import LayerGather, uses_deepspeed
from memcalc.engine.sim import Node, Param, Sim
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine.weights import Model, make_params

if TYPE_CHECKING:
    from memcalc.engine.deepspeed import DeepSpeedZero2

# memcalc.engine.deepspeed and memcalc.engine.fsdp1 are imported where a step uses them: an
# unsharded step never does (about 1.5 ms of an estimate's start-up)


@dataclass
class SimResult:
    """What one simulated step produced (bytes are ints)."""

    peak_bytes: int
    peak_phase: str
    peak_label: str
    peak_categories: dict[str, int]
    peak_kinds: dict[str, int]
    phases: dict[str, int]
    timeline: list[TimelinePoint]
    max_activation_bytes: int
    alloc_trace: Optional[list[tuple[int, str, str, int]]] = None  # (total, phase, label, requested) per allocation
    events: Optional[list[tuple[int, int]]] = None  # allocation events (see Sim.events)
    step_start: int = 0  # index of the step's first event (before it: weights, state)
    #: activation offloading: (raw bytes, pinned host bytes, tensors) offloaded in one forward
    host_offload: Optional[tuple[int, int, int]] = None
    #: bitsandbytes paged optimizer state (CUDA unified memory, not in the peak); None when not paged
    paged_state_bytes: Optional[int] = None
    #: with ``events``: (index into events, phase) where each phase begins
    event_phases: Optional[list[tuple[int, str]]] = None
    #: a steady-state step with ``events`` outside DeepSpeed: the uids of the optimizer state allocated
    #: in setup, and (index into events, [(uid, bytes)]) where a first step would create each
    #: parameter's state instead (:func:`first_step_of`)
    state_moves: Optional[tuple[frozenset[int], list[tuple[int, list[tuple[int, int]]]]]] = None
    #: an unfused step simulated with ``fused_twin``: where each gradient became ready
    #: (:class:`GradReady`), from which :func:`fused_twin_of` derives the same step with the
    #: optimizer fused into backward
    grads_ready: Optional[list["GradReady"]] = None


def check_supported(exp: ExperimentSpec) -> None:
    tr = exp.training
    if tr.fused_optimizer and tr.grad_accum > 1:
        # torchtune recipes (full_finetune_single_device.py and the others) raise the same for
        # optimizer_in_bwd with gradient_accumulation_steps > 1: "Gradient accumulation is not
        # supported with optimizer in bwd"
        raise UserError(
            f"a fused optimizer (optimizer in backward) steps inside backward, so it cannot accumulate gradients "
            f"(grad_accum {tr.grad_accum}); torchtune refuses it too (\"Gradient accumulation is not supported with "
            f"optimizer in bwd\"): set grad_accum 1 or drop --fused-optimizer"
        )
    if tr.seq > exp.model.max_seq_len and exp.model.positions == "learned":
        raise UserError(
            f"seq ({tr.seq}) exceeds {exp.model.name}'s learned position table ({exp.model.max_seq_len})"
        )
    if tr.sharding == "deepspeed" and tr.zero >= 2 and tr.gpus > 1 and (tr.fused_optimizer or tr.compile):
        raise UserError("DeepSpeed ZeRO runs the optimizer after backward, uncompiled, in memcalc's model; "
                        "drop --fused-optimizer / --compile with --sharding deepspeed")
    if tr.seq < 2:
        raise UserError(f"seq ({tr.seq}) must be at least 2 for a causal LM loss")
    if tr.activation_offload and tr.compile:
        raise UserError("activation offloading under torch.compile is not modelled (the compiled graph saves "
                        "its tensors as a whole); drop --compile or --activation-offload")
    if tr.activation_offload and tr.checkpoint in ("sqrt", "selective"):
        # the offload hooks' reloads inside a multi-layer or sub-layer recompute are not modelled: the
        # simulated step loses track of a reloaded tensor (found 2026-11-23)
        raise UserError(f"activation offloading with --checkpoint {tr.checkpoint} is not modelled yet (modelled: "
                        "none, full, every-k, selective-op); pick one of those or drop --activation-offload")


def _label_of(node: Node) -> str:
    lab = node.fwd_label or ""
    got = _BWD_LABELS.get(lab)
    if got is None:
        if len(_BWD_LABELS) > 4096:
            _BWD_LABELS.clear()
        got = _BWD_LABELS[lab] = lab.replace("fwd ", "bwd ") if lab.startswith("fwd ") else (lab or "backward")
    return got


#: backward labels by forward label (_label_of: once per node of every step, from a few distinct labels)
_BWD_LABELS: dict[str, str] = {}


def weights_and_state(sim: Sim, exp: ExperimentSpec, create_state: bool) -> tuple[Model, "OptimizerSim | DeepSpeedZero2"]:
    """What exists before a step's forward, allocated on ``sim``: the weights
    (:func:`memcalc.engine.weights.make_params`) and the optimizer, with its state when
    ``create_state`` (a steady-state step; the first step creates it inside the step, see
    :class:`memcalc.engine.optimizers.OptimizerSim`)."""
    model = make_params(sim, exp)
    rows_of = {p.name: (p.shape[0] if len(p.shape) == 2 else 0) for p in param_inventory(exp.model, exp.training.lora)}
    if uses_deepspeed(exp):  # its own optimizer side
        from memcalc.engine.deepspeed import deepspeed_optimizer

        opt = deepspeed_optimizer(sim, exp, model.order)
    else:
        opt = OptimizerSim(sim, optimizer_training(exp.training), model.order, rows_of)
    if create_state:
        opt.create_all()
    return model, opt


def first_step_within_steady(exp: ExperimentSpec) -> bool:
    """Whether the first step's peak is at most the steady step's, without simulating it.

    Outside DeepSpeed (whose optimizer side is its own, :mod:`memcalc.engine.deepspeed`) the two
    steps run the same events in the same order with the same sizes except the optimizer state:
    the steady step allocates it in setup, the first step creates each tensor of it inside the
    step (:meth:`memcalc.engine.optimizers.OptimizerSim.create_state`, which does nothing for
    state that exists). So at every event the first step's live bytes are the steady step's less
    the state not yet created, and its peak cannot be higher. ``estimate()`` checks this on every
    estimate it makes (an internal invariant); the plan relies on it to skip first-step
    simulations (:func:`memcalc.plan.simulations.estimated_peak`)."""
    return not uses_deepspeed(exp)


def weights_and_state_bytes(exp: ExperimentSpec) -> int:
    """Bytes allocated at the start of a steady-state step of ``exp`` (weights plus optimizer
    state, each rounded as the allocator does): a lower bound of its peak that needs no forward
    pass (:mod:`memcalc.plan` discards options with it)."""
    return _setup(exp)[0].total


def _setup(exp: ExperimentSpec) -> tuple[Sim, Model]:
    """A simulator holding what a steady-state step of ``exp`` starts with, and the model."""
    sim = Sim(exp.profile.allocator_round_bytes)
    sim.record_timeline = False
    model, _ = weights_and_state(sim, exp, create_state=True)
    return sim, model


def grads_all_alive(exp: ExperimentSpec) -> bool:
    """Whether every trainable parameter's whole gradient is alive at once with the weights and
    the optimizer state in a steady-state step (after the last backward, before the optimizer
    step): an unfused step (a fused one frees each gradient as it steps it) whose gradients are
    neither sharded (ZeRO over several GPUs, DeepSpeed) nor moved to the host (optimizer offload)."""
    tr = exp.training
    return (not tr.fused_optimizer and not tr.offload_optimizer and not uses_deepspeed(exp)
            and (tr.zero == 0 or tr.gpus == 1))


def floor_bytes(exp: ExperimentSpec) -> int:
    """A lower bound of the steady step's peak that needs no forward pass: the weights and optimizer
    state (:func:`weights_and_state_bytes`) plus, where they are all alive together
    (:func:`grads_all_alive`), every trainable parameter's gradient, each rounded as the allocator
    rounds it (``Param.grad_bytes``; the moment before the optimizer step)."""
    sim, model = _setup(exp)
    total = sim.total
    if grads_all_alive(exp):
        rb = exp.profile.allocator_round_bytes
        total += sum(round_up(p.grad_bytes, rb) for p in model.order if p.trainable)
    return total


def sharded_runtime(sim: Sim, exp: ExperimentSpec, model: Model):
    """What gathers and reduces the sharded state during the step: FSDP2's per-unit buffers
    (:class:`memcalc.engine.fsdp.FSDP2`), FSDP1's flat units (:class:`memcalc.engine.fsdp1.FSDP1`), the generic ZeRO-3 layer gathers
    (:class:`memcalc.engine.sharding.LayerGather`), or None (nothing sharded or gathered)."""
    if model.fsdp1:
        from memcalc.engine.fsdp1 import FSDP1

        return FSDP1(sim, exp, model.order, model.shapes)
    if model.fsdp2:
        return FSDP2(sim, exp, model.order, model.shapes)
    if model.layer_gather_bytes:
        return LayerGather(sim, model.layer_gather_bytes, exp.model.n_layers)
    return None


def simulate(exp: ExperimentSpec, first_step: bool = False, record_timeline: bool = True,
             trace_allocs: bool = False, events: bool = False,
             strategy: Optional[Callable[[], LayerStrategy]] = None, fused_twin: bool = False,
             stop_above: Optional[int] = None) -> SimResult:
    """Simulate one optimizer step of ``exp``; see the module docstring for what it covers.
    ``trace_allocs`` also returns the running total (and phase) after every allocation.
    ``strategy`` makes the layer strategy of each micro-step (default: eager, or
    checkpointing as the spec asks); a compiled step needs one from :mod:`memcalc.compile`
    (:func:`memcalc.estimate.step.simulate` chooses). ``fused_twin`` (with ``trace_allocs``, where
    :func:`fused_twin_applies`) also records where each gradient becomes ready, for
    :func:`fused_twin_of`. ``stop_above``: stop, raising :class:`memcalc.engine.sim.PeakAbove`,
    as soon as the running total passes this many bytes (the step does not fit: its peak is all
    a caller asks about, and only whether it passes).

    Python's cyclic garbage collector is paused while the step runs: the simulation makes tens of
    thousands of objects that live until it ends, which the collector would otherwise traverse
    again and again (about a tenth of the time); it runs again afterwards."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _simulate(exp, first_step, record_timeline, trace_allocs, events, strategy,
                         fused_twin and trace_allocs and not first_step and fused_twin_applies(exp), stop_above)
    finally:
        if paused:
            gc.enable()


def _simulate(exp: ExperimentSpec, first_step: bool, record_timeline: bool, trace_allocs: bool, events: bool,
              strategy: Optional[Callable[[], LayerStrategy]], fused_twin: bool = False,
              stop_above: Optional[int] = None) -> SimResult:
    check_supported(exp)
    tr = exp.training
    if strategy is None:
        assert not tr.compile, "a compiled step needs the compiled layer strategy (memcalc.estimate.step)"
        strategy = lambda: layer_strategy(tr)  # noqa: E731
    sim = Sim(exp.profile.allocator_round_bytes)
    if stop_above is not None:
        sim.stop_above = stop_above
    sim.record_timeline = record_timeline
    if trace_allocs:
        sim.alloc_trace = []
    if events:
        sim.events = []
    sim.mark("weights", "setup")
    model, opt = weights_and_state(sim, exp, create_state=not first_step)
    sim.mark("step start", "setup")
    step_start = len(sim.events) if sim.events is not None else 0
    twin = events and not first_step and isinstance(opt, OptimizerSim)
    if twin:  # where a first step would create the state (first_step_of)
        setup_state = frozenset(t.uid for ts in opt.state.values() for t in ts if t.uid)
        opt.created_at = []
    if tr.activation_offload:
        sim.offload = ActivationOffload()

    micro = min(tr.grad_accum, 2)
    strategies = [strategy() for _ in range(micro)]
    deferred: list[Param] = []
    if tr.fused_optimizer:
        def hook(s: Sim, p: Param) -> None:
            opt.step_param(p)
            s.unref(p.grad)
            p.grad = None

        if strategies[0].grads_leave_together:
            # e.g. all gradients leave the compiled backward together (its outputs), and only
            # then does AccumulateGrad, and with it each post-accumulate-grad hook, run
            sim.grad_ready = lambda s, p: deferred.append(p)
        else:
            sim.grad_ready = hook

    deepspeed = not isinstance(opt, OptimizerSim)  # DeepSpeed's optimizer side (weights_and_state)
    if deepspeed:
        from memcalc.engine.deepspeed import DeepSpeedZero3

        sim.grad_ready = opt.grad_ready
    grads_ready: Optional[list[GradReady]] = None
    if fused_twin:  # where a fused step would step and free each gradient (fused_twin_of)
        grads_ready = []
        assert sim.grad_ready is None and isinstance(opt, OptimizerSim)

        def ready(s: Sim, p: Param) -> None:
            grads_ready.append(GradReady(len(s.alloc_trace), s.total, s.label, s.phase,  # type: ignore[union-attr,arg-type]
                                         opt._temps_of(p), p.grad.nbytes))  # type: ignore[union-attr]

        sim.grad_ready = ready
    # DeepSpeed ZeRO-3 gathers its own way (engine.deepspeed); FSDP2/FSDP1/generic ZeRO-3 otherwise
    gather = opt.gather if deepspeed and isinstance(opt, DeepSpeedZero3) else sharded_runtime(sim, exp, model)
    if gather is not None:
        sim.on_layer = lambda s, i: gather.backward_enter(i)
    for layers in strategies:
        sim.nodes = []
        if gather is not None:
            gather.before_forward()
        fwd = Forward(sim, exp, model, layers, gather)
        loss = fwd.run()
        if gather is not None:
            gather.after_forward()
        sim.mark("backward start", "backward")
        if gather is not None:
            gather.backward_start()
        sim.backward(loss, 4, _label_of)
        layers.end_backward(fwd)
        if deepspeed:
            opt.end_backward()
        if gather is not None:
            gather.end_backward()
        for p in deferred:
            hook(sim, p)
        deferred.clear()
        if gather is not None:
            gather.release()
        sim.unref(loss)
        fwd.release_inputs()
        sim.mark("backward end", "backward")

    if not tr.fused_optimizer:
        sim.mark("optimizer step", "optimizer step")
        opt.step_all()
        for p in model.order:  # zero_grad(set_to_none=True)
            if p.grad is not None:
                sim.unref(p.grad)
                p.grad = None
        sim.mark("step end", "optimizer step")

    phases = {k: v for k, v in sim.phase_peaks.items() if k != "setup"}
    result = SimResult(
        peak_bytes=sim.peak,
        peak_phase=sim.peak_phase,
        peak_label=sim.peak_label,
        peak_categories=sim.peak_categories(),
        peak_kinds=sim.peak_kinds_alive(),
        phases=phases,
        timeline=sim.timeline,
        max_activation_bytes=sim.max_activations,
        alloc_trace=sim.alloc_trace,
        events=sim.events,
        step_start=step_start,
        host_offload=(sim.offload.max_host_bytes, sim.offload.max_pinned_bytes,
                      sim.offload.max_offloaded_tensors)
        if sim.offload is not None else None,
        paged_state_bytes=opt.paged_bytes if OPTIMIZERS[tr.optimizer].paged else None,
        event_phases=sim.event_phases if events else None,
        state_moves=(setup_state, [(i, [(t.uid, t.nbytes) for t in ts if t.uid]) for i, ts in opt.created_at])
        if twin else None,
        grads_ready=grads_ready,
    )
    sim.release_graph()
    return result


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
    ``tests/test_first_step.py`` compares it with simulated first steps. None without the
    recorded moves (DeepSpeed, or a step simulated without events)."""
    if steady.state_moves is None or steady.events is None or steady.event_phases is None:
        return None
    setup_state, moves = steady.state_moves
    evs, start = steady.events, steady.step_start
    # the events: setup less the state, then the step with each parameter's state where it is made
    out = [e for e in evs[:start] if e[0] not in setup_state]
    step_start = len(out)
    made_at = [i for i, _ in moves]  # ascending; every index is in the step (recorded after setup)
    inserted = [0]  # inserted[k]: state events made before the k-th move's index
    prev = start
    for i, made in moves:
        out += evs[prev:i]
        out += made
        prev = i
        inserted.append(inserted[-1] + len(made))
    out += evs[prev:]

    def derived(m: int) -> int:
        """Where the steady step's event index ``m`` lands (a phase mark there precedes any state
        made at the same index: the optimizer step's phase begins, then its state is made)."""
        if m <= start:
            return m - sum(1 for e in evs[:m] if e[0] in setup_state)
        return m - (start - step_start) + inserted[bisect_left(made_at, m)]

    # running totals (a free gives back its allocation's bytes) and, per phase stretch, the highest
    # total an allocation reaches (Sim.alloc: the peak is the first highest; Sim.mark starts a
    # phase's peak at the total when it begins)
    size = {uid: n for uid, n in out if n}
    totals = list(accumulate(n or -size[uid] for uid, n in out))
    alloc_totals = [t if e[1] else 0 for t, e in zip(totals, out)]
    cuts = [(derived(m), ph) for m, ph in steady.event_phases] + [(len(out), "")]
    phases: dict[str, int] = {}
    peak = 0
    peak_phase = ""
    for (a, ph), (b, _) in zip(cuts, cuts[1:]):
        phases.setdefault(ph, totals[a - 1] if a else 0)
        if a < b:
            top = max(alloc_totals[a:b])
            if top > phases[ph]:
                phases[ph] = top
            if top > peak:
                peak, peak_phase = top, ph
    return SimResult(
        peak_bytes=peak, peak_phase=peak_phase, peak_label="", peak_categories={}, peak_kinds={},
        phases={k: v for k, v in phases.items() if k != "setup"}, timeline=[], max_activation_bytes=steady.max_activation_bytes,
        events=out, step_start=step_start, host_offload=steady.host_offload,
        paged_state_bytes=steady.paged_state_bytes)


@dataclass(frozen=True)
class GradReady:
    """An unfused step's gradient becoming ready (AccumulateGrad, :meth:`Sim._run_node`): where a
    fused step would run that parameter's optimizer step (:meth:`OptimizerSim.step_param`) and
    free its gradient."""

    trace_at: int  # allocations traced before it
    total: int  # bytes alive then (the new gradient included)
    label: str
    phase: str
    temps: list[tuple[str, int]]  # the parameter's step temporaries (per_param_temps)
    grad_bytes: int  # the gradient's block


def fused_twin_applies(exp: ExperimentSpec) -> bool:
    """Whether :func:`fused_twin_of` may derive ``exp``'s step with a fused optimizer from its
    unfused one: a single-GPU eager step (no ZeRO sharding, DeepSpeed, tensor parallelism or
    torch.compile, whose gradients leave the backward together), one micro-step, the optimizer
    state on the GPU, the steady state (a fused first step makes its state inside backward)."""
    tr = exp.training
    return (not tr.fused_optimizer and tr.grad_accum == 1 and not tr.compile and not tr.offload_optimizer
            and tr.tp == 1 and (tr.zero == 0 or tr.gpus == 1) and not uses_deepspeed(exp)
            and not tr.activation_offload)


def fused_twin_of(unfused: SimResult, round_bytes: int) -> Optional[SimResult]:
    """The steady step with the optimizer fused into backward, from the same step unfused (simulated
    with ``fused_twin``), without simulating it. The two run the same events up to each gradient
    becoming ready; there the fused step runs that parameter's step temporaries
    (``per_param_temps``, allocated and freed in order, the rest freed at the end:
    :meth:`OptimizerSim.run_events`) and frees the gradient (the hook in :func:`_simulate`), and it
    has no optimizer-step phase. So every later total is the unfused one less the gradients freed
    so far, and the temporaries' totals follow from the total when the gradient was ready.

    Gives the allocation trace (``alloc_trace``), the peak, its phase and label: what the plan
    reads; the phase peaks, breakdown, events and timeline are left empty.
    ``tests/test_fused_twin.py`` compares it with simulated fused steps. None without the
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

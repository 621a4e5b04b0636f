"""The training step as a timeline: setup, forward, backward, optimizer step.

``simulate(exp, first_step)`` runs one step on the simulator:
- steady state (``first_step=False``): weights and optimizer state exist, no
  gradients (``zero_grad(set_to_none=True)`` ran after the previous step);
- first step: no optimizer state yet; it is created inside the step (all at once
  for a foreach step, per parameter for a per-parameter or fused step).
Gradient accumulation runs the first micro-step (no gradients alive) and a
later one (all gradients alive, each new gradient allocated and added in
place); micro-steps after the second repeat the second exactly.
With ``TrainingSpec.first_seq`` the first step is the run's first: its first
micro-step runs ``first_seq`` tokens with nothing of an earlier micro-step
alive (``Forward.run_start``: no previous output held), the later ones ``seq``.
A fused optimizer steps each parameter in its post-accumulate-grad hook and
frees its gradient at once.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional

from memcalc.core.errors import UserError
from memcalc.core.units import round_up
from memcalc.core.spec import ExperimentSpec
from memcalc.core.optimizers import OPTIMIZERS
from memcalc.engine.checkpoint import layer_strategy
from memcalc.engine.context_parallel import shard_group
from memcalc.engine.forward import Forward
from memcalc.engine.fsdp import FSDP2, optimizer_training
from memcalc.engine.optimizers import OptimizerSim
from memcalc.engine.params import param_inventory
from memcalc.engine.offload import ActivationOffload
from memcalc.engine.offload_trl import TrlActivationOffload
from memcalc.engine.observers import AllocEvents, AllocTrace, PeakAbove, Timeline
from memcalc.engine.result import GradReady, SimResult
from memcalc.engine.sharding import GatherHooks, LayerGather, uses_deepspeed
from memcalc.engine.sim import Node, Param, Sim, T
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine.twins import fused_twin_applies
from memcalc.engine.weights import Model, make_params

if TYPE_CHECKING:
    from memcalc.engine.deepspeed import DeepSpeedZero2

# memcalc.engine.deepspeed and memcalc.engine.fsdp1 are imported where a step uses them: an
# unsharded step never does (about 1.5 ms of an estimate's start-up)


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
    for name, tokens in (("seq", tr.seq), ("first_seq", tr.first_seq)):  # (first_seq: the run's first micro-step)
        if tokens is not None and tokens > exp.model.max_seq_len and exp.model.positions == "learned":
            raise UserError(
                f"{name} ({tokens}) exceeds {exp.model.name}'s learned position table ({exp.model.max_seq_len})"
            )
    if uses_deepspeed(exp) and (tr.fused_optimizer or tr.compile):
        raise UserError("DeepSpeed ZeRO runs the optimizer after backward, uncompiled, in memcalc's model; "
                        "drop --fused-optimizer / --compile with --sharding deepspeed")
    if tr.seq < 2:
        raise UserError(f"seq ({tr.seq}) must be at least 2 for a causal LM loss")
    if exp.profile.framework == "unsloth" and (tr.compile or tr.activation_offload or uses_deepspeed(exp)):
        # memcalc.core.unsloth: Unsloth's own kernels run eagerly; it compiles and offloads in its own ways
        raise UserError("--framework unsloth models Unsloth's eager kernels and its own offloading checkpoint "
                        "(--checkpoint full); --compile, --activation-offload and DeepSpeed with it are not modelled")
    if tr.activation_offload and tr.compile and tr.compile_scope != "layer":
        # one graph is one autograd node (AOTAutograd's CompiledFunction): OffloadActivations packs its
        # whole saved set when the forward graph returns and unpacks all of it when its backward starts
        raise UserError(f"activation offloading under --compile-scope {tr.compile_scope} is not modelled (the "
                        "whole forward is one compiled graph: its saved set would be offloaded and brought back all at "
                        "once); use --compile-scope layer (torchtune's per-layer compile, its default with --framework "
                        "torchtune) or drop --activation-offload")
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
    the state not yet created, and its peak cannot be higher. Not with ``first_seq``: the run's first
    micro-step is then a different length. ``estimate()`` checks this on every
    estimate it makes (an internal invariant); the plan relies on it to skip first-step
    simulations (:func:`memcalc.plan.simulations.estimated_peak`)."""
    return not uses_deepspeed(exp) and exp.training.first_seq is None


def weights_and_state_bytes(exp: ExperimentSpec) -> int:
    """Bytes allocated at the start of a steady-state step of ``exp`` (weights plus optimizer
    state, each rounded as the allocator does): a lower bound of its peak that needs no forward
    pass (:mod:`memcalc.plan` discards options with it)."""
    return _setup(exp)[0].total


def _setup(exp: ExperimentSpec) -> tuple[Sim, Model]:
    """A simulator holding what a steady-state step of ``exp`` starts with, and the model."""
    sim = Sim(exp.profile.allocator_round_bytes)
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


def sharded_runtime(sim: Sim, exp: ExperimentSpec, model: Model) -> Optional[GatherHooks]:
    """What gathers and reduces the sharded state during the step: FSDP2's per-unit buffers
    (:class:`memcalc.engine.fsdp.FSDP2`), FSDP1's flat units (:class:`memcalc.engine.fsdp1.FSDP1`), the generic ZeRO-3 layer gathers
    (:class:`memcalc.engine.sharding.LayerGather`), or None (nothing sharded or gathered)."""
    if model.fsdp1:
        from memcalc.engine.fsdp1 import FSDP1

        return FSDP1(sim, exp, model.order, model.shapes)
    if model.fsdp2 and exp.training.ep > 1:  # two FSDP2 parameter groups per MoE layer
        from memcalc.engine.expert_fsdp import ep_fsdp2

        return ep_fsdp2(sim, exp, model.order, model.shapes)
    if model.fsdp2:
        return FSDP2(sim, exp, model.order, model.shapes)
    if model.layer_gather_bytes:
        return LayerGather(sim, model.layer_gather_bytes, exp.model.n_layers)
    return None


def simulate(exp: ExperimentSpec, first_step: bool = False, record_timeline: bool = True,
             trace_allocs: bool = False, events: bool = False,
             strategy: Optional[Callable[[], LayerStrategy]] = None, fused_twin: bool = False,
             observers: Sequence[object] = ()) -> SimResult:
    """Simulate one optimizer step of ``exp``; see the module docstring for what it covers.
    ``trace_allocs`` also returns the running total (and phase) after every allocation.
    ``strategy`` makes the layer strategy of each micro-step (default: eager, or
    checkpointing as the spec asks); a compiled step needs one from :mod:`memcalc.compile`
    (:func:`memcalc.estimate.step.simulate` chooses). ``fused_twin`` (with ``trace_allocs`` or ``events``, where
    :func:`memcalc.engine.twins.fused_twin_applies`) also records where each gradient becomes ready,
    for :func:`memcalc.engine.twins.fused_twin_of` (the trace) and :func:`memcalc.engine.twins.fused_events_of`
    (the events). ``events`` records the allocation events (and
    what :func:`memcalc.engine.twins.first_step_of` needs). ``observers``: the caller's own
    (:mod:`memcalc.engine.observers`, registered with :meth:`memcalc.engine.sim.Sim.watch` before the
    step starts), e.g. :class:`memcalc.engine.observers.StopAbove`, which stops the step by raising
    :class:`memcalc.engine.observers.PeakAbove` as soon as the running total passes a card (its peak
    is all a caller asks about, and only whether it passes).

    Python's cyclic garbage collector is paused while the step runs: the simulation makes tens of
    thousands of objects that live until it ends, which the collector would otherwise traverse
    again and again (about a tenth of the time); it runs again afterwards."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _simulate(exp, first_step, record_timeline, trace_allocs, events, strategy,
                         fused_twin and (trace_allocs or events) and not first_step and fused_twin_applies(exp),
                         observers)
    finally:
        if paused:
            gc.enable()


def _simulate(exp: ExperimentSpec, first_step: bool, record_timeline: bool, trace_allocs: bool, events: bool,
              strategy: Optional[Callable[[], LayerStrategy]], fused_twin: bool = False,
              observers: Sequence[object] = ()) -> SimResult:
    """The step, phase by phase: setup (weights, optimizer state), the micro-steps' forward and
    backward, the optimizer step (:class:`_Step`)."""
    check_supported(exp)
    exp = shard_group(exp)  # context parallelism: ZeRO over data-parallel x context-parallel ranks
    tr = exp.training
    if strategy is None:
        assert not tr.compile, "a compiled step needs the compiled layer strategy (memcalc.estimate.step)"
        strategy = lambda: layer_strategy(tr)  # noqa: E731
    sim = Sim(exp.profile.allocator_round_bytes)
    for observer in observers:
        sim.watch(observer)
    step = _Step(sim, exp, Timeline(sim) if record_timeline else None, AllocTrace() if trace_allocs else None,
                 AllocEvents() if events else None)
    strategies = [strategy() for _ in range(min(tr.grad_accum, 2))]
    try:
        step.setup(first_step)
        step.gradient_hooks(strategies[0].grads_leave_together, fused_twin)
        gather = step.gather()
        for k, layers in enumerate(strategies):
            step.micro_step(layers, gather, run_start=first_step and tr.first_seq is not None and k == 0)
        if not tr.fused_optimizer:
            step.optimizer_step()
        result = step.result()
    except PeakAbove:  # cut short: its graph let go as a whole step's is
        sim.abandon_graph()
        raise
    sim.release_graph()
    return result


def step_and_zero_grad(sim: Sim, opt: OptimizerSim | DeepSpeedZero2, model: Model) -> None:
    """The optimizer step (phase "optimizer step"), then ``optimizer.zero_grad(set_to_none=True)``:
    every parameter's gradient freed (torch/optim/optimizer.py ``zero_grad``)."""
    sim.mark("optimizer step", "optimizer step")
    opt.step_all()
    for p in model.order:
        if p.grad is not None:
            sim.unref(p.grad)
            p.grad = None


class _Step:
    """One simulated step's parts (:func:`_simulate` runs them in order) and what they leave for its
    result: the observers it registered (``timeline``, ``trace``, ``log``: the allocation events),
    the model, the optimizer, and the records the derived steps need (:mod:`memcalc.engine.twins`)."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, timeline: Optional[Timeline], trace: Optional[AllocTrace],
                 log: Optional[AllocEvents]) -> None:
        self.sim, self.exp, self.tr = sim, exp, exp.training
        self.timeline, self.trace, self.log = timeline, trace, log
        for observer in (timeline, trace, log):
            if observer is not None:
                sim.watch(observer)
        self.deferred: list[Param] = []  # gradients whose fused optimizer step waits (grads_leave_together)
        self.grads_ready: Optional[list[GradReady]] = None
        self.state_moves: Optional[tuple[frozenset[int], list[tuple[int, list[T]]]]] = None
        self.carried: list[T] = []  # a micro-step's graph-held tensors the loop's `loss` still keeps

    def setup(self, first_step: bool) -> None:
        """The weights and (outside a first step) the optimizer state; activation offloading."""
        sim, log = self.sim, self.log
        sim.mark("weights", "setup")
        self.model, self.opt = weights_and_state(sim, self.exp, create_state=not first_step)
        sim.mark("step start", "setup")
        self.step_start = len(log.events) if log is not None else 0
        opt = self.opt
        if log is not None and not first_step and isinstance(opt, OptimizerSim):
            # where a first step would create the state (twins.first_step_of)
            opt.created_at = []
            opt.events = log.events
            self.state_moves = (frozenset(t.uid for ts in opt.state.values() for t in ts if t.uid), opt.created_at)
        if self.tr.activation_offload:  # TRL's OffloadActivations packs by its own rules (engine/offload_trl.py)
            cls = TrlActivationOffload if self.exp.profile.framework == "trl" else ActivationOffload
            sim.set_offload(cls(prior=not first_step))

    def fused_step(self, s: Sim, p: Param) -> None:
        """A fused optimizer's post-accumulate-grad hook: the parameter steps, its gradient goes."""
        self.opt.step_param(p)
        s.unref(p.grad)
        p.grad = None

    def gradient_hooks(self, leave_together: bool, fused_twin: bool) -> None:
        """What runs as each gradient becomes ready: a fused optimizer's step (deferred when
        ``leave_together``: e.g. all gradients leave the compiled backward together, its outputs, and
        only then does AccumulateGrad, and with it each post-accumulate-grad hook, run), DeepSpeed's
        reduction, or with ``fused_twin`` a record of where a fused step would step and free it
        (:func:`memcalc.engine.twins.fused_twin_of`)."""
        sim, opt = self.sim, self.opt
        hook: Optional[Callable[[Sim, Param], None]] = None
        if self.tr.fused_optimizer:
            hook = (lambda s, p: self.deferred.append(p)) if leave_together else self.fused_step
        if not isinstance(opt, OptimizerSim):  # DeepSpeed's optimizer side (weights_and_state)
            hook = opt.grad_ready
        if fused_twin:
            assert hook is None and isinstance(opt, OptimizerSim) and (self.trace or self.log) is not None
            grads_ready: list[GradReady] = []
            rows = self.trace.rows if self.trace is not None else None
            log = self.log

            def ready(s: Sim, p: Param) -> None:
                g = p.grad
                assert g is not None
                at = len(rows) if rows is not None else -1
                temps = opt._temps_of(p)
                if log is None:
                    grads_ready.append(GradReady(at, s.total, s.label, s.phase, temps, g.nbytes))
                    return
                state = tuple((t.uid, t.nbytes) for t in opt.state.get(p.name, ()) if t.uid)
                grads_ready.append(GradReady(at, s.total, s.label, s.phase, temps, g.nbytes,
                                             len(log.events), len(log.phases), g.uid, state))

            hook = ready
            self.grads_ready = grads_ready
        if hook is not None:
            sim.set_grad_ready(hook)

    def gather(self) -> Optional[GatherHooks]:
        """What gathers the sharded weights (DeepSpeed ZeRO-3 its own way, engine.deepspeed; FSDP2,
        FSDP1 or the generic ZeRO-3 otherwise), its backward hook registered; None: nothing does."""
        opt = self.opt
        gather: Optional[GatherHooks] = None
        if not isinstance(opt, OptimizerSim):
            from memcalc.engine.deepspeed import DeepSpeedZero3

            gather = opt.gather if isinstance(opt, DeepSpeedZero3) else None
        if gather is None:
            gather = sharded_runtime(self.sim, self.exp, self.model)
        if gather is not None:
            self.sim.set_on_layer(lambda s, i: gather.backward_enter(i))
        return gather

    def micro_step(self, layers: LayerStrategy, gather: Optional[GatherHooks], run_start: bool = False) -> None:
        """One micro-step's forward and backward, the layers run by ``layers``. ``run_start``: the run's
        first micro-step, ``first_seq`` tokens, nothing of an earlier one alive (module docstring)."""
        sim = self.sim
        sim.new_graph()
        if gather is not None:
            gather.before_forward()
        exp = self.exp
        if run_start:
            assert self.tr.first_seq is not None
            exp = exp.model_copy(update={"training": self.tr.model_copy(update={"seq": self.tr.first_seq})})
        fwd = Forward(sim, exp, self.model, layers, gather)
        fwd.run_start = run_start
        loss = fwd.run()
        for t in self.carried:  # the previous micro-step's loss is rebound: its graph goes
            sim.unref(t)
        self.carried = []
        if gather is not None:
            gather.after_forward()
        sim.mark("backward start", "backward")
        if gather is not None:
            gather.backward_start()
        sim.backward(loss, 4, _label_of)
        layers.end_backward(fwd)
        if not isinstance(self.opt, OptimizerSim):
            self.opt.end_backward()
        if gather is not None:
            gather.end_backward()
        for p in self.deferred:
            self.fused_step(sim, p)
        self.deferred.clear()
        if gather is not None:
            gather.release()
        sim.unref(loss)
        # what a 4-bit linear kept on its ctx goes with the graph (memcalc.engine.retained): Hugging Face's
        # Trainer returns loss.detach() from training_step (the graph goes after backward); memcalc's own loop
        # (validate/step.py train_step) keeps `loss` until the next forward returns or the step ends
        self.carried = fwd.ops.retained.take()
        if self.exp.profile.framework != "plain":
            for t in self.carried:
                sim.unref(t)
            self.carried = []
        fwd.release_inputs()
        sim.mark("backward end", "backward")

    def optimizer_step(self) -> None:
        """The optimizer step, then ``zero_grad(set_to_none=True)``."""
        sim = self.sim
        step_and_zero_grad(sim, self.opt, self.model)
        for t in self.carried:  # the step ends (validate/step.py train_step: ``del loss``)
            sim.unref(t)
        self.carried = []
        sim.mark("step end", "optimizer step")

    def result(self) -> SimResult:
        sim, opt, log = self.sim, self.opt, self.log
        moves = None
        if self.state_moves is not None:
            setup_state, created_at = self.state_moves
            moves = (setup_state, [(i, [(t.uid, t.nbytes) for t in ts if t.uid]) for i, ts in created_at])
        off = sim.offload
        return SimResult(
            peak_bytes=sim.peak,
            peak_phase=sim.peak_phase,
            peak_label=sim.peak_label,
            peak_categories=sim.peak_categories(),
            peak_kinds=sim.peak_kinds_alive(),
            peak_by_kind=sim.peak_by_kind(),
            phases={k: v for k, v in sim.phase_peaks.items() if k != "setup"},
            timeline=self.timeline.points if self.timeline is not None else [],
            max_activation_bytes=sim.max_activations,
            alloc_trace=self.trace.rows if self.trace is not None else None,
            events=log.events if log is not None else None,
            step_start=self.step_start,
            host_offload=(off.max_host_bytes, off.max_pinned_bytes, off.max_offloaded_tensors)
            if off is not None else None,
            paged_state_bytes=opt.paged_bytes if OPTIMIZERS[self.tr.optimizer].paged else None,
            event_phases=log.phases if log is not None else None,
            state_moves=moves,
            prior_step=frozenset(off.prior_uids) if off is not None else frozenset(),
            grads_ready=self.grads_ready,
        )

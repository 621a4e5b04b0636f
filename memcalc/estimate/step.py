"""One training step on the simulator, with the layer strategy the training setup calls for.

The engine runs layers eagerly or checkpointed by itself; a ``torch.compile`` step needs the
compiled strategies of :mod:`memcalc.compile.backward`, which sit above the engine. This is
where the choice is made, once, for every caller (the estimate and plan's fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional

from memcalc.core.spec import ExperimentSpec
from memcalc.engine.checkpoint import layer_strategy
from memcalc.engine.observers import StopAbove
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine.result import SimResult
from memcalc.engine.timeline import simulate as simulate_with
from memcalc.engine.twins import first_step_of


def strategy_for(exp: ExperimentSpec, keep_pools: Optional[frozenset[int]] = None,
                 made: Optional[list] = None) -> Callable[[], LayerStrategy]:
    """A maker of the layer strategy for ``exp``'s step (one per micro-step): the partitioner's
    saved set under torch.compile without checkpointing; checkpointed regions recomputed whole
    inside a compiled graph; else eager or checkpointed layers.

    Compiled layers under peak-aware reuse (``KernelProfile.inductor_reuse``): with ``keep_pools``
    the layers whose MLP buffers stay for the next layer; without, probes that keep none and
    measure which would stay (:meth:`memcalc.compile.backward.CompiledLayers.kept_pools`), each
    appended to ``made``."""
    tr = exp.training
    if tr.compile:  # imported only here: an eager estimate needs no partitioner (nor numpy)
        from memcalc.compile.backward import CompiledCheckpointing, CompiledLayers
        from memcalc.compile.compiled import compiled_plan

        if tr.compile_partitions:
            plan = compiled_plan(exp)
            if exp.profile.inductor_reuse == "always" or not plan.mlp_pool_by_layer:
                return lambda: CompiledLayers(plan, tr.compile_scope)
            if keep_pools is not None:
                return lambda: CompiledLayers(plan, tr.compile_scope, keep_pools=keep_pools)

            def probe() -> LayerStrategy:
                layers = CompiledLayers(plan, tr.compile_scope, probe=True)
                if made is not None:
                    made.append(layers)
                return layers
            return probe
        return lambda: CompiledCheckpointing(tr)
    if exp.profile.framework == "unsloth" and tr.checkpoint == "full":  # use_gradient_checkpointing="unsloth"
        from memcalc.engine.unsloth_checkpoint import UnslothCheckpointing

        buffers: list = []  # the staging buffers are module globals: one pair for every micro-step
        return lambda: UnslothCheckpointing(tr, tr.seq, buffers)
    return lambda: layer_strategy(tr)


def simulate(exp: ExperimentSpec, first_step: bool = False, record_timeline: bool = True,
             trace_allocs: bool = False, events: bool = False, fused_twin: bool = False,
             observers: Sequence[object] = ()) -> SimResult:
    """:func:`memcalc.engine.timeline.simulate` with the strategy :func:`strategy_for` picks (pipeline
    parallelism: every rank's step, :func:`memcalc.engine.pipeline.simulate_pp`, the worst rank's result;
    there, under peak-aware reuse, compiled layers keep no MLP pool: the probe's step, whose peak is the
    step's). A compiled step under peak-aware reuse runs twice when its probe finds pools that stay."""
    if exp.training.pp > 1:
        from memcalc.engine.pipeline import simulate_pp

        return simulate_pp(exp, strategy_for(exp), first_step=first_step, record_timeline=record_timeline,
                           trace_allocs=trace_allocs, events=events, observers=observers)
    made: list = []
    res = simulate_with(exp, first_step=first_step, record_timeline=record_timeline, trace_allocs=trace_allocs,
                        events=events, strategy=strategy_for(exp, made=made), fused_twin=fused_twin,
                        observers=observers)
    keep = made[-1].kept_pools() if made else frozenset()
    if not keep:  # no probe, or a probe that kept no pool: its step is the step
        return res
    # peak-aware reuse keeps some pools: the step again with them (by their rule, the peak stays the probe's)
    return simulate_with(exp, first_step=first_step, record_timeline=record_timeline, trace_allocs=trace_allocs,
                         events=events, strategy=strategy_for(exp, keep_pools=keep), fused_twin=fused_twin,
                         observers=observers)


def steady_step(exp: ExperimentSpec, timeline: bool = True, stop_above: Optional[int] = None,
                fused_twin: bool = False) -> SimResult:
    """The steady step ``estimate()`` reads (:func:`memcalc.estimate.peak.estimate`), with its allocation events;
    ``stop_above``: :class:`memcalc.engine.observers.StopAbove`. ``fused_twin``: also the records
    :func:`memcalc.engine.twins.fused_events_of` derives the fused step's events from, where it applies."""
    observers = [StopAbove(stop_above)] if stop_above is not None else []
    return simulate(exp, first_step=False, record_timeline=timeline, events=True, fused_twin=fused_twin,
                    observers=observers)


def first_step(exp: ExperimentSpec, steady: SimResult, events: bool = True,
               stop_above: Optional[int] = None) -> SimResult:
    """The first step ``estimate()`` reads beside ``steady``: it follows from the steady step's events where it
    runs the same ones (not under DeepSpeed: :func:`memcalc.engine.twins.first_step_of`, nor with a first
    micro-batch of its own length, ``first_seq``); otherwise it is simulated too (``events``: with its
    allocation events)."""
    derived = first_step_of(steady) if exp.training.first_seq is None else None
    observers = [StopAbove(stop_above)] if stop_above is not None else []
    return derived or simulate(exp, first_step=True, record_timeline=False, events=events, observers=observers)

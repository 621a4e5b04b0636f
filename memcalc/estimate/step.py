"""One training step on the simulator, with the layer strategy the training setup calls for.

The engine runs layers eagerly or checkpointed by itself; a ``torch.compile`` step needs the
compiled strategies of :mod:`memcalc.compile.backward`, which sit above the engine. This is
where the choice is made, once, for every caller (the estimate and plan's fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

from memcalc.core.spec import ExperimentSpec
from memcalc.engine.checkpoint import layer_strategy
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine.result import SimResult
from memcalc.engine.timeline import simulate as simulate_with


def strategy_for(exp: ExperimentSpec) -> Callable[[], LayerStrategy]:
    """A maker of the layer strategy for ``exp``'s step (one per micro-step): the partitioner's
    saved set under torch.compile without checkpointing; checkpointed regions recomputed whole
    inside a compiled graph; else eager or checkpointed layers."""
    tr = exp.training
    if tr.compile:  # imported only here: an eager estimate needs no partitioner (nor numpy)
        from memcalc.compile.backward import CompiledCheckpointing, CompiledLayers
        from memcalc.compile.compiled import compiled_plan

        if tr.compile_partitions:
            plan = compiled_plan(exp)
            return lambda: CompiledLayers(plan, tr.compile_scope)
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
    parallelism: every rank's step, :func:`memcalc.engine.pipeline.simulate_pp`, the worst rank's result)."""
    if exp.training.pp > 1:
        from memcalc.engine.pipeline import simulate_pp

        return simulate_pp(exp, strategy_for(exp), first_step=first_step, record_timeline=record_timeline,
                           trace_allocs=trace_allocs, events=events, observers=observers)
    return simulate_with(exp, first_step=first_step, record_timeline=record_timeline, trace_allocs=trace_allocs,
                         events=events, strategy=strategy_for(exp), fused_twin=fused_twin, observers=observers)

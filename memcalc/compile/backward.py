"""The compiled step on the timeline: layer strategies for ``torch.compile``.

:class:`CompiledLayers` runs the layers as the partitioner decided
(:func:`memcalc.compile.compiled.compiled_plan`): each layer keeps its saved set through the
forward; its backward recomputes the rest and holds what later steps read; inductor's
buffer reuse keeps MLP buffers from one layer's backward to the next. With activation
checkpointing inside the compiled graph the tagged regions are recomputed whole, which is
the eager checkpoint's memory (:class:`CompiledCheckpointing`). In both, the graph ends at
the logits and all parameter gradients leave the compiled backward together.
"""

from __future__ import annotations

from typing import Callable, Optional

from memcalc.compile.compiled import CompiledPlan
from memcalc.engine.checkpoint import Checkpointing, checkpoint
from memcalc.engine.forward import Forward
from memcalc.engine.sim import Node, Sim, T
from memcalc.engine.strategy import LayerStrategy


def _chain(first: Optional[Callable[[Sim, Node], None]], then: Optional[Callable[[Sim, Node], None]]) -> Callable[[Sim, Node], None]:
    """Two node hooks, one after the other (either may be None)."""
    def both(s: Sim, nd: Node) -> None:
        for f in (first, then):
            if f is not None:
                f(s, nd)
    return both


class _CompiledGraph:
    """What any compiled step shares: the graph ends at the logits, whose gradient is an argument
    of ``CompiledFunction.backward`` (AOTAutograd's runtime wrapper) and so stays referenced
    until the whole compiled backward returns; parameter gradients are the compiled backward's
    outputs, so they all appear together, and only then does AccumulateGrad (and any
    post-accumulate-grad hook, a fused optimizer step) run."""

    grads_leave_together = True
    tangent: Optional[T] = None

    def logits(self, fwd: Forward, logits: T) -> None:
        if logits.producer is None:
            return

        def keep_tangent(s: Sim, nd: Node) -> None:
            if logits.grad_buffer is not None:
                self.tangent = s.ref(logits.grad_buffer)

        logits.producer.on_backward = _chain(keep_tangent, logits.producer.on_backward)

    def end_backward(self, fwd: Forward) -> None:
        if self.tangent is not None:
            fwd.sim.unref(self.tangent)
        self.tangent = None


class CompiledCheckpointing(_CompiledGraph, Checkpointing):
    """torch.compile over checkpointed layers: the regions recompute whole, as in eager mode."""


class CompiledLayers(_CompiledGraph, LayerStrategy):
    """torch.compile without checkpointing: the partitioner's saved set, per layer."""

    def __init__(self, plan: CompiledPlan) -> None:
        self.plan = plan
        self.nodes: list[Node] = []  # each layer's region node, in forward order
        # called with the nodes each MLP creates while a layer's backward recomputes it
        self.mlp_sink: Optional[Callable[[list[Node]], None]] = None
        self.mlp_pool: Optional[T] = None  # MLP buffers a compiled layer leaves for the next

    def run(self, fwd: Forward, x: T, lo: int, hi: int) -> T:
        """One layer inside the compiled graph.

        Forward: inductor frees every intermediate once used, so what stays is the saved set the
        partitioner chose: the layer's input (or, when the budget recomputes it, the residual
        stream the backward graph rebuilds before its first layer, one tensor per layer, which
        is the same memory once backward starts) plus the layer's other saved bytes. Backward:
        the saved set is consumed and the layer's values the backward reads are computed again
        (the saved set and the recomputation together are the layer's eager saved set; the
        simulator recomputes the eager layer, as a checkpointed region). Once the layer's MLP
        backward is done, its buffers (see memcalc.compile.compiled.mlp_pool) stay allocated
        for the next layer's MLP to reuse, so they overlap this layer's attention backward;
        layer 0 has no next layer and frees them."""
        i = lo
        saved_bytes = self.plan.extra_by_layer.get(i, 0)
        pool_bytes = self.plan.mlp_pool_by_layer.get(i, 0)
        sim = fwd.sim
        block = sim.alloc(saved_bytes, "activations", "saved activations (compiled)") if saved_bytes else None
        y = checkpoint(sim, fwd.ops, lambda: [x], lambda: fwd.layer(x, i), f"layer {i}", i)
        node = y.producer
        recompute = node.on_backward

        def release_pool(s: Sim, nd: Node) -> None:  # the MLP backward reuses the pool
            if self.mlp_pool is not None:
                s.unref(self.mlp_pool)
                self.mlp_pool = None

        def keep_pool(s: Sim, nd: Node) -> None:
            if i > 0 and pool_bytes:
                release_pool(s, nd)
                self.mlp_pool = s.alloc(pool_bytes, "temporaries", "compiled backward buffers kept for reuse")

        def hook_mlp(nodes: list[Node]) -> None:
            nodes[-1].on_backward = _chain(release_pool, nodes[-1].on_backward)  # first in backward
            nodes[0].after_backward = _chain(nodes[0].after_backward, keep_pool)  # last in backward

        def on_backward(s: Sim, nd: Node) -> None:
            if block is not None:
                nd.saved.remove(block)  # the backward graph consumes (frees) the saved set
                s.unref(block)
            self.mlp_sink = hook_mlp if pool_bytes else None
            try:
                recompute(s, nd)
            finally:
                self.mlp_sink = None

        node.on_backward = on_backward
        if block is not None:
            node.saved.append(block)
        self.nodes.append(node)
        return y

    def mlp(self, fwd: Forward, h: T, i: int, fn: Callable[[], T]) -> T:
        n0 = len(fwd.sim.nodes)
        y = fn()
        if self.mlp_sink is not None and len(fwd.sim.nodes) > n0:
            self.mlp_sink(fwd.sim.nodes[n0:])
        return y

    def after_layers(self, fwd: Forward) -> None:
        """What the compiled backward computes at one step and keeps for a later one (see
        memcalc.compile.compiled.chain_hold): allocated when step ``c`` starts (the head's step,
        the first, at the last layer's), freed when step ``last`` starts."""
        held = self.plan.held
        n = len(self.nodes)
        if not held or not n:
            return
        blocks: dict[int, list[T]] = {}

        for k, node in enumerate(self.nodes):
            inner = node.on_backward
            here = [(last, b) for (c, last), b in held.items() if c == k or (c >= n and k == n - 1)]

            def start(s: Sim, nd: Node, k: int = k, here=here, inner=inner) -> None:
                for t in blocks.pop(k, []):  # their last reader is this layer's backward
                    s.unref(t)
                for last, b in here:
                    if last != k:
                        blocks.setdefault(last, []).append(
                            s.alloc(b, "activations", "recomputed in backward (compiled)"))
                inner(s, nd)
                if k == 0:  # what the embedding's backward reads goes with the graph's end
                    for ts in blocks.values():
                        for t in ts:
                            s.unref(t)
                    blocks.clear()

            node.on_backward = start

    def end_backward(self, fwd: Forward) -> None:
        """End of the compiled backward: what it kept to the end goes."""
        if self.mlp_pool is not None:
            fwd.sim.unref(self.mlp_pool)
        self.mlp_pool = None
        super().end_backward(fwd)

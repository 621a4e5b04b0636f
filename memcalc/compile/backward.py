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
from memcalc.core.spec import TrainingSpec
from memcalc.engine.checkpoint import Checkpointing, checkpoint
from memcalc.engine.forward import Forward
from memcalc.engine.offload import ActivationOffload, rope_region_inputs
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
    """What any compiled step shares. With ``compile_scope model`` the graph ends at the loss where the
    forward computes it (memcalc.engine.blocks.compiled_loss.loss_in_model_graph), else at the logits,
    whose gradient is then an argument of ``CompiledFunction.backward`` (AOTAutograd's runtime wrapper)
    and so stays referenced until the whole compiled backward returns; parameter gradients are the
    compiled backward's outputs, so they all appear together, and only then does AccumulateGrad
    (and any post-accumulate-grad hook, a fused optimizer step) run. With ``compile_scope layer``
    (:mod:`memcalc.compile.layer_scope`) the head runs eagerly, so neither holds: the logits'
    gradient and the parameter gradients go as in eager mode (a layer's gradients leave its own
    compiled backward together, which an unfused step does not see)."""

    grads_leave_together = True
    whole = True  # compile_scope model: one graph, embedding to logits
    tangent: Optional[T] = None

    def _scope(self, scope: str) -> None:
        self.whole = scope != "layer"
        self.grads_leave_together = self.whole

    def logits(self, fwd: Forward, logits: T) -> None:
        from memcalc.engine.blocks.compiled_loss import loss_in_model_graph

        # a loss inside the graph (loss_in_model_graph): the graph's output is the scalar loss, and the
        # logits' gradient is one of the compiled backward's own buffers, freed after its last use
        # (inductor's wrapper frees each buffer after its last reader: FreeIfNotReusedLine in
        # torch/_inductor/codegen/wrapper.py)
        if logits.producer is None or not self.whole or loss_in_model_graph(fwd):
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
    """torch.compile over checkpointed layers: the regions recompute whole, as in eager mode.
    With ``compile_scope layer`` the checkpoint wraps the compiled layer (torchtune applies
    ``set_activation_checkpointing`` before ``compile_model`` compiles the wrapped
    ``TransformerSelfAttentionLayer``): the region's input is what its forward saves, packed by an
    outer saved-tensor hook (activation offloading) as in eager mode."""

    def __init__(self, tr: TrainingSpec) -> None:
        super().__init__(tr)
        self._scope(tr.compile_scope)


class CompiledLayers(_CompiledGraph, LayerStrategy):
    """torch.compile without checkpointing: the partitioner's saved set, per layer."""

    def __init__(self, plan: CompiledPlan, scope: str = "model", keep_pools: Optional[frozenset[int]] = None,
                 probe: bool = False) -> None:
        self.plan = plan
        self._scope(scope)
        self.nodes: list[Node] = []  # each layer's region node, in forward order
        # called with the nodes each MLP creates while a layer's backward recomputes it
        self.mlp_sink: Optional[Callable[[list[Node]], None]] = None
        self.mlp_pool: Optional[T] = None  # MLP buffers a compiled layer leaves for the next
        # the layers whose pool inductor keeps (None: every one, KernelProfile.inductor_reuse always);
        # probe: keep none, and measure where each would have been kept (see kept_pools)
        self.keep_pools = keep_pools
        self.probe = probe
        self.pool_spans: dict[int, int] = {}  # probe: layer -> the highest total while its pool would be kept
        self.backward_peak = 0  # probe: the highest total of the backward phase, at its end
        self._span: Optional[list[int]] = None  # probe: [layer, highest total so far] of the open span
        self._watching = False

    def on_row(self, row: tuple) -> None:
        """Observer hook (memcalc.engine.observers, registered by the probe): the running total after
        each allocation, while a pool's span is open."""
        span = self._span
        if span is not None and row[0] > span[1]:
            span[1] = row[0]

    def _open_span(self, s: Sim, i: int) -> None:
        if not self._watching:
            s.watch(self)
            self._watching = True
        self._span = [i, s.total]

    def _close_span(self) -> None:
        if self._span is not None:
            self.pool_spans[self._span[0]] = self._span[1]
        self._span = None

    def kept_pools(self) -> frozenset[int]:
        """After a probe's backward: the layers whose MLP buffers inductor keeps for the next layer
        under peak-aware reuse (KernelProfile.inductor_reuse; torch/_inductor/codegen/wrapper.py
        AllocateLine.should_reuse_buffer, PyTorch >= 2.9): a freed buffer is reused by a later
        allocation of its size only when its size plus the highest memory between its free and that
        allocation (EfficientPeakEstimate.peak_between) stays within the graph's peak
        (overall_peak_memory), else it is freed and the later one allocated anew. Measured in the probe,
        which keeps no pool: each span's highest total plus the pool against the backward's highest
        total (the graph's own bytes differ from the step's by what stays constant meanwhile: weights,
        optimizer state). Pools never overlap (each is taken before the next is left), so each is
        decided alone."""
        pools = self.plan.mlp_pool_by_layer
        return frozenset(i for i, m in self.pool_spans.items() if m + pools.get(i, 0) <= self.backward_peak)

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
        off = sim.offload if sim.offload is not None and sim.offload.active else None
        if off is not None and not self.whole:  # each saved tensor packed apart (_pack_layer)
            order = self.plan.saved_order_by_layer.get(i, ())
            pieces = [sim.alloc(n, "activations", "saved activations (compiled)") for n, param in order if not param]
            block = None
        else:
            block = sim.alloc(saved_bytes, "activations", "saved activations (compiled)") if saved_bytes else None
        # the layer graph's inputs besides the parameters: the layer input (a layer graph whose input needs no
        # gradient does not save it) and, under offloading, the RoPE tables (graph inputs it saves, so packed
        # too; no device bytes: they exist anyway)
        keeps_x = self.plan.input_saved_by_layer is None or self.plan.input_saved_by_layer.get(i, True)
        first = [x] if keeps_x else []
        ins = (lambda: first + rope_region_inputs(fwd)) if off is not None and not self.whole else (lambda: first)
        y = checkpoint(sim, fwd.ops, ins, lambda: fwd.layer(x, i), f"layer {i}", i, first_unpack=False)
        node = y.producer
        if off is not None and not self.whole:
            assert node is not None
            return self._pack_layer(sim, off, node, order, pieces, y)
        recompute = node.on_backward

        def release_pool(s: Sim, nd: Node) -> None:  # the MLP backward reuses the pool
            self._close_span()
            if self.mlp_pool is not None:
                s.unref(self.mlp_pool)
                self.mlp_pool = None

        def keep_pool(s: Sim, nd: Node) -> None:
            if i > 0 and pool_bytes:
                release_pool(s, nd)
                if self.probe:
                    self._open_span(s, i)
                elif self.keep_pools is None or i in self.keep_pools:
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

    def _pack_layer(self, sim: Sim, off: ActivationOffload, node: Node, order: tuple[tuple[int, bool], ...],
                    pieces: list[T], y: T) -> T:
        """A compiled layer's saved tensors under activation offloading (``compile_scope layer``).

        When the layer's ``CompiledFunction`` returns, ``ctx.save_for_backward`` passes its saved
        tensors through the offload hook (torchtune ``OffloadActivations.pack_tensor``): the layer
        input and the RoPE tables (packed as the region inputs here), the parameters (``nn.Parameter`` objects: an id
        each, kept as they are) and the saved activations, each offloaded from ``min_offload_size``
        bytes (memcalc.engine.offload). At the layer's backward ``ctx.saved_tensors`` unpacks them
        all in one autograd node, whose post-hook alone frees the previous node's reloads. Here the
        backward recomputes the eager layer (the saved set and the recomputation together are the
        layer's eager saved set), so the reloaded activations are represented by that recompute
        while it runs and stay allocated after it, in the backward stash, until the next reloading
        node's post-hook."""
        keep: list[T] = []
        mine: list[T] = []  # offloaded: only the forward stash references them now
        it = iter(pieces)
        for _, param in order:
            if param:
                off.skip()
                continue
            t = next(it)
            kept, out = off.pack(sim, [t])
            keep += kept
            if out:
                node.offloaded = [*node.offloaded, *out]
                mine.append(t)
                sim.unref(t)
        node.saved.extend(keep)
        recompute = node.on_backward
        assert recompute is not None

        def on_backward(s: Sim, nd: Node) -> None:
            for t in keep:
                if t in nd.saved:
                    nd.saved.remove(t)
                    s.unref(t)
            back = []  # reloaded bytes, kept in the backward stash after the recompute
            for t in mine:
                if not t.alive:
                    continue
                if any(q is t for q in off.bwd_cur):
                    off.bwd_cur = [q for q in off.bwd_cur if q is not t]
                    back.append(t.nbytes)
                else:  # still in the forward stash: used as it is
                    off.fwd_stash = [(k, q) for k, q in off.fwd_stash if q is not t]
                s.unref(t)
            due, off.hook_due = off.hook_due, False  # one autograd node: its post-hook runs after it
            try:
                recompute(s, nd)
            finally:
                off.hook_due = due
            off.bwd_cur += [s.alloc(n, "activations", "reloaded activations") for n in back]

        node.on_backward = on_backward
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
        self._close_span()
        if self.probe:
            self.backward_peak = fwd.sim.phase_peaks.get("backward", 0)
        if self.mlp_pool is not None:
            fwd.sim.unref(self.mlp_pool)
        self.mlp_pool = None
        super().end_backward(fwd)

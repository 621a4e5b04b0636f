"""Activation checkpointing: ``torch.utils.checkpoint(use_reentrant=False)`` regions.

A region's first forward keeps nothing but its inputs; at the region's first backward node
the whole region is recomputed (all its saved tensors alive at once) and then
back-propagated (torch/utils/checkpoint.py, ``_checkpoint_without_reentrant_generator``).
Non-reentrant checkpointing stops recomputing once the last tensor the region saves has been
recomputed (early stop, ``_StopRecomputationError``), so allocations after that point cost
nothing. Modes: ``full`` (every layer), ``every-k`` (every K-th layer), ``sqrt`` (segments of
about sqrt(n) layers, ``checkpoint_sequential``), ``selective`` (the attention core only).
"""

from __future__ import annotations

from typing import Callable, Iterator

from memcalc.core.spec import TrainingSpec, sqrt_segments
from memcalc.engine.ops import Ops
from memcalc.engine.sim import Node, Sim, T
from memcalc.engine.strategy import LayerStrategy, Walk


def checkpoint(sim: Sim, ops: Ops, inputs: Callable[[], list[T]], fn: Callable[[], T], label: str,
               layer: int) -> T:
    """Non-reentrant checkpoint of ``fn``: forward keeps only the inputs; backward recomputes.
    ``layer``: the decoder layer the region starts at (the checkpoint node carries it)."""
    ins = inputs()
    sim.grad_enabled = False
    out = fn()
    sim.grad_enabled = True
    out.requires_grad = True

    def recompute(s: Sim, node: Node) -> None:
        saved_nodes, saved_phase, saved_layer = s.nodes, s.phase, s.layer
        s.phase = "backward"
        s.layer = layer  # the recomputed ops belong to the region's layer (a sub-layer region sets none itself)
        s.label = f"bwd {label} (recompute)"
        # Non-reentrant checkpoint stops recomputing once the last tensor the region saves
        # is recomputed (early stop): a dry run without memory finds that point.
        s.nodes = []
        c0 = s.alloc_count
        s.ghost_after = c0
        s.last_save_count = c0
        dry = fn()
        ops.exit_autocast()
        for n in s.nodes:
            for p in n.params:
                p.uses -= 1
            s._release_node(n)
        s.unref(dry)
        stop = s.last_save_count - c0
        s.nodes = []
        s.ghost_after = s.alloc_count + stop
        out2 = fn()
        ops.exit_autocast()
        s.ghost_after = None
        sub = s.nodes
        s.nodes = saved_nodes
        s.phase = saved_phase
        s.layer = saved_layer
        # the recomputed output is discarded; its gradient is the region output's gradient
        out2.grad_buffer, node.outputs[0].grad_buffer = node.outputs[0].grad_buffer, None
        s.unref(out2)
        # back-propagate the region now; the checkpoint node itself then has no work left
        s.run_nodes(sub, lambda n: f"bwd {label}")
        out2.grad_buffer = None
        node.outputs = []
        node.inputs = []

    node = Node(f"checkpoint {label}", [], [t for t in ins if t.requires_grad], [], [out], on_backward=recompute)
    node.fwd_label = f"fwd {label}"
    node.layer, node.role = layer, "checkpoint"
    for t in ins:
        sim.ref(t)
    node.saved = list(ins)
    out.producer = node
    sim.nodes.append(node)
    return out


class Checkpointing(LayerStrategy):
    """Layers (or segments, or attention cores) run as checkpointed regions, per ``--checkpoint``."""

    def __init__(self, tr: TrainingSpec) -> None:
        self.mode = tr.checkpoint
        self.every = tr.checkpoint_every

    def regions(self, n_layers: int) -> Iterator[tuple[int, int]]:
        if self.mode != "sqrt":
            yield from super().regions(n_layers)
            return
        seg = sqrt_segments(n_layers)
        for lo in range(0, n_layers, seg):
            yield lo, min(n_layers, lo + seg)

    def run(self, fwd: Walk, x: T, lo: int, hi: int) -> T:
        if self.mode == "sqrt":
            return checkpoint(fwd.sim, fwd.ops, lambda: [x], lambda: super(Checkpointing, self).run(fwd, x, lo, hi),
                              f"layers {lo}-{hi - 1}", lo)
        if self.mode == "full" or (self.mode == "every-k" and lo % self.every == 0):
            return checkpoint(fwd.sim, fwd.ops, lambda: [x], lambda: fwd.layer(x, lo), f"layer {lo}", lo)
        return fwd.layer(x, lo)

    def core_attention(self, fwd: Walk, q: T, k: T, v: T, i: int, fn: Callable[[], T]) -> T:
        if self.mode != "selective":
            return fn()
        return checkpoint(fwd.sim, fwd.ops, lambda: [q, k, v], fn, f"layer {i} attention", i)


def layer_strategy(tr: TrainingSpec) -> LayerStrategy:
    """The eager step's strategy: checkpointing when asked for, else eager."""
    return Checkpointing(tr) if tr.checkpoint != "none" else LayerStrategy()

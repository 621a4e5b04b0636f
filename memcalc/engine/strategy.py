"""How the decoder walk runs its layers: the explicit hooks a technique plugs into.

:class:`memcalc.engine.forward.Forward` walks the decoder and asks its strategy how to run
each region of layers and the few places a technique changes (the attention core, the MLP,
the end of the layers, the logits, the end of backward). The eager strategy here runs them
as written. Others: activation checkpointing (:mod:`memcalc.engine.checkpoint`) and the
compiled graph (:mod:`memcalc.compile.backward`). A strategy object serves one forward pass
and its backward; the timeline makes a fresh one per micro-step.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

from memcalc.engine.ops import Ops
from memcalc.engine.sim import Sim, T


class Walk(Protocol):
    """What a strategy uses of the decoder walk (:class:`memcalc.engine.forward.Forward`)."""

    sim: Sim
    ops: Ops

    def layer(self, x: T, i: int) -> T:
        """One decoder layer on a reference to ``x``; returns a new output reference."""


class LayerStrategy:
    """Eager execution: every layer runs as written; autograd keeps what each kernel saves."""

    #: all parameter gradients appear together at the end of backward (a compiled backward
    #: returns them as outputs), so post-accumulate-grad hooks run only then
    grads_leave_together = False

    def regions(self, n_layers: int) -> Iterator[tuple[int, int]]:
        """The layers in forward order, as ``(first, end)`` regions run in one piece."""
        for i in range(n_layers):
            yield i, i + 1

    def run(self, fwd: Walk, x: T, lo: int, hi: int) -> T:
        """Run the region's layers on ``x`` (a reference the caller drops); returns a new reference."""
        h = fwd.sim.ref(x)
        for j in range(lo, hi):
            h2 = fwd.layer(h, j)
            fwd.ops.drop(h)
            h = h2
        return h

    def core_attention(self, fwd: Walk, q: T, k: T, v: T, i: int, fn: Callable[[], T]) -> T:
        """The attention core of layer ``i`` (RoPE, GQA expansion, SDPA) given q, k, v."""
        return fn()

    def mlp(self, fwd: Walk, h: T, i: int, fn: Callable[[], T]) -> T:
        """The feed-forward block of layer ``i``."""
        return fn()

    def after_layers(self, fwd: Walk) -> None:
        """Once the last layer's forward has run."""

    def logits(self, fwd: Walk, logits: T) -> None:
        """The LM head's output, before the loss."""

    def end_backward(self, fwd: Walk) -> None:
        """Once backward has reached the embedding."""

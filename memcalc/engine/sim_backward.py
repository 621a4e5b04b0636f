"""The simulator's autograd engine: backward over the registered nodes (a base class of
:class:`memcalc.engine.sim.Sim`, which allocates, references and registers; this module runs them).

Backward walks the nodes in reverse creation order (a valid topological order for a sequential
decoder, and the order PyTorch's engine picks by sequence number): per node the backward workspace,
the input gradients and the parameter gradients are allocated, then its incoming gradients and saved
tensors are released, then each parameter's AccumulateGrad runs (highest priority in the engine's
ready queue), and with it any post-accumulate-grad hook (a fused optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from memcalc.engine.records import Node, Param, T


class SimBackward:
    """Backward over a :class:`memcalc.engine.sim.Sim`'s nodes (see the module docstring)."""

    # (set by Sim.__init__)
    nodes: list[Node]
    label: str
    trace_label: Optional[str]
    bwd_layer: Optional[int]
    on_layer: Optional[Callable[..., None]]
    grad_ready: Optional[Callable[..., None]]
    grads_ready: int
    offload: Any
    _on_mark: list[Callable[[], None]]

    if TYPE_CHECKING:  # Sim's allocator
        def alloc(self, nbytes: int, kind: str, category: str, requires_grad: bool = False, name: str = "",
                  numel: int = 0, itemsize_bits: int = 32) -> T: ...

        def ref(self, t: T) -> T: ...

        def unref(self, t: Optional[T]) -> None: ...

    def backward(self, loss: T, loss_grad_bytes: int, label_of: Callable[[Node], str]) -> None:
        """Run backward from ``loss`` over all registered nodes (reverse creation order)."""
        loss.grad_buffer = self.alloc(loss_grad_bytes, "temporaries", "activation gradients")
        self.bwd_layer = None
        self.run_nodes(self.nodes, label_of)
        if self.offload is not None:
            self.offload.end_backward(self)

    def run_nodes(self, nodes: list[Node], label_of: Callable[[Node], str]) -> None:
        """Backward over ``nodes`` in reverse order; nodes no gradient reaches just release."""
        for node in reversed(nodes):
            if node.done:
                continue
            for o in node.outputs:  # does a gradient reach the node?
                if o.grad_buffer is not None:
                    break
            else:
                self._release_node(node)
                continue
            lab = label_of(node)
            if node.layer != self.bwd_layer:
                if self.on_layer is not None:
                    self.trace_label = lab  # the layer's own allocations (a ZeRO-3 regather), in the trace
                    self.on_layer(self, node.layer)
                    self.trace_label = None
                self.bwd_layer = node.layer
            if lab != self.label:
                self.label = lab
                for mark_hook in self._on_mark:
                    mark_hook()
            if node.offloaded:  # saved tensors come back from host memory first (before a recompute)
                self.offload.unpack(self, node)
            if node.on_backward is not None:
                node.on_backward(self, node)
            self._run_node(node)
            if node.after_backward is not None:
                node.after_backward(self, node)

    def _release_node(self, node: Node) -> None:
        """The node is done: its saved tensors are released; its outputs forget it (their
        ``producer`` is read only in forward), which leaves no reference cycle behind."""
        for t in node.saved:
            self.unref(t)
        node.saved = []
        node.done = True
        for o in node.outputs:
            o.producer = None

    def _input_grads(self, node: Node) -> list[T]:
        """The gradients the node's backward sends its inputs (one per input, in order).

        ``passes_grad`` (AddBackward0): each input of the output's size and element width gets the
        incoming gradient itself, a new reference (torch 2.13 tools/autograd/derivatives.yaml
        ``add.Tensor``: ``self: handle_r_to_c(self.scalar_type(), grad)``, ``other:
        handle_r_to_c(other.scalar_type(), maybe_multiply(grad, alpha.conj()))``, and
        ``maybe_multiply`` returns ``grad`` itself for alpha 1: torch/csrc/autograd/FunctionsManual.cpp);
        an input of another width or a broadcast one gets a new tensor (torch/csrc/autograd/engine.cpp
        ``validate_outputs``: ``grad.to(metadata.dtype())``, ``at::sum_to`` to the input's shape)."""
        alloc = self.alloc
        sizes = node.grad_input_bytes
        inputs = node.inputs
        g0 = node.outputs[0].grad_buffer if node.passes_grad and len(node.outputs) == 1 else None
        if g0 is not None:
            o0 = node.outputs[0]
            return [self.ref(g0) if t.numel == o0.numel and t.itemsize_bits == o0.itemsize_bits
                    else alloc(b, "temporaries", "activation gradients")
                    for t, b in zip(inputs, sizes or [t.nbytes for t in inputs], strict=True)]
        if sizes:
            return [alloc(b, "temporaries", "activation gradients") for b in sizes]
        if len(inputs) == 1:
            return [alloc(inputs[0].nbytes, "temporaries", "activation gradients")]
        return [alloc(t.nbytes, "temporaries", "activation gradients") for t in inputs]

    def _run_node(self, node: Node) -> None:
        """One node's backward: workspace, input gradients and weight gradients are allocated;
        then the node's incoming gradients and saved tensors are released; then the
        AccumulateGrad of each parameter runs (highest priority in the engine's ready queue),
        and with it any post-accumulate-grad hook (a fused optimizer step)."""
        alloc, unref = self.alloc, self.unref
        # (one element is the common case: made without a comprehension's frame)
        sizes = node.temps
        temps: list[T]
        if not sizes:
            temps = []
        elif len(sizes) == 1:
            temps = [alloc(sizes[0], "temporaries", "backward workspace")]
        else:
            temps = [alloc(b, "temporaries", "backward workspace") for b in sizes]
        new_grads = self._input_grads(node)
        params = node.params
        pgrads: list[T]
        if not params:
            pgrads = []
        elif len(params) == 1 and params[0].uses == 1 and params[0].pending is None:
            pgrads = [alloc(params[0].grad_bytes, "gradients", "gradients")]
        else:
            pgrads = [alloc(p.grad_bytes, *_grad_kind(p)) for p in params]
        for t in temps:
            unref(t)
        for o in node.outputs:
            o.producer = None  # (as _release_node does; nothing reads it after forward)
            g = o.grad_buffer
            if g is not None:
                unref(g)
                o.grad_buffer = None
        for t in node.saved:  # self._release_node(node), inline
            if t.refs > 1:  # unref(t) frees nothing
                assert t.alive, f"double free of {t.name}"
                t.refs -= 1
            else:
                unref(t)
        node.saved = []
        node.done = True
        if self.offload is not None and self.offload.hook_due:  # the unpacking node's post-hook
            self.offload.after_node(self)
        for inp, g in zip(node.inputs, new_grads, strict=True):
            old = inp.grad_buffer
            if old is None:
                inp.grad_buffer = g
            elif old.refs > 1:
                # torch 2.13 torch/csrc/autograd/input_buffer.cpp ``accumulate``: ``old_var.add_(var)`` only when
                # ``can_accumulate_inplace(old_var)`` (its last reference), else ``old_var + var``, a new tensor
                # (a pipeline stage's gradient receive buffer, which the stage keeps: engine.pipeline)
                inp.grad_buffer = alloc(old.nbytes, "temporaries", "activation gradients")
                unref(old)
                unref(g)
            else:  # InputBuffer accumulates in place
                unref(g)
        for p, g in zip(node.params, pgrads, strict=True):
            self._accumulate(p, g)

    def _accumulate(self, p: Param, g: T) -> None:
        """AccumulateGrad of ``p`` with the gradient ``g`` one use of it made."""
        p.uses -= 1
        if p.pending is not None:
            # a parameter used twice (tied embeddings): its contributions meet in the
            # AccumulateGrad node's input buffer; the linear's weight gradient is a transposed
            # view, so the buffer adds out of place
            total = self.alloc(p.grad_bytes, "gradients", "gradients")
            self.unref(p.pending)
            self.unref(g)
            g, p.pending = total, None
        if p.uses > 0:  # AccumulateGrad waits for the other uses
            p.pending = g
            return
        if p.deferred_reduce:  # FSDP2: the unit's post-backward reduces it (engine.fsdp)
            if p.unsharded_grad is None:
                p.unsharded_grad = g
            else:
                self.unref(g)
            return
        if p.grad_keep_bytes is not None:  # reduce-scatter: keep only this rank's shard
            shard = self.alloc(p.grad_keep_bytes, "gradients", "gradients")
            self.unref(g)
            g = shard
        if p.grad is None:
            p.grad = g
        else:  # accumulate into the existing .grad in place
            self.unref(g)
        self.grads_ready += 1
        if self.grad_ready is not None:
            self.grad_ready(self, p)


def _grad_kind(p: Param) -> tuple[str, str]:
    """(kind, category) of the gradient one use of ``p`` makes: the parameter's gradient, or, for a
    parameter used more than once (tied embeddings), one part of it: the parts meet in the
    AccumulateGrad node's input buffer (torch/csrc/autograd/input_buffer.cpp ``InputBuffer::add``) and
    only their sum becomes ``.grad`` (:meth:`SimBackward._accumulate`), so each part lives only within
    backward."""
    if p.uses > 1 or p.pending is not None:
        return "temporaries", "tied gradient parts"
    return "gradients", "gradients"

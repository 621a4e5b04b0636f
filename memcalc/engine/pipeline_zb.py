"""Zero bubble's split backward (``--pp-schedule zero-bubble``, torch's ``ScheduleInterleavedZeroBubble``): a
micro-batch's backward runs as ``I`` (the gradient of the stage's input only) and, later, ``W`` (the weights'
gradients), and what ``W`` needs stays alive between them.

From torch 2.13 torch/distributed/pipelining/_backward.py and stage.py:

- ``I`` (``backward_one_chunk(full_backward=False)`` -> ``stage_backward_input``): ``torch.autograd.grad`` from
  the stage's output (or loss) to its input only, ``retain_graph=True``: no weight gradient is made and no saved
  tensor is freed. A pre-hook on each *intermediate* (the node where a weight's path meets the input's:
  ``get_param_groups``; a linear's ``mm``, a norm's ``mul``) keeps the gradient flowing into it, in
  ``param_group["grads"]``, until ``W``. The input gradient is set as the received buffer's ``.grad``
  (``inp.grad = dinput``), where it stays until the next step's ``clear_runtime_states`` (after this step's
  optimizer step); the stage's outputs are ``detach_()``-ed, so the nodes between the output and the last
  intermediate (the last stage's loss) die with their saved tensors, and a non-last stage's output stays in
  ``backward_state`` until ``W``. The global first stage runs no ``I`` at all (``if not self.is_first``).
- ``W`` (``backward_weight_one_chunk`` -> ``stage_backward_weight``): per parameter group
  ``torch.autograd.grad`` from the kept gradients to the weights, ``retain_graph=False``: each intermediate runs
  again for its weight gradient (``weight.grad = dw``, or ``+=``), then its saved tensors and its kept gradients
  go; the loop's ``dweights`` keeps the group's new gradients until the next group's ``autograd.grad`` returns;
  when ``W`` returns the micro-batch's graph (``backward_state``'s reference) dies
  with every tensor it saved. On the first stage ``W`` is the full backward (``stage_backward``).

In the simulator a node with parameters is an intermediate (its incoming gradient is the one torch keeps); a
node after the graph's last such node is one the loss's ``detach_()`` frees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from memcalc.engine.records import Node
from memcalc.engine.sim import Sim, T


class InputBackward:
    """One micro-batch's ``I`` over ``nodes`` (the stage's graph), then its ``W`` (:meth:`weights`)."""

    def __init__(self, sim: Sim, nodes: list[Node]) -> None:
        self.sim, self.nodes = sim, nodes
        self.kept: list[tuple[Node, list[T]]] = []  # (intermediate, the gradients its pre-hook kept)

    def run(self, label_of: Callable[[Node], str]) -> None:
        """``I``: the input's gradient through every node a gradient reaches; saved tensors stay (retain_graph),
        except those of the nodes after the last intermediate (freed by the output's ``detach_()``)."""
        sim = self.sim
        last_param = max((k for k, n in enumerate(self.nodes) if n.params), default=-1)
        for node in reversed(self.nodes):
            if node.done or all(o.grad_buffer is None for o in node.outputs):
                continue
            lab = label_of(node)
            if lab != sim.label:
                sim.mark(lab)
            self._input_only(node)
        for node in self.nodes[last_param + 1:]:  # when autograd.grad returns, the outputs are detach_()-ed
            if not node.done:
                sim._release_node(node)

    def _input_only(self, node: Node) -> None:
        """The node's backward for its inputs' gradients only (``task_should_compute_output`` false for the
        weights): its workspace, its inputs' gradients; the incoming gradients kept (an intermediate) or freed."""
        sim = self.sim
        temps = [sim.alloc(b, "temporaries", "backward workspace") for b in node.temps]
        new_grads = sim._input_grads(node)
        for t in temps:
            sim.unref(t)
        incoming = []
        for o in node.outputs:
            if o.grad_buffer is not None:
                incoming.append(o.grad_buffer)
                o.grad_buffer = None
        if node.params:
            self.kept.append((node, incoming))
        else:
            for g in incoming:
                sim.unref(g)
        for inp, g in zip(node.inputs, new_grads, strict=True):
            old = inp.grad_buffer
            if old is None:
                inp.grad_buffer = g
            elif old.refs > 1:  # InputBuffer::accumulate: in place only into a gradient nothing else holds
                inp.grad_buffer = sim.alloc(old.nbytes, "temporaries", "activation gradients")  # (the received
                sim.unref(old)  # gradient buffer, which the stage keeps: out of place, add.Tensor)
                sim.unref(g)
            else:  # in place
                sim.unref(g)

    def weights(self, order: dict[str, int], label: Optional[str] = None) -> None:
        """``W``: each intermediate's weight gradients (accumulated as AccumulateGrad does), then its saved tensors
        and kept gradients, in the order of the stage's parameters (``order``: a parameter's place in
        ``module.parameters()``, which ``get_param_groups`` walks; a layer's norms come after its linears); then
        the rest of the graph's saved tensors."""
        sim = self.sim
        lingering: list[T] = []  # the last group's ``dweights``, alive until the next autograd.grad returns
        groups = sorted(self.kept, key=lambda ng: min(order.get(p.name, 0) for p in ng[0].params))
        for node, grads in groups:
            if label is not None and label != sim.label:
                sim.mark(label)
            made = [sim.alloc(p.grad_bytes, "gradients", "gradients") for p in node.params]
            for t in lingering:
                sim.unref(t)
            lingering = [sim.ref(g) for g in made]
            for p, g in zip(node.params, made, strict=True):
                sim._accumulate(p, g)  # ``weight.grad = dw`` or ``weight.grad += dw``
            sim._release_node(node)
            for g in grads:
                sim.unref(g)
        for t in lingering:
            sim.unref(t)
        self.kept = []
        for node in self.nodes:
            if not node.done:
                sim._release_node(node)


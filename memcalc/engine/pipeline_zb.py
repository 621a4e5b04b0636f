"""Zero bubble's split backward (``--pp-schedule zero-bubble``, torch's ``ScheduleInterleavedZeroBubble``): a
micro-batch's backward runs as ``I`` (the gradient of the stage's input only) and, later, ``W`` (the weights'
gradients), and what ``W`` needs stays alive between them.

From torch 2.13 torch/distributed/pipelining/_backward.py and stage.py:

- ``I`` (``backward_one_chunk(full_backward=False)`` -> ``stage_backward_input``): ``torch.autograd.grad`` from
  the stage's output (or loss) to its input only, ``retain_graph=True`` (l. 250): no weight gradient is made and
  no saved tensor is freed. A pre-hook on each *intermediate* (the node where a weight's path meets the input's:
  ``get_param_groups``; a linear's ``mm``, a norm's ``mul``; l. 242) keeps the gradient flowing into it, in
  ``param_group["grads"]``, until ``W``. The input gradient is set as the received buffer's ``.grad``
  (``inp.grad = dinput``), where it stays until the next step's ``clear_runtime_states`` (after this step's
  optimizer step); the stage's outputs are ``detach_()``-ed (l. 265), so every node no intermediate leads back to (the
  last stage's loss, the last MoE layer's combine of the routed experts' outputs) dies with its saved tensors
  (:class:`Ownership`), and a non-last stage's output stays in ``backward_state`` until ``W``. The global first
  stage runs no ``I`` at all (``if not self.is_first``).
- ``W`` (``backward_weight_one_chunk`` -> ``stage_backward_weight``): per parameter group
  ``torch.autograd.grad`` from the kept gradients to the weights, ``retain_graph=False``: each intermediate runs
  again for its weight gradient (``weight.grad = dw``, or ``+=``), then its saved tensors and its kept gradients
  go; the loop's ``dweights`` keeps the group's new gradients until the next group's ``autograd.grad`` returns;
  each group's intermediates are dropped (``del param_group["intermediates"]``, l. 321), so the nodes that led only to
  them die as its ``autograd.grad`` returns (:class:`Ownership`); when ``W`` returns the rest of the micro-batch's
  graph dies with every tensor it saved. On the first stage ``W`` is the full backward (``stage_backward``).

In the simulator a node with parameters is an intermediate (its incoming gradient is the one torch keeps).
Autograd nodes own the nodes that make their inputs (``next_edges``, shared pointers: torch/csrc/autograd/
function.h); after ``I`` the only other owners are the kept intermediates (``param_groups``), so a node lives while
an intermediate not yet dropped leads back to it (:class:`Ownership` counts those references).

A checkpointed region (``torch.utils.checkpoint``, ``use_reentrant=False``, as torchtitan's ``apply_ac`` wraps each
layer; torch 2.13 torch/utils/checkpoint.py) keeps a ``_Holder`` per tensor its forward saved (``_checkpoint_hook``'s
``pack_hook``, l. 1155) and recomputes the region once per *graph task* that unpacks one of them (``unpack_hook``,
l. 1165-1186: ``frame.is_recomputed[gid]``, ``gid = torch._C._current_graph_task_id()``), storing the recomputed
tensor of every holder still alive in ``frame.recomputed[gid]`` (``_recomputation_hook``'s ``pack_hook``, l. 1119-1126:
``if holder is not None``), each until it is unpacked (l. 1205-1206: ``holder.handles[gid] = None``, "Rule 4", l. 681:
even with ``retain_graph=True``) or its holder
dies with its node's saved variables. So (:class:`RegionState`):

- ``I`` is one graph task: the region is recomputed once and every node ``I`` runs unpacks its tensors, all of
  them (a generated ``apply`` unpacks each saved variable before computing the gradients it is asked for), which
  go as they are unpacked; the intermediates' gradients are kept as without checkpointing.
- ``W`` runs one ``torch.autograd.grad`` per parameter group (``stage_backward_weight``): each group whose
  intermediate is in a region is a graph task of its own that recomputes the whole region again. Its own node
  unpacks its tensors and is released (``retain_graph=False``), killing its holders, with the copies earlier
  groups stored for them; the recompute's tensors of holders already dead go when the recompute ends; the
  tensors of every other node (attention, activations, the nodes of later groups) stay stored, one copy per
  group that recomputed the region, until their node runs or dies (:class:`Ownership`). The region's inputs
  (``frame.saved_args``) stay while any of its nodes lives (each holder's hooks refer to the frame).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from memcalc.engine.checkpoint import Recompute
from memcalc.engine.records import Node
from memcalc.engine.sim import Sim, T


class RegionState:
    """One checkpointed region of one micro-batch between its ``I`` and its ``W`` (see the module docstring):
    ``node`` is the checkpoint's node (it holds the region's inputs), ``alive`` how many of the region's nodes
    live (:class:`Ownership`)."""

    __slots__ = ("alive", "node", "recompute", "released", "stored")

    def __init__(self, recompute: Recompute, node: Node) -> None:
        self.recompute, self.node = recompute, node
        self.released: set[int] = set()  # the region's nodes (their index in a recompute) whose holders died
        self.stored: dict[int, list[Node]] = {}  # node index -> its copies earlier groups' recomputes stored
        self.alive = 0


class Ownership:
    """Which nodes of one micro-batch's graph live between its ``I`` and the end of its ``W``: each node is owned by
    the nodes that take its outputs (their ``next_edges``; a checkpointed region's nodes as ``I``'s recompute made
    them, the checkpoint's node standing for the node that makes the region's output) and by a kept intermediate's
    reference; a node no one owns dies: its saved tensors go (a region's node: its holders, with every copy
    stored for them; the region's last node: the region's inputs too)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.parents: dict[int, list[Node]] = {}
        self.nodes: dict[int, Node] = {}
        self.region: dict[int, tuple[RegionState, int]] = {}  # id(a region's node) -> (region, index)
        self.output_of: dict[int, Node] = {}  # id(checkpoint node) -> the node making its region's output
        self.refs: dict[int, int] = {}

    def add(self, node: Node) -> None:
        self.nodes[id(node)] = node
        self.parents[id(node)] = [t.producer for t in node.inputs if t.producer is not None]

    def add_region(self, state: RegionState, sub: list[Node], out: T) -> None:
        for k, n in enumerate(sub):
            self.add(n)
            self.region[id(n)] = (state, k)
        state.alive = len(sub)
        if out.producer is not None:
            self.output_of[id(state.node)] = out.producer

    def start(self, intermediates: list[Node]) -> None:
        """``I`` is over: the references counted, and what no one owns dies (the outputs' ``detach_()``)."""
        refs = self.refs = dict.fromkeys(self.nodes, 0)
        for nid, ps in self.parents.items():
            mine: list[Node] = []
            for p in ps:
                p = self.output_of.get(id(p), p)
                if id(p) in refs and p not in mine:
                    mine.append(p)
                    refs[id(p)] += 1
            self.parents[nid] = mine
        for n in intermediates:
            refs[id(n)] += 1
        for nid in [nid for nid, r in refs.items() if r == 0 and nid not in self.output_of]:
            self._die(nid)

    def drop(self, node: Node) -> None:
        """A group's intermediate is dropped (``del param_group["intermediates"]``)."""
        self.refs[id(node)] -= 1
        if self.refs[id(node)] == 0:
            self._die(id(node))

    def _die(self, first: int) -> None:
        sim, todo = self.sim, [first]
        while todo:
            nid = todo.pop()
            node = self.nodes.pop(nid)
            where = self.region.pop(nid, None)
            if where is None:
                if not node.done:
                    sim._release_node(node)
            else:
                state, k = where
                state.released.add(k)
                for n in state.stored.pop(k, []):
                    sim._release_node(n)
                state.alive -= 1
                if state.alive == 0:  # the frame (its saved inputs) goes with the region's last holder
                    sim._release_node(state.node)
            for p in self.parents.pop(nid):
                self.refs[id(p)] -= 1
                if self.refs[id(p)] == 0 and id(p) in self.nodes:
                    todo.append(id(p))

    def end(self) -> None:
        """``W`` returned: the rest of the graph dies."""
        for nid in list(self.nodes):
            if nid in self.nodes and nid not in self.output_of:
                self._die(nid)


class InputBackward:
    """One micro-batch's ``I`` over ``nodes`` (the stage's graph), then its ``W`` (:meth:`weights`)."""

    def __init__(self, sim: Sim, nodes: list[Node]) -> None:
        self.sim, self.nodes = sim, nodes
        self.kept: list[tuple[Node, list[T]]] = []  # (intermediate, the gradients its pre-hook kept)
        self.owned = Ownership(sim)
        self.regions: list[RegionState] = []

    def run(self, label_of: Callable[[Node], str]) -> None:
        """``I``: the input's gradient through every node a gradient reaches; saved tensors stay (retain_graph),
        but a checkpointed region's recomputed ones (:meth:`_region`); then what no intermediate owns dies."""
        sim, owned = self.sim, self.owned
        for node in self.nodes:
            owned.add(node)
        layer: Optional[int] = None  # the layer the input gradient is in
        for node in reversed(self.nodes):
            if node.done or all(o.grad_buffer is None for o in node.outputs):
                continue
            lab = label_of(node)
            if node.layer != layer and sim.on_layer is not None:  # (FSDP2's hooks fire in I too:
                sim.on_layer(sim, node.layer)  # engine.pipeline_fsdp; as Sim.run_nodes calls it)
            layer = node.layer
            if lab != sim.label:
                sim.mark(lab)
            if isinstance(node.on_backward, Recompute):
                self._region(node, node.on_backward, lab)
            else:
                self._input_only(node)
        owned.start([n for n, _ in self.kept])

    def _region(self, node: Node, rc: Recompute, lab: str) -> None:
        """``I`` through a checkpointed region (the checkpoint's ``node``): the trailing nodes, the recompute
        (torch/utils/checkpoint.py ``unpack_hook``, at the first unpack), then each recomputed node's input-only
        backward, its tensors going as it unpacks them (Rule 4); the checkpoint keeps the region's inputs."""
        sim = self.sim
        if rc.first is not None:
            rc.first.run_tail(sim, lab)
        out2, sub = rc.regen(sim)
        state = RegionState(rc, node)
        self.regions.append(state)
        self.owned.add_region(state, sub, out2)
        if rc.first is not None:
            rc.first.hand_over(sim, sub)
        _undo_uses(sub)  # (no weight gradient in I)
        out2.grad_buffer, node.outputs[0].grad_buffer = node.outputs[0].grad_buffer, None
        sim.unref(out2)
        for n in reversed(sub):
            if n.done:
                continue
            if all(o.grad_buffer is None for o in n.outputs):
                sim._release_node(n)
                continue
            self._input_only(n)
            sim._release_node(n)
        out2.grad_buffer = None
        node.outputs = []
        node.inputs, node.grad_input_bytes = [], None  # (the recomputed nodes sent the inputs their gradients)

    def _input_only(self, node: Node) -> None:
        """The node's backward for its inputs' gradients only (``task_should_compute_output`` false for the
        weights): its workspace, its inputs' gradients; the incoming gradients kept (an intermediate) or freed."""
        sim = self.sim
        if node.on_backward is not None:  # (as SimBackward.run_nodes: the ring attention's backward buffers)
            node.on_backward(sim, node)
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
        if node.after_backward is not None:
            node.after_backward(sim, node)

    def weights(self, order: dict[str, int], label: Optional[str] = None) -> None:
        """``W``: each intermediate's weight gradients (accumulated as AccumulateGrad does), then its saved tensors
        and kept gradients, in the order of the stage's parameters (``order``: a parameter's place in
        ``module.parameters()``, which ``get_param_groups`` walks; a layer's norms come after its linears); then
        the rest of the graph's saved tensors."""
        sim = self.sim
        lingering: list[T] = []  # the last group's ``dweights``, alive until the next autograd.grad returns
        groups = sorted(self.kept, key=lambda ng: min(order.get(p.name, 0) for p in ng[0].params))
        owned = self.owned
        for kept, grads in groups:
            if label is not None and label != sim.label:
                sim.mark(label)
            where = owned.region.get(id(kept))
            node = kept if where is None else _recompute_for(sim, *where)  # (a region: recomputed for the group)
            made = [sim.alloc(p.grad_bytes, "gradients", "gradients") for p in node.params]
            for t in lingering:
                sim.unref(t)
            lingering = [sim.ref(g) for g in made]
            for p, g in zip(node.params, made, strict=True):
                sim._accumulate(p, g)  # ``weight.grad = dw`` or ``weight.grad += dw``
            sim._release_node(node)
            if where is not None:  # its holders die: the copies earlier groups stored go with them
                state, k = where
                state.released.add(k)
                for n in state.stored.pop(k, []):
                    sim._release_node(n)
            owned.drop(kept)
            for g in grads:
                sim.unref(g)
        for t in lingering:
            sim.unref(t)
        self.kept = []
        owned.end()
        for node in self.nodes:
            if not node.done:
                sim._release_node(node)


def _undo_uses(nodes: list[Node]) -> None:
    """A recompute's nodes counted a use of each parameter (``Sim.node``) that no backward of theirs takes."""
    for n in nodes:
        for p in n.params:
            p.uses -= 1


def _recompute_for(sim: Sim, state: RegionState, k: int) -> Node:
    """The region recomputed for the group of its ``k``-th node (a graph task of ``W``): the recomputed
    tensors of holders already dead go as the recompute ends, the others stay stored
    (:attr:`RegionState.stored`); returns the ``k``-th node, whose weight gradients the group computes."""
    out2, sub = state.recompute.regen(sim)
    sim.unref(out2)
    _undo_uses(sub)
    for j, n in enumerate(sub):
        if j == k:
            continue
        if j in state.released or not n.saved:
            sim._release_node(n)
        else:
            state.stored.setdefault(j, []).append(n)
    node = sub[k]
    for p in node.params:
        p.uses += 1
    return node


def pass_back(sim: Sim, stages: dict, index: int, i: int, g: T) -> None:
    """Stage ``index - 1`` is this rank's too (a V's turn, ``zbv-zero-bubble``): the input gradient ``g`` of
    micro-batch ``i`` becomes its gradient receive buffer (``get_local_bwd_output`` -> ``set_local_bwd_input``:
    ``info.buffer = tensor``, replacing the one before; torch 2.13 stage.py, schedules.py
    _PipelineScheduleRuntime, BACKWARD_INPUT / FULL_BACKWARD). ``stages``: the rank's
    :class:`memcalc.engine.pipeline.LocalStage` s by global index."""
    prev = stages.get(index - 1)
    if prev is not None:
        old, prev.grad_recv[i] = prev.grad_recv[i], sim.ref(g)
        sim.unref(old)

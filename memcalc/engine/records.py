"""The simulator's objects: blocks of memory (:class:`T`), parameters (:class:`Param`) and autograd
nodes (:class:`Node`), which :mod:`memcalc.engine.sim` allocates, references and runs backward.

Blocks and nodes are slotted classes: the simulator makes one per allocation and per recorded op
(hundreds of thousands per plan), and fills their fields in itself without calling ``__init__``
(:meth:`memcalc.engine.sim.Sim.alloc`, :meth:`memcalc.engine.sim.Sim.node`): a field added here
is added there too (``tests/unit/test_sim_bookkeeping.py`` checks that both set every field alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

#: a node's backward hook, called with the simulator and the node (this module sits below
#: :mod:`memcalc.engine.sim`, which it does not import)
NodeHook = Callable[[Any, "Node"], None]


class T:
    """A block of memory: ``nbytes`` already rounded to the allocator granularity.

    A plain class with slots rather than a dataclass: the simulator makes one per allocation
    (hundreds of thousands per plan); :meth:`Sim.alloc` sets the same fields without calling
    ``__init__`` (keep the two in step)."""

    __slots__ = ("nbytes", "kind", "category", "requires_grad", "refs", "alive", "numel", "itemsize_bits",
                 "grad_buffer", "producer", "name", "uid", "seq")

    def __init__(self, nbytes: int, kind: str, category: str, requires_grad: bool = False, refs: int = 1,
                 alive: bool = True, numel: int = 0, itemsize_bits: int = 32, grad_buffer: Optional[T] = None,
                 producer: Optional[Node] = None, name: str = "", uid: int = 0, seq: int = 0) -> None:
        self.nbytes = nbytes
        self.kind = kind  # one of result.KINDS
        self.category = category  # finer name shown in the breakdown
        self.requires_grad = requires_grad
        self.refs = refs
        self.alive = alive
        self.numel = numel  # elements, for ops that size their outputs from inputs
        self.itemsize_bits = itemsize_bits
        self.grad_buffer = grad_buffer  # accumulated gradient w.r.t. this tensor (backward)
        self.producer = producer
        self.name = name
        self.uid = uid  # identity in the allocation event log
        self.seq = seq  # Sim.alloc_count when it was allocated (which op made it)

    def __repr__(self) -> str:
        return (f"T(nbytes={self.nbytes}, kind={self.kind!r}, category={self.category!r}, name={self.name!r}, "
                f"refs={self.refs}, alive={self.alive}, seq={self.seq})")


@dataclass(eq=False)
class Param:
    """A parameter: its storage, whether it trains, and its gradient's size in bytes."""

    name: str
    weight: T
    trainable: bool
    grad_bytes: int
    layer: Optional[int]
    numel: int
    grad: Optional[T] = None
    grad_keep_bytes: Optional[int] = None  # the gradient shard kept after a reduce-scatter (ZeRO-2/3)
    # FSDP2 (memcalc.engine.fsdp): AccumulateGrad fills the unsharded parameter's .grad, which waits
    # for its unit's post-backward reduce-scatter (which then sets ``grad`` to the shard)
    deferred_reduce: bool = False
    unsharded_grad: Optional[T] = None
    uses: int = 0  # nodes of the current graph that will send this parameter a gradient
    pending: Optional[T] = None  # AccumulateGrad's input buffer while more contributions are due


class Node:
    """An autograd node: saved tensors, the inputs it sends gradients to, the params it grads.

    A plain class with slots (one is made per recorded op); :meth:`Sim.node` sets the same
    fields without calling ``__init__`` (keep the two in step)."""

    __slots__ = ("name", "saved", "inputs", "params", "outputs", "temps", "grad_input_bytes", "on_backward",
                 "after_backward", "done", "fwd_label", "flops", "layer", "role", "offloaded", "passes_grad")

    def __init__(self, name: str, saved: list[T], inputs: list[T], params: list[Param], outputs: list[T],
                 temps: Optional[list[int]] = None, grad_input_bytes: Optional[list[int]] = None,
                 on_backward: Optional[NodeHook] = None, after_backward: Optional[NodeHook] = None, done: bool = False,
                 fwd_label: str = "", flops: int = 0, layer: Optional[int] = None, role: str = "",
                 offloaded: Optional[list] = None, passes_grad: bool = False) -> None:
        self.name = name
        self.saved = saved
        self.inputs = inputs  # activation inputs requiring grad (each receives a grad of its own size)
        self.params = params
        self.outputs = outputs
        self.temps = [] if temps is None else temps  # transient backward allocations (bytes, unrounded)
        self.grad_input_bytes = grad_input_bytes  # override sizes of grads sent to inputs
        self.on_backward = on_backward  # e.g. checkpoint recompute
        self.after_backward = after_backward  # once its backward has run
        self.done = done
        self.fwd_label = fwd_label
        self.flops = flops  # forward FLOPs of the op (matmuls and attention; 0 for pointwise ops)
        self.layer = layer  # decoder layer the op belongs to (None: embedding, head, loss)
        self.role = role  # which part of the model issued it: embedding, attention, mlp, norm, head, loss
        self.offloaded = [] if offloaded is None else offloaded  # (pack id, tensor) moved to host (engine/offload.py)
        # AddBackward0: the incoming gradient itself goes to each input of the output's size and element
        # width, a new reference and no new tensor (memcalc.engine.sim_backward.SimBackward._input_grads)
        self.passes_grad = passes_grad


def grad_inputs(inputs: list[T], sizes: Optional[list[int]]) -> tuple[list[T], Optional[list[int]]]:
    """The inputs a node sends gradients to (those that require grad) and their gradients' sizes:
    ``sizes`` given per input (one per element of ``inputs``) keeps the kept inputs' entries. An
    autograd formula computes only the gradients whose edge is valid (torch 2.13
    tools/autograd/gen_autograd_functions.py: each input's formula under
    ``task_should_compute_output({ <input>_ix })``); an op whose kernel makes the others anyway
    (flash/efficient attention's dq, dk, dv) lists those in its ``temps``. ``sizes`` of another length
    are already per kept input (a node that filtered them itself)."""
    kept = [t for t in inputs if t.requires_grad]
    if sizes is not None and len(kept) < len(inputs) and len(sizes) == len(inputs):
        sizes = [b for t, b in zip(inputs, sizes, strict=True) if t.requires_grad] or None
    return kept, sizes

"""A small simulator of PyTorch's caching allocator and autograd engine, in bytes.

Tensors are reference-counted blocks of bytes (each rounded up to the
allocator's 512-byte granularity). Forward ops allocate outputs and register
autograd nodes that hold references to the tensors they save for backward;
Python-level references are held and dropped explicitly by the model code.
Backward (:mod:`memcalc.engine.sim_backward`, a base class) walks the nodes in
reverse creation order, allocating activation gradients and parameter gradients,
and releasing each node's saved tensors when it has run.

Every allocation updates the running total, the per-kind totals, the per-phase
maxima and, when it raises the peak, the peak; what is alive there by category and
kind is copied when memory next goes down (every allocation before that is a new
peak itself). Views are modelled by sharing a tensor object (no new bytes).

This is the hot path of every estimate and plan (a plan simulates hundreds of steps):
blocks and nodes are slotted classes that :meth:`Sim.alloc` and :meth:`Sim.node` fill in
without an ``__init__`` call, and the few helpers the op code calls per tensor are inline.
"""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter
from collections.abc import Callable, Container, Iterable
from typing import Optional

from memcalc.engine.records import Node, Param, T, grad_inputs
from memcalc.engine.breakdown import PeakBreakdown
from memcalc.engine.result import KINDS
from memcalc.core.kernels import ALLOCATOR_ROUND_BYTES
from memcalc.engine.sharding import Share
from memcalc.engine.sim_backward import SimBackward
from memcalc.engine.sim_hooks import SimHooks

__all__ = ["Node", "Param", "Sim", "T"]  # the blocks, parameters and nodes live in memcalc.engine.records


_new = object.__new__
_trainable = attrgetter("trainable")


def param_id(sim: Sim) -> list:
    """``[None]`` where a saved ``nn.Parameter`` gets a pack id from the step's activation offloading (its
    ``param_ids``: TRL's, memcalc.engine.offload_trl), else ``[]``: what an op puts in its saved list for it."""
    off = sim.offload
    return [None] if off is not None and off.active and off.param_ids else []


class Sim(PeakBreakdown, SimHooks, SimBackward):
    """Allocator + autograd bookkeeping. Bytes are ints; all sizes rounded to ``round_bytes``.
    What is alive at the peak is :class:`memcalc.engine.breakdown.PeakBreakdown`'s; what else a
    caller wants of a step, an observer it registers (:meth:`watch`); what other modules switch,
    :class:`memcalc.engine.sim_hooks.SimHooks`'s methods (nothing else assigns a Sim's fields)."""

    def __init__(self, round_bytes: int = ALLOCATOR_ROUND_BYTES) -> None:
        self.round_bytes = round_bytes
        self._round = max(round_bytes, 1)  # round_up leaves sizes as they are below 2, as does rounding to 1
        self.total = 0
        self.by_kind: dict[str, int] = {k: 0 for k in KINDS}
        self.by_cat: dict[tuple[str, str], int] = defaultdict(int)  # (kind, category) -> bytes alive
        self.peak = 0
        self.max_activations = 0  # the highest activation bytes alive at any instant
        self.peak_phase = ""
        self.peak_label = ""
        self.peak_cats: dict[tuple[str, str], int] = {}
        self.peak_kinds: dict[str, int] = {}
        self._peak_open = False  # a new peak whose breakdown is not copied yet (alloc, _snap_peak)
        self.grads_ready = 0  # gradients ready so far (observers.PeakAbove)
        self.phase = "setup"
        self.label = ""
        self.trace_label: Optional[str] = None  # a layer hook's label in backward, when not self.label
        self.phase_peaks: dict[str, int] = {}
        self.nodes: list[Node] = []
        # (the fields below that other modules switch are set only through SimHooks' methods:
        # memcalc.engine.sim_hooks; tests/unit/test_sim_hooks.py checks that nothing else assigns them)
        # the observers' hooks (memcalc.engine.observers, Sim.watch), each list tested only when non-empty
        self._on_row: list[Callable[[tuple[int, str, str, int]], None]] = []
        self._on_event: list[Callable[[tuple[int, int]], None]] = []
        self._uid = 0  # the last block numbered for the on_event hooks
        # the block the on_event hooks hear of, for an observer that reads its kind, category and name
        # (memcalc.snapshot.export labels a snapshot's allocations with them)
        self.event_block: Optional[T] = None
        self._on_peak: list[Callable[[int], None]] = []
        self._on_phase: list[Callable[[str], None]] = []
        self._on_mark: list[Callable[[], None]] = []
        # a checkpointed region's recompute: the allocations that take no memory (checkpoint.Ghosts)
        self.ghosts: Optional[Container[int]] = None
        self.grad_ready: Optional[Callable[["Sim", Param], None]] = None
        self.grad_enabled = True  # False inside a checkpointed region's first forward
        self.alloc_count = 0  # allocations so far
        self.last_save_count = 0  # alloc_count when the last node that saves something was made
        # a checkpointed region's first forward (grad disabled) counts where its recompute's last
        # saving node will be: node() then calls this (checkpoint.FirstForward), making no node
        self.count_saves: Optional[Callable[..., None]] = None
        # allocations made by a sharded runtime's per-layer forward hooks (FSDP's unshard), which
        # a checkpointed region's recompute does not repeat; ``last_save_hooks`` is its value at
        # ``last_save_count``
        self.hook_allocs = 0
        self.last_save_hooks = 0
        # where the forward code is: the decoder layer (None outside the layers) and the part of
        # the model (Forward sets both; every node records them)
        self.layer: Optional[int] = None
        self.role = ""
        # called when backward moves on to a node of another decoder layer, or from a layer to a node
        # outside the layers (``None``): ZeRO-3 regathers there, FSDP2 runs its post- and
        # pre-backward hooks there
        self.on_layer: Optional[Callable[["Sim", Optional[int]], None]] = None
        self.bwd_layer: Optional[int] = None  # the decoder layer backward is in
        # called with every op as the forward code issues it, before autograd filtering
        # (memcalc.compile.compiled records the forward graph this way)
        self.recorder: Optional[Callable[..., None]] = None
        # activation offloading (memcalc.engine.offload.ActivationOffload): while its ``active`` is
        # set, saved tensors are packed to host memory and come back in backward
        self.offload = None

    # -- allocation -----------------------------------------------------------------
    def alloc(self, nbytes: int, kind: str, category: str, requires_grad: bool = False, name: str = "",
              numel: int = 0, itemsize_bits: int = 32) -> T:
        """Allocate a block (rounded up); returns it with one reference (``numel`` and
        ``itemsize_bits`` describe its elements, for ops that size outputs from inputs).

        The hot path of every simulation (hundreds of thousands of calls per plan): the block is
        made without a call to ``T.__init__`` (the same fields, set here), the rounding is
        :func:`memcalc.core.units.round_up` inline, and a new peak's breakdown is copied only when
        memory next goes down (:meth:`_snap_peak`)."""
        c = self.alloc_count = self.alloc_count + 1
        t = _new(T)
        t.kind = kind
        t.category = category
        t.requires_grad = requires_grad
        t.refs = 1
        t.alive = True
        t.numel = numel
        t.itemsize_bits = itemsize_bits
        t.grad_buffer = None
        t.producer = None
        t.name = name
        t.seq = c
        t.uid = 0
        g = self.ghosts
        if g is not None and c in g:
            t.nbytes = 0
            return t
        req = nbytes if type(nbytes) is int else int(nbytes)
        rb = self._round
        n = -(-req // rb) * rb
        t.nbytes = n
        if self._on_event and n:
            uid = self._uid = self._uid + 1
            t.uid = uid
            self.event_block = t
            for event_hook in self._on_event:
                event_hook((uid, n))
        total = self.total = self.total + n
        by_kind = self.by_kind
        k = by_kind[kind] = by_kind[kind] + n
        self.by_cat[(kind, category)] += n
        if k > self.max_activations and kind == "activations":
            self.max_activations = k
        phase = self.phase
        pp = self.phase_peaks
        if total > pp.get(phase, 0):
            pp[phase] = total
            if total > self.peak:  # (a phase's peak is never above the peak)
                self.peak = total
                self.peak_phase = phase
                self.peak_label = self.label
                self._peak_open = True  # the breakdown is copied when memory next goes down (_snap_peak)
                if self._on_peak:
                    for hook in self._on_peak:
                        hook(total)
        if self._on_row:  # a Share keeps its type: the whole it divides (memcalc.plan.depth extrapolates that)
            row = (total, phase, self.trace_label or self.label, nbytes if type(nbytes) is Share else req)
            for row_hook in self._on_row:
                row_hook(row)
        return t

    def alloc_many(self, kind: str, rows: list[tuple[int, str, str, int, int]]) -> list[T]:
        """``alloc(nbytes, kind, category, False, name, numel, itemsize_bits)`` for each row
        ``(nbytes, category, name, numel, itemsize_bits)`` in order, with nothing freed in between:
        the same blocks, trace, events, peak and breakdown, with the per-kind and per-category
        totals, the phase's maximum and the peak updated once at the end (the weights and the
        optimizer state before a step: hundreds of allocations in a row). Activations (whose
        running maximum is tracked) and ghost allocations take :meth:`alloc` one by one."""
        if kind == "activations" or self.ghosts is not None:
            return [self.alloc(nb, kind, cat, False, name, numel, bits) for nb, cat, name, numel, bits in rows]
        out: list[T] = []
        rb = self._round
        c = self.alloc_count
        total = self.total
        event_hooks = self._on_event
        uid = self._uid
        row_hooks = self._on_row
        phase = self.phase
        label = self.trace_label or self.label
        sums: dict[str, int] = {}  # bytes by category, in the order the categories first appear
        for nb, cat, name, numel, bits in rows:
            c += 1
            req = int(nb)
            n = -(-req // rb) * rb
            t = _new(T)
            t.nbytes = n
            t.kind = kind
            t.category = cat
            t.requires_grad = False
            t.refs = 1
            t.alive = True
            t.numel = numel
            t.itemsize_bits = bits
            t.grad_buffer = None
            t.producer = None
            t.name = name
            t.seq = c
            if event_hooks and n:
                uid += 1
                t.uid = uid
                self.event_block = t
                for event_hook in event_hooks:
                    event_hook((uid, n))
            else:
                t.uid = 0
            total += n
            sums[cat] = sums.get(cat, 0) + n
            if row_hooks:
                row = (total, phase, label, req)
                for row_hook in row_hooks:
                    row_hook(row)
            out.append(t)
        added = total - self.total
        self.alloc_count = c
        self._uid = uid
        self.total = total
        self.by_kind[kind] += added
        by_cat = self.by_cat
        for cat, n in sums.items():
            by_cat[(kind, cat)] += n
        if rows:  # totals only grew: the last one is the batch's highest
            pp = self.phase_peaks
            if total > pp.get(phase, 0):
                pp[phase] = total
            if total > self.peak:
                self.peak = total
                self.peak_phase = phase
                self.peak_label = self.label
                self._peak_open = True
                for hook in self._on_peak:
                    hook(total)
        return out

    def transient(self, nbytes: int, kind: str = "temporaries", category: str = "op workspace") -> None:
        """Allocate and immediately free (a workspace that lives inside one kernel)."""
        t = self.alloc(nbytes, kind, category)
        self.unref(t)

    def ref(self, t: T) -> T:
        assert t.alive, f"reference to a freed tensor {t.name}"
        t.refs += 1
        return t

    def unref(self, t: Optional[T]) -> None:
        if t is None:
            return
        refs = t.refs
        assert t.alive and refs > 0, f"double free of {t.name}"
        t.refs = refs = refs - 1
        if refs == 0:
            t.alive = False
            if self._peak_open:
                self._snap_peak()
            n = t.nbytes
            if t.uid:  # (numbered only for on_event hooks)
                for event_hook in self._on_event:
                    event_hook((t.uid, 0))
            self.total -= n
            self.by_kind[t.kind] -= n
            self.by_cat[(t.kind, t.category)] -= n

    def mark(self, label: str, phase: Optional[str] = None) -> None:
        """Set the current label (and phase) and tell the observers."""
        if phase is not None:
            self.phase = phase
            self.phase_peaks.setdefault(phase, self.total)
            for phase_hook in self._on_phase:
                phase_hook(phase)
        self.label = label
        for mark_hook in self._on_mark:
            mark_hook()

    # -- autograd -------------------------------------------------------------------
    def node(self, name: str, saved: list[T], inputs: list[T], params: list[Param], outputs: list[T],
             temps: Optional[list[int]] = None, grad_input_bytes: Optional[list[int]] = None, flops: int = 0,
             **kw) -> Optional[Node]:
        """Register a node if anything needs a gradient; takes a reference on each saved tensor.
        ``temps``, ``grad_input_bytes``, ``flops`` and any other keyword set the :class:`Node`'s
        fields of those names (the recorder hears the ones given)."""
        if self.recorder is not None:
            saved = [t for t in saved if t is not None]  # (None: a parameter's pack id, engine/offload_trl.py)
            heard = dict(kw)
            if temps is not None:
                heard["temps"] = temps
            if grad_input_bytes is not None:
                heard["grad_input_bytes"] = grad_input_bytes
            if flops:
                heard["flops"] = flops
            self.recorder(name, saved, inputs, params, outputs, heard)
        if not self.grad_enabled:
            if self.count_saves is not None:
                self.count_saves(self, saved, inputs, params, outputs, temps, grad_input_bytes, name, kw)
            return None
        # the inputs that require grad (with their gradients' sizes: records.grad_inputs) and the
        # trainable params (new lists; one element is the common case)
        if len(inputs) == 1:
            if inputs[0].requires_grad:
                inputs = [inputs[0]]
            else:
                inputs, grad_input_bytes = [], None
        else:
            inputs, grad_input_bytes = grad_inputs(inputs, grad_input_bytes)
        if not params:
            params = []
        elif len(params) == 1:
            params = [params[0]] if params[0].trainable else []
        else:
            params = list(filter(_trainable, params))
        if not inputs and not params:
            return None
        off: list | tuple = ()  # nothing offloaded (read only: engine/offload.py iterates it)
        if saved:
            if self.offload is not None and self.offload.active:
                saved, off = self.offload.pack(self, saved)
            for t in saved:  # self.ref(t), inline
                assert t.alive, f"reference to a freed tensor {t.name}"
                t.refs += 1
            if saved:
                self.last_save_count = self.alloc_count
        for p in params:
            p.uses += 1
        n = _new(Node)  # Node(name, saved, inputs, params, outputs, **kw) without the call
        n.name = name
        n.saved = saved
        n.inputs = inputs
        n.params = params
        n.outputs = outputs
        n.temps = [] if temps is None else temps
        n.grad_input_bytes = grad_input_bytes
        n.on_backward = None
        n.after_backward = None
        n.done = False
        n.flops = flops
        n.passes_grad = False
        if kw:
            for k, v in kw.items():
                setattr(n, k, v)
        n.offloaded = off
        n.fwd_label = self.label
        n.layer = self.layer
        n.role = self.role
        for o in outputs:
            o.requires_grad = True
            o.producer = n
        self.nodes.append(n)
        return n

    def note_op(self, name: str, inputs: list[T], params: list[Param], outputs: list[T]) -> None:
        """An op whose autograd bookkeeping another node does (autocast's casts): only the
        graph recorder hears of it."""
        if self.recorder is not None:
            self.recorder(name, [], inputs, params, outputs, {})

    def release_graph(self) -> None:
        """Drop the simulator's references to the step's graph and hooks once the step is over,
        so that reference counting frees them (the hooks' closures refer back to the simulator:
        without this the whole graph waits for the cyclic garbage collector), and to its observers
        (one that reads the simulator refers back to it too: :class:`memcalc.engine.observers.StopAbove`;
        what the others recorded stays theirs)."""
        self.nodes = []
        self.grad_ready = None
        self.on_layer = None
        self.recorder = None
        for hooks in (self._on_row, self._on_event, self._on_peak, self._on_phase, self._on_mark):
            hooks.clear()

    def abandon_graph(self, graphs: Iterable[list[Node]] = ()) -> None:
        """:meth:`release_graph` for a step cut short (:class:`memcalc.engine.observers.PeakAbove`), whose
        nodes still hold the tensors they save and make (each tensor's ``producer`` refers back to its node):
        those references go too, so that reference counting frees the step at once instead of the cyclic
        garbage collector later ("to make it fit" stops a dozen steps part-way). ``graphs``: the node lists
        kept elsewhere (the pipeline's micro-batches in flight)."""
        for nodes in (self.nodes, *graphs):
            for n in nodes:
                n.saved, n.outputs, n.inputs, n.params = [], [], [], []
                n.on_backward = n.after_backward = None
        self.release_graph()

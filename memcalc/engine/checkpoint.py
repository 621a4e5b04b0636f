"""Activation checkpointing: ``torch.utils.checkpoint(use_reentrant=False)`` regions.

A region's first forward keeps nothing but its inputs; when backward first unpacks a tensor the
region saved the whole region is recomputed (all its saved tensors alive at once) and then
back-propagated (torch/utils/checkpoint.py, ``_checkpoint_without_reentrant_generator``,
``_checkpoint_hook``); the region's last nodes that save nothing run their backward before that
(:class:`FirstForward`).
Non-reentrant checkpointing stops recomputing once the last tensor the region saves has been
recomputed (early stop, ``_StopRecomputationError``), so allocations after that point cost
nothing; the region's first forward counts where that point is (its ops are the recompute's),
except under torchtitan's op-level policy and activation offloading, where a dry run in backward
finds it. Modes: ``full`` (every layer), ``every-k`` (every K-th layer), ``sqrt`` (segments of
about sqrt(n) layers, ``checkpoint_sequential``), ``selective`` (the attention core only),
``selective-op`` (every layer, keeping torchtitan's op-level selection of outputs: :class:`OpSaver`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Optional

from memcalc.core.spec import TrainingSpec, sqrt_segments
from memcalc.engine.offload import rope_region_inputs
from memcalc.engine.ops import Ops
from memcalc.engine.records import grad_inputs
from memcalc.engine.sim import Node, Param, Sim, T
from memcalc.engine.strategy import LayerStrategy, Walk


class Ghosts:
    """The allocations of a recompute that take no memory (:attr:`Sim.ghosts`): those past the
    ``after``-th (the recompute stops there, or a dry run: every one) and those at the counts in
    ``at`` (a cached output, which adopts the cache's memory: :func:`adopt`)."""

    __slots__ = ("after", "at")

    def __init__(self, after: int, at: frozenset[int] | set[int] = frozenset()) -> None:
        self.after = after
        self.at = at

    def __contains__(self, count: object) -> bool:
        return count > self.after or count in self.at  # type: ignore[operator]


def adopt(sim: Sim, dst: T, src: T) -> None:
    """``dst`` (allocated as a ghost, no bytes) becomes the memory of ``src``, which gives up
    its bytes and one reference: a selective checkpoint's recompute returns the output it
    cached in forward instead of computing a new one (torch/utils/checkpoint.py
    ``_CachingTorchDispatchMode``: ``storage[func].pop(0)``)."""
    assert dst.nbytes == 0 and src.alive
    dst.nbytes, dst.kind, dst.category, dst.uid = src.nbytes, src.kind, src.category, src.uid
    src.nbytes, src.uid = 0, 0
    sim.unref(src)


def count_save(sim: Sim, saved: list[T], inputs: list[T], params: list[Param], outputs: list[T],
               temps: Optional[list[int]] = None, grad_input_bytes: Optional[list[int]] = None, name: str = "",
               kw: Optional[dict] = None) -> None:
    """:func:`_count_save` (``Sim.count_saves`` where the trailing nodes are not kept)."""
    _count_save(sim, saved, inputs, params, outputs)


def _count_save(sim: Sim, saved: list[T], inputs: list[T], params: list[Param], outputs: list[T]) -> bool:
    """What :meth:`Sim.node` does with grad enabled, short of making the node (``Sim.count_saves``
    in a checkpointed region's first forward): when an input needs a gradient or a parameter
    trains, the outputs need one, and a node that saves something moves ``last_save_count`` (and
    ``last_save_hooks``) to here. (Activation offloading is inactive in a recompute, so ``saved``
    is what the node would keep.) Returns whether :meth:`Sim.node` would make the node."""
    for t in inputs:
        if t.requires_grad:
            break
    else:
        for p in params:
            if p.trainable:
                break
        else:
            return False
    for o in outputs:
        o.requires_grad = True
    if saved:
        sim.saves_here()
    return True


class FirstForward:
    """``Sim.count_saves`` in a checkpointed region's first forward: :func:`_count_save`, and the
    region's trailing nodes, those made after its last node that saves something, kept as
    :class:`Node` s of the first forward's tensors (``tail``: (index among the region's nodes, node)).

    Non-reentrant checkpointing recomputes a region when backward first UNPACKS one of its saved
    tensors, not when it reaches the region's first backward node (torch 2.13
    torch/utils/checkpoint.py ``_checkpoint_hook``: every tensor the region saves is packed into a
    ``_Holder`` (l. 1155); ``unpack_hook`` (l. 1165) runs ``frame.recompute_fn`` under
    ``_recomputation_hook`` only ``if not frame.is_recomputed[gid]`` (l. 1175-1186)). The graph of
    the first forward is the one backward walks, so the nodes that save nothing and come last run
    their backward first, in reverse order, and their gradients are alive through the whole
    recompute (PEFT's ``lora.Linear`` on down_proj: ``* scaling``, ``result + lora_out``,
    ``result.to(torch_result_dtype)``, then the residual add). A trailing node with a trainable
    parameter ends the tail here (its AccumulateGrad bookkeeping is the recompute's node's): none
    of the modelled ops makes one."""

    __slots__ = ("made", "tail")

    def __init__(self) -> None:
        self.made = 0  # the nodes Sim.node would have made so far (the recompute makes the same, in order)
        self.tail: list[tuple[int, Node]] = []

    def __call__(self, sim: Sim, saved: list[T], inputs: list[T], params: list[Param], outputs: list[T],
                 temps: Optional[list[int]] = None, grad_input_bytes: Optional[list[int]] = None,
                 name: str = "", kw: Optional[dict] = None) -> None:
        if not _count_save(sim, saved, inputs, params, outputs):
            return
        i = self.made
        self.made = i + 1
        # a node with a parameter operand unpacks it: mm saves mat2, the weight, for the input's gradient
        # (torch 2.13 tools/autograd/derivatives.yaml ``mm``: ``self: mm_mat1_backward(grad, mat2, ...)``),
        # and torch/csrc/autograd/saved_variable.cpp packs every saved tensor through the checkpoint's
        # hooks but a wrapped number (``x * 0.5`` saves nothing the hooks see)
        if saved or params:
            self.tail.clear()
            return
        # Sim.node's node, short of its references (it saves nothing) and its outputs' producer
        kept, sizes = grad_inputs(inputs, grad_input_bytes)
        node = Node(name, [], kept, [], outputs, temps=list(temps) if temps else [], grad_input_bytes=sizes,
                    fwd_label=sim.label, layer=sim.layer, role=sim.role,
                    passes_grad=bool(kw and kw.get("passes_grad")))
        self.tail.append((i, node))

    def run_tail(self, s: Sim, bwd_label: str) -> None:
        """The trailing nodes' backward, before the recompute: the gradients they send to the
        region's own tensors land on the first forward's (moved to the recompute's by :meth:`hand_over`;
        the first forward's tensors keep their sizes: in the recompute these are past its early
        stop, allocations without memory)."""
        if self.tail:
            s.run_nodes([n for _, n in self.tail], lambda n: bwd_label)

    def hand_over(self, s: Sim, sub: list[Node]) -> None:
        """The recompute made ``sub``: the trailing nodes' twins are done (their backward ran), and
        the gradients waiting on the first forward's tensors move to the recompute's."""
        if not self.tail:
            return
        assert len(sub) == self.made, f"the recompute made {len(sub)} nodes, the first forward {self.made}"
        for i, first in self.tail:
            twin = sub[i]
            for a, b in zip(first.inputs, twin.inputs, strict=True):
                if a is not b and a.grad_buffer is not None:
                    assert b.grad_buffer is None
                    b.grad_buffer, a.grad_buffer = a.grad_buffer, None
            s._release_node(twin)
        self.tail = []


class OpSaver:
    """torchtitan's op-level selective activation checkpointing policy for one region
    (``torchtitan/distributed/activation_checkpoint.py`` before its name-based rewrite, and
    ``torchtitan/models/llama3/parallelize.py``: ``_save_list`` = {``aten.mm``, the flash and
    memory-efficient SDPA ops, ``aten.max``, the reduce-scatter}, ``_custom_policy``: MUST_SAVE an
    op in the list except every second ``mm`` (``mm_count % 2 == 0``, counted per region and per
    forward/recompute), PREFER_RECOMPUTE the rest), run through
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``: in forward the outputs of
    the saved ops are cached (kept alive) until the recompute pops them in order instead of
    computing them again. A linear is an ``mm`` when it has no bias (``addmm`` otherwise) and a
    16-bit or fp32 weight (a 4-bit base runs bitsandbytes' matmul); attention is saved on the
    flash and memory-efficient kernels (the math path's matmuls are ``bmm``, not listed).

    The simulator's op recorder while :meth:`recording` (chaining the one already there). Modes: ``cache``
    (the first forward: keep a reference to each saved op's new tensors), ``locate`` (the
    recompute's dry run: where those tensors are allocated), ``adopt`` (the recompute: the
    ghost allocations take the cached tensors' memory, :func:`adopt`)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.cache: list[list[T]] = []
        self.locs: list[list[int]] = []
        self.mode = "cache"
        self.prev: Optional[Callable[..., None]] = None
        self._reset()

    def _reset(self) -> None:
        self.mm_count = 0
        self.mark = self.sim.alloc_count
        self.i = 0

    @contextmanager
    def recording(self, mode: str) -> Iterator[None]:
        """Within: the simulator's op recorder, in ``mode`` (chaining the recorder it replaces)."""
        self.mode = mode
        self._reset()
        with self.sim.recording(self) as prev:
            self.prev = prev
            yield

    def _saved(self, name: str, params: list) -> bool:
        if name == "linear":
            if len(params) != 1 or params[0].weight.itemsize_bits < 8:
                return False
            self.mm_count += 1
            return self.mm_count % 2 == 1
        return name in ("sdpa_flash", "sdpa_efficient")

    def __call__(self, name: str, saved: list[T], inputs: list[T], params: list, outputs: list[T], kw: dict) -> None:
        if self.prev is not None:
            self.prev(name, saved, inputs, params, outputs, kw)
        mark, self.mark = self.mark, self.sim.alloc_count
        if not self._saved(name, params):
            return
        seen: set[int] = set()
        new = [t for t in [*outputs, *saved] if t.seq > mark and not (id(t) in seen or seen.add(id(t)))]
        if self.mode == "cache":
            self.cache.append([self.sim.ref(t) for t in new])
        elif self.mode == "locate":
            self.locs.append([t.seq for t in new])
        elif self.i < len(self.cache):
            ghosts = self.sim.ghosts
            stop = ghosts.after if isinstance(ghosts, Ghosts) else None
            for dst, src in zip(new, self.cache[self.i]):
                if src.alive and src.nbytes and (stop is None or dst.seq <= stop):
                    adopt(self.sim, dst, src)
        self.i += 1

    def release(self) -> None:
        """The region's backward is over: cached outputs the recompute never reached go."""
        for ts in self.cache:
            for t in ts:
                if t.alive and t.refs:
                    self.sim.unref(t)
        self.cache = []


class Recompute:
    """A checkpointed region's ``on_backward`` (:func:`checkpoint`'s recompute, then the region's backward), with
    its parts apart for zero bubble's split backward (:mod:`memcalc.engine.pipeline_zb`): ``regen`` (the
    recompute alone: its output and its nodes) and ``first`` (the trailing nodes, :class:`FirstForward`, or
    None)."""

    __slots__ = ("first", "regen", "run")

    def __init__(self, run: Callable[[Sim, Node], None], regen: Callable[[Sim], tuple[T, list[Node]]],
                 first: Optional[FirstForward]) -> None:
        self.run, self.regen, self.first = run, regen, first

    def __call__(self, s: Sim, node: Node) -> None:
        self.run(s, node)


def checkpoint(sim: Sim, ops: Ops, inputs: Callable[[], list[T]], fn: Callable[[], T], label: str,
               layer: int, save_ops: bool = False, first_unpack: bool = True, full_recompute: bool = False,
               reentrant: bool = False) -> T:
    """Non-reentrant checkpoint of ``fn``: forward keeps only the inputs; backward recomputes.
    ``layer``: the decoder layer the region starts at (the checkpoint node carries it).
    ``save_ops``: torchtitan's op-level policy keeps some op outputs from forward (:class:`OpSaver`).
    ``first_unpack``: the region's trailing nodes that save nothing run their backward before the
    recompute (:class:`FirstForward`; where the first forward counts the early stop); False: the
    recompute comes first (a compiled layer's backward graph, memcalc.compile.backward).
    ``full_recompute``: a reentrant checkpoint (Unsloth's ``UnslothCheckpointFunction``) recomputes the whole
    region, outputs included (no early stop), when backward reaches its one node (torch/utils/checkpoint.py
    ``CheckpointFunction.backward``: the region is one autograd node, so none of its nodes runs before).
    ``reentrant``: ``torch.utils.checkpoint(use_reentrant=True)``: a full recompute whose backward is the
    nested ``torch.autograd.backward(outputs, args)`` of ``CheckpointFunction.backward`` (torch/utils/checkpoint.py,
    torch 2.13), so the recomputed output (``outputs``) and the gradient it receives (``args``, the engine's
    input buffer of the checkpoint node) stay alive until the region's backward has run."""
    full_recompute = full_recompute or reentrant
    assert sim.grad_enabled and sim.count_saves is None, f"{label}: a checkpointed region inside another's forward"
    ins = inputs()
    saver = OpSaver(sim) if save_ops else None
    # where the recompute may stop: counted by this forward, whose ops are the recompute's (the
    # layer hooks' allocations aside: Sim.hook_allocs), node() doing to requires_grad what it will
    # do then (count_save). None: a dry run finds it (torchtitan's op-level policy, whose
    # cache must not see the recompute's requires_grad; offloading, which saves more in forward)
    stop: Optional[int] = None
    count = saver is None and not (sim.offload is not None and sim.offload.active)
    # the trailing nodes run before the recompute with offloading too (its hooks only change what a
    # node packs, not which node unpacks first): the first forward keeps them, the dry run counts
    first = FirstForward() if saver is None and first_unpack and not full_recompute else None
    if count:
        f0, h0 = sim.alloc_count, sim.hook_allocs
        sim.saves_here()
    with saver.recording("cache") if saver is not None else nullcontext(), \
            sim.no_grad(first or (count_save if count else None)):
        out = fn()
    if count:
        stop = (sim.last_save_count - f0) - (sim.last_save_hooks - h0)
    out.requires_grad = True

    def regen(s: Sim) -> tuple[T, list[Node]]:
        """The recompute itself: the region's forward again, to its early stop; its output and its nodes."""
        # the recomputed ops belong to the region's layer (a sub-layer region sets none itself)
        with s.recomputing(layer, f"bwd {label} (recompute)"):
            # Non-reentrant checkpoint stops recomputing once the last tensor the region saves
            # is recomputed (early stop): the first forward counted where (stop), or a dry run without
            # memory finds that point.
            here = stop
            if full_recompute:
                here = 1 << 62
            elif here is None or CHECK_STOP:
                here = _dry_run(s, ops, fn, saver)
                assert stop is None or stop == here, (label, stop, here)
            c1 = s.alloc_count
            # (with a saver, the cached outputs' allocations take no memory: they adopt the cache)
            ghosts = Ghosts(c1 + here) if saver is None else \
                Ghosts(c1 + here, {c1 + q for group in saver.locs[:len(saver.cache)] for q in group})
            with s.apart(ghosts) as sub:
                h1 = s.hook_allocs
                with saver.recording("adopt") if saver is not None else nullcontext():
                    out2 = fn()
                # the counted stop leaves out the forward's layer-hook allocations: the recompute makes none
                assert stop is None or s.hook_allocs == h1, f"{label}: a layer hook allocated during the recompute"
                ops.exit_autocast()
        return out2, sub

    def recompute(s: Sim, node: Node) -> None:
        bwd_label = f"bwd {label}"
        if first is not None:  # the nodes after the last saving one, before the first unpack
            first.run_tail(s, bwd_label)
        if region_off:  # the region's inputs come back from the host at that unpack, after the tail
            node.offloaded = region_off
            s.offload.unpack(s, node)
            node.offloaded = []
        out2, sub = regen(s)
        if first is not None:
            first.hand_over(s, sub)
        # the recomputed output is discarded; its gradient is the region output's gradient (none
        # left when a trailing node's backward took it)
        out2.grad_buffer, node.outputs[0].grad_buffer = node.outputs[0].grad_buffer, None
        held = [out2, out2.grad_buffer] if reentrant else []  # alive through the nested backward
        for t in held:
            if t is not None:
                s.ref(t)
        s.unref(out2)
        # back-propagate the region now; the checkpoint node itself then has no work left
        s.run_nodes(sub, lambda n: bwd_label)
        for t in held:
            if t is not None and t.alive:
                s.unref(t)
        if saver is not None:
            saver.release()
        out2.grad_buffer = None
        node.outputs = []
        node.inputs, node.grad_input_bytes = [], None  # (the sub-graph sent the inputs their gradients)

    # the offloaded inputs (id, tensor): unpacked by recompute itself, after the trailing nodes' backward
    # (torch 2.13 checkpoint.py: ``frame.get_inputs()`` unpacks them in ``recompute_fn``, run at the
    # region's first unpack, so the offload hook's post-hook sits on that node, not on a trailing one)
    region_off: list[tuple[int, T]] = []
    node = Node(f"checkpoint {label}", [], [t for t in ins if t.requires_grad], [], [out],
                on_backward=Recompute(recompute, regen, first))
    node.fwd_label = f"fwd {label}"
    node.layer, node.role = layer, "checkpoint"
    saved = list(ins)
    if sim.offload is not None and sim.offload.active:
        # torch.utils.checkpoint saves the inputs with save_for_backward (_NoopSaveInputs), so an
        # outer saved-tensor hook (activation offloading) packs them (memcalc.engine.offload)
        saved, region_off = sim.offload.pack(sim, saved)
    for t in saved:
        sim.ref(t)
    node.saved = saved
    out.producer = node
    sim.nodes.append(node)
    return out


#: run the dry run where the first forward counted the stop too, and check that both agree (tests)
CHECK_STOP = False


def _dry_run(s: Sim, ops: Ops, fn: Callable[[], T], saver: Optional[OpSaver]) -> int:
    """Run the region once without memory (every allocation a ghost) and release what it made;
    returns how many allocations the recompute makes up to its last node that saves something
    (``saver``: where the cached ops' outputs are allocated, relative to the start, goes to
    ``saver.locs``)."""
    c0 = s.alloc_count
    with s.apart(Ghosts(c0)) as nodes:
        s.saves_here()
        if saver is not None:
            saver.locs = []
        with saver.recording("locate") if saver is not None else nullcontext():
            dry = fn()
        if saver is not None:
            saver.locs = [[q - c0 for q in group] for group in saver.locs]
        ops.exit_autocast()
        for n in nodes:
            for p in n.params:
                p.uses -= 1
            s._release_node(n)
        s.unref(dry)
    return s.last_save_count - c0


class Checkpointing(LayerStrategy):
    """Layers (or segments, or attention cores) run as checkpointed regions, per ``--checkpoint``."""

    def __init__(self, tr: TrainingSpec) -> None:
        self.mode = tr.checkpoint
        self.every = tr.checkpoint_every
        self.reentrant = tr.checkpoint_reentrant

    def regions(self, n_layers: int) -> Iterator[tuple[int, int]]:
        if self.mode != "sqrt":
            yield from super().regions(n_layers)
            return
        seg = sqrt_segments(n_layers)
        for lo in range(0, n_layers, seg):
            yield lo, min(n_layers, lo + seg)

    def run(self, fwd: Walk, x: T, lo: int, hi: int) -> T:
        ins = lambda: [x] + rope_region_inputs(fwd)  # noqa: E731 (RoPE tables: only while offloading)
        if self.mode == "selective-op":
            return checkpoint(fwd.sim, fwd.ops, ins, lambda: fwd.layer(x, lo), f"layer {lo}", lo,
                              save_ops=True)
        if self.mode == "sqrt":
            return checkpoint(fwd.sim, fwd.ops, ins, lambda: super(Checkpointing, self).run(fwd, x, lo, hi),
                              f"layers {lo}-{hi - 1}", lo, reentrant=self.reentrant)
        if self.mode == "full" or (self.mode == "every-k" and lo % self.every == 0):
            return checkpoint(fwd.sim, fwd.ops, ins, lambda: fwd.layer(x, lo), f"layer {lo}", lo,
                              reentrant=self.reentrant)
        return fwd.layer(x, lo)

    def core_attention(self, fwd: Walk, q: T, k: T, v: T, i: int, fn: Callable[[], T]) -> T:
        if self.mode != "selective":
            return fn()
        return checkpoint(fwd.sim, fwd.ops, lambda: [q, k, v], fn, f"layer {i} attention", i)


def layer_strategy(tr: TrainingSpec) -> LayerStrategy:
    """The eager step's strategy: checkpointing when asked for, else eager."""
    return Checkpointing(tr) if tr.checkpoint != "none" else LayerStrategy()

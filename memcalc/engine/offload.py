"""Activation offloading: saved tensors go to pinned host memory in forward and come back for backward.

Follows torchtune ``torchtune/training/_activation_offloading.py`` ``OffloadActivations`` (a
``torch.autograd.graph.saved_tensors_hooks``) with its defaults (``use_pin_memory=True``,
``use_streams=True`` on PyTorch >= 2.5, ``max_fwd_stash_size=5``, ``min_offload_size=1024``) as
``get_act_offloading_ctx_manager`` applies it: around the model's forward, with a ``NoOpManager``
around the output head (its saved tensors stay on the GPU), the loss outside.

``pack_tensor`` (every tensor autograd saves, in order, one id each):
- at least ``min_offload_size`` bytes (``element_size() * nelement()``) and not an
  ``nn.Parameter`` / ``nn.Buffer`` instance: a pinned host copy is made and autograd keeps only
  the id, so the GPU tensor lives only as long as Python references it and the forward stash
  holds it: the stash keeps each offloaded tensor until an offloaded pack ``max_fwd_stash_size``
  ids later (the stream's copy must finish). A *view* of a parameter is no ``nn.Parameter``
  (``F.linear`` saves ``weight.t()`` for the input's gradient), so frozen and trainable weights
  saved that way are offloaded too (one host copy per save) and reloaded in backward;
- otherwise (small tensors, a parameter saved directly as a norm weight is) it stays as is.

``unpack_tensor_with_streams`` (backward): a tensor still in the forward stash is used as is;
otherwise a GPU copy comes back (``.to("cuda")``) and is kept in ``bwd_tensor_stash`` until the
node *after* the next reloading node has run: at its first unpack a node takes the ids stashed
so far, and its post-hook deletes them once it has run; the first such hook also empties the
forward stash; what is left goes at the end of backward (``queue_callback``).

Host memory: each pinned copy comes from PyTorch's caching host allocator, which rounds every
request up to a power of two (aten/src/ATen/core/CachingHostAllocator.h ``PowerOf2Ceil``) and
caches freed blocks, so the pinned memory a step needs is the sum over one forward's offloaded
tensors, rounded so. Ignored: the CPU side's ``psutil`` check and stream timing (the memory is
counted as if every copy completed in order).
"""

from __future__ import annotations

from typing import Optional

from memcalc.core.kernels import pinned_bytes
from memcalc.core.rules import MAX_FWD_STASH, MIN_OFFLOAD_BYTES
from memcalc.engine.sim import Node, Sim, T

def raw_bytes(t: T) -> int:
    """The tensor's own bytes (``element_size() * nelement()``), before the device allocator's rounding."""
    return t.numel * t.itemsize_bits // 8 if t.numel else t.nbytes


class ActivationOffload:
    """The pack/unpack bookkeeping of one step's forward and backward passes on a :class:`Sim`."""

    #: whether an op's saved list may hold ``None`` for a saved ``nn.Parameter`` (an id, no bytes: the forward
    #: stash counts ids); torchtune's estimate gives none (its grid agrees without), TRL's does (offload_trl.py)
    param_ids = False
    #: the category of the last step's input leaf an earlier step's graph still holds (:meth:`carry_prior`)
    held_leaf_category = "the last step's input leaf (activation offloading)"

    def __init__(self, prior: bool = False) -> None:
        self.active = False  # inside the offloading context (the model's forward, not the head)
        self.next_id = 0
        self.fwd_stash: list[tuple[int, T]] = []
        self.bwd_prev: list[T] = []  # reloaded by earlier nodes, freed after the current one runs
        self.bwd_cur: list[T] = []
        self.hook_due = False  # a node unpacked offloaded tensors; its post-hook has not run yet
        self.host_bytes = 0  # raw bytes offloaded in the current forward
        self.pinned_bytes = 0
        self.max_host_bytes = 0
        self.max_pinned_bytes = 0
        self.offloaded_tensors = 0  # in the current forward
        self.max_offloaded_tensors = 0
        self.prior_uids: set[int] = set()  # blocks an earlier step left, made at this one's start (twins)
        # the graph the last unpacking node keeps: the input leaf and its .grad of the last backward (keep_graph)
        self.held: list[T] = []
        self.prior = prior  # a steady step: an earlier step's leaf and .grad are held at its start

    def pack(self, sim: Sim, saved: list[T]) -> tuple[list[T], list[tuple[int, T]]]:
        """Split a node's saved tensors into those autograd keeps on the GPU and those offloaded
        (id and the GPU tensor, which only the forward stash still references)."""
        keep: list[T] = []
        off: list[tuple[int, T]] = []
        for t in saved:
            self.next_id += 1
            n = raw_bytes(t)
            if n < MIN_OFFLOAD_BYTES:
                keep.append(t)
                continue
            tid = self.next_id
            while self.fwd_stash and self.fwd_stash[0][0] <= tid - MAX_FWD_STASH:
                sim.unref(self.fwd_stash.pop(0)[1])
            self.fwd_stash.append((tid, sim.ref(t)))
            off.append((tid, t))
            self.count_host_copy(n)
        return keep, off

    def count_host_copy(self, n: int) -> None:
        """One offloaded tensor of ``n`` raw bytes: the host bytes, the pinned bytes and the tensors of this
        forward, and their maxima."""
        self.host_bytes += n
        self.pinned_bytes += pinned_bytes(n)
        self.offloaded_tensors += 1
        self.max_offloaded_tensors = max(self.max_offloaded_tensors, self.offloaded_tensors)
        self.max_host_bytes = max(self.max_host_bytes, self.host_bytes)
        self.max_pinned_bytes = max(self.max_pinned_bytes, self.pinned_bytes)

    def skip(self) -> None:
        """A saved ``nn.Parameter``: ``pack_tensor`` gives it an id and keeps it as it is."""
        self.next_id += 1

    def unpack(self, sim: Sim, node: Node) -> None:
        """Before ``node``'s backward: its offloaded tensors come back (unless still stashed). A
        checkpoint node unpacks its inputs before recomputing; the hook then sits on the first
        recomputed node to run (the autograd node current at the unpack). The backward's first unpack of an
        offloaded tensor replaces ``curr_autograd_node``: the graph it held (:meth:`keep_graph`) goes."""
        for t in self.held:
            sim.unref(t)
        self.held = []
        self.bwd_prev, self.bwd_cur = self.bwd_prev + self.bwd_cur, []
        self.hook_due = True
        stashed = {tid for tid, _ in self.fwd_stash}
        for tid, t in node.offloaded:
            if tid not in stashed:
                # a weight view comes back whole (a ZeRO-3 shard's block holds only its part)
                n = max(t.nbytes, raw_bytes(t)) if t.kind == "weights" else t.nbytes
                g = sim.alloc(n, "activations", "reloaded activations")
                if node.on_backward is not None and not t.alive:
                    g = _in_place_of(t, g)
                self.bwd_cur.append(g)

    def after_node(self, sim: Sim) -> None:
        """The unpacking node's post-hook: the forward stash empties, the earlier nodes' reloads go."""
        self.hook_due = False
        for _, t in self.fwd_stash:
            sim.unref(t)
        self.fwd_stash = []
        for t in self.bwd_prev:
            sim.unref(t)
        self.bwd_prev = []

    def carry_prior(self, sim: Sim, leaf: T) -> None:
        """A steady step's first forward makes its input leaf: the previous step's leaf and ``.grad`` (the same
        sizes) are still alive (:meth:`keep_graph`), since the step began; they go at this backward's first
        unpack. Counted from here (the batch alone is allocated before), and only once per step."""
        if self.prior:
            self.prior = False
            for kind, category in (("activations", self.held_leaf_category), ("temporaries", "activation gradients")):
                t = sim.alloc(leaf.nbytes, kind, category)
                self.held.append(t)
                if t.uid:
                    self.prior_uids.add(t.uid)

    def keep_graph(self, sim: Sim, tensors: tuple[Optional[T], ...]) -> None:
        """``unpack_tensor_with_streams`` keeps the node of its last unpack (``self.curr_autograd_node =
        node``, torchtune 0.6.1 training/_activation_offloading.py; trl 1.16.0 models/activation_offloading.py
        the same) until the next backward's first unpack replaces it; nothing clears it between steps (the
        twin, validate/offload.py ``OffloadActivations.unpack``: ``self.curr_node = node``, reset only at the
        next backward's first unpack). That node's ``next_functions`` reach the input leaf
        ``enable_input_require_grads`` makes (PEFT with checkpointing, --framework hf and trl:
        memcalc.core.rules.input_require_grads), whose ``AccumulateGrad`` node holds the leaf and so its
        ``.grad``: both outlive the step (the optimizer step, the next forward). Traced (hf and TRL grids): the
        leaf and a backward-made tensor of the last step alive at the next backward's peak. Without that leaf
        (torchtune, plain) the node reaches only parameters: nothing is held."""
        self.held += [sim.ref(t) for t in tensors if t is not None]

    def rope_tables(self, numel: int, itemsize_bits: int) -> list[T]:
        """The cos and sin tables a checkpointed region packs (:func:`rope_region_inputs`): host-only blocks."""
        return [T(0, "activations", "rope tables", numel=numel, itemsize_bits=itemsize_bits) for _ in range(2)]

    def end_backward(self, sim: Sim) -> None:
        """The callback queued at the end of backward frees what is still stashed; the host
        copies' blocks return to the caching host allocator (reused by the next forward)."""
        for t in self.bwd_prev + self.bwd_cur + [t for _, t in self.fwd_stash]:
            sim.unref(t)
        self.bwd_prev, self.bwd_cur, self.fwd_stash = [], [], []
        self.host_bytes = self.pinned_bytes = self.offloaded_tensors = 0


def _in_place_of(t: T, g: T) -> T:
    """A checkpointed region's recompute runs on its reloaded inputs (torch/utils/checkpoint.py:
    the recompute takes ``ctx.saved_tensors``, which the offload hook's unpack returns as the
    GPU copies), while the region's ops here refer to the input blocks of the first forward: a
    freed input takes the reloaded block's memory ``g`` (its bytes and its one reference, held
    by the backward stash), so an op of the recompute that keeps it (an fp32 RMSNorm's
    ``x.to(fp32)`` is ``x`` itself, which ``pow`` saves) keeps the reload alive past the stash."""
    t.nbytes, t.kind, t.category, t.uid, t.seq = g.nbytes, g.kind, g.category, g.uid, g.seq
    t.refs, t.alive = g.refs, True
    return t


def rope_region_inputs(fwd) -> list[T]:
    """While offloading: the RoPE cos/sin tables a checkpointed layer receives as inputs (Hugging
    Face passes ``position_embeddings`` into every decoder layer; ``(1, T, rotary width)`` in the
    hidden states' dtype, ``LlamaRotaryEmbedding.forward``). torch.utils.checkpoint saves them with the
    layer input, so the offload hook copies them to the host per region; on the GPU they exist
    anyway (shared by all layers), so they are host-only blocks here (no device bytes). torchtune
    passes none: ``TransformerDecoder.forward`` calls ``layer(h, mask=mask, input_pos=input_pos)``
    and each attention reads its own RoPE cache buffer (modules/transformer.py, 0.6.1), so its
    checkpointed region saves ``h`` alone (one pack id, not three: the forward stash's count). Nor does Hugging
    Face 5.x (--framework hf; TRL's rule the same, offload_trl.py ``rope_tables``): ``GradientCheckpointingLayer``
    runs ``self._gradient_checkpointing_func(partial(forward, self, **kwargs), *args)`` (transformers 5.24
    modeling_layers.py) and ``LlamaModel.forward`` passes ``position_embeddings=`` as a keyword
    (models/llama/modeling_llama.py), which torch.utils.checkpoint does not save: traced, the hf grid's host bytes
    carry no tables and its forward stash counts one id per region."""
    off = offload_of(fwd.sim)
    if off is None or fwd.m.positions != "rope" or fwd.m.mla is not None or fwd.exp.profile.framework in (
            "torchtune", "hf"):
        return []
    from memcalc.core.rules import rope_width

    bits = fwd.model.params["embed_tokens.weight"].weight.itemsize_bits
    return off.rope_tables(fwd.T * rope_width(fwd.m), bits)


def offload_of(sim: Sim) -> Optional[ActivationOffload]:
    """The step's offloader while its context is active (None otherwise)."""
    off = getattr(sim, "offload", None)
    return off if off is not None and off.active else None

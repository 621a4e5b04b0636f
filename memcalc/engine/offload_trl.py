"""TRL's activation offloading: torchtune's hooks (:mod:`memcalc.engine.offload`) with TRL's own rules.

trl 1.16.0 ``trl/models/activation_offloading.py`` ``OffloadActivations`` (``SFTConfig(activation_offloading=True)``:
``SFTTrainer.__init__`` calls ``get_act_offloading_ctx_manager(model=self.model)``, ``training_step`` runs under it)
started as torchtune's class; in its stream mode (the default) it differs where bytes move. Each rule is traced:
validate/trl_offload.py runs this class unmodified on meta (tests/trace/test_trl_grid.py).

- **storage dedup** (``pack_tensor``): each offloaded tensor's key, ``_get_unique_tensor_key``:
  ``(untyped_storage().data_ptr() + storage_offset(), dtype)``, is tracked while the forward stash holds it
  (``track_storage_key``; ``release_storage_key`` as the stash drops it). A later save of a tracked key is *not*
  offloaded (``self.tracker[tensor_id] = (activation, False, ...)``): it stays on the GPU until its backward, and
  the key now names that id (tracked until that unpack). Here a block is its storage, offset and dtype (views
  share the block: :mod:`memcalc.engine.sim`), so the key is the block. An RMSNorm's fp32 input (saved by ``pow``
  and by ``mul``) and ``rsqrt``, a linear input shared by q/k/v or gate/up, the attention output ``o_proj``
  saves: the second save keeps the block on the GPU for the forward;
- **parameter storages**: ``update_model_params`` records every parameter's storage pointer and ``pack_tensor``
  keeps a tensor whose storage is one of them: the ``weight.t()`` view ``F.linear`` saves is kept, not copied;
  a saved ``nn.Parameter`` (a norm's weight, ``native_layer_norm``'s weight and bias, the fused head's weight)
  takes an id like every pack (``get_tensor_id()`` first), which the forward stash's window counts;
- **the last unpacking node** (``self.curr_autograd_node``) outlives the step: torchtune's rule too
  (:meth:`ActivationOffload.keep_graph`, :meth:`ActivationOffload.carry_prior`);
- **record_stream** after an unpack whose storage gained references: :meth:`after_node`;
- not modelled (the trace runs them; no grid row moves by 0.1%): the contiguous copy of a saved view with an
  offset or strides (``activation.clone()`` / ``.contiguous()`` before the host copy: SDPA's q/k/v/output),
  which exists beside the view while Python holds both; and the RoPE ``cos`` / ``sin`` saves of
  ``apply_rotary_pos_emb`` (an id each, a host copy when not deduplicated, a copy back in backward).
"""

from __future__ import annotations

from memcalc.core.rules import MAX_FWD_STASH, MIN_OFFLOAD_BYTES
from memcalc.engine.offload import ActivationOffload, raw_bytes
from memcalc.engine.sim import Sim, T


class TrlActivationOffload(ActivationOffload):
    """:class:`ActivationOffload` with trl 1.16.0 ``OffloadActivations.pack_tensor``'s rules (module docstring).
    ``None`` in a saved list is an ``nn.Parameter`` saved as it is (``native_layer_norm``'s weight and bias): an id
    (``get_tensor_id()`` runs before every check), kept."""

    param_ids = True

    held_leaf_category = "the last step's input leaf (TRL offloading)"

    def __init__(self, prior: bool = False) -> None:
        super().__init__(prior)
        self.counted: list[tuple[T, int]] = []  # the last unpack's copies and their references then
        # storage_to_tensor_id: block -> the pack id that holds its key (the block kept as the dict's key's owner)
        self.keys: dict[int, tuple[T, int]] = {}

    def pack(self, sim: Sim, saved: list) -> tuple[list[T], list[tuple[int, T]]]:
        keep: list[T] = []
        off: list[tuple[int, T]] = []
        keys = self.keys
        for t in saved:
            self.next_id += 1
            tid = self.next_id
            if t is None:  # a parameter (an id)
                continue
            if id(t) in keys:  # ``storage_key in self.storage_to_tensor_id``: kept, the key now this id's
                keys[id(t)] = (t, tid)
                keep.append(t)
                continue
            n = raw_bytes(t)
            if n < MIN_OFFLOAD_BYTES or t.kind == "weights":  # too small; a parameter's storage (a weight view)
                keep.append(t)
                continue
            while self.fwd_stash and self.fwd_stash[0][0] <= tid - MAX_FWD_STASH:
                old_id, old = self.fwd_stash.pop(0)
                entry = keys.get(id(old))
                if entry is not None and entry[1] == old_id:  # release_storage_key(id)
                    del keys[id(old)]
                sim.unref(old)
            self.fwd_stash.append((tid, sim.ref(t)))
            keys[id(t)] = (t, tid)  # track_storage_key(storage_key, tensor_id)
            off.append((tid, t))
            self.count_host_copy(n)
        return keep, off

    def rope_tables(self, numel: int, itemsize_bits: int) -> list[T]:
        """None: transformers 5.x checkpoints a decoder layer as ``self._gradient_checkpointing_func(partial(forward,
        self, **kwargs), *args)`` (modeling_layers.py ``GradientCheckpointingLayer``) with ``position_embeddings`` a
        keyword, and torch.utils.checkpoint saves only the positional tensors (``_NoopSaveInputs`` /
        ``CheckpointFunction``): the region packs its hidden states alone (the TRL trace packs one tensor per layer)."""
        return []

    def unpack(self, sim: Sim, node) -> None:
        """Each copy brought back notes its references (``storage_refcount = torch._C._storage_Use_Count(...)``);
        the held graph goes at the backward's first unpack (:meth:`ActivationOffload.unpack`)."""
        super().unpack(sim, node)  # (bwd_cur: this node's copies)
        self.counted = [(g, g.refs) for g in self.bwd_cur]

    def after_node(self, sim: Sim) -> None:
        """The unpacking node's post-hook (``hook`` in ``unpack_tensor_with_streams``): a copy brought back that
        something else now references (``storage_count > storage_refcount``: an op of a checkpointed region's
        recompute keeps it, as an fp32 norm keeps its input ``x.to(fp32)``, which is ``x``) leaves the backward
        stash now (``unpacked_tensor.record_stream(self.s0); del self.bwd_tensor_stash[id]``: on the GPU its
        block is reused only once the compute stream is past this point; here, as every free of the trace,
        when the last reference goes), instead of at the next unpacking node's post-hook. Then the forward
        stash empties, releasing its keys (``release_storage_key``), and the earlier nodes' copies go."""
        for g, refs in self.counted:
            if g.alive and g.refs > refs and any(q is g for q in self.bwd_cur):
                self.bwd_cur = [q for q in self.bwd_cur if q is not g]
                sim.unref(g)
        self.counted = []
        for tid, t in self.fwd_stash:
            entry = self.keys.get(id(t))
            if entry is not None and entry[1] == tid:
                del self.keys[id(t)]
        super().after_node(sim)

    def end_backward(self, sim: Sim) -> None:
        """``__enter__`` of the next step clears ``storage_to_tensor_id`` (and the tracker)."""
        super().end_backward(sim)
        self.keys = {}

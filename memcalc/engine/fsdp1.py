"""FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=False``) on one rank, over the timeline.

The setup modelled: ``ModuleWrapPolicy`` on every decoder layer plus the outer root unit
(embedding, final norm, head), ``FULL_SHARD`` (``--zero 3``) or ``SHARD_GRAD_OP`` (``--zero 2``),
``MixedPrecision(param_dtype, reduce_dtype)`` as FSDP2's policy maps (:func:`memcalc.engine.fsdp.policy`),
default ``BACKWARD_PRE`` prefetch, no forward prefetch. Read from torch 2.13,
``torch/distributed/fsdp/``:

- **Flat parameters** (``_flat_param.py`` ``FlatParamHandle``): a unit's parameters are one flat
  tensor, padded to a multiple of N and sharded evenly (``ceil(total / N)`` elements per rank).
- **Unshard** (``FlatParamHandle.pre_unshard`` / ``unshard``): under a mixed-precision policy the
  shard is first cast into ``_mp_shard`` (shard size, ``param_dtype``), then all-gathered
  straight into ``_full_param_padded`` (N x shard, ``param_dtype``), whose views are the
  parameters; ``_mp_shard`` is freed after the all-gather. No separate all-gather buffer.
- **Forward** (``_runtime_utils.py`` ``_post_forward_reshard``): ``FULL_SHARD`` frees the unsharded
  flat parameter after a unit's forward, except the root's ("immediately used for backward").
- **Backward** (``_pre_backward_hook``, ``_prefetch_handle``): a unit's pre-backward unshards it
  and prefetches the unit before it in forward order (``BACKWARD_PRE``); the root's pre-backward
  (at the loss) prefetches the last layer.
- **Gradients** (``_post_backward_hook``, ``_reduce_grad``, ``_get_reduce_scatter_tensors``): the
  parameter views' gradients (``param_dtype``) all wait for the split's backward, which cats them
  into one flat gradient; the hook on the flat parameter's AccumulateGrad then frees the unsharded
  parameter (``_post_backward_reshard``), casts the flat gradient to ``reduce_dtype`` (the
  ``param_dtype`` one stays referenced, ``autograd_computed_grad``, until the hook returns), pads
  it to N x shard (``F.pad``, when padding is needed), allocates the new sharded gradient
  (``empty_like(chunks[0])``) and keeps it (``_saved_grad_shard``). The root's hook fires last, so
  the head's gradient lives until the end of backward.

With LoRA (frozen base, trainable adapters) FSDP1's flat parameters need one ``requires_grad`` each
(``_flat_param.py`` ``_validate_tensors_to_flatten``: "Must flatten tensors with uniform
``requires_grad`` when ``use_orig_params=False``"), so PEFT wraps with ``fsdp_auto_wrap_policy``
(peft 0.21 utils/other.py: ``lambda_policy_fn``, every leaf module whose weight requires grad, i.e.
each ``lora_A`` / ``lora_B`` Linear, is its own unit; ``transformer_auto_wrap_policy`` on the decoder
layers). A layer's flat parameter then holds its frozen weights only (a QLoRA base as
``bnb_4bit_quant_storage`` bf16: the packed bytes, uniform with the norms), gets no gradient (FSDP1
registers the post-backward hook on a flat parameter that requires grad only: ``_runtime_utils.py``
``_register_post_backward_hook``), and each adapter unit reduce-scatters its own padded gradient.
The adapters are gathered with their layer here (their units are a few rows each).

Ignored: ``record_stream`` (CUDA frees can come later than this model; FSDP1 calls it on CUDA
only), ``limit_all_gathers``'s rate limiting (it delays, it does not allocate).
"""

from __future__ import annotations

from memcalc.core.spec import ExperimentSpec, TrainingSpec
from memcalc.engine.fsdp import FSDP2, Unit
from memcalc.engine.sim import Param, Sim

#: sim categories (the breakdown's names)
CAT_UNSHARDED = "unsharded flat parameters (FSDP1)"
CAT_RS = "reduce-scatter buffers (FSDP1)"


def fsdp1_active(tr: TrainingSpec) -> bool:
    """FSDP1 runs the step: ``--sharding fsdp1`` with ZeRO 2 or 3 over more than one GPU."""
    return tr.sharding == "fsdp1" and tr.zero >= 2 and tr.gpus > 1


def flat_shard_numel(numels: list[int], gpus: int) -> int:
    """Elements of one rank's shard of a unit's flat parameter: the flat numel padded to a
    multiple of N, divided evenly (``FlatParamHandle._get_shard``)."""
    return -(-sum(numels) // gpus)


class FSDP1(FSDP2):
    """FSDP1's per-rank runtime: the same hooks as :class:`memcalc.engine.fsdp.FSDP2`, flat units."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, params: list[Param], shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(sim, exp, params, shapes)
        #: LoRA: the frozen params make the layer's flat parameter, each adapter its own unit (PEFT's policy)
        self.split = any(not p.trainable for p in params) and any(p.trainable for p in params)
        for u in [self.root, *self.layers.values()]:
            u.flat = flat_shard_numel([p.numel for p in self._flat_params(u)], self.n)

    def _flat_params(self, u: Unit) -> list[Param]:
        """The parameters in ``u``'s own flat parameter (without PEFT's adapter units)."""
        return [p for p in u.params if not (self.split and p.trainable)]

    def _adapters(self, u: Unit) -> list[Param]:
        return [p for p in u.params if self.split and p.trainable]

    def _flat_bytes(self, u: Unit, numel: int) -> int:
        """Bytes of ``numel`` elements of ``u``'s flat parameter, whose elements are its parameters'
        (a packed 4-bit weight counts its packed bytes, as its bf16 quant storage holds them)."""
        ps = self._flat_params(u)
        total = sum(p.numel for p in ps)
        if not total:
            return 0
        bits = sum(p.numel * p.weight.itemsize_bits for p in ps)
        return -(-numel * bits // (8 * total))

    def _adapter_bytes(self, u: Unit) -> int:
        """The unsharded flat parameters of ``u``'s adapter units (each padded to a multiple of N)."""
        return sum(-(-flat_shard_numel([p.numel], self.n) * self.n * p.weight.itemsize_bits // 8)
                   for p in self._adapters(u))

    def unshard(self, u: Unit) -> None:
        """``_mp_shard`` (under a cast), then ``_full_param_padded`` (the unsharded parameters)."""
        if not u.resharded:
            return
        sim = self.sim
        mp = sim.alloc(self._flat_bytes(u, u.flat), "temporaries", CAT_UNSHARDED) if self.pol.cast else None
        u.unsharded = [sim.alloc(self._flat_bytes(u, self.n * u.flat), "weights", CAT_UNSHARDED)]
        if self._adapters(u):
            u.unsharded.append(sim.alloc(self._adapter_bytes(u), "weights", CAT_UNSHARDED))
        u.resharded = False
        sim.unref(mp)

    def wait_for_unshard(self, u: Unit, forward: bool) -> None:
        """FSDP1 all-gathers straight into the unsharded flat parameter: nothing to copy out."""

    def layer_exit(self, i: int) -> None:
        if self.in_backward:
            return
        u = self.layers[i]
        if self.pol.reshard_after_forward:  # FULL_SHARD
            self.reshard(u)
        self.order.append(u)

    def after_forward(self) -> None:
        """The root is never freed after forward (``_post_forward_reshard``)."""
        self.order.append(self.root)

    def post_backward(self, u: Unit) -> None:
        """The split's cat, then ``_post_backward_hook`` (reshard, cast, pad, reduce-scatter)."""
        sim, pol = self.sim, self.pol
        with_grad = [p for p in u.params if p.unsharded_grad is not None]
        if not with_grad:
            self.reshard(u)
            return
        if self.split:  # PEFT's policy: only the adapter units have gradients, each its own flat parameter
            self._post_backward_adapters(u, with_grad)
            return
        total = sum(p.numel for p in u.params)
        flat = sim.alloc(pol.param.nbytes(total), "gradients", "unsharded gradients (FSDP1)")  # cat
        for p in with_grad:
            sim.unref(p.unsharded_grad)
            p.unsharded_grad = None
        self.reshard(u)
        live = [flat]
        if pol.reduce != pol.param:  # flat_param.grad.to(reduce_dtype)
            live.append(sim.alloc(pol.reduce.nbytes(total), "gradients", "unsharded gradients (FSDP1)"))
        if self.n * u.flat != total:  # F.pad to N x shard
            live.append(sim.alloc(pol.reduce.nbytes(self.n * u.flat), "temporaries", CAT_RS))
        self._hand_out(sim.alloc(pol.reduce.nbytes(u.flat), "gradients", "gradient shards (FSDP1)"), with_grad)
        for t in live:
            sim.unref(t)

    def _post_backward_adapters(self, u: Unit, with_grad: list[Param]) -> None:
        """Each adapter unit's ``_post_backward_hook``: its gradient (one parameter: the flat gradient is
        the parameter's own), cast to ``reduce_dtype``, padded to N x shard, the new sharded gradient
        kept; the layer's frozen flat parameter is resharded without a gradient."""
        sim, pol = self.sim, self.pol
        self.reshard(u)
        for p in with_grad:
            shard = flat_shard_numel([p.numel], self.n)
            live = []
            if pol.reduce != pol.param:
                live.append(sim.alloc(pol.reduce.nbytes(p.numel), "gradients", "unsharded gradients (FSDP1)"))
            if shard * self.n != p.numel:
                live.append(sim.alloc(pol.reduce.nbytes(shard * self.n), "temporaries", CAT_RS))
            out = sim.alloc(pol.reduce.nbytes(shard), "gradients", "gradient shards (FSDP1)")
            sim.unref(p.unsharded_grad)
            p.unsharded_grad = None
            self._hand_out(out, [p])
            for t in live:
                sim.unref(t)

    def end_backward(self) -> None:
        if self.current is not None:
            self.post_backward(self.current)
            self.current = None
        self.post_backward(self.root)
        for u in self.layers.values():
            if not u.resharded:
                self.reshard(u)
        self.in_backward = False

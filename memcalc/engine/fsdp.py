"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on one rank, op by op over the timeline.

The setup modelled is torchtitan's (``torchtitan/models/llama3/infra/parallelize.py``
``apply_fsdp``): ``fully_shard`` on every decoder layer with ``reshard_after_forward`` True
(``--zero 3``) or False (``--zero 2``), then ``fully_shard(model, **fsdp_config)`` on the root
module (embedding, final norm, head: one more unit) with FSDP2's default, which for the root is
"do not reshard after forward" (``_fsdp_state.py`` ``FSDPState._lazy_init``: the root's
parameters would be all-gathered again at once for backward), so the root stays unsharded from
its pre-forward to its reduce-scatter at the end of backward, under zero 2 and zero 3 alike.
Every rank holds its dim-0 shard of every
parameter (zero 2 and zero 3 alike: FSDP2 always shards parameters at rest). What follows is
read from torch 2.13, ``torch/distributed/fsdp/_fully_shard/``:

- **Shards** (``_fsdp_param.py`` ``FSDPParam._init_sharded_param``): each parameter is chunked on
  dim 0 (``torch.chunk``) and padded to the first chunk's size (``padded_sharded_param_size``,
  ``new_zeros``): ceil(rows / N) rows each, one allocation per parameter, in the original dtype.
- **All-gather** (``_fsdp_collectives.py`` ``foreach_all_gather``): with a ``param_dtype`` cast,
  the shards are first copied into one flat ``param_dtype`` buffer
  (``_get_param_all_gather_inputs``, ``flat_foreach_copy_input``), then the flat output of N times
  the padded shard elements is allocated (``all_gather_output``); the copy-in buffer dies when the
  function returns. Without a cast the inputs are views of the shards. With CPU offload every
  shard is first copied to the GPU (``sharded_param_data.to(device)``), then cast.
- **Copy-out** (``foreach_all_gather_copy_out``, ``FSDPParam.alloc_all_gather_outputs``): one
  unsharded buffer per parameter (N x padded shard, ``param_dtype``), allocated by
  ``UntypedStorage.resize_`` and freed the same way on reshard (``free_storage``), whatever
  autograd still references.
- **Forward** (``FSDPParamGroup.pre_forward`` / ``wait_for_unshard``): a unit all-gathers in its
  pre-forward; its all-gather output is kept (``comm_ctx.all_gather_state``, "implicit
  prefetching": the next copy-in must not overwrite it) until the *next* unit's copy-out, and
  the last one until the root's post-forward (``FSDPState._post_forward``). Post-forward
  reshards when ``reshard_after_forward`` (``FSDPParamGroup.reshard``).
- **Backward** (``pre_backward``, ``_backward_prefetch``): a unit's pre-backward hook (on its
  outputs) all-gathers it if needed, copies out, frees the all-gather output at once, and
  prefetches the unit before it in forward order (``post_forward_order[i - 1]``); the root's
  pre-backward (at the loss) prefetches the last layer.
- **Gradients** (``post_backward``, ``foreach_reduce``): autograd accumulates each unsharded
  gradient (``param_dtype``) into the unsharded parameter's ``.grad``; all of a unit's stay until
  its post-backward (``RegisterPostBackwardFunction`` on the unit's inputs, so after its last
  backward op), which reshards, frees the oldest kept reduce-scatter input
  (``reduce_scatter_states``, ``reduce_scatter_max_input_buffers`` = 1), allocates the
  reduce-scatter input (N x padded shard elements, ``reduce_dtype``), copies the gradients in
  (``chunk_cat``) and frees them, allocates the output (one flat shard, ``reduce_dtype``; cast to
  the original dtype when they differ) and sets each sharded ``.grad`` to a view of it (or adds
  into the existing one and frees it). That input stays alive through the next unit's backward.
  The root has no post-backward hook (its inputs, the token ids, need no gradient): it reduces
  in the final callback (``_root_post_backward_final_callback``), so the head's and embedding's
  unsharded gradients live until the end of backward; then every kept input is released.
- **Mixed precision** (``MixedPrecisionPolicy``, ``FSDPParam.init_dtype_attrs``): under
  ``--bf16 --master-weights`` the shards are fp32, ``param_dtype`` bf16, ``reduce_dtype`` fp32
  (torchtitan's default): gradient shards fp32, the optimizer steps the fp32 shards (no separate
  master copy). With LoRA only the trainable parameters have fp32 shards; the frozen base keeps its
  16-bit ones and is all-gathered without a cast copy (:meth:`FSDP2._cast`; accelerate's
  ``fsdp2_prepare_model`` upcast, memcalc.engine.weights ``_shard_dtype``). Pure ``--bf16``:
  everything bf16. ``amp-*`` / fp32: fp32 shards, no cast.
- **CPU offload** (``CPUOffloadPolicy``, ``offload_to_cpu``): shards, gradient shards and the
  optimizer (which steps on the CPU) live in host memory; the GPU keeps the per-unit buffers.

Ignored: collective streams' timing (a buffer freed on one stream is reusable at once), NCCL's
own workspaces, DTensor metadata, and the first step's lazy init (the same allocations).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from memcalc.core.dtypes import DType
from memcalc.core.spec import ExperimentSpec, TrainingSpec
from memcalc.engine.sharding import GatherHooks
from memcalc.engine.sim import Param, Sim, T

#: sim categories (the breakdown's names)
CAT_UNSHARDED = "unsharded parameters (FSDP2)"
CAT_AG = "all-gather buffers (FSDP2)"
CAT_RS = "reduce-scatter buffers (FSDP2)"


def fsdp2_active(tr: TrainingSpec) -> bool:
    """FSDP2 runs the step: ``--sharding fsdp2`` with ZeRO 2 or 3 over more than one GPU."""
    return tr.sharding == "fsdp2" and tr.zero >= 2 and tr.gpus > 1


def padded_shard_numel(shape: tuple[int, ...], gpus: int) -> int:
    """Elements of one rank's padded shard of a parameter: ``torch.chunk`` on dim 0 gives the
    first chunk ceil(rows / N) rows, and every rank's shard is padded to it
    (``FSDPParam._init_sharded_param``, ``padded_sharded_param_size``)."""
    rows = shape[0] if shape else 1
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-rows // gpus) * rest


@dataclass(frozen=True)
class Policy:
    """The dtypes FSDP2 uses for one setup (``MixedPrecisionPolicy`` as memcalc maps it)."""

    orig: DType  # the sharded parameters (and the optimizer's parameters)
    param: DType  # unsharded parameters, all-gather, unsharded gradients
    reduce: DType  # reduce-scatter buffers and gradient shards before any cast back
    reshard_after_forward: bool
    offload: bool  # CPUOffloadPolicy

    @property
    def cast(self) -> bool:
        return self.param != self.orig

    def describe(self) -> str:
        parts = ["reshard after forward" if self.reshard_after_forward else "no reshard after forward"]
        if self.cast or self.reduce != self.param:
            parts.append(f"MixedPrecisionPolicy {self.param.value}/{self.reduce.value}")
        if self.offload:
            parts.append("CPUOffloadPolicy")
        return ", ".join(parts)


def policy(tr: TrainingSpec) -> Policy:
    """FSDP2's dtypes for ``tr``: ``--master-weights`` over a 16-bit precision is
    ``MixedPrecisionPolicy(param_dtype=16-bit, reduce_dtype=fp32)`` over fp32 shards; otherwise
    no policy (everything in the weight dtype; autocast, if any, casts inside the ops). Reshard after
    forward under ``--zero 3``, never with ``--pp``: torchtitan 0.3.0 ``distributed/fsdp.py``
    ``get_fsdp_reshard_after_forward_policy("default", pp_enabled)`` is ``not pp_enabled``
    (:mod:`memcalc.engine.pipeline_fsdp`)."""
    if tr.master_weights:
        orig, par, red = DType.fp32, tr.compute_dtype, DType.fp32
    else:
        orig = par = red = tr.weight_dtype
    return Policy(orig, par, red, tr.zero >= 3 and tr.pp == 1, tr.offload_optimizer)


def fsdp_active(tr: TrainingSpec) -> bool:
    """FSDP2 or FSDP1 (``engine.fsdp1``) runs the step: ZeRO 2 or 3 over more than one GPU."""
    return tr.sharding in ("fsdp2", "fsdp1") and tr.zero >= 2 and tr.gpus > 1


def optimizer_training(tr: TrainingSpec) -> TrainingSpec:
    """The setup as the optimizer sees it under FSDP: with the mixed-precision policy it steps
    fp32 shards with fp32 gradients, exactly an fp32 step (no master copy, foreach as usual)."""
    if fsdp_active(tr) and tr.master_weights:
        return tr.model_copy(update={"precision": "fp32", "master_weights": False})
    return tr


@dataclass(eq=False)
class Unit:
    """One ``fully_shard`` unit: a decoder layer, or the root (``layer`` None)."""

    layer: Optional[int]
    params: list[Param]
    shard_numels: list[int]  # padded shard elements per parameter (this rank)
    unsharded: list[T] = field(default_factory=list)
    ag_out: Optional[T] = None  # all-gather output, between unshard and copy-out
    resharded: bool = True
    flat: int = 0  # FSDP1: this rank's elements of the unit's flat parameter (engine.fsdp1)


class FSDP2(GatherHooks):
    """The per-rank runtime of FSDP2 on the simulator. The decoder walk calls
    :meth:`layer_enter` / :meth:`layer_exit` around each layer's forward (and again around a
    checkpointed layer's recompute, where they do nothing); the timeline calls the rest."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, params: list[Param], shapes: dict[str, tuple[int, ...]]) -> None:
        self.sim = sim
        self.n = exp.training.gpus
        self.pol = policy(exp.training)
        by_layer: dict[Optional[int], list[Param]] = {}
        for p in params:
            by_layer.setdefault(p.layer, []).append(p)
        self.root = self._unit(None, by_layer.pop(None, []), shapes)
        self.layers = {i: self._unit(i, ps, shapes) for i, ps in sorted(by_layer.items())}
        self.ag_state: Optional[T] = None  # comm_ctx.all_gather_state: the last forward all-gather output
        self.rs_state: Optional[T] = None  # comm_ctx.reduce_scatter_states (max_input_buffers 1)
        self.in_backward = False
        self.current: Optional[Unit] = None  # the layer unit backward is in
        self.order: list[Unit] = []  # post_forward_order

    def _unit(self, layer: Optional[int], ps: list[Param], shapes: dict[str, tuple[int, ...]]) -> Unit:
        for p in ps:
            p.deferred_reduce = True
        return Unit(layer, ps, [padded_shard_numel(shapes[p.name], self.n) for p in ps])

    def _param_dtype_bytes(self, p: Param, numel: int) -> int:
        """Bytes of ``numel`` elements of ``p`` as the forward sees it (its ``param_dtype``; a
        packed NF4 base keeps its packed size per element ratio)."""
        bits = p.weight.itemsize_bits
        return -(-numel * bits // 8)

    def _cast(self, p: Param) -> bool:
        """Whether ``p`` is all-gathered through a cast copy (torch 2.13 ``_fsdp_collectives.py``
        ``_get_param_all_gather_inputs``: ``use_foreach_copy`` when its ``param_dtype`` is set): under
        the policy the trainable parameters' fp32 shards; a frozen one is 16-bit already
        (``init_dtype_attrs`` clears a ``param_dtype`` equal to the original dtype; memcalc.engine.weights
        ``_shard_dtype``)."""
        return self.pol.cast and p.trainable

    # -- all-gather ---------------------------------------------------------------------
    def unshard(self, u: Unit) -> None:
        """``FSDPParamGroup.unshard`` -> ``foreach_all_gather``: copy-in, then the flat output."""
        if not u.resharded or u.ag_out is not None:
            return
        sim, pol = self.sim, self.pol
        ins: list[T] = []
        if pol.offload:  # all_gather_inputs: sharded_param_data.to(device), then the cast
            for p, s in zip(u.params, u.shard_numels):
                h2d = sim.alloc(pol.orig.nbytes(s) if self._cast(p) else self._param_dtype_bytes(p, s),
                                "temporaries", CAT_AG)
                if self._cast(p):
                    c = sim.alloc(self._param_dtype_bytes(p, s), "temporaries", CAT_AG)
                    sim.unref(h2d)
                    h2d = c
                ins.append(h2d)
        elif pol.cast:  # flat_foreach_copy_input: the parameters with a param_dtype (use_foreach_copy)
            copied = sum(self._param_dtype_bytes(p, s) for p, s in zip(u.params, u.shard_numels) if self._cast(p))
            if copied:
                ins.append(sim.alloc(copied, "temporaries", CAT_AG))
        u.ag_out = sim.alloc(self.n * sum(self._param_dtype_bytes(p, s) for p, s in zip(u.params, u.shard_numels)),
                             "temporaries", CAT_AG)
        for t in ins:
            sim.unref(t)

    def wait_for_unshard(self, u: Unit, forward: bool) -> None:
        """``wait_for_unshard`` -> ``foreach_all_gather_copy_out``: allocate the unsharded
        parameters; in forward then free the previous unit's kept all-gather output and keep this
        one, in backward free this one."""
        if u.ag_out is None:
            return
        sim = self.sim
        u.unsharded = [sim.alloc(self.n * self._param_dtype_bytes(p, s), "weights", CAT_UNSHARDED)
                       for p, s in zip(u.params, u.shard_numels)]
        u.resharded = False
        if forward:
            # ``if prev_all_gather_state := self.comm_ctx.all_gather_state``: the local name keeps
            # the previous output alive until wait_for_unshard returns, after this copy-out
            if self.ag_state is not None:
                sim.unref(self.ag_state)
            self.ag_state = u.ag_out
        else:
            sim.unref(u.ag_out)
        u.ag_out = None

    def reshard(self, u: Unit) -> None:
        for t in u.unsharded:
            self.sim.unref(t)
        u.unsharded = []
        u.resharded = True

    # -- forward ------------------------------------------------------------------------
    def before_forward(self) -> None:
        """The root's pre-forward (``_root_pre_forward``, then its group's ``pre_forward``)."""
        self.in_backward = False
        self.order = []
        self.unshard(self.root)
        self.wait_for_unshard(self.root, forward=True)

    def forward_enter(self, lo: int) -> None:
        """A region of layers starts (the per-layer hooks do the work)."""

    def layer_enter(self, i: int) -> None:
        if self.in_backward:  # a checkpointed layer's recompute: pre_backward unsharded it
            return
        u = self.layers[i]
        self.unshard(u)
        self.wait_for_unshard(u, forward=True)

    def layer_exit(self, i: int) -> None:
        if self.in_backward:
            return
        u = self.layers[i]
        if self.pol.reshard_after_forward:
            self.reshard(u)
        self.order.append(u)

    def release(self) -> None:
        """After the layers: nothing (the last all-gather output waits for the root's post-forward)."""

    def after_forward(self) -> None:
        """The root's post-forward (after the loss, which the model's forward returns): the root
        keeps its unsharded parameters (FSDP2's default for the root, see the module docstring),
        and the kept all-gather output is freed."""
        if self.ag_state is not None:
            self.sim.unref(self.ag_state)
            self.ag_state = None
        self.order.append(self.root)

    # -- backward -----------------------------------------------------------------------
    def backward_start(self) -> None:
        """The root's pre-backward (at the loss): the root is still unsharded (its unshard is a
        no-op then), then prefetch the last layer."""
        self.in_backward = True
        self.current = None
        self.unshard(self.root)
        self.wait_for_unshard(self.root, forward=False)
        self._prefetch_before(self.root)

    def _prefetch_before(self, u: Unit) -> None:
        idx = max(i for i, x in enumerate(self.order) if x is u)
        if idx > 0:
            self.unshard(self.order[idx - 1])

    def backward_enter(self, layer: Optional[int]) -> None:
        """Backward reaches an op of ``layer`` (None: embedding, head, loss): the post-backward of
        the layer it leaves, then the pre-backward of the layer it enters."""
        if layer is not None and self.current is not None and self.current.layer == layer:
            return
        if layer is None and self.current is None:
            return
        if self.current is not None:
            self.post_backward(self.current)
            self.current = None
        if layer is not None:
            u = self.layers[layer]
            self.unshard(u)
            self.wait_for_unshard(u, forward=False)
            self._prefetch_before(u)
            self.current = u

    def post_backward(self, u: Unit) -> None:
        """``FSDPParamGroup.post_backward`` -> ``foreach_reduce`` for one unit."""
        sim, pol = self.sim, self.pol
        with_grad = [(p, s) for p, s in zip(u.params, u.shard_numels) if p.unsharded_grad is not None]
        self.reshard(u)
        if self.rs_state is not None:  # reduce_scatter_states.pop(0)
            sim.unref(self.rs_state)
            self.rs_state = None
        if not with_grad:
            return
        shard = sum(s for _, s in with_grad)
        # ``unsharded_grads.clear()`` frees the gradients, but the loop variable ``unsharded_grad``
        # of foreach_reduce's Shard(i > 0) check still holds the last one until it returns: the
        # root's last parameter is the head, so its gradient outlives the reduce-scatter output
        kept = self._reduce_loop(with_grad)
        rs_in = sim.alloc(self.n * pol.reduce.nbytes(shard), "temporaries", CAT_RS)
        for p, _ in with_grad:
            if not any(p.unsharded_grad is k for k in kept):
                sim.unref(p.unsharded_grad)
            p.unsharded_grad = None
        out = sim.alloc(pol.reduce.nbytes(shard), "gradients", "gradient shards (FSDP2)")
        if pol.reduce != pol.orig:  # _to_dtype_if_needed(reduce_output, orig_dtype)
            cast = sim.alloc(pol.orig.nbytes(shard), "gradients", "gradient shards (FSDP2)")
            sim.unref(out)
            out = cast
        self._hand_out(out, [p for p, _ in with_grad])
        for k in kept:
            sim.unref(k)
        self.rs_state = rs_in

    def _reduce_loop(self, with_grad: list) -> list[T]:
        """``foreach_reduce``'s Shard(i > 0) loop before the reduce-scatter input; what its locals hold until it
        returns: the loop variable the last gradient (``Shard(1)`` copies and ``chunks``:
        :func:`memcalc.engine.expert_fsdp.shard1_cat`)."""
        return [with_grad[-1][0].unsharded_grad]

    def _hand_out(self, out: T, params: list[Param]) -> None:
        """The reduced gradient shard ``out`` (this call's reference) becomes each parameter's
        ``.grad`` (where it has none), and each parameter's gradient is then ready (the optimizer
        hook); under CPU offload (``new_sharded_grad.to("cpu")``) the GPU copy dies here."""
        sim = self.sim
        if self.pol.offload:
            sim.unref(out)
            out = None
        for p in params:
            if out is not None and p.grad is None:
                p.grad = sim.ref(out)
            if sim.grad_ready is not None:
                sim.grad_ready(sim, p)
        if out is not None:
            sim.unref(out)

    def end_backward(self) -> None:
        """The final callback: the last layer's post-backward if it has not run, the root's
        post-backward, then every kept reduce-scatter input released (``finalize_backward``)."""
        if self.current is not None:
            self.post_backward(self.current)
            self.current = None
        self.post_backward(self.root)
        if self.rs_state is not None:
            self.sim.unref(self.rs_state)
            self.rs_state = None
        for u in self.layers.values():  # a unit whose post-backward never ran (no gradient reached it)
            if not u.resharded:
                self.reshard(u)
        self.in_backward = False


def host_offload_bytes(exp: ExperimentSpec) -> int:
    """Host (CPU) bytes per rank under FSDP2's ``CPUOffloadPolicy`` (``--offload-optimizer`` with
    FSDP2): every parameter's padded shard and every trainable one's gradient shard in the
    original dtype (``FSDPParam._init_sharded_param`` moves the shard to the CPU;
    ``foreach_reduce`` copies each gradient shard there), plus the optimizer state of the shards
    (the optimizer steps on the CPU). Pinned staging and the host allocator's rounding ignored."""
    from memcalc.engine.optimizers import state_bytes
    from memcalc.engine.params import param_inventory
    from memcalc.engine.tensor_parallel import local_experiment

    tr = exp.training
    pol = policy(tr)
    opt_tr = optimizer_training(tr)
    total = 0
    for pt in param_inventory(local_experiment(exp).model, tr.lora):  # with TP: this rank's shards
        s = padded_shard_numel(pt.shape, tr.gpus)
        total += (pol.orig if pt.trainable or not pol.cast else tr.weight_dtype).nbytes(s)  # weights._shard_dtype
        if pt.trainable:
            total += pol.orig.nbytes(s)
            w = T(0, "weights", "", itemsize_bits=pol.orig.bits)
            fake = Param(pt.name, w, True, pol.orig.nbytes(s), pt.layer, s)
            rows = -(-pt.shape[0] // tr.gpus) if len(pt.shape) == 2 else 0
            total += sum(b for _, b in state_bytes(fake, rows, opt_tr))
    return total


def sharding_mechanics(tr: TrainingSpec) -> str:
    """Whose mechanics the estimate runs for ``tr``'s ZeRO stage, in words (the inputs table):
    FSDP2's (:mod:`memcalc.engine.fsdp`, with its reshard and precision policy), FSDP1's, DeepSpeed's
    (:mod:`memcalc.engine.deepspeed`), or the ZeRO paper's stage 1; empty when nothing is sharded."""
    if tr.zero == 0 or (tr.gpus <= 1 and not (tr.sharding == "deepspeed" and tr.zero >= 2)):
        return ""  # (DeepSpeed ZeRO-2/3 runs its partitions on one rank too: engine.sharding.uses_deepspeed)
    if fsdp2_active(tr):
        pipelined = (", each stage unsharded from its first all-gather to the end, gradients reduced after the last "
                     "micro-batch (engine.pipeline_fsdp)") if tr.pp > 1 else ""
        return f"FSDP2, {policy(tr).describe()}{pipelined}"
    if fsdp_active(tr):  # FSDP1 (engine.fsdp1)
        pol = policy(tr)
        how = ["FULL_SHARD" if pol.reshard_after_forward else "SHARD_GRAD_OP", "flat parameters"]
        if pol.cast or pol.reduce != pol.param:
            how.append(f"MixedPrecision {pol.param.value}/{pol.reduce.value}")
        return "FSDP1, " + ", ".join(how)
    if tr.zero == 1 and tr.sharding in ("fsdp2", "fsdp1"):
        return "DDP + ZeroRedundancyOptimizer: FSDP has no stage 1"
    if tr.zero >= 2:  # engine.deepspeed
        return ("DeepSpeed: flat fp32 partition, reduce buckets" +
                (", per-layer gathers with prefetch" if tr.zero >= 3 else ", gradient partition"))
    return "DeepSpeed ZeRO-1: the ZeRO paper's stage 1 (optimizer state sharded; its buckets not modelled)"

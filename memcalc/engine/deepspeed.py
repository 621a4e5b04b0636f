"""DeepSpeed ZeRO-2 / ZeRO-3 on one rank: its buffers and their lifetimes (sharding ``deepspeed``).

Followed from DeepSpeed 0.19's source (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py,
cited by function); every size is this rank's, in bytes:

- **flat 16-bit weights** (ZeRO-2): ``bit16_groups_flat``, all trainable parameters flattened
  into one buffer padded to ``2 * N`` elements (``nccl_start_alignment_factor = 2``,
  ``flatten_dense_tensors_aligned``); the parameters are views into it. memcalc keeps them as
  the weights of :func:`memcalc.engine.weights.make_params`.
- **fp32 master partition**: ``single_partition_of_fp32_groups`` (``__init__``: the rank's
  slice of the flat buffer, ``.clone().float()``), ``partition_size = flat / N`` elements, and
  the optimizer state created over that one tensor (``torch.optim.AdamW``: ``exp_avg``,
  ``exp_avg_sq``); the step's temporaries are those of the same optimizer over one tensor.
- **reduce bucket** (``setup_buckets``): at a micro-step's first gradient hook,
  ``reduce_bucket_size`` elements in the weights' dtype, twice with ``overlap_comm``
  (double buffering), released at the end of backward (``_release_ipg_buffers``). With
  ``contiguous_gradients`` each gradient is copied into it (``reduce_independent_p_g_buckets_
  and_remove_grads``) and autograd's own gradient is freed; a gradient larger than the bucket
  stays where it is until the next reduction.
- **reduction**: when the next gradient would overflow the bucket, and at the end of backward
  (``independent_gradient_partition_epilogue``), ``average_tensor`` all-reduces the bucket
  through ``allreduce_bucket``, whose ``flatten`` copies the bucket's gradients (a transient of
  the bucket's elements when, split at the ranks' partition boundaries, it is more than one piece).
- **gradient partition** (``copy_grads_in_partition``): at the first reduction, one buffer of
  the *whole* size of every parameter that overlaps this rank's partition
  (``params_in_partition``), in the weights' dtype, kept until the optimizer step.
- **step** (``step``): the gradient norm casts each gradient slice of the partition to fp64
  one at a time (``get_grad_norm_direct``, ``get_norm_dtype``); the partition's gradients are
  flattened (a copy unless they are one slice) and cast to fp32 (``single_grad_partition``,
  a new tensor unless they are fp32 already); the gradient partition is freed; the optimizer
  steps the fp32 partition; its fp32 gradient is freed; the 16-bit partition is copied back
  and all-gathered in place.

ZeRO-3 (stage3.py, :class:`DeepSpeedZero3`) keeps each 16-bit weight partitioned
(``ceil(numel / N)`` elements, ``ds_tensor``), all-gathers a layer's parameters when it runs
(prefetching ahead, keeping those reused within ``stage3_max_reuse_distance`` elements) and
releases them after, with small parameters (at most ``stage3_param_persistence_threshold``
elements) kept whole on every rank; its reduce bucket exists from the start and its gradient
partitions are one flat buffer (``grad_partitions_flat_buffer``).

``offload_param`` (ZeRO-3, :func:`memcalc.engine.sharding.offload_param`): the 16-bit partitions live in
pinned host memory (:func:`host_param_bytes`, reported apart, not in the GPU peak); every gather copies
them to the GPU (:class:`_Gathers`), bounded by the same prefetch / live / reuse limits; the fp32 master
partition, its state, the gradient partition and the buckets stay on the GPU unless ``offload_optimizer``
moves the first three (stage3.py ``self.device``); after the step the fp32 partition is copied into the
host buffer in place (``_reassign_or_swap_out_partitioned_parameters``).

Gradient accumulation runs as the timeline runs it (micro-steps after the second repeat it;
the gradient partitions persist across micro-steps, the ZeRO-2 bucket is made again in each).

Not modelled: ZeRO-3's
gathers are followed per layer, not per module (DeepSpeed releases and prefetches module by
module: with a small ``stage3_max_reuse_distance`` and prefetch bucket the estimate can be
several percent low), and the coalesced all-gather's transient flat buffer;
``round_robin_gradients``, pipeline or tensor parallel groups, MoE expert groups, NVMe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from memcalc.core.dtypes import DType
from memcalc.core.spec import DeepSpeedSpec, ExperimentSpec
from memcalc.engine.sim import Param, Sim, T
from memcalc.engine.sharding import GatherHooks, offload_param

#: stage_1_and_2.py ``nccl_start_alignment_factor``: 4-byte alignment / sizeof(fp16)
NCCL_START_ALIGNMENT_FACTOR = 2
#: deepspeed/runtime/zero/utils.py ``get_norm_dtype``: gradient norms accumulate in fp64
NORM_BYTES = 8


def deepspeed_optimizer(sim: Sim, exp: ExperimentSpec, params: list[Param]) -> "DeepSpeedZero2":
    """The optimizer side of ``exp``'s DeepSpeed stage, on ``sim``."""
    return (DeepSpeedZero3 if exp.training.zero >= 3 else DeepSpeedZero2)(sim, exp, params)


def ds_spec(exp: ExperimentSpec) -> DeepSpeedSpec:
    """The DeepSpeed settings of ``exp``: its config, or DeepSpeed's defaults for its stage."""
    tr = exp.training
    return tr.deepspeed or DeepSpeedSpec(stage=3 if tr.zero >= 3 else 2)


@dataclass(frozen=True)
class Partition:
    """How DeepSpeed splits the flat trainable parameters over ``n`` ranks (stage_1_and_2.py
    ``__init__``: ``flatten_dense_tensors_aligned``, ``get_data_parallel_partitions``,
    ``get_partition_info``), for rank ``rank``."""

    flat_numel: int
    partition_numel: int
    #: elements of each trainable parameter inside this rank's partition (0 = none)
    pieces: tuple[int, ...]
    #: summed whole size of the parameters that overlap the partition (``params_in_partition``)
    overlap_numel: int
    #: each parameter's first element in the flat buffer
    starts: tuple[int, ...] = ()

    def ranks_spanned(self, i: int, numel: int) -> int:
        """How many ranks' partitions parameter ``i`` (``numel`` elements) crosses."""
        s = self.starts[i]
        return (s + max(numel, 1) - 1) // self.partition_numel - s // self.partition_numel + 1


def partition(numels: list[int], n: int, rank: int = 0) -> Partition:
    """See :class:`Partition`; the flat buffer is padded to a multiple of ``2 * n`` elements."""
    total = sum(numels)
    align = NCCL_START_ALIGNMENT_FACTOR * n
    flat = -(-total // align) * align
    part = flat // n
    lo, hi = rank * part, (rank + 1) * part
    pieces, overlap, start, starts = [], 0, 0, []
    for k in numels:
        starts.append(start)
        end = start + k
        inside = max(0, min(end, hi) - max(start, lo))
        pieces.append(inside)
        if inside:
            overlap += k
        start = end
    return Partition(flat, part, tuple(pieces), overlap, tuple(starts))


class DeepSpeedZero2:
    """ZeRO-2's optimizer side on the simulator: the fp32 master partition and its state, the
    reduce bucket, the gradient partition and the step (see the module docstring). Used by
    :mod:`memcalc.engine.timeline` in place of :class:`memcalc.engine.optimizers.OptimizerSim`;
    ``grad_ready`` is the simulator's gradient hook."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, params: list[Param]) -> None:
        tr = exp.training
        self.sim, self.ds = sim, ds_spec(exp)
        self.wdt: DType = tr.weight_dtype
        self.trainable = [p for p in params if p.trainable]
        self.part = partition([p.numel for p in self.trainable], tr.gpus)
        self.in_part = {p.name for p, k in zip(self.trainable, self.part.pieces) if k}
        self.index = {p.name: i for i, p in enumerate(self.trainable)}
        pn = self.part.partition_numel
        #: offload_optimizer: the fp32 partition, its gradient, state and step live on the host
        #: (stage_1_and_2.py ``cpu_offload``: gradients are copied out of the bucket to a pinned
        #: host buffer, ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``)
        self.offload = tr.offload_optimizer
        self._master_partition(sim, tr, pn)
        self.buckets: list[T] = []
        self.elements = 0
        self.bucket_params: list[Param] = []
        self.grad_partition: Optional[T] = None

    # -- OptimizerSim's interface ------------------------------------------------------
    def create_all(self) -> None:
        self.opt.create_all()

    def grad_ready(self, sim: Sim, p: Param) -> None:
        """``reduce_independent_p_g_buckets_and_remove_grads`` for one parameter's gradient."""
        if not p.trainable or p.grad is None:
            return
        size = self.ds.reduce_bucket_size
        if not self.buckets and self.ds.contiguous_gradients:  # setup_buckets
            for _ in range(2 if self.ds.overlap else 1):
                self.buckets.append(sim.alloc(self.wdt.nbytes(size), "gradients", "reduce bucket (DeepSpeed)"))
        if self.elements + p.numel > size and self.bucket_params:
            self._reduce()
        if self.ds.contiguous_gradients and p.numel <= size:
            sim.unref(p.grad)  # copied into the bucket; the parameter's .grad is a view of it
            p.grad = None
        self.elements += p.numel
        self.bucket_params.append(p)

    def _reduce(self) -> None:
        """``reduce_ipg_grads``: the all-reduce's flattened copy, then this rank's gradients into
        the gradient partition; the others' are dropped."""
        sim = self.sim
        # average_tensor splits the bucket at the ranks' partition boundaries; allreduce_bucket's
        # flatten copies the pieces unless there is only one
        pieces = sum(self.part.ranks_spanned(self.index[p.name], p.numel) for p in self.bucket_params)
        if pieces > 1:
            sim.transient(self.wdt.nbytes(self.elements), "temporaries", "all-reduce flatten (DeepSpeed)")
        for p in self.bucket_params:
            mine = p.name in self.in_part
            if self.ds.contiguous_gradients:
                if mine and self.grad_partition is None and not self.offload:
                    self.grad_partition = sim.alloc(self.wdt.nbytes(self.part.overlap_numel), "gradients",
                                                    "gradient partition (DeepSpeed)")
                if p.grad is not None:  # a gradient larger than the bucket
                    sim.unref(p.grad)
                    p.grad = None
            elif not mine and p.grad is not None:
                sim.unref(p.grad)
                p.grad = None
        self.elements = 0
        self.bucket_params = []

    def _master_partition(self, sim: Sim, tr, pn: int) -> None:
        """The fp32 master partition of ``pn`` elements (on the host with offload), and the client
        optimizer over that one tensor (an fp32 step, one flat parameter)."""
        from memcalc.engine.optimizers import OptimizerSim

        self.master = (T(0, "optimizer_state", "fp32 master partition (DeepSpeed, host)") if self.offload else
                       sim.alloc(DType.fp32.nbytes(pn), "optimizer_state", "fp32 master partition (DeepSpeed)"))
        self.flat = Param("fp32 partition", self.master, True, DType.fp32.nbytes(pn), None, pn)
        inner = tr.model_copy(update=dict(precision="fp32", master_weights=False, zero=0, gpus=1,
                                          sharding="fsdp2", deepspeed=None))
        self.opt = OptimizerSim(sim, inner, [self.flat], {self.flat.name: 0})

    def end_backward(self) -> None:
        """``independent_gradient_partition_epilogue``: reduce what is left, free the buckets."""
        if self.bucket_params:
            self._reduce()
        for b in self.buckets:
            self.sim.unref(b)
        self.buckets = []

    def step_all(self) -> None:
        """``step``: norm, the fp32 gradient partition, the optimizer, then the frees."""
        sim = self.sim
        if self.offload:  # the step runs on the host; the 16-bit partition is copied back in place
            for p in self.trainable:
                if p.grad is not None:
                    sim.unref(p.grad)
                    p.grad = None
            return
        pieces = [k for k in self.part.pieces if k]
        if pieces:
            sim.transient(max(pieces) * NORM_BYTES, "temporaries", "gradient norm in fp64 (DeepSpeed)")
        pn = self.part.partition_numel
        flat = sim.alloc(self.wdt.nbytes(pn), "temporaries", "flattened gradient partition") if len(pieces) > 1 else None
        grad32 = None
        if self.wdt != DType.fp32 or flat is None:
            grad32 = sim.alloc(DType.fp32.nbytes(pn), "gradients", "fp32 gradient partition (DeepSpeed)")
        else:
            grad32, flat = flat, None
        if flat is not None:
            sim.unref(flat)
        if self.grad_partition is not None:
            sim.unref(self.grad_partition)
            self.grad_partition = None
        for p in self.trainable:  # free_grad_in_param_list
            if p.grad is not None:
                sim.unref(p.grad)
                p.grad = None
        self.flat.grad = grad32
        self.opt.step_all()
        sim.unref(grad32)
        self.flat.grad = None


class _Gathers(GatherHooks):
    """ZeRO-3's gathered 16-bit weights at layer granularity (partitioned_param_coordinator.py):
    a layer's parameters are all-gathered (whole, ``numel`` elements of the weights' dtype, one
    tensor each: partition_parameters.py ``AllGatherCoalescedHandle.wait``) when it runs, with the
    next layers prefetched up to ``stage3_prefetch_bucket_size`` elements (``fetch_sub_module``,
    bounded by ``stage3_max_live_parameters``); after its forward a layer is released unless the
    parameters met before its backward reuse it are fewer than ``stage3_max_reuse_distance``
    elements (``__params_to_release``); after its backward it is released. Embedding and head
    are the root module's: fetched when the step starts, released when its backward ends;
    parameters of at most ``stage3_param_persistence_threshold`` elements are never released
    (``ds_persist``, allocated whole by :class:`DeepSpeedZero3`).

    A gathered parameter is a new device tensor unless it is its own partition: with one rank and the
    partitions on the GPU, ``all_gather_coalesced`` takes ``_no_gather_coalesced`` and ``NoGatherHandle``
    sets ``param.data = param.ds_tensor.data.to(device)``, the partition itself (no copy; ``copies``
    False). With ``offload_param`` that ``.to(device)`` copies the host partition to the GPU (one rank),
    or, over N ranks, ``torch.cat([p.ds_tensor.to(device) ...], out=...)`` first copies each host
    partition to the GPU (``host_copies``: a transient of the layer's partitions at each gather)."""

    def __init__(self, sim: Sim, ds: DeepSpeedSpec, wdt: DType, layer_numel: list[int], embed_numel: int,
                 head_numel: int, copies: bool = True, host_copies: int = 0) -> None:
        self.sim, self.ds, self.wdt = sim, ds, wdt
        self.copies, self.host_copies = copies, host_copies
        self.layer_numel, self.embed_numel, self.head_numel = layer_numel, embed_numel, head_numel
        self.live: dict[object, T] = {}  # "embed" / "head" / layer index -> gathered block
        self.in_backward = False
        n = len(layer_numel)
        after = [sum(layer_numel[i + 1:]) for i in range(n)]
        #: elements met between a layer's forward and its backward: the later layers and the head, twice
        self.reuse_gap = [2 * after[i] for i in range(n)]

    def _numel(self, key) -> int:
        return {"embed": self.embed_numel, "head": self.head_numel}.get(key, 0) if isinstance(key, str) \
            else self.layer_numel[key]

    def _get(self, key) -> None:
        if key not in self.live and self._numel(key) and self.copies:
            self.live[key] = self.sim.alloc(self.wdt.nbytes(self._numel(key)), "weights",
                                            "all-gathered weights (DeepSpeed ZeRO-3)")
            if self.host_copies:  # the partitions copied to the GPU, then cat into the gathered buffer
                self.sim.transient(self.wdt.nbytes(-(-self._numel(key) // self.host_copies)), "temporaries",
                                   "host-to-GPU partition copies (DeepSpeed offload_param)")

    def _drop(self, key) -> None:
        t = self.live.pop(key, None)
        if t is not None:
            self.sim.unref(t)

    def _prefetch(self, order: list) -> None:
        """Gather ahead along ``order`` up to the prefetch bucket (and the live-parameter limit)."""
        budget = min(self.ds.prefetch_bucket_size,
                     self.ds.max_live_parameters - sum(self._numel(k) for k in self.live))
        done = 0
        for key in order:
            if done >= budget:
                break
            if key not in self.live:
                self._get(key)
            done += self._numel(key)

    def forward_enter(self, i: int) -> None:
        if i == 0:  # the root's parameters: fetched with the root module, released when its backward ends
            self._get("embed")
            self._get("head")
        self._get(i)
        for j in range(i):
            if self.reuse_gap[j] >= self.ds.max_reuse_distance:
                self._drop(j)
        self._prefetch(list(range(i + 1, len(self.layer_numel))) + ["head"])

    def backward_enter(self, i: Optional[int]) -> None:
        if i is None:  # backward outside the layers (the root's ops): DeepSpeed's hooks are per layer
            return
        self.in_backward = True
        for j in [k for k in self.live if isinstance(k, int) and k > i]:
            self._drop(j)
        self._get(i)
        self._prefetch(list(range(i - 1, -1, -1)) + ["embed"])

    def release(self) -> None:
        """After the layers' forward (the head runs next), or at the end of backward (all go)."""
        if self.in_backward:
            for k in list(self.live):
                self._drop(k)
            self.in_backward = False
            return
        n = len(self.layer_numel)
        if n and self.reuse_gap[n - 1] >= self.ds.max_reuse_distance:
            self._drop(n - 1)

    def release_layers(self) -> None:
        """Every layer's post-backward hook has run: only the root's parameters stay."""
        for k in [k for k in self.live if isinstance(k, int)]:
            self._drop(k)


class DeepSpeedZero3(DeepSpeedZero2):
    """ZeRO-3 on the simulator (stage3.py): per-parameter partitions (``ceil(numel / N)``
    elements each, ``partition_numel``), the fp32 master partition and its state, the reduce
    bucket allocated once at start (``__init__``: one ``reduce_bucket_size`` buffer with
    ``contiguous_gradients``), the flat gradient partition buffer (``grad_partitions_flat_buffer``,
    the weights' dtype), persistent small parameters whole, the gathers (:class:`_Gathers`);
    in backward each gradient is copied into the bucket and freed, a full bucket is
    reduce-scattered (``reduce_scatter_coalesced`` flattens a copy of it); the step casts each
    gradient partition to fp64 for the norm (``get_grad_norm_direct``), flattens the partitions
    and casts them to fp32 (``_prepare_fp32_grad_for_sub_group``), steps, frees."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, params: list[Param]) -> None:
        tr = exp.training
        self.sim, self.ds = sim, ds_spec(exp)
        self.wdt = tr.weight_dtype
        n = self.n = tr.gpus
        self.trainable = [p for p in params if p.trainable]
        self.pns = [-(-p.numel // n) for p in self.trainable]
        pn = sum(self.pns)
        self.offload = tr.offload_optimizer
        #: a gathered parameter is a new GPU tensor (not its partition itself: see _Gathers)
        host = offload_param(exp)
        copies = n > 1 or host
        persist = [p for p in params if p.numel <= self.ds.param_persistence_threshold]
        self.persistent = [sim.alloc(self.wdt.nbytes(p.numel), "weights", "persistent small parameters (DeepSpeed)")
                           for p in persist] if copies else []
        self._master_partition(sim, tr, pn)
        self.buckets = ([sim.alloc(self.wdt.nbytes(self.ds.reduce_bucket_size), "gradients", "reduce bucket (DeepSpeed)")]
                        if self.ds.contiguous_gradients else [])
        self.grad_partition = (None if self.offload else
                               sim.alloc(self.wdt.nbytes(pn), "gradients", "gradient partition (DeepSpeed)"))
        self.elements = 0
        self.bucket_params: list[Param] = []
        keep = {id(p) for p in persist}
        layers = max([p.layer for p in params if p.layer is not None], default=-1) + 1
        layer_numel = [0] * layers
        root = {"embed": 0, "head": 0}
        for p in params:
            if id(p) in keep:
                continue
            if p.layer is not None:
                layer_numel[p.layer] += p.numel
            else:
                root["embed" if "embed" in p.name else "head"] += p.numel
        self.gather = _Gathers(sim, self.ds, self.wdt, layer_numel, root["embed"], root["head"], copies,
                               n if host and n > 1 else 0)

    def grad_ready(self, sim: Sim, p: Param) -> None:
        """``reduce_independent_p_g_buckets_and_remove_grads`` (stage3.py)."""
        if not p.trainable or p.grad is None:
            return
        size = self.ds.reduce_bucket_size
        if self.elements + p.numel > size and self.bucket_params:
            self._reduce()
        if self.ds.contiguous_gradients and self.elements + p.numel <= size:
            sim.unref(p.grad)  # __add_grad_to_ipg_bucket: copied in, .grad is a view of the bucket
            p.grad = None
        self.elements += p.numel
        self.bucket_params.append(p)

    def _reduce(self) -> None:
        """``__reduce_and_partition_ipg_grads``: ``reduce_scatter_coalesced`` (comm/coalesced_collectives.py)
        interleaves the gradients' rank chunks, each padded to ``ceil(numel / N)``, into one new
        buffer, unless the bucket is one gradient that divides evenly; the partitions land in the
        flat gradient buffer (no new block)."""
        ps = self.bucket_params
        if not (len(ps) == 1 and ps[0].numel % self.n == 0):
            padded = sum(-(-p.numel // self.n) * self.n for p in ps)
            self.sim.transient(self.wdt.nbytes(padded), "temporaries", "reduce-scatter flatten (DeepSpeed)")
        for p in self.bucket_params:
            if p.grad is not None:
                self.sim.unref(p.grad)
                p.grad = None
        self.elements = 0
        self.bucket_params = []

    def end_backward(self) -> None:
        """The layers are released in their post-backward hooks, then the epilogue reduces the rest."""
        self.gather.release_layers()
        if self.bucket_params:
            self._reduce()

    def step_all(self) -> None:
        sim = self.sim
        if self.offload:
            return
        if self.pns:
            sim.transient(max(self.pns) * NORM_BYTES, "temporaries", "gradient norm in fp64 (DeepSpeed)")
        pn = sum(self.pns)
        flat = sim.alloc(self.wdt.nbytes(pn), "temporaries", "flattened gradient partition")
        grad32 = flat
        if self.wdt != DType.fp32:
            grad32 = sim.alloc(DType.fp32.nbytes(pn), "gradients", "fp32 gradient partition (DeepSpeed)")
            sim.unref(flat)
        self.flat.grad = grad32
        self.opt.step_all()
        sim.unref(grad32)
        self.flat.grad = None


def host_param_bytes(exp: ExperimentSpec, numels: list[int]) -> int:
    """Pinned host bytes of ZeRO-3's ``offload_param`` on one rank: every parameter's 16-bit partition,
    ``ceil(numel / N)`` elements in the weights' dtype (partition_parameters.py ``_aligned_size`` /
    ``partition_numel``; stage3.py ``_create_param_groups_fp16_flat_cpu_memory``: one pinned buffer of the
    trainable partitions per parameter group, frozen parameters' partitions pinned one by one). Raw
    bytes: DeepSpeed pins with ``torch.Tensor.pin_memory`` (no caching host allocator rounding)."""
    n = exp.training.gpus
    return sum(exp.training.weight_dtype.nbytes(-(-k // n)) for k in numels)

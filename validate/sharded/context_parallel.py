"""Context parallelism (``--cp``) traced: one rank of torch's ring attention or DeepSpeed's Ulysses on the
fake process group, around memcalc's replica (:mod:`..model`).

Ring (``--cp-method ring``): torch 2.13's ``context_parallel``
(torch/distributed/tensor/experimental/_context_parallel/_attention.py), as torchtitan applies it
(``maybe_enable_cp`` / ``get_train_context``: the batch's ``inputs`` and ``labels`` and the RoPE table
sharded on the sequence, the default head-tail load balancer, rotate method ``allgather``). It is
``context_parallel``'s own pieces that run:

- the batch is this rank's shard: ``2 x cp`` chunks of ``seq / (2 cp)`` tokens, rank ``r`` holding
  chunks ``r`` and ``2 cp - 1 - r`` (``_HeadTailLoadBalancer``); the replica runs on ``seq / cp`` tokens
  (its RoPE table is made for them, as the sharded ``freqs_cis`` is);
- SDPA's q, k, v are wrapped by ``_ContextParallel.sdpa_input_fn`` (``DTensor.from_local``,
  ``Shard(2)``) and the output unwrapped by ``sdpa_output_fn``, the two functions ``context_parallel``
  monkey-patches ``F.scaled_dot_product_attention`` with (the replica calls the flash / efficient
  kernel by name, so they wrap its ``sdpa`` instead); ``_enable_cp_dtensor_dispatcher`` routes the
  DTensor kernels to ``_scaled_dot_product_ring_flash_attention`` (and its efficient / backward twins),
  whose ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` run unmodified;
- the collectives' outputs are not copied: ``_functional_collectives._maybe_wrap_tensor`` wraps a
  collective's output without a copy on CUDA, but the meta kernel of ``_wrap_tensor_autograd`` is an
  ``empty_like`` (:func:`_alias_wrap`);
- one kernel-dispatch patch: the ring's backward calls ``aten._scaled_dot_product_flash_attention_backward`` /
  ``_efficient_attention_backward`` once per ring step; the scratch CUDA's kernel allocates inside
  each call (FA2's ``dq_accum`` and ``softmax_d``, memory-efficient's ``delta`` and fp32 dq; see
  :mod:`..blocks.sdpa`) is allocated around each of those calls (the replica's kernel wrapper
  allocates it around its own call when it is not ring-dispatched).

Ulysses (``--cp-method ulysses``): DeepSpeed 0.19's ``DistributedAttention`` (deepspeed/sequence/layer.py)
unmodified, with the replica's SDPA call as its local attention (:func:`ulysses_sdpa`), its
all-to-alls through ``deepspeed.comm`` on the fake process group (no patch: ``all_to_all_single`` writes
into the ``empty_like`` buffer DeepSpeed allocates).

With ``--zero 2|3`` the replica is first wrapped by FSDP2's ``fully_shard`` over the flattened ``dp x cp``
mesh (torchtitan's ``dp_shard_cp``; ``fsdp2.apply_fsdp2``) and traced on fake tensors on ``cpu``, as the
FSDP2 x TP harness (:mod:`.tp`) is.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Optional
from collections.abc import Callable, Iterator

import torch
import torch.distributed._functional_collectives as ft_c

from memcalc.core.errors import UserError

aten = torch.ops.aten


def _scratch(q: torch.Tensor, k: torch.Tensor, efficient: bool) -> list:
    """What CUDA's backward kernel allocates inside one call (the replica's :mod:`..blocks.sdpa` rule)."""
    from memcalc.core.kernels import flash_head_dim_rounded, flash_seq_rounded

    B, H, T, D = q.shape
    if efficient:
        out = [q.new_empty((B, H, T), dtype=torch.float32)]
        if q.dtype != torch.float32:
            out.append(q.new_empty((B, T, H, D), dtype=torch.float32))
        return out
    tr = flash_seq_rounded(T)
    out = [q.new_empty((B, tr, H, flash_head_dim_rounded(D)), dtype=torch.float32),
           q.new_empty((B, H, tr), dtype=torch.float32)]
    if k.shape[1] != H:
        out += [q.new_empty((B, k.shape[2], H, D)) for _ in range(2)]
    return out


def _with_scratch(op, efficient: bool):
    def call(*args, **kwargs):
        scratch = _scratch(kwargs["query"], kwargs["key"], efficient)
        try:
            return op(*args, **kwargs)
        finally:
            del scratch
    return call


def _alias_wrap(t: torch.Tensor) -> torch.Tensor:
    """``_functional_collectives._maybe_wrap_tensor`` without a copy: on CUDA it wraps the collective's
    output in an ``AsyncCollectiveTensor`` over the same storage; ``_wrap_tensor_autograd``'s meta kernel
    returns ``empty_like(input)`` instead (a second buffer of the gathered size), and so does
    ``wait_tensor``'s. The collective's output itself: the same storage, as on CUDA."""
    return t


@contextlib.contextmanager
def ring_dispatch(mesh, tracer) -> Iterator[None]:
    """torch's CP dispatcher on, load balancing on, rotate method allgather (torch 2.13's defaults,
    torchtitan's ``context_parallel_rotate_method = "allgather"``), the backward kernels' scratch per
    ring step (the module docstring); everything restored on exit.

    The ring runs inside DTensor's dispatch of the SDPA kernel, below the tracer's dispatch mode: each
    CP handler runs with the mode pushed again (``tracer._reentered``, as loss parallel's handlers in
    :func:`.tp.make_tracer`), so the ring's own allocations on the local shards are counted."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    saved = (cpa._cp_options.enable_load_balance, cpa._cp_options.rotate_method,
             cpa._scaled_dot_product_ring_flash_attention_backward,
             cpa._scaled_dot_product_ring_efficient_attention_backward, cpa._templated_ring_attention_backward)
    templated = cpa._templated_ring_attention_backward

    def backward(group, seq_dim, op, *args, **kwargs):
        eff = op is aten._scaled_dot_product_efficient_attention_backward.default
        return templated(group, seq_dim, _with_scratch(op, eff), *args, **kwargs)

    cpa._cp_options.enable_load_balance = True
    cpa._cp_options.rotate_method = cpa._RotateMethod.ALL_GATHER
    cpa._templated_ring_attention_backward = backward
    cpa._dispatch_mode = cpa._DispatchMode.MONKEY_PATCH
    cpa._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=mesh)
    wrap = ft_c._maybe_wrap_tensor
    ft_c._maybe_wrap_tensor = _alias_wrap  # type: ignore[assignment]
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in cpa.custom_ops:
        handlers[op] = partial(tracer._reentered, handlers[op])
    try:
        yield
    finally:
        ft_c._maybe_wrap_tensor = wrap
        cpa._disable_context_parallel_dispatcher_impl()
        (cpa._cp_options.enable_load_balance, cpa._cp_options.rotate_method,
         cpa._scaled_dot_product_ring_flash_attention_backward,
         cpa._scaled_dot_product_ring_efficient_attention_backward, cpa._templated_ring_attention_backward) = saved


def ring_sdpa(mesh, inner: Callable) -> Callable:
    """The replica's ``sdpa`` with q, k, v (and a mask) passed through ``_ContextParallel.sdpa_input_fn``
    and the output through ``sdpa_output_fn`` (what ``context_parallel`` wraps
    ``F.scaled_dot_product_attention`` with)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _ContextParallel

    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)

    def sdpa(q, k, v, mask, kernel, dropout_p, is_causal, scale=None):
        if mask is not None or kernel not in ("flash", "efficient"):
            raise UserError(f"--cp-method ring runs the flash or memory-efficient kernel without a mask "
                            f"(torch's ring attention); this model's attention runs {kernel}"
                            + (" with a mask" if mask is not None else ""))
        (q, k, v), _ = style.sdpa_input_fn(None, (q, k, v), {}, mesh)
        out = inner(q, k, v, None, kernel, dropout_p, is_causal, scale)
        return style.sdpa_output_fn(None, None, out, mesh)
    return sdpa


def ulysses_env(rank: int, cp: int) -> dict[str, str]:
    """What ``deepspeed.comm`` reads of a launch, as rank ``rank`` of ``cp`` on the CPU accelerator
    (deepspeed 0.19 ``comm/comm.py`` ``init_distributed`` reads RANK / WORLD_SIZE / LOCAL_RANK;
    ``accelerator/real_accelerator.py`` DS_ACCELERATOR). With ``auto_mpi_discovery=False`` and
    ``dist_init_required=False`` DeepSpeed writes none of its own (MASTER_ADDR / MASTER_PORT are
    written on the MPI-discovery path only): these are all the Ulysses trace sets."""
    return {"RANK": str(rank), "WORLD_SIZE": str(cp), "LOCAL_RANK": "0", "LOCAL_SIZE": "1", "DS_ACCELERATOR": "cpu"}


#: the variables :func:`ulysses_sdpa` sets, which :func:`measure_cp` restores
ULYSSES_ENV_KEYS = tuple(ulysses_env(0, 1))


@contextlib.contextmanager
def restored_env(keys: tuple[str, ...]) -> Iterator[None]:
    """Each of ``keys`` back to its value on entry when the block ends (deleted where it was unset);
    every other variable as the block left it (what a library sets on import, e.g. inductor's
    TORCHINDUCTOR_CACHE_DIR, stays). A RANK / WORLD_SIZE left behind made a later Trainer in the process
    (accelerate's PartialState) and its subprocesses take themselves for a distributed launch."""
    import os

    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ulysses_sdpa(mesh, inner: Callable, rank: int, cp: int) -> Callable:
    """The replica's ``sdpa`` as the local attention of DeepSpeed 0.19's ``DistributedAttention``
    (deepspeed/sequence/layer.py; ``scatter_idx=2, gather_idx=1``, batch first): q, k, v go in as the
    ``(B, seq / cp, H, D)`` views of the kernel's ``(B, H, seq / cp, D)`` inputs, each through
    ``_SeqAllToAll`` to ``(B, seq, H / cp, D)``; the kernel runs on those (transposed to its layout)
    and its output comes back the same way. ``deepspeed.comm`` runs on the fake process group."""
    import os

    os.environ.update(ulysses_env(rank, cp))  # measure_cp puts each back as it was (restored_env)
    from deepspeed import comm as ds_comm
    from deepspeed.sequence.layer import DistributedAttention

    ds_comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False, dist_init_required=False)
    group = mesh.get_group()

    def sdpa(q, k, v, mask, kernel, dropout_p, is_causal, scale=None):
        if mask is not None:
            raise UserError("--cp-method ulysses runs SDPA without a mask here")

        def local_attn(ql, kl, vl):
            out = inner(ql.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2), None, kernel, dropout_p,
                        is_causal, scale)
            return out.transpose(1, 2)

        attn = DistributedAttention(local_attn, group, scatter_idx=2, gather_idx=1)
        return attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0).transpose(1, 2)
    return sdpa


def measure_cp(exp, scale_layers=None, progress=None, debug: bool = False, device: str = "meta",
               timeline: Optional[list] = None, rank: Optional[int] = None):
    """Trace rank 0 of a ``cp``-way context-parallel step: two steps, the second measured (a
    :class:`..step.Measurement`); ``timeline`` (a list) receives the measured step's events
    (:class:`.rank_tracer.RankTracer`'s ``(event, label, bytes, live_bytes, storage id, op)``)."""
    from ..step import Measurement, error_reason

    t0 = time.perf_counter()
    tr = exp.training
    meas = Measurement(device=device)
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    why = []
    if device != "meta":
        why.append(f"context parallelism is traced on meta (one rank of a fake process group), not on {device}")
    if tr.tp > 1 and tr.cp_method == "ulysses":
        why.append("--cp-method ulysses with --tp: not traced yet (DeepSpeed's all-to-all after a DTensor plan in "
                   "one process fails to resolve its process group)")
    if tr.gpus > 1 and tr.zero not in (2, 3):
        why.append("--cp with --gpus and no ZeRO (replicated data parallelism): not traced yet")
    if tr.zero and tr.sharding != "fsdp2":
        why.append(f"--cp with --sharding {tr.sharding}: ZeRO with context parallelism is traced with FSDP2 only")
    if why:
        meas.status, meas.reason = "skipped", "; ".join(why)
        return meas
    with restored_env(ULYSSES_ENV_KEYS):  # what ulysses_sdpa sets for deepspeed.comm, put back as it was
        try:
            from memcalc.core.rules import check_cp

            check_cp(exp)
            _trace(exp, m, meas, progress or (lambda _msg: None), debug, timeline, rank)
        except UserError:
            raise
        except Exception as e:
            meas.status, meas.reason, meas.measured_bytes = "error", error_reason(e), None
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def _trace(exp, m, meas, say, debug: bool, timeline: Optional[list] = None, rank: Optional[int] = None) -> None:
    import gc

    from ..blocks import attention as attention_mod
    from ..model import build_model, param_count
    from ..optim import allow_fused_on, build_optimizer
    from ..step import Probe, Step, fill_measurement, optimizer_step, track_inputs, train_step, two_steps
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..devices import fake_as_meta
    from .fake_dist import DEVICE, fake_world
    from .fsdp2 import apply_fsdp2, precision_plan
    from .rank_tracer import local_tensors
    from .tp import make_tracer

    tr = exp.training
    cp = tr.cp
    local_seq = tr.seq // cp
    if rank is None:  # the rank the estimate simulates (ulysses: every rank alike)
        from memcalc.core.ring_attention import ring_shapes, worst_rank

        rank = worst_rank(cp, ring_shapes(exp)) if tr.cp_method == "ring" else 0
    fsdp = tr.zero in (2, 3)  # FSDP2 over the dp x cp ranks (torchtitan's dp_shard_cp), as the FSDP2 x TP trace
    plan = precision_plan(tr) if fsdp else None
    build = plan.build if plan is not None else tr
    fake = FakeTensorMode() if fsdp else None
    in_fake = fake if fake is not None else contextlib.nullcontext()
    dev = DEVICE if fsdp else "meta"
    dp = tr.gpus
    tp = tr.tp
    with fake_world(dp * cp * tp, rank * tp, shape=(dp, cp, tp), names=("dp", "cp", "tp")) as mesh:  # dp, tp rank 0
        say(f"building {m.name} ({m.n_layers} layers), cp {cp} ({tr.cp_method})"
            + (f" x FSDP2 zero {tr.zero} over {dp} x {cp}" if fsdp else ""))
        torch.manual_seed(0)
        with in_fake:
            model = build_model(m, build, exp.profile, device="meta")
        meas.params = param_count(model)[0]
        if tp > 1:  # torchtitan's order: apply_tp, then context parallelism around SDPA, then apply_fsdp
            from .tp import apply_tp

            apply_tp(model, mesh["tp"], tr.sequence_parallel)
        if plan is not None and fake is not None:
            apply_fsdp2(model, mesh["dp", "cp"]._flatten("dp_cp"), tr.zero, plan)
            with fake:
                model.to_empty(device=DEVICE)
        inner = attention_mod.sdpa
        tracer = make_tracer(exp.profile.allocator_round_bytes, debug, "cpu" if fsdp else "meta", fake)
        dispatch: contextlib.AbstractContextManager
        if tr.cp_method == "ring":
            attention_mod.sdpa = ring_sdpa(mesh["cp"], inner)
            dispatch = ring_dispatch(mesh["cp"], tracer)
        else:
            attention_mod.sdpa = ulysses_sdpa(mesh["cp"], inner, rank, cp)
            dispatch = contextlib.nullcontext()
        try:
            with in_fake, fake_as_meta(fsdp), dispatch, allow_fused_on("meta"):
                ids = torch.zeros((tr.batch, local_seq), dtype=torch.int64, device=dev)
                labels = ids.clone()
                trainable = [p for p in model.parameters() if p.requires_grad]
                opt = build_optimizer(trainable, build)  # type: ignore[arg-type]
                probe = Probe("meta", tracer)
                model.on_label = probe.label
                from torch.distributed.tensor.parallel import loss_parallel

                parts = Step(forward=lambda: model(ids, labels), grad_accum=tr.grad_accum,  # noqa: F821
                             optimizer_step=optimizer_step(opt), release_loss=True, before=tracer.scopes.clear,
                             around=loss_parallel if tp > 1 else contextlib.nullcontext)
                track_inputs(tracer, model, ids, labels, opt, local_tensors)
                with tracer:
                    def before_measured() -> None:
                        gc.collect()
                        tracer.timeline = timeline

                    meas.first_step_bytes, result = two_steps(probe, lambda: train_step(parts, probe.set_phase), say,
                                                              before_measured=before_measured)
                    tracer.timeline = None
                fill_measurement(meas, result, probe, "meta", None, tracer, debug)
                model.on_label = None
                del model, opt, trainable
                gc.collect()
        finally:
            attention_mod.sdpa = inner

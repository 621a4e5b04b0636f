"""Pipeline parallelism (``--pp``) traced: ``torch.distributed.pipelining``'s real schedules, one rank at a time.

Each of the ``pp`` ranks is traced in turn on PyTorch's fake process group (``fake_dist.fake_world``,
rank ``r`` of ``pp``), on ``meta``. The rank's stage is memcalc's replica (:mod:`..model`) cut as
torchtitan cuts a Llama for pipelining (torchtitan/distributed/pipeline_parallel.py
``pipeline_module_split``: every stage a copy of the model with the modules it does not own set to
``None``; its ``forward`` runs ``tok_embeddings`` if present, its layers, then ``norm`` and ``output``
if present): the first stage holds the embedding, the last the final norm and the head, and the
layers are split as :func:`memcalc.core.pipeline.stage_layers` splits them (torchtitan's
``_generate_llm_fqn_per_model_part`` with the two weights; ``tests/trace/test_pp_grid.py`` checks they
agree). The stage is wrapped in ``PipelineStage`` with static metadata (``input_args`` /
``output_args``: the micro-batch's ``(b, T, d)`` hidden states, or the token ids on the first stage), and the schedule
(:data:`memcalc.core.pipeline.TORCH_SCHEDULES`) runs its unmodified ``step``:
``step(ids, target=labels, losses=...)`` on the first stage, ``step(target=labels, losses=...)`` on
the last, ``step()`` between (torchtitan/train.py ``forward_backward_step``, with
``return_outputs=False`` as torchtitan passes), then the optimizer step and
``zero_grad(set_to_none=True)``. The loss function is the replica's ``lm_loss`` on the logits the
last stage returns. Two steps run; the second is measured.

Two patches, both of communication only (the fake process group delivers no data):

- ``schedules._batch_p2p`` (the send/recv dispatch every schedule calls): a no-op returning no
  works. The fake backend cannot run ``batch_isend_irecv`` on ``meta`` tensors ("No backend type
  associated with device type meta"); a receive on a GPU fills a buffer the stage allocated
  beforehand (``_RecvInfo.buffer``, made in ``_prepare_forward_infra`` / ``_prepare_backward_infra``
  and counted here), a send reads a tensor the stage holds, so dropping the transfer allocates
  nothing less.
- ``_PipelineSchedule._warmup_p2p`` (the vote of ``PipelineStage`` ranks on static or dynamic
  metadata, a ``dist.send`` / ``dist.recv`` of one int32 and ``.item()``): every stage is given
  complete static metadata, so every rank votes STATIC and the exchange's answer is STATIC; it is
  set directly (a ``recv`` on the fake group leaves zeros, which would read as DYNAMIC).

With ``--tp`` the mesh is ``pp x tp`` (this rank at tp coordinate 0) and torchtitan's ``apply_tp``
(:func:`.tp.apply_tp`, which skips the modules a stage does not own) parallelizes the stage over the ``tp``
dimension before ``PipelineStage`` wraps it (given the ``pp`` group); with sequence parallelism the
stage boundary is the rank's ``seq / tp`` rows; the schedule's ``step`` runs under ``loss_parallel``, as
torchtitan's ``train_context`` wraps it; the tracer counts each DTensor by its local shard.

With ``--ep`` the mesh is ``pp x (gpus / ep) x ep`` (torchtitan 0.3.0's sparse mesh ``("pp", "dp_replicate",
"efsdp", "ep")``, parallel_dims.py; this rank at dp and ep coordinate 0) and each stage's replica gets its local
``n_experts / ep`` experts and torchtitan's ``AllToAllTokenDispatcher`` on the ``ep`` dimension
(:func:`.ep_dispatch.shard_experts`, as ``parallelize_deepseekv3`` runs ``model.parallelize`` on each model part),
its token counts answered from the spec (:func:`.ep_dispatch.splits_from_spec`), under torchtitan's
``partial_dtensor`` SPMD backend, as the whole-model trace (:mod:`.expert_parallel`) runs it.

With ``--cp`` (ring attention) the mesh is ``pp x cp [x tp]`` (torchtitan 0.3.0's ``_build_mesh`` order
``("pp", "dp_replicate", "dp_shard", "cp", "tp")``; this rank at the cp coordinate the estimate simulates,
:func:`memcalc.core.ring_attention.worst_rank` of a micro-batch's shapes, and tp 0). Each stage's attention runs
torch's ring as :mod:`.context_parallel` runs it for a whole model (:func:`.context_parallel.ring_sdpa` /
:func:`.context_parallel.ring_dispatch`: ``_templated_ring_attention`` unmodified, the collectives' outputs not
copied, the flash backward's scratch per ring step), and the stage boundary is the rank's ``seq / cp`` tokens
(``/ tp`` more with sequence parallelism): torchtitan 0.3.0's ``pp_forward_backward_step`` shards every micro-batch
before the schedule runs (``post_dataloading_process`` -> ``prepare_context_parallel_input`` -> ``cp_shard``:
torch's ``_context_parallel_shard`` with the ``_HeadTailLoadBalancer``), so the stages only ever see the shard.
The shard is made here by the same torch function on the whole batch (torchtitan makes it per micro-batch: the
same bytes, ``M`` pieces), beside the unsharded batch torchtitan has moved to the GPU.

Every rank loads the whole batch (``inputs`` and ``labels`` moved to the GPU before the stage
branch in torchtitan's ``forward_backward_step``); both are counted on every rank.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from memcalc.core.pipeline import (MULTI_STAGE, TORCH_SCHEDULES, check_pp, micro_batch, rank_stages,
                                   stages_per_rank)
from memcalc.core.pipeline import split as split_layers

from ..blocks import attention_variants as variants
from ..blocks.head import lm_loss

if TYPE_CHECKING:
    from ..model import Decoder


class StageModule(nn.Module):
    """One pipeline stage of the replica: embedding if first, layers ``[lo, hi)``, final norm and head if
    last (torchtitan's split: the other modules dropped). ``forward(x)``: token ids (first stage) or
    hidden states in, hidden states or logits out."""

    def __init__(self, dec: Decoder, lo: int, hi: int, first: bool, last: bool, seq: int) -> None:
        super().__init__()
        self.dec: Decoder = dec
        self.first, self.last, self.seq = first, last, seq
        dec.layers = nn.ModuleList(list(dec.layers)[lo:hi])  # the stage's layers (indices lo..hi-1)
        dec.m = dec.m.model_copy(update={"n_layers": hi - lo})
        # torchtitan's split sets the modules a stage does not own to None
        drop = ([] if first else ["embed_tokens", "embed_positions"]) + ([] if last else ["lm_head", "final_norm"])
        for name in drop:
            if hasattr(dec, name):
                setattr(dec, name, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dec = self.dec
        with dec.amp.region():
            if self.first:
                B, T = x.shape
                x = dec.embed(x)
            else:  # (with sequence parallelism the received hidden states are this rank's seq / tp rows)
                B, T = x.shape[0], self.seq
            cos, sin = dec.rope(T, x.dtype)
            masks = variants.build_masks(dec.m, B, T, x.dtype, x.device)
            x = dec.run_layers(x, cos, sin, masks)
            del masks
            if not self.last:
                return x
            x = dec.final(x)
            box = [x]
            del x
            return dec.head(box)


def _patch_p2p() -> contextlib.AbstractContextManager:
    """The two communication patches of the module docstring, undone on exit."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import InferenceMode

    @contextlib.contextmanager
    def patched():
        saved = schedules._batch_p2p, schedules._PipelineSchedule._warmup_p2p

        def warmup(self, stages, has_backward, p2p_done):
            for stage in stages:
                stage._inference_mode = InferenceMode.STATIC

        schedules._batch_p2p = lambda ops, desc=None: []
        schedules._PipelineSchedule._warmup_p2p = warmup
        try:
            yield
        finally:
            schedules._batch_p2p, schedules._PipelineSchedule._warmup_p2p = saved

    return patched()


def trace_pp_rank(exp, rank: int, m, say: Callable[[str], None], debug: bool = False) -> dict:
    """Trace rank ``rank`` of the pipeline (see the module docstring): its peak, phase, label, first step."""
    from torch.distributed import pipelining

    from ..optim import allow_fused_on, build_optimizer
    from ..step import Probe, track_inputs
    from .fake_dist import fake_world
    from .rank_tracer import RankTracer, local_tensors
    from .tp import make_tracer

    tr = exp.training
    pp, (M, b), V = tr.pp, micro_batch(tr), stages_per_rank(tr)
    split, mine = split_layers(tr, m.n_layers), rank_stages(tr, rank)
    first, last = mine[0] == 0, mine[-1] == pp * V - 1  # the rank holds the embedding / the head
    out: dict = {"rank": rank, "layers": list(split[mine[0]])}
    if V > 1:
        out["stages"] = [{"stage": s, "layers": list(split[s])} for s in mine]
    tp, cp = tr.tp, tr.cp
    world, c = _world(tr, rank, exp)
    tracer = (make_tracer(exp.profile.allocator_round_bytes, debug, "meta") if tp > 1 or cp > 1
              else RankTracer("meta", exp.profile.allocator_round_bytes, debug=debug))
    with fake_world(*world) as mesh, _patch_p2p(), _ep_dispatch(exp), _ring(exp, mesh, tracer):
        layers = ", ".join(f"{lo}..{hi - 1}" for lo, hi in (split[s] for s in mine))
        say(f"rank {rank} of {pp}: layers {layers}{' + embedding' if first else ''}{' + head' if last else ''}, "
            f"{tr.pp_schedule}, {M} micro-batches" + (f", tp {tp}" if tp > 1 else "")
            + (f", cp {cp} (cp rank {c})" if c is not None else ""))
        with allow_fused_on("meta"):
            ids = torch.zeros((tr.batch, tr.seq), dtype=torch.int64, device="meta")
            labels = ids.clone()
            run_ids, run_labels = _cp_shard(mesh, tr, ids, labels) if cp > 1 else (ids, labels)
            built = [_build_stage(exp, m, s, mesh, run_ids[:b], b) for s in mine]
            decs = [dec for dec, _, _ in built]
            stage_mods = nn.ModuleList([mod for _, mod, _ in built])
            amp, profile = decs[-1].amp, exp.profile

            def loss_fn(logits, target):
                with amp.region():
                    return lm_loss(logits, target, profile, amp)

            cls = getattr(pipelining, TORCH_SCHEDULES[tr.pp_schedule])
            stages = [stage for _, _, stage in built]
            sched = cls(stages if V > 1 or tr.pp_schedule in MULTI_STAGE else stages[0], M, loss_fn=loss_fn)
            del built
            trainable: list[torch.Tensor] = [p for p in stage_mods.parameters() if p.requires_grad]
            opt = build_optimizer(trainable, tr)
            probe = Probe("meta", tracer)
            for dec in decs:
                dec.on_label = probe.label
            ran: list = []
            for stage in stages:
                _label_chunks(stage, tracer, ran, V > 1)
            track_inputs(tracer, stage_mods, ids, labels, opt, local_tensors)
            if cp > 1:
                tracer.track([run_ids, run_labels])
            _measure_steps(out, tracer, probe, sched, (first, last, run_ids, run_labels), opt, ran, tp > 1, say, debug)
            for dec in decs:
                dec.on_label = None
    return out


def _build_stage(exp, m, s: int, mesh, first_ids, b: int) -> tuple:
    """Global stage ``s`` of ``pp x V``: the replica cut to it (:class:`StageModule`), tensor-parallel over the
    mesh's ``tp`` dimension with ``--tp``, wrapped in ``PipelineStage`` with its static metadata."""
    from torch.distributed import pipelining

    from ..model import build_model
    from .tp import apply_tp

    tr = exp.training
    n_stages = tr.pp * stages_per_rank(tr)
    lo, hi = split_layers(tr, m.n_layers)[s]
    first, last = s == 0, s == n_stages - 1
    torch.manual_seed(0)
    dec = build_model(m, tr, exp.profile, device="meta")
    T = tr.seq // tr.cp  # (context parallelism: the rank's shard of the sequence)
    stage_mod = StageModule(dec, lo, hi, first, last, T)
    if tr.tp > 1:  # torchtitan's parallelize_llama: apply_tp on each model part (its stage) over the tp mesh
        apply_tp(dec, mesh["tp"], tr.sequence_parallel)
    if tr.ep > 1:  # parallelize_deepseekv3: model.parallelize(parallel_dims) on each model part
        from .ep_dispatch import shard_experts

        shard_experts(dec, exp, mesh["ep"])
    group = mesh["pp"].get_group() if tr.tp > 1 or tr.ep > 1 or tr.cp > 1 else None
    t_local = T // tr.tp if tr.tp > 1 and tr.sequence_parallel else T  # the stage boundary: a local tensor
    hidden = torch.empty((b, t_local, m.d_model), dtype=_hidden_dtype(tr), device="meta")
    in_args = (first_ids,) if first else (hidden.detach().requires_grad_(True),)
    out_args = (hidden.detach().requires_grad_(True),) if not last else \
        (torch.empty((b, T, m.vocab_size), dtype=_logits_dtype(tr), device="meta").requires_grad_(True),)
    stage = pipelining.PipelineStage(stage_mod, s, n_stages, torch.device("meta"), input_args=in_args,
                                     output_args=out_args, group=group)
    return dec, stage_mod, stage


def _run_schedule(sched, first: bool, last: bool, ids, labels, losses: list) -> None:
    """The schedule's unmodified ``step`` as torchtitan's ``forward_backward_step`` calls it on this stage."""
    if first:
        sched.step(ids, target=labels if last else None, losses=losses if last else None, return_outputs=False)
    elif last:
        sched.step(target=labels, losses=losses, return_outputs=False)
    else:
        sched.step(return_outputs=False)


def _measure_steps(out: dict, tracer, probe, sched, batch: tuple, opt, ran: list, loss_parallel: bool,
                   say: Callable[[str], None], debug: bool) -> None:
    """Two steps of the schedule on this rank (the first, then the measured one), each the schedule's
    ``step`` then the optimizer's, as torchtitan's train step runs them; the measured step's peak, phase,
    label, phase peaks and the actions it ran go into ``out`` (and the live tensors at the peak with
    ``debug``). ``batch`` is ``(first, last, ids, labels)``."""
    from ..step import two_steps

    first, last, ids, labels = batch
    around = _loss_parallel if loss_parallel else contextlib.nullcontext

    def step() -> None:
        ran.clear()
        tracer.set_phase("forward")
        losses: list = []
        with around():  # torchtitan's train_context: loss parallel around the schedule's step
            _run_schedule(sched, first, last, ids, labels, losses)
        del losses
        tracer.set_phase("optimizer step")
        opt.step()
        opt.zero_grad(set_to_none=True)

    with tracer:
        out["first_step_bytes"], (peak, phase, label, peaks) = two_steps(
            probe, step, say, before_measured=_collect)
    out.update(peak_bytes=peak, phase=phase, label=label, phase_peaks=peaks, actions=list(ran))
    if debug:
        out["peak_live"] = sorted(([bb, w] for bb, w, _ in tracer.peak_live), reverse=True)


@contextlib.contextmanager
def _ep_dispatch(exp):
    """With ``--ep``: the expert-parallel trace's token-count exchange answered from the spec and torchtitan's
    ``partial_dtensor`` SPMD backend (:func:`.expert_parallel._trace`); nothing otherwise."""
    if exp.training.ep == 1:
        yield
        return
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    from .ep_dispatch import splits_from_spec

    backend = get_spmd_backend()
    set_spmd_backend("partial_dtensor")
    try:
        with splits_from_spec(exp):
            yield
    finally:
        set_spmd_backend(backend)


def _world(tr, rank: int, exp) -> tuple[tuple, Optional[int]]:
    """``fake_world``'s arguments for pipeline rank ``rank`` (torchtitan 0.3.0's mesh order ``pp, dp, cp, tp``;
    this rank at dp and tp coordinate 0) and the cp rank traced (None without context parallelism)."""
    pp, tp, cp, ep = tr.pp, tr.tp, tr.cp, tr.ep
    if ep > 1:  # pp x (dp, ep): the ep ranks borrowed from the data-parallel ones (core/expert_parallel.py)
        return (pp * tr.gpus, rank * tr.gpus, (pp, tr.gpus // ep, ep), ("pp", "dp", "ep")), None
    c = _cp_rank(exp) if cp > 1 else None
    dims = [(k, n) for k, n in (("pp", pp), ("cp", cp), ("tp", tp)) if k == "pp" or n > 1]
    shape = tuple(n for _, n in dims)
    return (math.prod(shape), (rank * cp + (c or 0)) * tp, shape if len(dims) > 1 else None,
            tuple(k for k, _ in dims)), c


def _cp_rank(exp) -> int:
    """The cp rank traced: the one the estimate simulates (:func:`memcalc.core.ring_attention.worst_rank` of one
    micro-batch's ring)."""
    from memcalc.core.ring_attention import ring_shapes, worst_rank

    tr = exp.training
    mexp = exp.model_copy(update={"training": tr.model_copy(update={"batch": micro_batch(tr)[1]})})
    return worst_rank(tr.cp, ring_shapes(mexp))


def _cp_shard(mesh, tr, ids, labels) -> tuple:
    """This rank's shard of the batch, as torchtitan 0.3.0's ``cp_shard`` makes it
    (torchtitan/distributed/context_parallel/api.py: torch's ``_context_parallel_shard`` with a
    ``_HeadTailLoadBalancer(seq, cp, device)``, the sequence on dim 1); the two CP globals it sets are put
    back (the ring's dispatch is :func:`_ring`'s)."""
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard, _HeadTailLoadBalancer
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    saved = cpa._dispatch_mode, cpa._cp_options.enable_load_balance
    try:
        balancer = _HeadTailLoadBalancer(tr.seq, tr.cp, ids.device)
        return tuple(_context_parallel_shard(mesh["cp"], [ids, labels], (1, 1), balancer))
    finally:
        cpa._dispatch_mode, cpa._cp_options.enable_load_balance = saved


@contextlib.contextmanager
def _ring(exp, mesh, tracer):
    """With ``--cp``: the replica's SDPA through torch's ring on the ``cp`` dimension
    (:func:`.context_parallel.ring_sdpa` under :func:`.context_parallel.ring_dispatch`), put back on exit;
    nothing otherwise."""
    if exp.training.cp == 1:
        yield
        return
    from ..blocks import attention as attention_mod
    from .context_parallel import ring_dispatch, ring_sdpa

    inner = attention_mod.sdpa
    attention_mod.sdpa = ring_sdpa(mesh["cp"], inner)
    try:
        with ring_dispatch(mesh["cp"], tracer):
            yield
    finally:
        attention_mod.sdpa = inner


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _collect() -> None:
    gc.collect()


def _hidden_dtype(tr) -> torch.dtype:
    """The residual stream's dtype between stages: the weights' (under emulated AMP the layers' outputs
    stay in the residual's fp32)."""
    from ..blocks.build import torch_dtype

    return torch_dtype(tr.weight_dtype.value)


def _logits_dtype(tr) -> torch.dtype:
    from ..blocks.build import torch_dtype

    return torch_dtype(tr.compute_dtype.value)


def _label_chunks(stage, tracer, ran: list, multi: bool = False) -> None:
    """Phase ``forward`` / ``backward`` and label ``mb i`` (and ``stage s`` with several stages per rank) around
    each chunk, and the order they ran in (``ran``: ``(F | B | I | W, stage, i)``; instrumentation only)."""
    fwd, bwd, wgt = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
    s = stage.stage_index
    at = f" stage {s}" if multi else ""

    def forward_one_chunk(i, *a, **k):
        tracer.set_phase("forward")
        tracer.label = f"mb {i}{at}"
        ran.append(("F", s, i))
        return fwd(i, *a, **k)

    def backward_one_chunk(i, *a, **k):
        tracer.set_phase("backward")
        tracer.label = f"mb {i}{at}"
        ran.append(("B" if k.get("full_backward", True) else "I", s, i))
        return bwd(i, *a, **k)

    def backward_weight_one_chunk(i, *a, **k):
        tracer.set_phase("backward")
        tracer.label = f"mb {i}{at} weights"
        ran.append(("W", s, i))
        return wgt(i, *a, **k)

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk


def measure_pp(exp, scale_layers: Optional[int] = None, progress=None, debug: bool = False, device: str = "meta",
               trace: Optional[Callable] = None):
    """Trace every rank of a ``pp``-stage pipeline (``trace``, default :func:`trace_pp_rank`; with FSDP2
    :func:`.pipeline_fsdp.trace_pp_fsdp_rank`); the Measurement is the worst rank's, and ``pipeline_stages``
    holds every rank's (peak, layers, phase, label)."""
    from ..step import Measurement, error_reason

    t0 = time.perf_counter()
    meas = Measurement(device=device)
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    say = progress or (lambda _msg: None)
    stages: list[dict] = meas.pipeline_stages
    if device != "meta":
        meas.status, meas.reason = "skipped", f"pipeline parallelism is traced on meta, not on {device}"
        return meas
    try:
        check_pp(exp.model_copy(update={"model": m}))
        trace = trace or trace_pp_rank
        for r in range(exp.training.pp):
            stages.append(trace(exp, r, m, say, debug))
        worst = max(stages, key=lambda s: s["peak_bytes"])
        meas.measured_bytes = worst["peak_bytes"]
        meas.first_step_bytes = max(s["first_step_bytes"] for s in stages)
        meas.peak_phase, meas.peak_label = worst["phase"], f"rank {worst['rank']} {worst['label']}".strip()
        meas.phase_peaks = {k: v for k, v in worst["phase_peaks"].items() if k != "setup"}
    except Exception as e:  # the record says why, as runner.measure does
        meas.status, meas.reason, meas.measured_bytes = "error", error_reason(e), None
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas

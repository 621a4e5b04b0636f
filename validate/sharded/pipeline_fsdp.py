"""Pipeline parallelism composed with FSDP2 (``--pp`` with ``--gpus N --zero 2|3``), one rank traced.

The mesh is torchtitan's order, ``pp`` outermost (torchtitan/distributed/parallel_dims.py: ``pp``,
``dp_shard``, ``tp``): ``(pp, dp)`` or ``(pp, dp, tp)``; the traced rank is data-parallel (and
tensor-parallel) coordinate 0 of pipeline rank ``r``. Each stage is cut as :mod:`.pipeline` cuts it
(:class:`.pipeline.StageModule`), tensor-parallel over ``tp`` first (:func:`.tp.apply_tp`), then wrapped by
torchtitan 0.3.0's own ``torchtitan/distributed/fsdp.py`` ``apply_fsdp_to_decoder`` with ``pp_enabled=True``
(:func:`apply_fsdp_stage`): the embedding (first stage) its own unit, the final norm and the head one unit
together (last stage; ``reshard_after_forward`` only under the "always" policy), every decoder layer one
unit, then the stage module itself (the root, whose own parameters are none), under
``MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs=False)``, with ``reshard_after_forward``
from ``get_fsdp_reshard_after_forward_policy("default", pp_enabled=True)`` (False: "For PP, by default do not
reshard after forward to avoid per-microbatch all-gathers"), and FSDP's gradient division disabled
(``disable_fsdp_gradient_division``).

The schedule then does what torch 2.13 ``torch/distributed/pipelining/stage.py`` does with an
``FSDPModule`` stage: every micro-batch's backward runs with ``set_requires_gradient_sync(False)``,
``set_reshard_after_backward(False)``, ``set_is_last_backward(False)``
(``backward_maybe_with_nosync``), so the unsharded parameters stay from the first forward's all-gather to
the end and the unsharded gradients accumulate (in ``reduce_dtype`` when it differs:
``FSDPParam.to_accumulated_grad_if_needed``); after the last backward ``perform_reduce_grad`` sets the three
back and runs every parameter group's ``post_backward`` (reshard, reduce-scatter), the root's final
callback, then ``scale_grads``.

With ``--cp`` (ring attention) the mesh is ``(pp, dp, cp[, tp])`` (torchtitan's order) and FSDP2 shards each stage
over the flattened ``dp x cp`` ranks (torchtitan's ``dp_shard_cp``: the ``fsdp`` mesh its ``parallelize_llama`` hands
``apply_fsdp_to_decoder`` when ``cp > 1``), the traced rank at the cp coordinate the estimate simulates; the ring,
the cp-sharded batch and the ``seq / cp`` stage boundary are :mod:`.pipeline`'s.

With ``--ep`` the mesh is torchtitan's sparse one and ``apply_fsdp_to_decoder`` gets ``ep_degree`` and the
``efsdp`` mesh: :mod:`.pipeline_ep_fsdp`.

With several stages per rank (``interleaved-1f1b``, ``zero-bubble``) each of the rank's stages is cut, made
tensor-parallel and wrapped the same way, each its own FSDP root (torchtitan's ``parallelize`` runs on every model
part), and the multi-stage schedule (``_PipelineScheduleRuntime``) runs its lowered actions unmodified: the
UNSHARD / RESHARD / REDUCE_GRAD that ``_add_unshard_reshard`` and ``_add_reduce_grad`` add
(memcalc.core.pp_lowering), on top of the ``backward_maybe_with_nosync`` flags above.

The model is built on ``meta`` under ``FakeTensorMode`` and moved with ``to_empty`` (FSDP2 refuses meta
parameters), the step runs on fake ``cpu`` tensors with CUDA's kernel choice (``devices.fake_as_meta``), as
the FSDP2 harness does (:mod:`.runner`); the communication patches are :mod:`.pipeline`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from memcalc.core.pipeline import MULTI_STAGE, TORCH_SCHEDULES, micro_batch, rank_stages, split, stages_per_rank

from ..blocks.head import lm_loss


def apply_fsdp_stage(stage_mod, dec, dp_mesh, plan, ep: int = 1, edp_mesh=None) -> None:
    """torchtitan 0.3.0's own ``apply_fsdp_to_decoder`` on one pipeline stage (module docstring), with
    ``pp_enabled=True`` and the policy "default". It reads torchtitan's module names (``tok_embeddings``,
    ``layers.items()``, ``norm``, ``lm_head``, ``enable_weight_tying``), so the stage module is given them as
    aliases of the replica's own modules (``embed_tokens``, ``layers``, ``final_norm``, ``lm_head``; the same
    module objects: FSDP2 and ``modules()`` meet each once). The policy's dtypes: memcalc's
    (:func:`.fsdp2.precision_plan`), a dtype equal to the shards' where it has none (FSDP2 then casts nothing,
    ``FSDPParam.init_dtype_attrs``)."""
    import torch.nn as nn
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from .fsdp2 import upcast_trainable

    upcast_trainable(dec, plan)
    stage_mod.enable_weight_tying = False
    stage_mod.tok_embeddings = getattr(dec, "embed_tokens", None)
    stage_mod.norm = getattr(dec, "final_norm", None)
    stage_mod.lm_head = getattr(dec, "lm_head", None)
    stage_mod.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(dec.layers)})
    own = next((p.dtype for p in dec.parameters() if p.requires_grad), torch.float32)
    from .pipeline_ep_fsdp import moe_aliases

    moe_aliases(dec)  # torchtitan's names for the MoE layers (their experts' Shard(1) placement, efsdp groups)
    apply_fsdp_to_decoder(stage_mod, dp_mesh, param_dtype=plan.param_dtype or own,
                          reduce_dtype=plan.reduce_dtype or own, pp_enabled=True, ep_degree=ep, edp_mesh=edp_mesh)


def trace_pp_fsdp_rank(exp, rank: int, m, say: Callable[[str], None], debug: bool = False) -> dict:
    """Trace pipeline rank ``rank`` of a ``pp`` x FSDP2 (x ``tp``) step (module docstring); the same dict as
    :func:`.pipeline.trace_pp_rank`. With several stages per rank each of the rank's stages is its own model part,
    wrapped as one (torchtitan's ``parallelize`` runs on every model part), and the multi-stage schedule
    (``_PipelineScheduleRuntime``) runs them with its UNSHARD / RESHARD / REDUCE_GRAD actions."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed import pipelining

    from ..devices import fake_as_meta
    from ..optim import allow_fused_on, build_optimizer
    from ..step import Probe, track_inputs
    from .fake_dist import DEVICE, fake_world
    from .fsdp2 import precision_plan
    from .pipeline import _cp_shard, _ep_dispatch, _label_chunks, _measure_steps, _patch_p2p, _ring
    from .rank_tracer import RankTracer, local_tensors
    from .tp import make_tracer

    tr = exp.training
    pp, dp, tp, cp = tr.pp, tr.gpus, tr.tp, tr.cp
    M, b = micro_batch(tr)
    V = stages_per_rank(tr)
    layers, mine = split(tr, m.n_layers), rank_stages(tr, rank)
    first, last = mine[0] == 0, mine[-1] == pp * V - 1  # the rank holds the embedding / the head
    out: dict = {"rank": rank, "layers": list(layers[mine[0]])}
    if V > 1:
        out["stages"] = [{"stage": s, "layers": list(layers[s])} for s in mine]
    plan = precision_plan(tr)
    ep = tr.ep
    fake = FakeTensorMode()
    with fake_world(*_world(exp, rank)) as mesh, _patch_p2p(), _ep_dispatch(exp):
        dp_mesh = (mesh["efsdp", "ep"]._flatten("dp") if ep > 1 else mesh["dp", "cp"]._flatten("dp_cp") if cp > 1
                   else mesh["dp"])
        say(f"rank {rank} of {pp}: layers {', '.join(f'{lo}..{hi - 1}' for lo, hi in (layers[s] for s in mine))}"
            f"{' + embedding' if first else ''}{' + head' if last else ''}, {tr.pp_schedule}, {M} micro-batches, "
            f"FSDP2 over {dp}" + (f" x cp {cp}" if cp > 1 else "") + (f", tp {tp}" if tp > 1 else ""))
        built = [_fsdp_stage(exp, m, s, mesh, dp_mesh, plan, fake) for s in mine]
        decs = [dec for dec, _ in built]
        stage_mods = nn.ModuleList([mod for _, mod in built])
        with fake, fake_as_meta(True), allow_fused_on("meta"):
            ids = torch.zeros((tr.batch, tr.seq), dtype=torch.int64, device=DEVICE)
            labels = ids.clone()
            run_ids, run_labels = _cp_shard(mesh, tr, ids, labels) if cp > 1 else (ids, labels)
            stages = [_pipeline_stage(exp, m, s, mod, mesh, run_ids[:b], b, plan)
                      for s, mod in zip(mine, stage_mods, strict=True)]
            amp, profile = decs[-1].amp, exp.profile

            def loss_fn(logits, target):
                with amp.region():
                    return lm_loss(logits, target, profile, amp)

            cls = getattr(pipelining, TORCH_SCHEDULES[tr.pp_schedule])
            sched = cls(stages if tr.pp_schedule in MULTI_STAGE else stages[0], M, loss_fn=loss_fn)
            trainable: list[torch.Tensor] = [p for p in stage_mods.parameters() if p.requires_grad]
            opt = build_optimizer(trainable, plan.build)
            tracer = (make_tracer(exp.profile.allocator_round_bytes, debug, DEVICE, fake) if tp > 1 or cp > 1
                      else RankTracer(DEVICE, exp.profile.allocator_round_bytes, debug=debug))
            probe = Probe(DEVICE, tracer)
            for dec in decs:
                dec.on_label = probe.label
            ran: list = []
            for stage in stages:
                _label_chunks(stage, tracer, ran, V > 1)
            track_inputs(tracer, stage_mods, ids, labels, opt, local_tensors)
            if cp > 1:
                tracer.track([run_ids, run_labels])
            with _ring(exp, mesh, tracer):
                _measure_steps(out, tracer, probe, sched, (first, last, run_ids, run_labels), opt, ran, tp > 1, say,
                               debug)
            for dec in decs:
                dec.on_label = None
    return out


def _world(exp, rank: int) -> tuple:
    """``fake_world``'s arguments for pipeline rank ``rank``: torchtitan's mesh ``(pp, dp[, cp][, tp])``, this rank at
    dp and tp coordinate 0 and at the cp coordinate the estimate simulates (:func:`.pipeline._cp_rank`); with
    ``--ep`` the sparse mesh ``(pp, efsdp, ep)`` (:mod:`.pipeline_ep_fsdp`: the experts' FSDP over efsdp = dp / ep)."""
    from .pipeline import _cp_rank

    tr = exp.training
    pp, dp, tp, cp, ep = tr.pp, tr.gpus, tr.tp, tr.cp, tr.ep
    if ep > 1:
        return pp * dp * tp, rank * dp * tp, (pp, dp // ep, ep), ("pp", "efsdp", "ep")
    dims = [(k, n) for k, n in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)) if k in ("pp", "dp") or n > 1]
    c = _cp_rank(exp) if cp > 1 else 0
    return (pp * dp * cp * tp, (rank * dp * cp + c) * tp, tuple(n for _, n in dims), tuple(k for k, _ in dims))


def _fsdp_stage(exp, m, s: int, mesh, dp_mesh, plan, fake) -> tuple:
    """Global stage ``s``: the replica cut to it (:class:`.pipeline.StageModule`), its experts sharded over ``ep``
    with ``--ep``, tensor-parallel with ``--tp``, wrapped by :func:`apply_fsdp_stage` over ``dp_mesh``, moved to the
    fake device."""
    from ..model import build_model
    from .fake_dist import DEVICE
    from .pipeline import StageModule
    from .tp import apply_tp

    tr = exp.training
    n_stages = tr.pp * stages_per_rank(tr)
    lo, hi = split(tr, m.n_layers)[s]
    torch.manual_seed(0)
    with fake:
        dec = build_model(m, plan.build, exp.profile, device="meta")
        if tr.ep > 1:  # parallelize_deepseekv3: the experts sharded over ep before FSDP
            from .ep_dispatch import shard_experts

            shard_experts(dec, exp, mesh["ep"])
    stage_mod = StageModule(dec, lo, hi, s == 0, s == n_stages - 1, tr.seq // tr.cp)  # (cp: the rank's shard)
    if tr.tp > 1:
        apply_tp(dec, mesh["tp"], tr.sequence_parallel)
    apply_fsdp_stage(stage_mod, dec, dp_mesh, plan, tr.ep, mesh["efsdp"] if tr.ep > 1 else None)
    with fake:
        stage_mod.to_empty(device=DEVICE)
    return dec, stage_mod


def _pipeline_stage(exp, m, s: int, stage_mod, mesh, first_ids, b: int, plan):
    """``PipelineStage`` over ``stage_mod`` (global stage ``s``) with its static metadata."""
    from torch.distributed import pipelining

    from .fake_dist import DEVICE
    from .pipeline import _logits_dtype

    tr = exp.training
    n_stages = tr.pp * stages_per_rank(tr)
    first, last = s == 0, s == n_stages - 1
    T = tr.seq // tr.cp  # (context parallelism: the rank's shard of the sequence)
    t_local = T // tr.tp if tr.tp > 1 and tr.sequence_parallel else T
    hidden = torch.empty((b, t_local, m.d_model), dtype=_stage_dtype(plan, tr), device=DEVICE)
    in_args = (first_ids,) if first else (hidden.detach().requires_grad_(True),)
    out_args = (hidden.detach().requires_grad_(True),) if not last else \
        (torch.empty((b, T, m.vocab_size), dtype=_logits_dtype(tr), device=DEVICE).requires_grad_(True),)
    return pipelining.PipelineStage(stage_mod, s, n_stages, torch.device(DEVICE), input_args=in_args,
                                    output_args=out_args, group=mesh["pp"].get_group())


def _stage_dtype(plan, tr) -> torch.dtype:
    """The hidden states between stages: the all-gathered parameters' dtype (``param_dtype`` under the
    policy), else the weights'."""
    from ..blocks.build import torch_dtype

    return plan.param_dtype if plan.param_dtype is not None else torch_dtype(tr.weight_dtype.value)

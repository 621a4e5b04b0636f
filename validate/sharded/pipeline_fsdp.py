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

With ``--ep`` the mesh is torchtitan's sparse one and ``apply_fsdp_to_decoder`` gets ``ep_degree`` and the
``efsdp`` mesh: :mod:`.pipeline_ep_fsdp`.

The model is built on ``meta`` under ``FakeTensorMode`` and moved with ``to_empty`` (FSDP2 refuses meta
parameters), the step runs on fake ``cpu`` tensors with CUDA's kernel choice (``devices.fake_as_meta``), as
the FSDP2 harness does (:mod:`.runner`); the communication patches are :mod:`.pipeline`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memcalc.core.pipeline import TORCH_SCHEDULES, micro_batch, split

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
    if ep > 1:  # torchtitan's names for the MoE layers (pipeline_ep_fsdp.moe_aliases)
        from .pipeline_ep_fsdp import moe_aliases

        moe_aliases(dec)
    apply_fsdp_to_decoder(stage_mod, dp_mesh, param_dtype=plan.param_dtype or own,
                          reduce_dtype=plan.reduce_dtype or own, pp_enabled=True, ep_degree=ep, edp_mesh=edp_mesh)


def trace_pp_fsdp_rank(exp, rank: int, m, say: Callable[[str], None], debug: bool = False) -> dict:
    """Trace pipeline rank ``rank`` of a ``pp`` x FSDP2 (x ``tp``) step (module docstring); the same dict as
    :func:`.pipeline.trace_pp_rank`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed import pipelining

    from ..devices import fake_as_meta
    from ..model import build_model
    from ..optim import allow_fused_on, build_optimizer
    from ..step import Probe, track_inputs
    from .fake_dist import DEVICE, fake_world
    from .fsdp2 import precision_plan
    from .pipeline import StageModule, _ep_dispatch, _label_chunks, _logits_dtype, _measure_steps, _patch_p2p
    from .rank_tracer import RankTracer, local_tensors
    from .tp import apply_tp, make_tracer

    tr = exp.training
    pp, dp, tp = tr.pp, tr.gpus, tr.tp
    M, b = micro_batch(tr)
    lo, hi = split(tr, m.n_layers)[rank]  # (one stage per rank: check_pp)
    first, last = rank == 0, rank == pp - 1
    out: dict = {"rank": rank, "layers": [lo, hi]}
    plan = precision_plan(tr)
    shape, names = ((pp, dp, tp), ("pp", "dp", "tp")) if tp > 1 else ((pp, dp), ("pp", "dp"))
    ep = tr.ep
    if ep > 1:  # torchtitan's sparse mesh (pipeline_ep_fsdp): the experts' FSDP over efsdp = dp / ep
        shape, names = (pp, dp // ep, ep), ("pp", "efsdp", "ep")
    fake = FakeTensorMode()
    with fake_world(pp * dp * tp, rank * dp * tp, shape, names) as mesh, _patch_p2p(), _ep_dispatch(exp):
        dp_mesh = mesh["efsdp", "ep"]._flatten("dp") if ep > 1 else mesh["dp"]
        say(f"rank {rank} of {pp}: layers {lo}..{hi - 1}{' + embedding' if first else ''}{' + head' if last else ''}, "
            f"{tr.pp_schedule}, {M} micro-batches, FSDP2 over {dp}" + (f", tp {tp}" if tp > 1 else ""))
        torch.manual_seed(0)
        T = tr.seq
        with fake:
            dec = build_model(m, plan.build, exp.profile, device="meta")
            if ep > 1:  # parallelize_deepseekv3: the experts sharded over ep before FSDP
                from .ep_dispatch import shard_experts

                shard_experts(dec, exp, mesh["ep"])
        stage_mod = StageModule(dec, lo, hi, first, last, T)
        if tp > 1:
            apply_tp(dec, mesh["tp"], tr.sequence_parallel)
        apply_fsdp_stage(stage_mod, dec, dp_mesh, plan, ep, mesh["efsdp"] if ep > 1 else None)
        with fake:
            stage_mod.to_empty(device=DEVICE)
        with fake, fake_as_meta(True), allow_fused_on("meta"):
            ids = torch.zeros((tr.batch, T), dtype=torch.int64, device=DEVICE)
            labels = ids.clone()
            t_local = T // tp if tp > 1 and tr.sequence_parallel else T
            hidden = torch.empty((b, t_local, m.d_model), dtype=_stage_dtype(plan, tr), device=DEVICE)
            in_args = (ids[:b],) if first else (hidden.detach().requires_grad_(True),)
            out_args = (hidden.detach().requires_grad_(True),) if not last else \
                (torch.empty((b, T, m.vocab_size), dtype=_logits_dtype(tr), device=DEVICE).requires_grad_(True),)
            stage = pipelining.PipelineStage(stage_mod, rank, pp, torch.device(DEVICE), input_args=in_args,
                                             output_args=out_args, group=mesh["pp"].get_group())
            del in_args, out_args, hidden
            amp, profile = dec.amp, exp.profile

            def loss_fn(logits, target):
                with amp.region():
                    return lm_loss(logits, target, profile, amp)

            sched = getattr(pipelining, TORCH_SCHEDULES[tr.pp_schedule])(stage, M, loss_fn=loss_fn)
            trainable: list[torch.Tensor] = [p for p in stage_mod.parameters() if p.requires_grad]
            opt = build_optimizer(trainable, plan.build)
            tracer = (make_tracer(exp.profile.allocator_round_bytes, debug, DEVICE, fake) if tp > 1
                      else RankTracer(DEVICE, exp.profile.allocator_round_bytes, debug=debug))
            probe = Probe(DEVICE, tracer)
            dec.on_label = probe.label
            ran: list = []
            _label_chunks(stage, tracer, ran)
            track_inputs(tracer, stage_mod, ids, labels, opt, local_tensors)
            _measure_steps(out, tracer, probe, sched, (first, last, ids, labels), opt, ran, tp > 1, say, debug)
            dec.on_label = None
    return out


def _stage_dtype(plan, tr) -> torch.dtype:
    """The hidden states between stages: the all-gathered parameters' dtype (``param_dtype`` under the
    policy), else the weights'."""
    from ..blocks.build import torch_dtype

    return plan.param_dtype if plan.param_dtype is not None else torch_dtype(tr.weight_dtype.value)

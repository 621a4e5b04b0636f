"""Tensor parallelism (``--tp``) traced: DTensor's ``parallelize_module`` on memcalc's replica, one rank.

The plan is torchtitan's ``apply_tp`` (torchtitan/models/llama3/infra/parallelize.py) mapped onto the
replica's module names (:mod:`..model`):

===========================  ==========================  ===============================================
torchtitan                   replica                     style (torch/distributed/tensor/parallel/style.py)
===========================  ==========================  ===============================================
``tok_embeddings``           ``embed_tokens``            ``RowwiseParallel(input_layouts=Replicate(),
                                                         output_layouts=Shard(1) | Replicate())``
``attention.wq/wk/wv``       ``attn.q_proj/k_proj/v_proj``  ``ColwiseParallel()``
``attention.wo``             ``attn.o_proj``             ``RowwiseParallel(output_layouts=Shard(1) | Replicate())``
``feed_forward.w1/w3``       ``mlp.gate_proj/up_proj``   ``ColwiseParallel()``
``feed_forward.w2``          ``mlp.down_proj``           ``RowwiseParallel(output_layouts=Shard(1) | Replicate())``
``attention``, ``feed_forward``  ``attn``, ``mlp``       ``PrepareModuleInput(Shard(1) -> Replicate())`` (SP only)
``attention_norm``, ...      ``norm1``, ``norm2``,       ``SequenceParallel()`` (SP) or replicated
                             ``final_norm``
``output``                   ``lm_head``                 ``ColwiseParallel(input_layouts=Shard(1) | Replicate(),
                                                         output_layouts=Shard(-1), use_local_output=False)``
===========================  ==========================  ===============================================

(``A | B``: with sequence parallelism | without.) The loss runs under ``loss_parallel()`` on the
vocabulary-sharded logits (torchtitan's default; ``--disable-loss-parallel`` is not modelled).

Two departures, both forced and neither changing what a rank allocates:

- the replica's projections (:class:`..layers.Linear`, ``F.linear`` with the profile's autocast casts)
  and head (:class:`..blocks.head.LMHead`) are not ``nn.Linear``, which ``ColwiseParallel._apply`` /
  ``RowwiseParallel._apply`` insist on; :class:`_Colwise` / :class:`_Rowwise` call the same
  ``distribute_module(module, mesh, _partition_linear_fn, _prepare_input_fn, _prepare_output_fn)``
  those ``_apply`` methods call for an ``nn.Linear``;
- without sequence parallelism torchtitan has no plan (its ``apply_tp`` always applies
  ``SequenceParallel`` to the norms); the norms there are replicated DTensors
  (``distribute_module``'s default partition: ``Replicate``; the input wrapped with ``from_local``,
  the output unwrapped): plain tensors beside DTensors would make the foreach optimizer step fail
  ("got mixed torch.Tensor and DTensor"). A replicated DTensor holds the whole tensor, as a plain one.

The step runs on the ``meta`` device on the fake process group (every collective allocates its
output, as on GPUs, and moves no data); DTensors are counted by their local shard.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from memcalc.core.spec import ModelSpec

from .moe_tp import apply_moe_tp


class _Colwise(ColwiseParallel):
    """``ColwiseParallel`` on the replica's ``Linear`` / ``LMHead`` (``F.linear`` modules that are not
    ``nn.Linear``): exactly the ``distribute_module`` call its ``_apply`` makes for an ``nn.Linear``."""

    def _apply(self, module: nn.Module, device_mesh):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class _Rowwise(RowwiseParallel):
    """``RowwiseParallel`` on the replica's ``Linear`` (see :class:`_Colwise`)."""

    def _apply(self, module: nn.Module, device_mesh):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)  # as RowwiseParallel._apply for an nn.Linear
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _replicate_norm(module: nn.Module, mesh) -> None:
    """A norm without sequence parallelism: parameters replicated DTensors, plain tensors in and out."""
    distribute_module(
        module, mesh,
        input_fn=lambda mod, inputs, m: tuple(
            DTensor.from_local(t, m, [Replicate()], run_check=False) if isinstance(t, torch.Tensor)
            and not isinstance(t, DTensor) else t for t in inputs),
        output_fn=lambda mod, out, m: out.to_local() if isinstance(out, DTensor) else out)


def tp_plan_supported(m: ModelSpec) -> list[str]:
    """What of ``m`` the traced plan does not build (beyond the estimator's own refusals). A tied head
    borrows the embedding's ``Shard(0)`` weight, which is the head's colwise layout too."""
    moe = m.moe
    if moe is not None and moe.shared_expert_gate:
        return ["Qwen2-MoE's gated shared expert under --tp (torchtitan has no such model)"]
    return []


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """torchtitan's ``apply_tp`` on the replica (see the module docstring's table)."""
    sp = sequence_parallel
    resid = Shard(1) if sp else Replicate()
    # a pipeline stage holds the embedding (first), the final norm and the head (last) or neither: the modules
    # it does not own are None (torchtitan's pipeline_module_split), and apply_tp's plan skips them
    ends = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=resid),
            "lm_head": _Colwise(input_layouts=resid, output_layouts=Shard(-1), use_local_output=False)}
    ends = {k: v for k, v in ends.items() if getattr(model, k, None) is not None}
    if getattr(model, "lm_head", None) is not None:
        model.lm_head.call_module = True  # ColwiseParallel works through the head module's hooks
    if ends:
        parallelize_module(model, tp_mesh, ends)
    if getattr(model, "final_norm", None) is None:
        pass
    elif sp:
        parallelize_module(model, tp_mesh, {"final_norm": SequenceParallel()})
    else:
        _replicate_norm(model.final_norm, tp_mesh)
    for layer in model.layers:
        moe = getattr(layer, "moe", None)
        plan = {
            "attn.q_proj": _Colwise(), "attn.k_proj": _Colwise(), "attn.v_proj": _Colwise(),
            "attn.o_proj": _Rowwise(output_layouts=resid),
        }
        if moe is not None:  # torchtitan's set_moe_sharding_config (enable_ep=False): moe_tp.py
            apply_moe_tp(moe, tp_mesh, sp, _Colwise, _Rowwise)
        else:
            plan["mlp.down_proj" if hasattr(layer.mlp, "down_proj") else "mlp.fc2"] = _Rowwise(output_layouts=resid)
        for name in ("gate_proj", "up_proj", "fc1"):
            if moe is None and hasattr(layer.mlp, name):
                plan[f"mlp.{name}"] = _Colwise()
        if sp:
            plan.update({
                "norm1": SequenceParallel(), "norm2": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                           desired_input_layouts=(Replicate(), None, None, None)),
            })
            if moe is None:
                plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        else:
            _replicate_norm(layer.norm1, tp_mesh)
            _replicate_norm(layer.norm2, tp_mesh)
        parallelize_module(layer, tp_mesh, plan)


# -- the traced step -------------------------------------------------------------------------
def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def make_tracer(round_bytes: int, debug: bool = False, device_type: str = "meta", fake_mode=None):
    """A tracer that counts a DTensor by its local shard (a DTensor is a wrapper whose own storage
    reports the global size; the rank holds ``_local_tensor``): :class:`.rank_tracer.RankTracer`
    (which also follows FSDP2's ``UntypedStorage.resize_``) on ``device_type``.

    DTensor's sharding propagation runs below the mode on its own fake tensors, so its full-size
    temporaries are not seen -- except inside loss parallel's handlers
    (torch/distributed/tensor/parallel/loss.py ``customized_loss_ops``), which run inside DTensor's
    dispatch too but make real temporaries on the local shards (``x - max``, ``exp(...)``, the
    zeroed gradient): each handler runs with the mode pushed again, and the propagation's fake
    tensors met there (a fake tensor of another fake mode than ``fake_mode``, the trace's own) are
    skipped."""
    from torch._subclasses.fake_tensor import FakeTensor

    from .rank_tracer import RankTracer

    class _TPTracer(RankTracer):
        def __enter__(self):
            from torch.distributed.tensor.parallel import loss as tp_loss

            self._handlers = dict(tp_loss.customized_loss_ops)
            for op, fn in self._handlers.items():
                tp_loss.customized_loss_ops[op] = partial(self._reentered, fn)
            return super().__enter__()

        def __exit__(self, *exc):
            from torch.distributed.tensor.parallel import loss as tp_loss

            try:
                return super().__exit__(*exc)
            finally:
                tp_loss.customized_loss_ops.update(self._handlers)

        def _reentered(self, fn, op_call, args, kwargs):
            with _Push(self):
                return fn(op_call, args, kwargs)

        def _add(self, t: torch.Tensor) -> None:
            t = _local(t)
            if isinstance(t, FakeTensor) and t.fake_mode is not fake_mode:  # DTensor's sharding propagation
                return
            super()._add(t)

    return _TPTracer(device_type, round_bytes, debug=debug)


class _Push:
    """The tracer's dispatch mode pushed again (without its ``resize_`` wrapper a second time)."""

    def __init__(self, mode) -> None:
        self.mode = mode

    def __enter__(self):
        from torch.utils._python_dispatch import _push_mode

        _push_mode(self.mode)

    def __exit__(self, *exc):
        from torch.utils._python_dispatch import _pop_mode

        _pop_mode()
        return False


def measure_tp(exp, scale_layers=None, progress=None, debug: bool = False, device: str = "meta"):
    """Trace rank 0 of a ``tp``-way tensor-parallel step: two steps, the second measured (a
    :class:`..runner.Measurement`). ``gpus`` > 1 with ``zero`` 2/3: 2-D FSDP2 x TP, torchtitan's
    order (``parallelize_llama``: ``apply_tp`` on the ``tp`` mesh dimension, then ``apply_fsdp``
    on ``dp``), traced as the FSDP2 harness traces (fake tensors on ``cpu``, ``fake_dist``,
    ``fsdp2.apply_fsdp2``); otherwise on ``meta`` (each data-parallel replica a whole TP group)."""
    import time

    from memcalc.core.rules import check_tp as check

    from ..step import Measurement, error_reason

    t0 = time.perf_counter()
    tr = exp.training
    meas = Measurement(device=device)
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    why = tp_plan_supported(m)
    if device != "meta":
        why.append(f"tensor parallelism is traced on meta (one rank of a fake process group), not on {device}")
    if tr.zero and tr.gpus > 1 and tr.sharding != "fsdp2":
        why.append(f"--sharding {tr.sharding} with --tp: 2-D data x tensor parallelism is traced with FSDP2 only")
    if why:
        meas.status, meas.reason = "skipped", "; ".join(why)
        return meas
    try:
        check(exp)
        _trace(exp, m, meas, progress or (lambda _msg: None), debug)
    except Exception as e:  # noqa: BLE001 - the record says why, as runner.measure does
        meas.status, meas.reason, meas.measured_bytes = "error", error_reason(e), None
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def _trace(exp, m, meas, say, debug: bool) -> None:
    import contextlib
    import gc

    from torch.distributed.tensor.parallel import loss_parallel

    from ..devices import fake_as_meta
    from ..model import build_model, param_count
    from ..optim import allow_fused_on, build_optimizer
    from ..step import Probe, Step, fill_measurement, optimizer_step, track_inputs, train_step, two_steps
    from .fake_dist import DEVICE, fake_world
    from .fsdp2 import apply_fsdp2, precision_plan
    from .rank_tracer import local_tensors

    tr = exp.training
    fsdp = tr.zero in (2, 3) and tr.gpus > 1
    plan = precision_plan(tr) if fsdp else None
    build = plan.build if fsdp else tr
    fake = None
    if fsdp:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode()
    in_fake = fake if fake is not None else contextlib.nullcontext()
    dev = DEVICE if fsdp else "meta"
    with fake_world(tr.gpus * tr.tp, 0, shape=(tr.gpus, tr.tp), names=("dp", "tp")) as mesh:
        say(f"building {m.name} ({m.n_layers} layers), tp {tr.tp}"
            + (" (sequence parallel)" if tr.sequence_parallel else "")
            + (f" x FSDP2 zero {tr.zero} over {tr.gpus}" if fsdp else ""))
        torch.manual_seed(0)
        with in_fake:
            model = build_model(m, build, exp.profile, device="meta")
        meas.params = param_count(model)[0]
        apply_tp(model, mesh["tp"], tr.sequence_parallel)
        if fsdp:
            apply_fsdp2(model, mesh["dp"], tr.zero, plan)
            with fake:
                model.to_empty(device=DEVICE)
        with in_fake, fake_as_meta(fsdp), allow_fused_on("meta"):
            ids = torch.zeros((tr.batch, tr.seq), dtype=torch.int64, device=dev)
            labels = ids.clone()
            trainable = [p for p in model.parameters() if p.requires_grad]
            opt = build_optimizer(trainable, build)
            tracer = make_tracer(exp.profile.allocator_round_bytes, debug, "cpu" if fsdp else "meta", fake)
            probe = Probe("meta", tracer)
            model.on_label = probe.label
            # torchtitan's loop: the loss under loss_parallel, dropped after each backward; the
            # optimizer's record_function scopes of the step before cleared as a step starts
            parts = Step(forward=lambda: model(ids, labels), grad_accum=tr.grad_accum,
                         optimizer_step=optimizer_step(opt), release_loss=True, around=loss_parallel,
                         before=tracer.scopes.clear)
            track_inputs(tracer, model, ids, labels, opt, local_tensors)
            with tracer:
                meas.first_step_bytes, result = two_steps(probe, lambda: train_step(parts, probe.set_phase), say,
                                                          before_measured=gc.collect)
            fill_measurement(meas, result, probe, "meta", None, tracer, debug)
            model.on_label = None
            del model, opt, trainable
            gc.collect()

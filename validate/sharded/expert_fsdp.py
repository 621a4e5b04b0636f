"""FSDP2 x expert parallelism traced (``--ep`` with ``--zero 2/3``): torchtitan 0.3.0's
``apply_fsdp_to_decoder`` for ``ep_degree > 1`` on memcalc's replica, one rank on the fake process group.

The experts and their dispatcher are :mod:`.expert_parallel`'s; the step is the FSDP2 harness's
(``runner._steps``, written out here: that module reaches ``validate.runner`` through the HF harness,
which dispatches to this one): fake tensors on ``cpu`` with CUDA's kernels, AdamW ``foreach``, two
steps, the peak reset before the second, which is measured (:class:`.rank_tracer.RankTracer`).
"""

from __future__ import annotations

import gc
import time
from typing import Optional

import torch
import torch.nn as nn

from memcalc.core.expert_parallel import check_ep
from memcalc.core.spec import ExperimentSpec

from ..blocks.moe import Experts
from .ep_dispatch import shard_experts, splits_from_spec


def apply_fsdp2_ep(model: nn.Module, exp: ExperimentSpec, dp_mesh, efsdp_mesh, plan) -> None:
    """torchtitan 0.3.0's ``apply_fsdp_to_decoder`` with ``ep_degree > 1`` on the replica: each MoE layer
    one ``fully_shard`` whose ``shard_placement_fn`` puts the routed experts on the ``efsdp`` mesh
    (``gpus / ep`` ranks; ``Shard(0)``, or ``Shard(1)`` when ``efsdp x ep`` exceeds the experts) and the
    rest on the whole data-parallel mesh (two FSDP2 parameter groups per layer), every other layer a
    plain ``fully_shard``, then the root (as ``fsdp2.apply_fsdp2``); and its explicit prefetching
    ("D2H syncs in EP could interfere with implicit prefetching"): each layer prefetches the next in
    forward and the one before in backward."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    from torch.distributed.tensor import Shard

    from .fsdp2 import RESHARD_AFTER_FORWARD, upcast_trainable

    tr = exp.training
    moe = exp.model.moe
    assert moe is not None
    reshard = RESHARD_AFTER_FORWARD[tr.zero]
    upcast_trainable(model, plan)
    policy = plan.policy()
    edp_info, dp_info = _get_mesh_info(efsdp_mesh), _get_mesh_info(dp_mesh)
    placement = Shard(1) if efsdp_mesh.size() * tr.ep > moe.n_experts else Shard(0)
    layers: list = list(model.layers)  # type: ignore[arg-type]  # an nn.ModuleList
    for layer in layers:
        experts = {p for mod in layer.modules() if isinstance(mod, Experts) for p in mod.parameters()}
        if not experts:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
            continue

        def fn(param, _experts=experts):
            if param in _experts:
                return ShardPlacementResult(placement=placement, mesh_info=edp_info)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy, shard_placement_fn=fn)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    for i, layer in enumerate(layers):
        if i + 1 < len(layers):
            layer.set_modules_to_forward_prefetch([layers[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([layers[i - 1]])


def trace_fsdp2_ep(exp: ExperimentSpec, scale_layers: Optional[int] = None, debug: bool = False, say=None) -> dict:
    """Rank 0 of FSDP2 (``--zero 2/3``) x expert parallelism: ``peak_bytes``, ``phase``, ``label``,
    ``phase_peaks``, ``first_step_bytes``, ``baseline_bytes``, ``params`` (and ``peak_live`` with ``debug``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    from ..devices import fake_as_meta
    from ..model import build_model, param_count
    from ..optim import allow_fused_on, build_optimizer
    from ..step import PHASES, Probe, Step, optimizer_step, track_inputs, train_step, two_steps
    from .fake_dist import DEVICE, fake_world
    from .fsdp2 import precision_plan
    from .rank_tracer import RankTracer, local_tensors

    t0 = time.perf_counter()
    tr = exp.training
    check_ep(exp)
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    plan = precision_plan(tr)
    out: dict = {"gpus": tr.gpus, "ep": tr.ep, "zero": tr.zero, "layers": m.n_layers}
    backend = get_spmd_backend()
    set_spmd_backend("partial_dtensor")
    fake = FakeTensorMode()
    say = say or (lambda _m: None)
    try:
        with fake_world(tr.gpus, 0, shape=(tr.gpus // tr.ep, tr.ep), names=("efsdp", "ep")) as mesh, \
                splits_from_spec(exp):
            dp_mesh = mesh._flatten("dp")
            with fake:
                model = build_model(m, plan.build, exp.profile, device="meta")
                shard_experts(model, exp, mesh["ep"])
            out["params"] = param_count(model)[0]
            apply_fsdp2_ep(model, exp, dp_mesh, mesh["efsdp"], plan)
            with fake:
                model.to_empty(device=DEVICE)
            with fake, fake_as_meta(True), allow_fused_on("meta"):
                ids = torch.zeros((tr.batch, tr.seq), dtype=torch.int64, device=DEVICE)
                labels = ids.clone()
                trainable: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
                opt = build_optimizer(trainable, plan.build)
                tracer = RankTracer(DEVICE, exp.profile.allocator_round_bytes, debug=debug)
                track_inputs(tracer, model, ids, labels, None, local_tensors)
                model.on_label = lambda text: setattr(tracer, "label", text)
                parts = Step(forward=lambda: model(ids, labels), grad_accum=tr.grad_accum,
                             optimizer_step=optimizer_step(opt))
                set_phase = lambda phase: tracer.set_phase(phase, tracer.label if phase == "backward" else "")  # noqa: E731

                def before_measured() -> None:
                    gc.collect()
                    tracer.set_phase("setup", "")
                    out["baseline_bytes"] = tracer.current

                try:
                    with tracer:
                        out["first_step_bytes"], _ = two_steps(Probe(DEVICE, tracer),
                                                               lambda: train_step(parts, set_phase), say,
                                                               before_measured)
                finally:
                    model.on_label = None
                rec = tracer.record
                out.update(peak_bytes=rec.bytes, phase=rec.phase, label=rec.label,
                           phase_peaks={k: v for k, v in rec.phase_peaks.items() if k in PHASES})
                if debug:
                    out["peak_live"] = sorted(([b, w] for b, w, _ in tracer.peak_live), reverse=True)
                del opt, trainable
                gc.collect()
    finally:
        set_spmd_backend(backend)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out

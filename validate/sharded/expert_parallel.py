"""Expert parallelism (``--ep``) traced: torchtitan's all-to-all token dispatcher around memcalc's
replica's experts, one rank on PyTorch's fake process group.

The library code that runs unmodified is torchtitan 0.3.0's
``torchtitan/models/common/token_dispatcher.py`` ``AllToAllTokenDispatcher`` (the
``expert_parallel_degree > 1`` dispatcher of ``RoutedExperts``): its ``dispatch`` (``_local_reorder``:
argsort by expert, the scores and the rows gathered; the token-count exchange; the rows sent by
``all_to_all_single``; ``_permute`` from rank-major to expert-major order) and its ``combine``
(``_unpermute``, the rows sent back by ``all_to_all_single``, the fp32 score product, torchtitan's
``deterministic_scatter_add``), with ``spmd_backend`` ``partial_dtensor`` (one of its
``ParallelismConfig.spmd_backend`` values: the functional collectives on the EP process group; the
default ``spmd_types`` path calls ``spmd.all_to_all``, the same all-to-all with the same buffers,
under spmd_types' type checking, which needs torchtitan's whole SPMD mesh).

What is ported, with memory-identical code, and why:

- the routing map and the per-expert token counts torchtitan's ``MoE.forward`` makes before it calls
  the routed experts (``zeros_like(scores, dtype=bool).scatter_(-1, ids, True)`` then
  ``.sum(dim=(0, 1))``), here inside the experts' call (the replica's router is transformers', which
  has no such counts);
- the experts' own computation is the replica's (transformers' ``grouped_mm_experts_forward``: one
  grouped matmul for gate and up, one for down, on ``n_experts / ep`` local experts; torchtitan's
  ``GroupedExperts`` runs w1 and w3 apart, which memcalc does not model), fed the dispatcher's rows
  and its per-local-expert counts (``GroupedExperts.forward``: ``cumsum(counts, dtype=int32)``);
- the experts' weights are plain tensors of the local shape ``(n_experts / ep, ...)``: torchtitan's
  are ``Shard(0)`` DTensors on the ``ep`` mesh (``moe_sharding.expert_param_placement_sparse``)
  that ``GroupedExperts.forward`` turns into their local tensors (``to_local()``) before computing:
  the rank holds the same bytes;
- ``_sync_token_count_exchange`` is answered from the spec: it reads the exchanged counts back
  to the host (``.tolist()``, data that meta tensors do not have) to size the variable all-to-all;
  the answer is the even split times ``ep_capacity_factor`` (``memcalc.core.expert_parallel``),
  the stated input the estimate uses. Its two ``(ep,)`` device sums are made as the real code
  makes them.

The step runs on ``meta`` (as the tensor-parallel trace without FSDP: ``tp.py``) on a
``(gpus / ep, ep)`` fake mesh; the all-to-alls allocate their outputs and move no data. With
``--zero 2/3`` (``expert_fsdp.trace_fsdp2_ep``): torchtitan's ``apply_fsdp_to_decoder`` for ``ep_degree > 1``
(``expert_fsdp.apply_fsdp2_ep``) on a ``(efsdp, ep)`` mesh and its flattened ``dp`` mesh, traced as the
FSDP2 harness traces (fake tensors on ``cpu``).
"""

from __future__ import annotations

import torch

from memcalc.core.expert_parallel import check_ep
from memcalc.core.spec import ExperimentSpec

from .ep_dispatch import TORCHTITAN, shard_experts, splits_from_spec  # noqa: F401  (re-exported)

def measure_ep(exp: ExperimentSpec, scale_layers=None, progress=None, debug: bool = False, device: str = "meta"):
    """Trace rank 0 of an expert-parallel step (``--ep``; ``gpus`` data-parallel ranks, the experts
    split over ``ep`` of them): two steps, the second measured (a :class:`..step.Measurement`)."""
    import time

    from ..step import Measurement, error_reason

    t0 = time.perf_counter()
    meas = Measurement(device=device)
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    if device != "meta":
        meas.status, meas.reason = "skipped", f"expert parallelism is traced on meta (one rank of a fake " \
                                              f"process group), not on {device}"
        return meas
    try:
        check_ep(exp)
        if exp.training.zero in (2, 3):  # FSDP2 x EP: the FSDP2 harness's steps (runner._steps)
            from .expert_fsdp import trace_fsdp2_ep

            r = trace_fsdp2_ep(exp, scale_layers, debug, progress)
            meas.measured_bytes, meas.first_step_bytes = r["peak_bytes"], r["first_step_bytes"]
            meas.peak_phase, meas.peak_label, meas.params = r["phase"], r["label"], r["params"]
            meas.phase_peaks = dict(r["phase_peaks"])
        else:
            _trace(exp, m, meas, progress or (lambda _msg: None), debug)
    except Exception as e:  # the record says why, as runner.measure does
        meas.status, meas.reason, meas.measured_bytes = "error", error_reason(e), None
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def _trace(exp: ExperimentSpec, m, meas, say, debug: bool) -> None:
    """The replica's single-GPU step (``step.run_on_device``, as ``runner.measure`` runs it on meta)
    with the experts sharded and dispatched (:func:`shard_experts`), inside the fake world."""
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    from ..model import build_model, param_count
    from ..step import run_on_device
    from .fake_dist import fake_world

    tr = exp.training
    backend = get_spmd_backend()
    set_spmd_backend("partial_dtensor")
    try:
        with fake_world(tr.gpus, 0, shape=(tr.gpus // tr.ep, tr.ep), names=("dp", "ep")) as mesh, \
                splits_from_spec(exp):
            say(f"building {m.name} ({m.n_layers} layers), ep {tr.ep} of {tr.gpus} GPUs")
            torch.manual_seed(0)
            model = build_model(m, tr, exp.profile, device="meta")
            meas.params = param_count(model)[0]
            shard_experts(model, exp, mesh["ep"])

            def attach(probe) -> None:
                model.on_label = probe.label

            try:
                run_on_device(exp, m, "meta", model, meas, say, debug, None, model, attach)
            finally:
                model.on_label = None
    finally:
        set_spmd_backend(backend)

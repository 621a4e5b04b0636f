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
``--zero 2/3`` (:func:`trace_fsdp2_ep`): torchtitan's ``apply_fsdp_to_decoder`` for ``ep_degree > 1``
(:func:`apply_fsdp2_ep`) on a ``(efsdp, ep)`` mesh and its flattened ``dp`` mesh, traced as the
FSDP2 harness traces (``runner._steps``: fake tensors on ``cpu``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from memcalc.core.expert_parallel import check_ep, received_rows
from memcalc.core.spec import ExperimentSpec

from ..blocks.mlp import activation
from ..blocks.moe import Experts, grouped_mm

#: torchtitan's version this harness follows (the dispatcher's signatures changed across releases)
TORCHTITAN = "0.3.0"


def _even(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` ranks, as evenly as whole rows go."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@contextlib.contextmanager
def splits_from_spec(exp: ExperimentSpec) -> Iterator[None]:
    """``AllToAllTokenDispatcher._sync_token_count_exchange`` answered from the spec (see the module
    docstring): the rows sent split evenly over the EP ranks, the rows received the sent ones times
    the capacity factor."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    tr = exp.training
    k = exp.model.moe.top_k if exp.model.moe is not None else 1

    def sync(self, num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size):
        glob = torch.ops._c10d_functional.wait_tensor(num_global_tokens_per_local_expert_EP_e)
        glob_E = glob.reshape(-1)
        # the device sums the real code copies to the host (.to("cpu")); their values are not used here
        sent = num_local_tokens_per_expert_E.view(ep_size, -1).sum(dim=1)
        got = glob_E.view(ep_size, -1).sum(dim=1)
        del sent, got
        rows = self._memcalc_tokens * k
        return glob_E, _even(rows, ep_size), _even(received_rows(rows, tr.ep_capacity_factor), ep_size)

    saved = AllToAllTokenDispatcher._sync_token_count_exchange
    AllToAllTokenDispatcher._sync_token_count_exchange = sync
    try:
        yield
    finally:
        AllToAllTokenDispatcher._sync_token_count_exchange = saved


def _ep_forward(self: Experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The replica's experts with torchtitan's dispatcher around them (see the module docstring)."""
    disp: Any = self.__dict__["_memcalc_dispatcher"]  # set by shard_experts
    disp._memcalc_tokens = hidden_states.size(0)
    # torchtitan MoE.forward: the routing map and the per-expert counts of this rank's tokens
    routing_map = torch.zeros((hidden_states.size(0), self.n), dtype=torch.bool,
                              device=hidden_states.device).scatter_(-1, top_k_index, True)
    num_local_tokens_per_expert = routing_map.sum(dim=0)
    routed_input, num_tokens_per_local_expert, metadata = disp.dispatch(
        hidden_states, top_k_weights, top_k_index, num_local_tokens_per_expert)
    offsets = torch.cumsum(num_tokens_per_local_expert, dim=0, dtype=torch.int32)
    w = self.weight("gate_up_proj")
    proj_out = grouped_mm(routed_input.to(w.dtype), w.transpose(-2, -1), offsets)
    if self.gated:  # transformers' _default_apply_gate
        gate, up = proj_out.chunk(2, dim=-1)
        proj_out = activation(gate, self.act) * up
        del gate, up
    else:
        proj_out = activation(proj_out, self.act)
    w = self.weight("down_proj")
    routed_output = grouped_mm(proj_out.to(w.dtype), w.transpose(-2, -1), offsets)
    del proj_out
    out = disp.combine(routed_output, metadata, hidden_states)  # RoutedExperts.forward keeps routed_output
    return out.to(hidden_states.dtype)


def shard_experts(model: nn.Module, exp: ExperimentSpec, ep_mesh) -> None:
    """Give every MoE layer's experts their local shard (``n_experts / ep``) and torchtitan's
    all-to-all dispatcher on ``ep_mesh`` (built as ``RoutedExperts`` builds it from its config, and
    wired as ``RoutedExperts.parallelize`` wires it)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    moe = exp.model.moe
    assert moe is not None
    ep = exp.training.ep
    for mod in model.modules():
        if not isinstance(mod, Experts):
            continue
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(mod, name)
            local = torch.empty((p.shape[0] // ep, *p.shape[1:]), dtype=p.dtype, device=p.device)
            setattr(mod, name, nn.Parameter(local, requires_grad=p.requires_grad))
        disp = AllToAllTokenDispatcher(AllToAllTokenDispatcher.Config(num_experts=moe.n_experts, top_k=moe.top_k))
        disp.wire_meshes(ep_mesh=ep_mesh)
        mod.__dict__["_memcalc_dispatcher"] = disp
        mod.__dict__["forward"] = types.MethodType(_ep_forward, mod)  # this instance's forward


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

    from .fsdp2 import RESHARD_AFTER_FORWARD

    tr = exp.training
    moe = exp.model.moe
    assert moe is not None
    reshard = RESHARD_AFTER_FORWARD[tr.zero]
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


def trace_fsdp2_ep(exp: ExperimentSpec, scale_layers=None, debug: bool = False, say=None) -> dict:
    """Rank 0 of FSDP2 (``--zero 2/3``) x expert parallelism, traced as the FSDP2 harness traces
    (``runner._steps``: fake tensors on ``cpu``, two steps, the second measured)."""
    import time

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchtitan.distributed.utils import get_spmd_backend, set_spmd_backend

    from ..model import build_model, param_count
    from .fake_dist import DEVICE, fake_world
    from .fsdp2 import precision_plan
    from .runner import _steps

    t0 = time.perf_counter()
    tr = exp.training
    check_ep(exp)
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    plan = precision_plan(tr)
    out: dict = {"gpus": tr.gpus, "ep": tr.ep, "zero": tr.zero, "layers": m.n_layers}
    backend = get_spmd_backend()
    set_spmd_backend("partial_dtensor")
    fake = FakeTensorMode()
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
            try:
                _steps(exp, model, model, None, plan, fake, fake, out, False, False, debug, say or (lambda _m: None),
                       True)
            finally:
                model.on_label = None
    finally:
        set_spmd_backend(backend)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out

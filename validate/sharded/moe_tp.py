"""Tensor parallelism on a mixture-of-experts layer (``--tp`` without ``--ep``): torchtitan 0.3.0's
layouts on memcalc's replica's MoE block, one rank on PyTorch's fake process group.

torchtitan 0.3.0 shards an MoE layer under tensor parallelism by ``set_moe_sharding_config``
(``torchtitan/models/common/moe_sharding.py``, applied by ``Module.parallelize`` from
``models/{qwen3,deepseek_v3}/sharding.py`` with ``enable_ep=False``). With ``enable_ep=False``:

- ``_moe_sharding_config``: the MoE's input arrives at the residual layout (``Shard(1)`` with
  sequence parallelism, else invariant) and is redistributed to ``Replicate`` (all-gathered under
  sequence parallelism): every tp rank routes every token; its output, ``Partial``, is
  redistributed to the residual layout (reduce-scattered to ``Shard(1)``, else all-reduced);
- ``_router_sharding_config``: the router gate's weight is ``Replicate``, it runs on all tokens;
- ``_routed_experts_sharding_configs``: the routed experts run in a ``local_map`` on the local
  weights (``expert_param_placement_dense``: ``w1_EFD``/``w3_EFD`` ``Shard(1)``, ``w2_EDF``
  ``Shard(2)``: ``d_ff_expert / tp`` of every expert's hidden width), the input's gradient
  ``Partial`` (``experts_input_grad_layout``), the output ``Partial``.

The same layouts here, with DTensor's own redistributes (which torchtitan's ``partial_dtensor``
spmd backend runs too): the block's input ``from_local`` at the residual layout,
``redistribute(Replicate)``, ``to_local(grad_placements=[Partial()])``; the router's parameters
replicated DTensors (``distribute_module``); the experts' tensors ``Shard(1)`` DTensors (the replica
fuses w1 and w3 into one ``gate_up_proj``, each half sharded on its rows: the local
``(E, 2 f / tp, d)`` holds this rank's rows of both, the bytes of torchtitan's two tensors) used
through ``to_local()``; the output ``from_local(Partial)`` redistributed to the residual layout.
Shared experts (DeepSeek-V3's; not Qwen2-MoE's gated one, which torchtitan has no model for):
``_shared_experts_sharding_configs`` (see :func:`_shared_plan`).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module


def _router_io(mesh):
    def inp(mod, inputs, m):
        return tuple(DTensor.from_local(t, m, [Replicate()], run_check=False)
                     if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

    def out(mod, outputs, m):
        return tuple(t.to_local() if isinstance(t, DTensor) else t for t in outputs)
    return inp, out


def _shard_experts(experts: nn.Module, mesh, tp: int) -> None:
    """``expert_param_placement_dense``: gate/up rows ``Shard(1)``, down columns ``Shard(2)``."""
    for name, dim in (("gate_up_proj", 1), ("down_proj", 2)):
        p = getattr(experts, name)
        shape = list(p.shape)
        shape[dim] //= tp
        local = p.new_empty(shape)  # a fake tensor when the model is built under FakeTensorMode (2-D FSDP2 x TP)
        d = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
        setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))

    def weight(self, name: str) -> torch.Tensor:  # the local_map's local tensors
        return getattr(self, name).to_local()
    experts.__dict__["weight"] = types.MethodType(weight, experts)


def _shared_plan(shared: nn.Module, mesh, sequence_parallel: bool, colwise: type, rowwise: type) -> None:
    """``_shared_experts_sharding_configs(enable_ep=False)``: w1/w3 colwise on the block's ``Replicate`` input
    (a DTensor: no per-linear reduction of the input's gradient, which stays ``Partial`` to the MoE boundary),
    w2 rowwise with its ``Partial`` output reduce-scattered to ``Shard(1)`` (sequence parallelism) or kept
    ``Partial`` (added to the routed experts' ``Partial`` output, reduced once at the boundary). ``colwise`` /
    ``rowwise``: ``tp._Colwise`` / ``tp._Rowwise`` (the replica's linears are not ``nn.Linear``)."""
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    out = Shard(1) if sequence_parallel else Partial()
    plan: dict[str, ParallelStyle] = {name: colwise() for name in ("gate_proj", "up_proj", "fc1")
                                      if hasattr(shared, name)}
    plan["down_proj" if hasattr(shared, "down_proj") else "fc2"] = rowwise(output_layouts=out, use_local_output=False)
    parallelize_module(shared, mesh, plan)


def apply_moe_tp(block: nn.Module, mesh, sequence_parallel: bool, colwise: type, rowwise: type) -> None:
    """torchtitan's ``set_moe_sharding_config(enable_ep=False)`` layouts on one replica ``MoEBlock``
    (``colwise`` / ``rowwise``: the plan's styles for the shared experts' linears, :func:`_shared_plan`)."""
    assert block.shared_expert_gate is None
    tp = mesh.size()
    inp, out = _router_io(mesh)
    distribute_module(block.router, mesh, input_fn=inp, output_fn=out)
    _shard_experts(block.experts, mesh, tp)
    resid = [Shard(1)] if sequence_parallel else [Replicate()]
    inner = block.forward
    shared = block.shared_experts
    if shared is not None:
        _shared_plan(shared, mesh, sequence_parallel, colwise, rowwise)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # with sequence parallelism norm2 (SequenceParallel) hands a Shard(1) DTensor; without, a local tensor
        x = h if isinstance(h, DTensor) else DTensor.from_local(h, mesh, resid, run_check=False)
        x_rep = x.redistribute(mesh, [Replicate()])
        x = x_rep.to_local(grad_placements=[Partial()])
        if shared is None:
            y = inner(x)
            return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, resid).to_local()
        # torchtitan MoE.forward: routed experts, then the shared experts, then their sum
        B, T, d = x.shape
        xf = x.view(-1, d)
        _, weights, idx = self.router(xf)
        y = self.experts(xf, idx, weights)
        yd = DTensor.from_local(y.view(B, T, d), mesh, [Partial()], run_check=False)
        if sequence_parallel:  # desired_experts_output_layout: Shard(1)
            yd = yd.redistribute(mesh, resid)
        out = yd + shared(x_rep)
        return out.redistribute(mesh, resid).to_local()
    block.__dict__["forward"] = types.MethodType(forward, block)

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
Shared experts (DeepSeek-V3, Qwen2-MoE) are not traced here (``tp_plan_supported`` says so).
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


def apply_moe_tp(block: nn.Module, mesh, sequence_parallel: bool) -> None:
    """torchtitan's ``set_moe_sharding_config(enable_ep=False)`` layouts on one replica ``MoEBlock``."""
    assert block.shared_experts is None and block.shared_expert_gate is None
    tp = mesh.size()
    inp, out = _router_io(mesh)
    distribute_module(block.router, mesh, input_fn=inp, output_fn=out)
    _shard_experts(block.experts, mesh, tp)
    resid = [Shard(1)] if sequence_parallel else [Replicate()]
    inner = block.forward

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # with sequence parallelism norm2 (SequenceParallel) hands a Shard(1) DTensor; without, a local tensor
        x = h if isinstance(h, DTensor) else DTensor.from_local(h, mesh, resid, run_check=False)
        x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        y = inner(x)
        return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, resid).to_local()
    block.__dict__["forward"] = types.MethodType(forward, block)

"""torchtitan's all-to-all token dispatcher on memcalc's replica's experts (``--ep``): the pieces the
expert-parallel traces share (:mod:`.expert_parallel` alone, :mod:`.expert_fsdp` under FSDP2); what is
ported and why is :mod:`.expert_parallel`'s docstring."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from memcalc.core.expert_parallel import received_rows
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

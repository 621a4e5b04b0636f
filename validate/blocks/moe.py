"""The mixture-of-experts block as transformers 5.23 runs it by default, op by op.

Source: transformers/integrations/moe.py ``grouped_mm_experts_forward`` (the default
``experts_implementation``: ``PreTrainedModel.get_correct_experts_implementation`` picks
``grouped_mm`` for every experts class decorated with ``@use_experts_implementation``), the
routers of models/{qwen2_moe,qwen3_moe,mixtral,deepseek_v3}/modeling_*.py and their sparse
blocks (shared experts, Qwen2-MoE's sigmoid shared-expert gate).

The experts run as ONE grouped matmul over all ``S = tokens x top_k`` routed rows, sorted by
expert (``torch.sort``, a gather ``hidden[perm // top_k]``, ``histc`` + ``cumsum`` offsets,
``F.grouped_mm``), so no shape depends on the routing: the block traces on ``meta`` as it is
(no ``nonzero``/``where``), whatever the (garbage) router outputs are. Under the balanced
assumption (``MoESpec.routing``) each expert gets ``S / n_experts`` rows, but the grouped
kernel's tensors are sized by ``S`` alone, so the assumption changes no byte here: it would
matter for the eager per-expert loop (``experts_implementation="eager"``, per-expert
temporaries of the busiest expert) and for expert parallelism, neither of which is modelled.

Router kinds (``MoESpec.router``):

- ``softmax`` (Qwen2-MoE, Qwen3-MoE ``*TopKRouter``): ``softmax(logits, dtype=float)``, top-k,
  renormalised (``norm_topk_prob``), cast back to the logits' dtype.
- ``softmax-fp32`` (Mixtral): ``softmax(logits.float())``, top-k, renormalised; the routing
  weights stay fp32, so the weighted expert output (S x d) is fp32.
- ``sigmoid`` (DeepSeek-V3 ``DeepseekV3TopkRouter``): the router linear in fp32 (``hidden.type(
  float32)``, ``weight.type(float32)``), sigmoid scores, group-limited top-k, fp32 weights times
  ``routed_scaling_factor``.

The router logits are dropped (``output_router_logits`` defaults to False in every config, so
no load-balancing loss is computed and no layer's logits outlive its block).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from memcalc.core.rules import deepseek_groups, expert_lora_ranks
from memcalc.core.spec import ModelSpec

from ..devices import kernel_device
from .mlp import MLP, activation


class _GroupedMMFallback(torch.autograd.Function):
    """``torch._grouped_mm`` for non-bf16 inputs: on CUDA the aten kernel falls back to a loop of
    ``mm`` into one output (aten ``_grouped_mm_fallback``), but its meta registration accepts bf16
    only. Same allocations: the (S, out) output; saves the input when the weight needs a gradient
    (autograd's codegen saves a variable only for the gradients that use it: tools/autograd/
    gen_variable_type.py ``guard_for``), and the weight; backward makes the input's and the weight's
    gradients. The estimator's twin: ``memcalc.engine.moe`` ``grouped_mm``."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.rows = a.shape[0]
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b, offs)
        if kernel_device(a) == "meta":
            return a.new_empty((a.shape[0], b.shape[-1]))
        out = a.new_zeros((a.shape[0], b.shape[-1]))
        start = 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ b[g]
            start = end
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        ga = gb = None
        if kernel_device(grad) == "meta":
            # empty_like keeps b's (transposed) strides, as grouped_mm's own weight gradient does,
            # so AccumulateGrad takes it without a contiguous copy
            ga = grad.new_empty((ctx.rows, b.shape[-2])) if ctx.needs_input_grad[0] else None
            gb = torch.empty_like(b) if ctx.needs_input_grad[1] else None
            return ga, gb, None
        ga = grad.new_zeros((ctx.rows, b.shape[-2])) if ctx.needs_input_grad[0] else None
        gb = torch.zeros_like(b) if ctx.needs_input_grad[1] else None
        start = 0
        for g, end in enumerate(offs.tolist()):
            if ga is not None:
                ga[start:end] = grad[start:end] @ b[g].T
            if gb is not None:
                gb[g] = a[start:end].T @ grad[start:end]
            start = end
        return ga, gb, None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm`` (bf16, and on CPU), else the fallback above (same memory)."""
    if a.dtype == torch.bfloat16 or kernel_device(a) == "cpu":
        return F.grouped_mm(a, b, offs=offs)
    return _GroupedMMFallback.apply(a, b, offs)


class Experts(nn.Module):
    """``*Experts`` with 3-D parameters: gate_up_proj (E, 2f, d), down_proj (E, d, f)."""

    def __init__(self, m: ModelSpec, cfg, layer: int) -> None:
        super().__init__()
        moe = m.moe
        assert moe is not None
        self.n, self.top_k, self.act = moe.n_experts, moe.top_k, cfg.activation
        self.gated = m.mlp == "gated"
        e, d, f = moe.n_experts, m.d_model, moe.d_ff_expert
        up = 2 * f if self.gated else f
        kw = dict(dtype=cfg.dtype, device=cfg.device)
        self.gate_up_proj = nn.Parameter(torch.empty((e, up, d), **kw), requires_grad=cfg.full)
        self.down_proj = nn.Parameter(torch.empty((e, d, f), **kw), requires_grad=cfg.full)
        if cfg.init:
            nn.init.normal_(self.gate_up_proj, std=0.02)
            nn.init.normal_(self.down_proj, std=0.02)
        # LoRA on the expert tensors (PEFT target_parameters; peft 0.21 tuners/lora/layer.py
        # ParamWrapper.update_layer): lora_A (r E, in), lora_B (out, r E) of each (E, out, in) tensor,
        # named <tensor>_lora_A / _lora_B here (the inventory's <tensor>.lora_A: a parameter cannot
        # have children); the rank per tensor is PEFT's mapping of the targets (core.rules)
        self.scale = {}
        if cfg.lora is not None:
            ranks = expert_lora_ranks(m, cfg.lora)
            for name in ("gate_up_proj", "down_proj"):
                if ranks[name]:
                    _e, d_out, d_in = getattr(self, name).shape
                    a_shape, b_shape = (ranks[name] * e, d_in), (d_out, ranks[name] * e)
                    self.register_parameter(name + "_lora_A", nn.Parameter(torch.empty(a_shape, **kw)))
                    self.register_parameter(name + "_lora_B", nn.Parameter(torch.zeros(b_shape, **kw)))
                    if cfg.init:
                        nn.init.normal_(getattr(self, name + "_lora_A"), std=0.02)
                    self.scale[name] = cfg.lora.alpha / (a_shape[0] // e)

    def weight(self, name: str) -> torch.Tensor:
        """The expert tensor as the experts see it: with an adapter, PEFT's ``_LoraFactorsProxy``
        parametrization ``baddbmm(W, B', A', alpha=scale)`` (B' = B reshaped (out, r, E) and permuted
        to (E, out, r); A' = A reshaped (E, r, in)), a new full-size tensor for the call."""
        w = getattr(self, name)
        if name not in self.scale:
            return w
        a, b = getattr(self, name + "_lora_A"), getattr(self, name + "_lora_B")
        lhs = b.reshape(b.shape[0], -1, self.n).permute(2, 0, 1).to(w.dtype)
        rhs = a.reshape(self.n, -1, a.shape[-1]).to(w.dtype)
        return torch.baddbmm(w, lhs, rhs, alpha=self.scale[name])

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``grouped_mm_experts_forward`` without expert parallelism or biases, its local names kept
        (a local holds its tensor until the function returns)."""
        device = hidden_states.device
        num_top_k = top_k_index.size(-1)
        num_tokens = hidden_states.size(0)
        hidden_dim = hidden_states.size(-1)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected_hidden_states_g = hidden_states[perm // num_top_k]
        sample_weights_g = sample_weights[perm]
        # CUDA (and meta) count int32 ids; cpu/mps count floats
        histc_input = expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int()
        tokens_per_expert = torch.histc(histc_input, bins=self.n, min=0, max=self.n - 1)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        # grouped_mm is on no autocast list (transformers' _grouped_mm says so): under AMP the
        # experts run in the fp32 of their weights
        w_gate_up = w = self.weight("gate_up_proj")  # the parametrization's cache holds it for the call
        # _grouped_linear(is_transposed=False) -> _grouped_mm(input.to(weight.dtype), weight.transpose(-2, -1))
        proj_out = grouped_mm(selected_hidden_states_g.to(w.dtype), w.transpose(-2, -1), offsets)
        if self.gated:  # _default_apply_gate
            gate, up = proj_out.chunk(2, dim=-1)
            proj_out = activation(gate, self.act) * up
            del gate, up  # locals of _default_apply_gate
        else:
            proj_out = activation(proj_out, self.act)
        w_down = w = self.weight("down_proj")
        proj_out = grouped_mm(proj_out.to(w.dtype), w.transpose(-2, -1), offsets)
        weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=device)
        weighted_out = weighted_out[inv_perm]
        final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        return final_hidden_states.to(hidden_states.dtype)


class Router(nn.Module):
    """The top-k router (see the module docstring for the kinds)."""

    def __init__(self, m: ModelSpec, cfg) -> None:
        super().__init__()
        moe = m.moe
        assert moe is not None
        self.kind, self.top_k, self.n = moe.router, moe.top_k, moe.n_experts
        self.weight = nn.Parameter(torch.empty((moe.n_experts, m.d_model), dtype=cfg.dtype, device=cfg.device),
                                   requires_grad=cfg.full)
        if cfg.init:
            nn.init.normal_(self.weight, std=0.02)
        self.amp = cfg.amp
        # DeepSeek-V3 group-limited routing: n_group / topk_group (8 / 4 in V3's config), and the
        # e_score_correction_bias buffer (fp32)
        self.n_group, self.topk_group = deepseek_groups(moe.n_experts)
        if self.kind == "sigmoid":
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(moe.n_experts, dtype=torch.float32, device=cfg.device), persistent=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (logits (N, E), routing weights (N, k), expert indices (N, k)). Local names as in
        the modeling files."""
        amp = self.amp
        if self.kind == "sigmoid":  # DeepseekV3TopkRouter.forward
            # under autocast the linear still runs in the lower precision (both casts are no-ops on fp32)
            router_logits = F.linear(amp.lp(hidden_states.type(torch.float32)), amp.lp(self.weight.type(torch.float32)))
            scores = router_logits.sigmoid()
            scores_for_choice = scores + self.e_score_correction_bias
            g, per = self.n_group, self.n // self.n_group
            group_scores = scores_for_choice.view(-1, g, per).topk(min(2, per), dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, g, per).reshape(-1, self.n)
            scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
            topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
            topk_weights = scores.gather(1, topk_indices)
            denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
            topk_weights /= denominator
            topk_weights = topk_weights * 2.5  # routed_scaling_factor (V3: 2.5; a value)
            return router_logits, topk_weights, topk_indices
        router_logits = F.linear(amp.lp(hidden_states), amp.lp(self.weight))
        if self.kind == "softmax-fp32":  # MixtralTopKRouter: softmax(logits.float())
            router_probs = F.softmax(router_logits.float(), dim=-1)
        else:  # Qwen2/3-MoE: softmax(logits, dtype=torch.float)
            router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)  # norm_topk_prob
        if self.kind == "softmax":
            router_top_value = router_top_value.to(router_logits.dtype)
        return router_logits, router_top_value, router_indices


class MoEBlock(nn.Module):
    """The sparse block: router, routed experts, shared experts (DeepseekV3MoE: added; Qwen2-MoE:
    ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` then added)."""

    def __init__(self, m: ModelSpec, cfg, layer: int) -> None:
        super().__init__()
        moe = m.moe
        assert moe is not None
        self.router = Router(m, cfg)
        self.experts = Experts(m, cfg, layer)
        self.shared_experts = None
        if moe.n_shared_experts:
            self.shared_experts = MLP(m.mlp, cfg.activation, cfg.linear, m.d_model, moe.shared_width, False,
                                      forgather_order=False)
        self.shared_expert_gate = cfg.linear("shared_expert_gate", m.d_model, 1, False) if moe.shared_expert_gate else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, d = h.shape
        x = h.view(-1, d)
        shared = None
        if self.shared_expert_gate is not None:  # Qwen2MoeSparseMoeBlock: shared expert first
            shared = self.shared_experts(x)
        # ``_, routing_weights, selected_experts = self.gate(...)``: ``_`` is a local too, so the
        # router logits live until the block returns
        _, weights, idx = self.router(x)
        y = self.experts(x, idx, weights)
        if self.shared_expert_gate is not None:
            y = y + F.sigmoid(self.shared_expert_gate(x)) * shared
        elif self.shared_experts is not None:  # DeepseekV3MoE: experts(...) + shared_experts(residuals)
            y = y.view(B, T, d) + self.shared_experts(h)
        return y.reshape(B, T, d)

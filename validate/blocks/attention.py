"""The twin of :mod:`memcalc.engine.blocks.attention`: the attention module (q/k/v/o projections,
q/k norms, positions, GQA expansion, the kernel; the families' eager and sliding attention through
:mod:`.attention_variants`). The kernels themselves (SDPA's, RoPE, ALiBi) are :mod:`.sdpa`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from memcalc.core.spec import ModelSpec

from . import attention_variants as variants
from .sdpa import alibi_mask, alibi_slopes_init, apply_rope, choose_kernel, repeat_kv, sdpa

if TYPE_CHECKING:
    from .build import BuildConfig


class Attention(nn.Module):
    """q/k/v/o projections, positions (RoPE or ALiBi), GQA expansion and the SDPA kernel."""

    def __init__(self, m: ModelSpec, cfg: "BuildConfig") -> None:
        super().__init__()
        self.m, self.cfg = m, cfg
        mk = cfg.linear
        if m.fused_qkv:  # Phi3Attention.qkv_proj, GPT-2 c_attn, GPT-NeoX query_key_value
            self.qkv_proj = mk("qkv", m.d_model, m.q_dim + 2 * m.kv_dim, m.qkv_bias)
        else:
            self.q_proj = mk("q", m.d_model, m.q_dim, m.qkv_bias)
            self.k_proj = mk("k", m.d_model, m.kv_dim, m.qkv_bias)
            self.v_proj = mk("v", m.d_model, m.kv_dim, m.qkv_bias)
        self.o_proj = mk("o", m.q_dim, m.d_model, m.o_bias)
        if m.qk_norm != "none":
            self.q_norm, self.k_norm = cfg.qk_norm(m.n_heads), cfg.qk_norm(m.kv_heads)
        if m.attn_sinks:  # GptOssAttention.sinks
            self.sinks = nn.Parameter(torch.zeros((m.n_heads,), dtype=cfg.dtype, device=cfg.device),
                                      requires_grad=cfg.full)
        if m.positions == "alibi":
            slopes = alibi_slopes_init(m.n_heads, cfg.device).to(cfg.dtype)
            if m.alibi_trainable:
                self.alibi_slopes = nn.Parameter(slopes, requires_grad=cfg.full)
            else:
                self.register_buffer("alibi_slopes", slopes, persistent=False)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
             layer_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Positions, mask and kernel on (B,H,T,D) q and (B,kvH,T,D) k, v; ``layer_mask``: the
        layer's shared mask (eager float mask, or SDPA's boolean sliding mask)."""
        m, amp = self.m, self.cfg.amp
        T = q.shape[2]
        mask = None
        if variants.eager(m):  # Gemma-2 softcap, gpt-oss sinks: transformers' eager attention
            if m.positions == "rope":
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            q, k, v = amp.lp(q), amp.lp(k), amp.lp(v)
            p = m.attn_dropout if self.training else 0.0
            out = variants.eager_attention(q, k, v, layer_mask, m.n_heads // m.kv_heads, m.dim_head ** -0.5,
                                           m.attn_softcap, getattr(self, "sinks", None), p)
            return out.transpose(1, 2)
        if layer_mask is not None:  # a sliding layer: the boolean mask through SDPA
            if m.positions == "rope":
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            q, k, v = amp.lp(q), amp.lp(k), amp.lp(v)
            n_rep = m.n_heads // m.kv_heads
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            mask = variants.convert_bool_mask(layer_mask, q.dtype)
            kernel = choose_kernel(self.cfg.profile.attention, q.dtype, True)
            p = m.attn_dropout if self.training else 0.0
            return sdpa(q, k, v, mask, kernel, p, is_causal=True)
        if m.positions == "alibi":
            mask = alibi_mask(self.alibi_slopes, T, q.dtype)
        elif m.positions == "rope":
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v, mask = amp.lp(q), amp.lp(k), amp.lp(v), amp.lp(mask)  # autocast: sdpa is lower-precision
        n_rep = m.n_heads // m.kv_heads
        # the profile's sdpa_gqa: K/V un-expanded with enable_gqa where transformers' use_gqa_in_sdpa holds
        # (integrations/sdpa_attention.py: no explicit mask, head dim <= 256; memcalc.engine.forward's rule)
        gqa = n_rep > 1 and self.cfg.profile.sdpa_gqa and mask is None and m.dim_head <= 256
        kernel = choose_kernel(self.cfg.profile.attention, q.dtype, mask is not None, gqa)
        if not gqa:
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        p = m.attn_dropout if self.training else 0.0
        return sdpa(q, k, v, mask, kernel, p, is_causal=True)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B,H,T,D) q and (B,kvH,T,D) k, v: projections (a fused one is split into views), q/k norms
        (Qwen3: per head on the (B,T,H,D) view; OLMo-2: on the whole projection), transposes."""
        B, T, _ = x.shape
        m = self.m
        if m.fused_qkv:
            query, key, value = self.qkv_proj(x).split([m.q_dim, m.kv_dim, m.kv_dim], dim=-1)
        else:
            query, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if m.qk_norm == "full":
            query, key = self.q_norm(query), self.k_norm(key)
        # -1 heads: a tensor-parallel rank holds n_heads / tp of them (as torchtitan's Attention views)
        query = query.view(B, T, -1, m.dim_head)
        key = key.view(B, T, -1, m.dim_head)
        if m.qk_norm in ("head", "head_unshared"):
            query, key = self.q_norm(query), self.k_norm(key)
        value = value.view(B, T, -1, m.dim_head)
        return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos=None, sin=None, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        m = self.m
        query, key, value = self.qkv(x)
        if self.cfg.checkpoint_attention:
            out = checkpoint(self.cfg.amp.wrap(self.core), query, key, value, cos, sin, mask,
                             use_reentrant=False, preserve_rng_state=self.cfg.preserve_rng)
        else:
            out = self.core(query, key, value, cos, sin, mask)
        del query, key, value
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out)

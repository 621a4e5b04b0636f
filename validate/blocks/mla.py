"""DeepSeek-V2/V3 multi-head latent attention, op by op as transformers 5.23 runs it.

Source: transformers/models/deepseek_v3/modeling_deepseek_v3.py ``DeepseekV3Attention.forward``
and ``expand_kv``, with integrations/sdpa_attention.py ``sdpa_attention_forward``:

- q: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` without ``q_lora_rank``),
  viewed (B, H, T, nope + rope) and split (views) into ``q_pass`` and ``q_rot``;
- kv: ``kv_a_proj_with_mqa(x)`` (B, T, kv_lora_rank + rope), split (views) into the latent and
  ``k_rot``; ``kv_a_layernorm`` on the latent (a strided view);
- RoPE on ``q_rot`` and the single-head ``k_rot`` (``apply_rotary_pos_emb_interleave``, the V3
  default ``rope_interleave=True``: even/odd slices, four products, a sub, an add, a cat);
- ``query_states = cat((q_pass, q_rot), -1)`` (a copy);
- ``expand_kv``: ``kv_b_proj(latent)`` (B, T, H * (nope + v)) viewed (B, H, T, nope + v); the
  value is a strided view of it (no copy: the attention kernel keeps the whole kv_b output
  alive); the key is ``new_empty`` (B, H, T, nope + rope) filled by two ``copy_`` (the nope
  part and the rope part broadcast over heads);
- SDPA with head dim nope + rope for q/k and ``v_head_dim`` for v. FlashAttention needs equal
  head dims (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
  ``check_head_dim_size_flash``), so CUDA runs the memory-efficient kernel, which accepts a
  different value width (``check_head_dim_size_mem_efficient``); transformers 5.23 pads
  nothing for SDPA;
- ``attn_output.transpose(1, 2).contiguous()`` (no copy: the kernels return a transposed view
  of a (B, T, H, v) buffer) then ``o_proj``.

RoPE tables have ``qk_rope_head_dim`` columns (DeepseekV3Config sets head_dim to it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from memcalc.core.kernels import mla_attention_kernel
from memcalc.core.spec import ModelSpec

from .sdpa import choose_kernel, sdpa
from .norm import RMSNorm


def apply_rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb_interleave`` for one tensor: cos/sin are ``cat(freqs, freqs)``,
    the first half holds the per-pair angle."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(1)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class MLAttention(nn.Module):
    """DeepseekV3Attention (see the module docstring); parameter names as
    :func:`memcalc.engine.params.param_inventory` (``attn.q_a_proj`` ...)."""

    def __init__(self, m: ModelSpec, cfg) -> None:
        super().__init__()
        a = m.mla
        assert a is not None
        self.m, self.a, self.cfg = m, a, cfg
        H, d = m.n_heads, m.d_model
        mk = cfg.linear
        if a.q_lora_rank is None:
            self.q_proj = mk("q", d, H * a.qk_head_dim, False)
        else:
            self.q_a_proj = mk("q_a", d, a.q_lora_rank, m.qkv_bias)
            self.q_a_layernorm = self._norm(a.q_lora_rank)
            self.q_b_proj = mk("q_b", a.q_lora_rank, H * a.qk_head_dim, False)
        self.kv_a_proj_with_mqa = mk("kv_a", d, a.kv_lora_rank + a.qk_rope_head_dim, m.qkv_bias)
        self.kv_a_layernorm = self._norm(a.kv_lora_rank)
        self.kv_b_proj = mk("kv_b", a.kv_lora_rank, H * (a.qk_nope_head_dim + a.v_head_dim), False)
        self.o_proj = mk("o", H * a.v_head_dim, d, m.o_bias)

    def _norm(self, width: int) -> nn.Module:
        cfg, m = self.cfg, self.m
        return RMSNorm(width, m.norm_eps, cfg.amp, mode=cfg.profile.rmsnorm, mean_saves_input=cfg.profile.mean_saves_input,
                       bias=m.has_norm_bias, dtype=cfg.dtype, device=cfg.device, trainable=cfg.full,
                       upcast=cfg.profile.norm_upcast)

    def forward(self, hidden_states: torch.Tensor, cos: Optional[torch.Tensor] = None,
                sin: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """DeepseekV3Attention.forward, its local names kept: a Python local holds its tensor until
        the method returns (q_states and compressed_kv stay alive through the attention call).
        ``mask``: the decoder passes its sliding-window mask to every attention; DeepSeek has none."""
        assert mask is None, "DeepSeek's MLA layers have no sliding window"
        a, m, amp = self.a, self.m, self.cfg.amp
        batch_size, seq_length = hidden_states.shape[:-1]
        nope, rope, dv = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        if a.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_states = q_states.view(batch_size, seq_length, -1, nope + rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [nope, rope], dim=-1)
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_nope, k_rot = torch.split(compressed_kv, [a.kv_lora_rank, rope], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        kv_nope = kv_nope.view(batch_size, 1, seq_length, a.kv_lora_rank)
        k_rot = k_rot.view(batch_size, 1, seq_length, rope)
        q_rot, k_rot = apply_rope_interleave(q_rot, cos, sin), apply_rope_interleave(k_rot, cos, sin)
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        key_states, value_states = self.expand_kv(kv_nope, k_rot)
        query_states, key_states, value_states = amp.lp(query_states), amp.lp(key_states), amp.lp(value_states)
        kernel = mla_attention_kernel(choose_kernel(self.cfg.profile.attention, query_states.dtype, False), nope + rope, dv)
        p = m.attn_dropout if self.training else 0.0
        attn_output = sdpa(query_states, key_states, value_states, None, kernel, p, is_causal=True,
                           scale=(nope + rope) ** -0.5)
        attn_output = attn_output.transpose(1, 2).contiguous()  # sdpa_attention_forward
        attn_output = attn_output.reshape(batch_size, seq_length, -1).contiguous()
        return self.o_proj(attn_output)

    def expand_kv(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepseekV3Attention.expand_kv: kv_b_proj, the value a view, the key a new tensor filled by
        two copy_."""
        a = self.a
        nope, rope, dv = a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        batch_size, _, seq_length, _ = kv_nope.shape
        kv_nope = self.kv_b_proj(kv_nope).view(batch_size, seq_length, -1, nope + dv).transpose(1, 2)
        k_nope, value_states = torch.split(kv_nope, [nope, dv], dim=-1)
        k_rot = k_rot.expand(-1, k_nope.shape[1], -1, -1)
        key_states = kv_nope.new_empty(*kv_nope.shape[:-1], nope + rope)
        key_states[..., :nope].copy_(k_nope)
        key_states[..., nope:].copy_(k_rot)
        return key_states, value_states

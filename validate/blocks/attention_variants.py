"""The model families beyond Llama, as transformers 5 runs them (the estimator's twin is
``memcalc.engine.attention_variants`` and ``memcalc.engine.block_variants``, whose docstrings
name the modeling files each rule follows).

- :func:`eager_attention`: ``eager_attention_forward`` of modeling_gemma2.py (softcapped scores,
  softmax upcast to fp32 then cast back) and modeling_gpt_oss.py (attention sinks: ``cat`` of the
  sink logits, ``max`` subtraction, softmax in the scores' dtype, the sink column sliced off).
  transformers runs these families eagerly by default (``_supports_sdpa = False``).
- :func:`build_masks`: ``masking_utils.sdpa_mask`` / ``eager_mask`` without padding, built once per
  forward and shared by the layers; :func:`convert_bool_mask`: what SDPA does with a boolean mask
  before the memory-efficient kernel (``convert_boolean_attn_mask``).
- :class:`PerHeadLayerNorm`: a LayerNorm over each head with a weight per head (Cohere/StableLM).
- :func:`variant_layer`: sandwich / output norm placements, two parallel norms, residual
  multipliers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from memcalc.core.rules import eager, layer_slides, mask_types, sliding_mask_materialised
from memcalc.core.spec import ModelSpec

from .sdpa import repeat_kv
from .base import dropout


# -- masks -------------------------------------------------------------------------------------
def bool_mask(T: int, window: Optional[int], device) -> torch.Tensor:
    """``sdpa_mask``'s (1, 1, T, T) bool: ``kv <= q`` (causal), ``and_masks`` with ``kv > q - window``."""
    q = torch.arange(T, device=device)
    kv = torch.arange(T, device=device)
    mask = kv[None, :] <= q[:, None]
    if window is not None:
        both = torch.ones((), dtype=torch.bool, device=device) & mask
        del mask
        win = kv[None, :] > (q - window)[:, None]
        mask = both & win
        del both, win
    return mask.view(1, 1, T, T)


def build_masks(m: ModelSpec, B: int, T: int, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """The masks by layer type (HF ``causal_mask_mapping``): eager families get float masks
    ``torch.where(mask, 0, finfo.min)`` of (B, 1, T, T) in the embeddings' dtype (``eager_mask``);
    SDPA families a boolean sliding mask expanded to (B, 1, T, T) (a view) when the sequence
    reaches the window; the full layers' causal mask is skipped (``is_causal``)."""
    out: dict[str, torch.Tensor] = {}
    if eager(m):
        for kind in mask_types(m):
            b = bool_mask(T, m.sliding_window if kind == "sliding" else None, device).expand(B, 1, T, T)
            out[kind] = torch.where(b, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)
            del b
    elif any(layer_slides(m, i) for i in range(m.n_layers)) and sliding_mask_materialised(m, T):
        out["sliding"] = bool_mask(T, m.sliding_window, device).expand(B, 1, T, T)
    return out


def layer_mask(m: ModelSpec, masks: dict[str, torch.Tensor], i: int) -> Optional[torch.Tensor]:
    return masks.get("sliding" if layer_slides(m, i) else "full")


def convert_bool_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """aten attention.cpp ``convert_boolean_attn_mask``: ``zeros_like(mask, dtype)`` then
    ``masked_fill_(mask.logical_not(), -inf)`` (a full (B, 1, T, T) tensor: the expanded input is
    not dense)."""
    new = torch.zeros_like(mask, dtype=dtype)
    new.masked_fill_(mask.logical_not(), float("-inf"))
    return new


# -- eager attention ------------------------------------------------------------------------------
def _softmax_fp32(w: torch.Tensor) -> torch.Tensor:
    """``F.softmax(w, -1, dtype=torch.float32)`` as CUDA runs it: fp16 goes straight to
    ``_softmax(half_to_float=True)``; other dtypes are cast to an fp32 copy first."""
    if w.dtype == torch.float16:
        return torch._softmax(w, -1, True)
    return F.softmax(w, dim=-1, dtype=torch.float32)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], n_rep: int,
                    scaling: float, softcap: Optional[float], sinks: Optional[torch.Tensor], p: float) -> torch.Tensor:
    """transformers ``eager_attention_forward`` (gemma2 / gpt_oss) on (B, H, T, D) q and (B, kvH, T, D)
    k, v; returns the (B, T, H, D) contiguous output."""
    key_states = repeat_kv(k, n_rep)
    value_states = repeat_kv(v, n_rep)
    w = torch.matmul(q, key_states.transpose(2, 3)) * scaling
    if softcap is not None:
        w = w / softcap
        w = torch.tanh(w)
        w = w * softcap
    if mask is not None:
        w = w + mask
    if sinks is not None:
        s = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        c = torch.cat([w, s], dim=-1)
        del w
        c = c - c.max(dim=-1, keepdim=True).values
        probs = F.softmax(c, dim=-1, dtype=c.dtype)
        del c
        w = dropout(probs[..., :-1], p).to(value_states.dtype)
        del probs
    else:
        w = _softmax_fp32(w).to(q.dtype)
        w = dropout(w, p)
    out = torch.matmul(w, value_states)
    del w
    return out.transpose(1, 2).contiguous()


# -- norms ----------------------------------------------------------------------------------------
class PerHeadLayerNorm(nn.Module):
    """A LayerNorm over each head's D values with a weight per head (H, D): ``layer_norm`` without
    affine parameters, then ``* weight`` (CohereLayerNorm / StableLmLayerNormPerHead shapes)."""

    def __init__(self, heads: int, d: int, eps: float, amp, *, dtype: torch.dtype, device, trainable: bool) -> None:
        super().__init__()
        self.eps, self.amp, self.d = eps, amp, d
        self.weight = nn.Parameter(torch.ones((heads, d), dtype=dtype, device=device), requires_grad=trainable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(self.amp.fp32(x), (self.d,), None, None, self.eps)
        return y * self.amp.fp32(self.weight) if self.amp.active else y * self.weight


# -- decoder layers -------------------------------------------------------------------------------
def _to_residual(h: torch.Tensor, p: float, post: Optional[nn.Module], mult: float) -> torch.Tensor:
    """A sublayer's output on its way to the residual: dropout, the post norm, the multiplier
    (each rebinding, so each input goes as soon as the next op has run)."""
    h = dropout(h, p)
    if post is not None:
        h = post(h)
    if mult != 1.0:
        h = h * mult
    return h


def variant_layer(layer, x: torch.Tensor, cos, sin, mask) -> torch.Tensor:
    """DecoderLayer.forward for sandwich (Gemma2DecoderLayer), output (Olmo2DecoderLayer), two
    parallel norms (GPTNeoXLayer use_parallel_residual) and residual multipliers (GraniteDecoderLayer)."""
    m = layer.m
    p = m.resid_dropout if layer.training else 0.0
    mult = m.residual_multiplier
    if m.block == "parallel":
        h = layer.norm1(x)
        a = layer.attn(h, cos, sin, mask)
        a = _to_residual(a, p, None, mult)
        if m.parallel_norms == 2:
            del h
            h = layer.norm2(x)
        f = layer.mlp(h)
        del h
        f = _to_residual(f, p, None, mult)
        return f + a + x
    sandwich = m.norm_placement == "sandwich"
    if m.norm_placement == "output":
        h = layer.attn(x, cos, sin, mask)
    else:
        h = layer.attn(layer.norm1(x), cos, sin, mask)
    h = _to_residual(h, p, layer.norm1 if m.norm_placement == "output" else layer.norm2 if sandwich else None, mult)
    x = x + h
    del h
    if m.norm_placement == "output":
        h = layer.mlp(x)
        post = layer.norm2
    else:
        h = layer.mlp((layer.norm3 if sandwich else layer.norm2)(x))
        post = layer.norm4 if sandwich else None
    h = _to_residual(h, p, post, mult)
    return x + h

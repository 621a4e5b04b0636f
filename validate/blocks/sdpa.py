"""Attention: the SDPA kernel CUDA would run, called explicitly, plus RoPE and Forgather's ALiBi mask.

On ``meta``, ``F.scaled_dot_product_attention`` takes the math path (it saves the whole
attention matrix); CUDA runs flash or memory-efficient kernels that save only q, k, v, the
output, the log-sum-exp and the bias. So the kernel is chosen here (:func:`choose_kernel`)
and called by name:

- ``flash``: ``aten._scaled_dot_product_flash_attention`` (16-bit, no explicit mask,
  ``is_causal=True``). Saves q, k, v, out, logsumexp (B,H,T fp32), the RNG state.
- ``efficient``: ``aten._scaled_dot_product_efficient_attention`` (fp32, or any additive
  mask). Saves q, k, v, the bias, out, logsumexp (B,H,ceil(T/32)*32 fp32). An explicit mask is
  first aligned and broadcast to (B,H,T,T) as ``preprocess_mask`` in
  aten/src/ATen/native/transformers/attention.cpp does (an ``expand``: no copy); its gradient
  is therefore a full (B,H,T,T) tensor, summed back by the expand's backward.
- ``math``: ``aten._scaled_dot_product_attention_math`` (composite: the ops CUDA runs too).

Both fused kernels are wrapped in autograd Functions that save exactly what the
``derivatives.yaml`` formulas save. Their backward also allocates, on ``meta``/``cpu`` only,
the scratch buffers CUDA's kernels allocate internally and the meta kernels do not
(aten/src/ATen/native/transformers/cuda/attention_backward.cu ``_efficient_attention_backward``:
``delta`` (B,H,T) fp32, plus an fp32 dq accumulator for 16-bit inputs; FlashAttention-2
``mha_bwd``: ``dq_accum`` (B, T rounded to 128, H, D rounded to 32) fp32 and ``softmax_d``
(B, H, T rounded to 128) fp32; with grouped K/V (fewer heads than q, which flash takes un-expanded)
also ``dk_expanded`` and ``dv_expanded`` (B, Tk, H, D) in the input dtype). The roundings are :mod:`memcalc.core.kernels`' constants, which
the estimator uses too. On ``cpu``, where these aten kernels do not exist, forward and
backward are computed with the math path (transients differ, saved tensors do not).

GQA: with flash/efficient, k and v are expanded to all query heads first (``repeat_kv``:
expand + reshape, a real copy), as Hugging Face models do; with the profile's ``sdpa_gqa`` they go
un-expanded with ``enable_gqa`` where transformers' ``use_gqa_in_sdpa`` holds (:class:`.attention.Attention`).
The math kernel is written out (:func:`math_attention`) so that its dropout is CUDA's
``native_dropout`` (a bool mask) on every device: on ``meta`` and ``cpu`` the aten op's
``at::dropout`` takes the non-fused path, whose mask is in the input's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from memcalc.core.kernels import (ATTENTION_KERNELS, choose_attention_kernel, efficient_lse_len, flash_head_dim_rounded,
                                  flash_seq_rounded)

from ..devices import kernel_device

aten = torch.ops.aten

KERNELS = ATTENTION_KERNELS


def choose_kernel(profile_choice: str, compute_dtype: torch.dtype, has_mask: bool, enable_gqa: bool = False) -> str:
    """The kernel CUDA runs (:func:`memcalc.core.kernels.choose_attention_kernel`, the rule the
    estimator uses too)."""
    return choose_attention_kernel(profile_choice, compute_dtype in (torch.float16, torch.bfloat16), has_mask,
                                   enable_gqa)


def _ring_dispatched(q) -> bool:
    """q is a DTensor: context parallelism's ring attention runs the kernel once per ring step, and the
    kernel's scratch is allocated around each of those calls (``validate/sharded/context_parallel.py``)."""
    from torch.distributed.tensor import DTensor

    return isinstance(q, DTensor)


def _math_forward(q, k, v, bias, is_causal, scale):
    gqa = k.shape[-3] != q.shape[-3]  # grouped K/V (flash takes them un-expanded)
    return aten._scaled_dot_product_attention_math(q, k, v, bias, 0.0, is_causal, None, scale=scale, enable_gqa=gqa)[0]


def _math_backward(ctx, grad, q, k, v, bias):
    """Backward of a fused kernel on a device without it (cpu): recompute with the math path."""
    needs = ctx.needs_input_grad[:4]
    with torch.enable_grad():
        ins = [t.detach().requires_grad_(n) if t is not None else None for t, n in zip((q, k, v, bias), needs)]
        out = _math_forward(ins[0], ins[1], ins[2], ins[3], ctx.is_causal, ctx.scale)
        wrt = [t for t, n in zip(ins, needs) if t is not None and n]
        got = iter(torch.autograd.grad(out, wrt, grad))
    return tuple(next(got) if (t is not None and n) else None for t, n in zip(ins, needs))


class EfficientAttention(torch.autograd.Function):
    """``_scaled_dot_product_efficient_attention`` with its derivatives.yaml saved set."""

    @staticmethod
    def forward(ctx, q, k, v, bias, dropout_p: float, is_causal: bool, scale: float):
        ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale
        B, H, T, _ = q.shape
        if kernel_device(q) == "cpu":
            out = _math_forward(q, k, v, bias, is_causal, scale)
            lse = q.new_empty((B, H, efficient_lse_len(T)), dtype=torch.float32)
            seed = offset = q.new_empty((), dtype=torch.int64)
        else:
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, dropout_p, is_causal, scale=scale
            )
            if kernel_device(q) == "meta":  # CUDA keeps the philox seed/offset on the host
                # torch.tensor: host data (under a fake mode, a lift_fresh the rank tracer skips)
                seed, offset = torch.tensor(0, dtype=torch.int64), torch.tensor(0, dtype=torch.int64)
        ctx.save_for_backward(q, k, v, bias, out, lse, seed, offset)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
        if kernel_device(q) == "cpu":
            dq, dk, dv, db = _math_backward(ctx, grad, q, k, v, bias)
            return dq, dk, dv, db, None, None, None
        scratch = []
        if kernel_device(q) != "cuda" and not _ring_dispatched(q):
            B, H, T, D = q.shape
            scratch.append(q.new_empty((B, H, T), dtype=torch.float32))  # delta
            if q.dtype != torch.float32:
                scratch.append(q.new_empty((B, T, H, D), dtype=torch.float32))  # dq accumulator
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2],
                bias is not None and ctx.needs_input_grad[3]]
        dq, dk, dv, db = aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, bias, out, lse, seed, offset, ctx.dropout_p, mask, ctx.is_causal, scale=ctx.scale
        )
        del scratch
        return dq, dk, dv, (db if mask[3] else None), None, None, None


class FlashAttention(torch.autograd.Function):
    """``_scaled_dot_product_flash_attention`` (FA2) with its derivatives.yaml saved set."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float, is_causal: bool, scale: float):
        ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale
        B, H, T, _ = q.shape
        if kernel_device(q) == "cpu":
            out = _math_forward(q, k, v, None, is_causal, scale)
            lse = q.new_empty((B, H, T), dtype=torch.float32)
            rng = q.new_empty((2,), dtype=torch.int64)
            ctx.meta = (None, None, T, k.shape[2])
            ctx.save_for_backward(q, k, v, out, lse, rng)
            return out
        res = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)
        out, lse, cq, ck, mq, mk, rng, unused = res[:8]
        ctx.meta = (cq, ck, mq, mk)
        ctx.save_for_backward(q, k, v, out, lse, rng, unused)
        return out

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        if kernel_device(q) == "cpu":
            ctx.needs_input_grad = tuple(ctx.needs_input_grad[:3]) + (False,)
            dq, dk, dv, _ = _math_backward(ctx, grad, q, k, v, None)
            return dq, dk, dv, None, None, None
        out, lse, rng, unused = saved[3:]
        cq, ck, mq, mk = ctx.meta
        scratch = []
        if kernel_device(q) != "cuda" and not _ring_dispatched(q):
            B, H, T, D = q.shape
            tr = flash_seq_rounded(T)
            dr = flash_head_dim_rounded(D)
            scratch.append(q.new_empty((B, tr, H, dr), dtype=torch.float32))  # dq_accum
            scratch.append(q.new_empty((B, H, tr), dtype=torch.float32))  # softmax_d
            if k.shape[1] != H:  # grouped K/V: dk_expanded, dv_expanded (B, Tk, H, D), summed into dk, dv
                scratch += [q.new_empty((B, k.shape[2], H, D)) for _ in range(2)]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cq, ck, mq, mk, ctx.dropout_p, ctx.is_causal, rng, unused, scale=ctx.scale
        )
        del scratch
        return dq, dk, dv, None, None, None


def align_mask(mask: torch.Tensor, B: int, H: int, Tq: int, Tk: int) -> torch.Tensor:
    """``preprocess_mask`` (attention.cpp): pad the last dim to a multiple of 8 when the strides
    are not aligned (``pad_bias``, a copy), then expand to (B,H,Tq,Tk) (a view)."""
    aligned = mask.stride(-1) == 1 and all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1))
    if not aligned:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(B, H, Tq, Tk)


def bool_mask_to_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sdp_utils.h ``convert_boolean_attn_mask``: ``zeros_like(mask, dtype).masked_fill_(~mask, -inf)``."""
    out = torch.zeros_like(mask, dtype=dtype)
    return out.masked_fill_(mask.logical_not(), float("-inf"))


def math_attention(q, k, v, mask, dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool):
    """``_scaled_dot_product_attention_math`` (aten/src/ATen/native/transformers/attention.cpp) written
    out so that its ``at::dropout`` is CUDA's ``native_dropout``: 16-bit inputs upcast to fp32
    (``allowFP16BF16ReductionMathSDP`` is off by default), q and k scaled by sqrt(scale), the causal
    mask built additive, K/V ``repeat_interleave``-d for grouped queries, ``_safe_softmax``."""
    origin = q.dtype
    if dropout_p <= 0.0:
        return aten._scaled_dot_product_attention_math(q, k, v, mask, 0.0, is_causal, None, scale=scale,
                                                       enable_gqa=enable_gqa)[0]
    q, k, v = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (q, k, v))
    sf = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    query = q * sf
    if is_causal:
        L, S = query.shape[-2], k.shape[-2]
        mask = bool_mask_to_additive(torch.ones((L, S), dtype=torch.bool, device=q.device).tril(), query.dtype)
    if enable_gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    attn = torch.matmul(query, k.transpose(-2, -1) * sf)
    if mask is not None:
        attn.add_(mask)
    attn = aten._safe_softmax(attn, -1)
    attn = torch.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, v).to(origin)


def sdpa(q, k, v, mask: Optional[torch.Tensor], kernel: str, dropout_p: float, is_causal: bool,
         scale: Optional[float] = None) -> torch.Tensor:
    """Attention of (B,H,T,D) q, k, v with the named kernel (see the module docstring)."""
    B, H, T, D = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    if kernel == "math":  # its dropout as CUDA runs it (native_dropout: a bool mask), see math_attention
        return math_attention(q, k, v, mask, dropout_p, is_causal and mask is None, scale, k.shape[-3] != H)
    if kernel == "flash":
        if mask is not None:
            raise ValueError("flash attention takes no explicit mask")
        return FlashAttention.apply(q, k, v, dropout_p, is_causal, scale)
    if kernel == "efficient":
        bias = align_mask(mask, B, H, T, k.shape[2]) if mask is not None else None
        return EfficientAttention.apply(q, k, v, bias, dropout_p, is_causal and mask is None, scale)
    raise ValueError(f"unknown attention kernel {kernel!r}; valid: {', '.join(KERNELS)}")


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Hugging Face ``repeat_kv``: (B, kvH, T, D) -> (B, kvH * n_rep, T, D), a copy."""
    if n_rep == 1:
        return x
    B, kvh, T, D = x.shape
    return x[:, :, None, :, :].expand(B, kvh, n_rep, T, D).reshape(B, kvh * n_rep, T, D)


# -- positions ----------------------------------------------------------------------------
def alibi_biases(query_len: int, key_len: int, device, dtype) -> torch.Tensor:
    """Forgather causal_alibi_attn.py ``alibi_biases``: (Tq, Tk) relative positions."""
    x = torch.arange(key_len, device=device, dtype=dtype)[None, :]
    y = torch.arange(query_len, device=device, dtype=dtype)[:, None]
    return x - y


def alibi_mask(slopes: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """Forgather ``CausalAlibiAttn.forward``'s mask: biases in the query dtype times the
    per-head slopes, ``-inf`` above the diagonal (``masked_fill_`` with a saved bool mask)."""
    attn_bias = alibi_biases(T, T, device=slopes.device, dtype=dtype)
    attn_bias = attn_bias * slopes.view(-1, 1, 1)
    causal_mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=slopes.device))
    attn_bias.masked_fill_(causal_mask.logical_not(), float("-inf"))
    return attn_bias


def alibi_slopes_init(n_heads: int, device=None) -> torch.Tensor:
    """Forgather's ``alt_alibi_init`` slopes (1/2^1..1/2^8, lower half zeroed)."""
    s = 1.0 / torch.logspace(1, 8, n_heads, base=2, dtype=torch.float, device=device)
    return s.masked_fill(torch.arange(n_heads, device=device) >= n_heads / 2, 0.0)


def rope_tables(inv_freq: torch.Tensor, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face ``LlamaRotaryEmbedding.forward``: cos/sin (1, T, rot) in fp32, then cast to
    the hidden states' dtype."""
    pos = torch.arange(T, device=inv_freq.device)[None, :]
    inv = inv_freq[None, :, None].float().expand(1, -1, 1)
    freqs = (inv @ pos[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on (B,H,T,D); partial rotary (phi) rotates the first
    ``cos.shape[-1]`` dims and concatenates the rest back."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x_rot = (x_rot * cos) + (_rotate_half(x_rot) * sin)
    return torch.cat((x_rot, x_pass), dim=-1)

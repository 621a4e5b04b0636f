"""The twin of :mod:`memcalc.engine.blocks.norm`: RMSNorm and LayerNorm.

- :class:`RMSNorm`: ``composite`` = ``rms_norm_symint`` (aten/src/ATen/native/layer_norm.cpp;
  the weight multiply in fp32, cast back last), ``composite-legacy`` (cast back before the
  weight multiply), ``fused`` = ``_fused_rms_norm`` (saves input and rstd only); which PyTorch
  versions run which is ``memcalc.core.kernels.RMSNORM_BY_TORCH``, shared with the estimator.
- :class:`LayerNorm`: ``F.layer_norm`` (``native_layer_norm`` saves input, mean, rstd).
- :class:`OpsLayerNorm`: a LayerNorm written as fp32 ops (``norm_impl`` layernorm-ops:
  transformers 5.24 models/cohere/modeling_cohere.py ``CohereLayerNorm.forward``).

``norm_impl`` weight-fp32 (Olmo2RMSNorm, GemmaRMSNorm) is :class:`RMSNorm` in ``composite`` mode
(:func:`memcalc.core.rules.rmsnorm_mode`, shared with the estimator).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..amp import Amp
from ..devices import kernel_device

aten = torch.ops.aten


# -- norms ---------------------------------------------------------------------------------
class _MeanKeepsInput(torch.autograd.Function):
    """``mean(x, -1, keepdim=True)`` whose backward keeps x (PyTorch <= 2.1's formula)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.mean(-1, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g.expand_as(x) / x.shape[-1]


class _FusedRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` (PyTorch 2.9+ on CUDA): saves the input and rstd (rows, fp32).
    The meta decomposition of that op runs above autograd (it would save the composite's
    tensors), hence this Function; on ``meta`` the forward allocates only y and rstd, as the
    CUDA kernel does."""

    @staticmethod
    def forward(ctx, x, w, eps: float):
        d = x.shape[-1]
        if kernel_device(x) == "meta":
            y = torch.empty_like(x)
            rstd = x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)
        else:
            xf = x.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            y = (xf * rstd * w).to(x.dtype) if w is not None else (xf * rstd).to(x.dtype)
            del xf
        ctx.d = d
        ctx.save_for_backward(x, rstd, w)
        return y

    @staticmethod
    def backward(ctx, g):
        x, rstd, w = ctx.saved_tensors
        need_w = w is not None and ctx.needs_input_grad[1]
        if kernel_device(x) == "cpu":  # no CPU kernel: the decomposition's formula
            xf, gf = x.float(), g.float()
            x_hat = xf * rstd
            gx_hat = gf * w.float() if w is not None else gf
            dx = ((gx_hat - x_hat * (x_hat * gx_hat).mean(-1, keepdim=True)) * rstd).to(x.dtype)
            dw = (gf * x_hat).sum(dim=tuple(range(g.dim() - 1))).to(w.dtype) if need_w else None
            return dx, dw, None
        dx, dw = aten._fused_rms_norm_backward(g, x, [ctx.d], rstd, w, [ctx.needs_input_grad[0], need_w])
        return dx, (dw if need_w else None), None


class RMSNorm(nn.Module):
    """RMSNorm as ``nn.RMSNorm`` computes it under the profile's PyTorch version."""

    def __init__(self, d: int, eps: float, amp: Amp, *, mode: str, mean_saves_input: bool, bias: bool,
                 dtype: torch.dtype, device, trainable: bool = True, shape: Optional[tuple[int, ...]] = None,
                 upcast: bool = True) -> None:
        super().__init__()
        self.eps, self.amp, self.mode, self.mean_saves_input = eps, amp, mode, mean_saves_input
        self.upcast = upcast  # the profile's norm_upcast
        # shape: (heads, d) for a per-head weight (a q/k norm of Cohere / StableLM), else (d,)
        self.weight = nn.Parameter(torch.ones(shape or (d,), dtype=dtype, device=device), requires_grad=trainable)
        self.bias = nn.Parameter(torch.zeros((d,), dtype=dtype, device=device), requires_grad=trainable) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "fused":
            if x.device.type == "cuda" and hasattr(aten, "_fused_rms_norm"):
                y = aten._fused_rms_norm(x, [x.shape[-1]], self.weight, self.eps)[0]
            else:
                y = _FusedRMSNorm.apply(x, self.weight, self.eps)
        else:
            amp = self.amp
            # norm_upcast off: the same composite formula in the input's dtype (no fp32 copy of x)
            xf = x.to(torch.float32) if self.upcast else x
            sq = torch.pow(amp.fp32(xf), 2)
            ms = _MeanKeepsInput.apply(sq) if self.mean_saves_input else sq.mean(-1, keepdim=True)
            del sq
            r = torch.rsqrt(amp.fp32(ms.add_(self.eps)))
            del ms
            if self.mode == "composite":  # ((xf * r) * w).type_as(x)
                y = xf.mul(r)
                y = y.mul(self.weight)
                y = y.type_as(x)
            else:  # composite-legacy: (xf * r).type_as(x) * w
                y = xf.mul(r).type_as(x)
                y = y.mul(self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y


class LayerNorm(nn.Module):
    """``F.layer_norm`` (fp32 under autocast)."""

    def __init__(self, d: int, eps: float, amp: Amp, *, bias: bool, dtype: torch.dtype, device,
                 trainable: bool = True) -> None:
        super().__init__()
        self.eps, self.amp, self.d = eps, amp, d
        self.weight = nn.Parameter(torch.ones((d,), dtype=dtype, device=device), requires_grad=trainable)
        self.bias = nn.Parameter(torch.zeros((d,), dtype=dtype, device=device), requires_grad=trainable) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.amp
        return F.layer_norm(a.fp32(x), (self.d,), a.fp32(self.weight), a.fp32(self.bias), self.eps)


class OpsLayerNorm(nn.Module):
    """``CohereLayerNorm.forward`` line by line (models/cohere/modeling_cohere.py, transformers 5.24);
    ``shape`` (H, D) for the per-head q/k norm (the mean over the last dim, a weight per head)."""

    def __init__(self, d: int, eps: float, *, dtype: torch.dtype, device, trainable: bool = True,
                 shape: Optional[tuple[int, ...]] = None) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(shape or (d,), dtype=dtype, device=device), requires_grad=trainable)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        hidden_states = (hidden_states - mean) * torch.rsqrt(variance + self.variance_epsilon)
        hidden_states = self.weight.to(torch.float32) * hidden_states
        return hidden_states.to(input_dtype)

"""The twin of :mod:`memcalc.engine.blocks.layer`: one decoder layer (pre-norm, post-norm DeepNet,
parallel; the families' placements through :func:`.attention_variants.variant_layer`) around its
attention (:mod:`.attention` or :mod:`.mla`) and feed-forward block (:mod:`.mlp` or :mod:`.moe`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from memcalc.core.spec import ModelSpec

from . import attention_variants as variants
from .attention import Attention
from .base import dropout
from .mla import MLAttention
from .mlp import MLP
from .moe import MoEBlock

if TYPE_CHECKING:
    from .build import BuildConfig


class DecoderLayer(nn.Module):
    """One layer: pre-norm (HF), post-norm DeepNet (Forgather) or parallel (phi)."""

    def __init__(self, m: ModelSpec, cfg: "BuildConfig", i: int) -> None:
        super().__init__()
        self.m, self.cfg, self.i = m, cfg, i
        self.attn = MLAttention(m, cfg) if m.mla is not None else Attention(m, cfg)
        if m.moe is not None and m.moe.is_moe_layer(i):
            self.moe = MoEBlock(m, cfg, i)  # parameters layers.{i}.moe.* (engine.params)
            object.__setattr__(self, "mlp", self.moe)  # forward calls self.mlp; registered once, as moe
        else:
            self.mlp = MLP(m.mlp, cfg.activation, cfg.linear, m.d_model, m.d_ff, m.mlp_bias,
                           forgather_order=m.norm_placement == "post", fused=m.fused_gate_up)
        for j in range(m.norms_per_layer):
            setattr(self, f"norm{j + 1}", cfg.norm())

    def forward(self, x: torch.Tensor, cos=None, sin=None, mask=None) -> torch.Tensor:
        m, p = self.m, (self.m.resid_dropout if self.training else 0.0)
        if m.norm_placement in ("sandwich", "output") or m.parallel_norms == 2 or m.residual_multiplier != 1.0:
            return variants.variant_layer(self, x, cos, sin, mask)
        if m.block == "parallel":  # phi: x + attn(n) + mlp(n), one norm
            h = self.norm1(x)
            a = dropout(self.attn(h, cos, sin, mask), p)
            f = dropout(self.mlp(h), p)
            del h
            return a + f + x
        if m.norm_placement == "pre":  # Hugging Face Llama
            residual = x
            h = self.norm1(x)
            h = dropout(self.attn(h, cos, sin, mask), p)
            x = residual + h
            del h
            residual = x
            h = self.norm2(x)
            h = dropout(self.mlp(h), p)
            return residual + h
        # Forgather DeepnetLayer.forward (residual_dropout = identity)
        alpha = m.residual_scale
        residual = x
        x = self.attn(x, cos, sin, mask)
        x = dropout(x, p)
        x = self.norm1((residual * alpha if alpha != 1.0 else residual) + x)
        residual = x
        x = self.mlp(x)
        x = dropout(x, p)
        x = self.norm2((residual * alpha if alpha != 1.0 else residual) + x)
        return x

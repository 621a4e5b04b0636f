"""What the replica's blocks are built with besides the ModelSpec (:class:`BuildConfig`: dtype,
device, amp, profile, LoRA; the projections and norms it makes)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from memcalc.core.rules import rmsnorm_mode
from memcalc.core.spec import KernelProfile, LoraSpec, ModelSpec, TrainingSpec

from ..amp import Amp
from . import attention_variants as variants
from .adapters import Linear
from .norm import LayerNorm, OpsLayerNorm, RMSNorm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


class BuildConfig:
    """What the modules need besides the ModelSpec: dtype, device, amp, profile, LoRA."""

    def __init__(self, m: ModelSpec, tr: TrainingSpec, profile: KernelProfile, device, amp: Amp,
                 init: bool) -> None:
        self.m, self.tr, self.profile, self.device, self.amp, self.init = m, tr, profile, device, amp, init
        self.dtype = torch_dtype(tr.weight_dtype.value)
        #: the adapters' dtype (ExperimentSpec.adapter_dtype: LoraSpec.dtype, else the profile's lora_dtype)
        adt = None if tr.lora is None else (tr.lora.dtype or profile.lora_dtype)
        self.adapter_dtype = torch.float32 if adt == "fp32" else self.dtype
        #: the activation as the profile runs it (gelu_new: fused, or transformers' chain of pointwise ops)
        chain = m.activation == "gelu_new" and profile.gelu_new == "chain"
        self.activation = "gelu_new_chain" if chain else m.activation
        self.lora: Optional[LoraSpec] = tr.lora
        self.full = tr.lora is None
        self.checkpoint_attention = tr.checkpoint == "selective"
        self.preserve_rng = torch.device(device).type != "meta"

    def linear(self, short: str, d_in: int, d_out: int, bias: bool) -> Linear:
        lora = self.lora
        # PEFT moves gate/up/down targets of some MoE types onto the routed experts (engine.params)
        to_experts = self.m.moe is not None and self.m.moe.lora_mlp_to_experts and short in ("gate", "up", "down")
        return Linear(d_in, d_out, bias, self.amp, dtype=self.dtype, device=self.device, trainable=self.full,
                      lora=lora, target=lora is not None and short in lora.targets and not to_experts, init=self.init,
                      adapter_dtype=self.adapter_dtype, input_cast=self.profile.lora_input_cast)

    def plain_linear(self, d_in: int, d_out: int, bias: bool) -> Linear:
        return Linear(d_in, d_out, bias, self.amp, dtype=self.dtype, device=self.device, trainable=self.full,
                      init=self.init)

    def norm(self) -> nn.Module:
        m = self.m
        if m.norm == "rmsnorm":
            return RMSNorm(m.d_model, m.norm_eps, self.amp, mode=rmsnorm_mode(m, self.profile.rmsnorm),
                           mean_saves_input=self.profile.mean_saves_input, bias=m.has_norm_bias,
                           dtype=self.dtype, device=self.device, trainable=self.full, upcast=self.profile.norm_upcast)
        if m.norm_impl == "layernorm-ops":
            return OpsLayerNorm(m.d_model, m.norm_eps, dtype=self.dtype, device=self.device, trainable=self.full)
        return LayerNorm(m.d_model, m.norm_eps, self.amp, bias=m.has_norm_bias, dtype=self.dtype,
                         device=self.device, trainable=self.full)

    def qk_norm(self, heads: int) -> nn.Module:
        """The q or k norm (no bias): over each head (one weight of head_dim, or one per head) or
        over the whole projection (heads * head_dim)."""
        m = self.m
        d = m.dim_head if m.qk_norm in ("head", "head_unshared") else heads * m.dim_head
        shape = (heads, m.dim_head) if m.qk_norm == "head_unshared" else (d,)
        if m.norm == "rmsnorm":
            return RMSNorm(d, m.norm_eps, self.amp, mode=rmsnorm_mode(m, self.profile.rmsnorm),
                           mean_saves_input=self.profile.mean_saves_input, bias=False, dtype=self.dtype,
                           device=self.device, trainable=self.full, shape=shape, upcast=self.profile.norm_upcast)
        if m.norm_impl == "layernorm-ops":
            return OpsLayerNorm(d, m.norm_eps, dtype=self.dtype, device=self.device, trainable=self.full, shape=shape)
        if m.qk_norm == "head_unshared":
            return variants.PerHeadLayerNorm(heads, d, m.norm_eps, self.amp, dtype=self.dtype, device=self.device,
                                             trainable=self.full)
        return LayerNorm(d, m.norm_eps, self.amp, bias=False, dtype=self.dtype, device=self.device, trainable=self.full)

"""Exact parameter inventory: every parameter tensor of the model, with its shape.

Counts follow the module code of the families we model (the Hugging Face transformers 5
modeling files of every model_type memcalc.inputs.hf_config reads, and Forgather's Deep One):
embeddings, attention with GQA (or a fused qkv, or DeepSeek's multi-head latent attention),
q/k norms, attention sinks, gated, fused or plain MLP, mixture-of-experts blocks (router,
3-D expert tensors, shared experts), norms (weight, and bias for LayerNorm; 1, 2 or 4 a layer),
projection biases, tied or untied head, trainable ALiBi slopes, LoRA adapters as PEFT
shapes them (one adapter on a fused projection; on the output head with target ``head``).
QLoRA's frozen 4-bit base is counted in elements here; its storage bytes
(packed NF4 plus quantisation constants) are computed in :mod:`memcalc.engine.weights`.
Buffers (RoPE caches, causal masks) are not parameters and are ignored here.

Each part's rule is in its block (:mod:`memcalc.engine.blocks`: ``embedding_params``,
``attention_params`` / ``mla_params``, ``mlp_params``, ``moe_params``, ``layer_norm_params``, ``norm_params``,
``projection_params`` / ``adapter_params``, ``head_params``); this module composes them in module
order and counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from memcalc.core.spec import LoraSpec, ModelSpec
from memcalc.engine.blocks.adapters import projection_params
from memcalc.engine.blocks.attention import attention_params
from memcalc.engine.blocks.base import ParamTensor
from memcalc.engine.blocks.embedding import embedding_params
from memcalc.engine.blocks.head import head_params
from memcalc.engine.blocks.layer import layer_norm_params
from memcalc.engine.blocks.mlp import mlp_params
from memcalc.engine.blocks.moe import moe_params
from memcalc.engine.blocks.norm import norm_params

__all__ = ["ParamCounts", "ParamTensor", "count_params", "param_inventory"]


def _layer_params(m: ModelSpec, i: int, lora: Optional[LoraSpec], ep: int = 1) -> list[ParamTensor]:
    full = lora is None
    out: list[ParamTensor] = []
    linear = projection_params(m, i, lora, out)
    norm = norm_params(i, full, out)
    attention_params(m, i, linear, norm, out, full)
    if m.moe is not None and m.moe.is_moe_layer(i):
        moe_params(m, i, linear, out, full, lora, ep)
    else:
        mlp_params(m, "mlp", m.d_ff, m.mlp_bias, linear)
    layer_norm_params(m, norm)
    return out


def param_inventory(m: ModelSpec, lora: Optional[LoraSpec] = None, ep: int = 1) -> list[ParamTensor]:
    """Every parameter tensor, in module order (embedding, layers, final norm, head). A new list
    each call; the (frozen) tensors are built once per (model, LoRA spec, expert-parallel degree):
    every simulated step asks for them two or three times. ``ep`` > 1: the routed experts one
    expert-parallel rank holds (:mod:`memcalc.engine.expert_parallel`)."""
    return list(_inventory(m, lora, ep))


@lru_cache(maxsize=64)
def _inventory(m: ModelSpec, lora: Optional[LoraSpec], ep: int = 1) -> tuple[ParamTensor, ...]:
    return tuple(_build_inventory(m, lora, ep))


def _build_inventory(m: ModelSpec, lora: Optional[LoraSpec], ep: int = 1) -> list[ParamTensor]:
    full = lora is None
    out = embedding_params(m, full, lora.modules_to_save if lora is not None else ())
    for i in range(m.n_layers):
        out.extend(_layer_params(m, i, lora, ep))
    out.extend(head_params(m, lora, full))
    return out


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (elements, not bytes)."""

    total: int
    trainable: int
    per_layer: int
    embedding: int
    head: int
    lora: int

    @property
    def base(self) -> int:
        """Parameters of the model without adapters."""
        return self.total - self.lora


def count_params(m: ModelSpec, lora: Optional[LoraSpec] = None) -> ParamCounts:
    """Totals over :func:`param_inventory`. ``per_layer`` counts one layer including adapters."""
    inv = param_inventory(m, lora)
    total = sum(p.numel for p in inv)
    trainable = sum(p.numel for p in inv if p.trainable)
    per_layer = sum(p.numel for p in inv if p.layer == 0)
    emb = sum(p.numel for p in inv if p.name.startswith("embed_"))
    head = sum(p.numel for p in inv if p.name.startswith("lm_head"))
    lora_n = sum(p.numel for p in inv if p.kind == "lora")
    return ParamCounts(total, trainable, per_layer, emb, head, lora_n)


def active_params(m: ModelSpec) -> int:
    """Parameters one token uses: the total less the routed experts it skips (a dense model: the total).

    Each routed-expert tensor (``moe.experts.*``, :func:`memcalc.engine.blocks.moe.moe_params`) counts
    ``top_k / n_experts`` of its elements; the router, shared experts, attention, embedding and head
    count whole (what Qwen's "A3B" and DeepSeek's "37B activated" name, embeddings included).
    """
    inv = param_inventory(m)
    total = sum(p.numel for p in inv)
    if m.moe is None:
        return total
    routed = sum(p.numel for p in inv if ".moe.experts." in p.name)
    return total - routed // m.moe.n_experts * (m.moe.n_experts - m.moe.top_k)

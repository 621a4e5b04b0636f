"""Exact parameter inventory: every parameter tensor of the model, with its shape.

Counts follow the module code of the families we model (Llama/Mistral/Qwen2 in
Hugging Face transformers, GPT-2, phi, and Forgather's Deep One): embeddings,
attention with GQA, gated or plain MLP, norms (weight, and bias for LayerNorm),
projection biases, tied or untied head, trainable ALiBi slopes, LoRA adapters.
QLoRA's frozen 4-bit base is counted in elements here; its storage bytes
(packed NF4 plus quantisation constants) are computed in :mod:`memcalc.engine.weights`.
Buffers (RoPE caches, causal masks) are not parameters and are ignored here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from memcalc.core.spec import LoraSpec, ModelSpec


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor. ``layer`` is None for embedding, final norm and head."""

    name: str
    shape: tuple[int, ...]
    layer: Optional[int]
    trainable: bool
    kind: str  # "linear" (2-D weight of a projection), "embedding", "norm", "bias", "slopes", "lora"
    quantizable: bool = False  # a frozen 2-D linear weight that QLoRA stores as NF4

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _layer_params(m: ModelSpec, i: int, lora: Optional[LoraSpec]) -> list[ParamTensor]:
    full = lora is None
    out: list[ParamTensor] = []

    def linear(short: str, name: str, d_in: int, d_out: int, bias: bool) -> None:
        out.append(ParamTensor(f"layers.{i}.{name}.weight", (d_out, d_in), i, full, "linear", quantizable=not full))
        if bias:
            out.append(ParamTensor(f"layers.{i}.{name}.bias", (d_out,), i, full, "bias"))
        if lora is not None and short in lora.targets:
            out.append(ParamTensor(f"layers.{i}.{name}.lora_A", (lora.rank, d_in), i, True, "lora"))
            out.append(ParamTensor(f"layers.{i}.{name}.lora_B", (d_out, lora.rank), i, True, "lora"))

    d = m.d_model
    linear("q", "attn.q_proj", d, m.q_dim, m.qkv_bias)
    linear("k", "attn.k_proj", d, m.kv_dim, m.qkv_bias)
    linear("v", "attn.v_proj", d, m.kv_dim, m.qkv_bias)
    linear("o", "attn.o_proj", m.q_dim, d, m.o_bias)
    if m.positions == "alibi" and m.alibi_trainable:
        out.append(ParamTensor(f"layers.{i}.attn.alibi_slopes", (m.n_heads,), i, full, "slopes"))
    if m.mlp == "gated":
        linear("gate", "mlp.gate_proj", d, m.d_ff, m.mlp_bias)
        linear("up", "mlp.up_proj", d, m.d_ff, m.mlp_bias)
        linear("down", "mlp.down_proj", m.d_ff, d, m.mlp_bias)
    else:
        linear("up", "mlp.fc1", d, m.d_ff, m.mlp_bias)
        linear("down", "mlp.fc2", m.d_ff, d, m.mlp_bias)
    for j in range(m.norms_per_layer):
        out.append(ParamTensor(f"layers.{i}.norm{j + 1}.weight", (d,), i, full, "norm"))
        if m.has_norm_bias:
            out.append(ParamTensor(f"layers.{i}.norm{j + 1}.bias", (d,), i, full, "bias"))
    return out


def param_inventory(m: ModelSpec, lora: Optional[LoraSpec] = None) -> list[ParamTensor]:
    """Every parameter tensor, in module order (embedding, layers, final norm, head)."""
    full = lora is None
    d = m.d_model
    out = [ParamTensor("embed_tokens.weight", (m.vocab_size, d), None, full, "embedding")]
    if m.positions == "learned":
        out.append(ParamTensor("embed_positions.weight", (m.max_seq_len, d), None, full, "embedding"))
    for i in range(m.n_layers):
        out.extend(_layer_params(m, i, lora))
    if m.final_norm:
        out.append(ParamTensor("final_norm.weight", (d,), None, full, "norm"))
        if m.has_norm_bias:
            out.append(ParamTensor("final_norm.bias", (d,), None, full, "bias"))
    if not m.tie_embeddings:
        out.append(ParamTensor("lm_head.weight", (m.vocab_size, d), None, full, "embedding"))
    if m.lm_head_bias:
        out.append(ParamTensor("lm_head.bias", (m.vocab_size,), None, full, "bias"))
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

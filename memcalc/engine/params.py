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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional

from memcalc.core.spec import LoraSpec, ModelSpec
from memcalc.core.rules import expert_lora_ranks


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor. ``layer`` is None for embedding, final norm and head."""

    name: str
    shape: tuple[int, ...]
    layer: Optional[int]
    trainable: bool
    kind: str  # "linear" (2-D weight of a projection), "experts" (3-D routed-expert weights), "router",
    #            "embedding", "norm", "bias", "slopes" (ALiBi slopes, attention sinks), "lora"
    quantizable: bool = False  # a frozen 2-D linear weight that QLoRA stores as NF4

    @cached_property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _layer_params(m: ModelSpec, i: int, lora: Optional[LoraSpec]) -> list[ParamTensor]:
    full = lora is None
    out: list[ParamTensor] = []

    # PEFT 0.21 on transformers 5 moves the gate/up/down targets of some MoE model types onto the routed
    # experts (peft/utils/transformers_weight_conversion.py _convert_peft_config_moe): no MLP Linear is adapted
    to_experts = m.moe is not None and m.moe.lora_mlp_to_experts

    def linear(short: str, name: str, d_in: int, d_out: int, bias: bool) -> None:
        out.append(ParamTensor(f"layers.{i}.{name}.weight", (d_out, d_in), i, full, "linear", quantizable=not full))
        if bias:
            out.append(ParamTensor(f"layers.{i}.{name}.bias", (d_out,), i, full, "bias"))
        if to_experts and short in ("gate", "up", "down"):
            return
        if lora is not None and short in lora.targets:
            out.append(ParamTensor(f"layers.{i}.{name}.lora_A", (lora.rank, d_in), i, True, "lora"))
            out.append(ParamTensor(f"layers.{i}.{name}.lora_B", (d_out, lora.rank), i, True, "lora"))
            if lora.dora:  # PEFT DoraLinearLayer.weight: the magnitude vector, one per output row
                out.append(ParamTensor(f"layers.{i}.{name}.lora_magnitude", (d_out,), i, True, "lora"))

    def norm(name: str, shape: tuple[int, ...], bias: bool) -> None:
        out.append(ParamTensor(f"layers.{i}.{name}.weight", shape, i, full, "norm"))
        if bias:
            out.append(ParamTensor(f"layers.{i}.{name}.bias", shape, i, full, "bias"))

    d = m.d_model
    _attention(m, i, linear, norm, out, full)
    if m.moe is not None and m.moe.is_moe_layer(i):
        _moe(m, i, linear, out, full, lora)
    else:
        _mlp(m, "mlp", m.d_ff, m.mlp_bias, linear)
    for j in range(m.norms_per_layer):
        norm(f"norm{j + 1}", (d,), m.has_norm_bias)
    return out


def _attention(m: ModelSpec, i: int, linear, norm, out: list[ParamTensor], full: bool) -> None:
    """Attention parameters: q/k/v (or the fused qkv, or MLA's projections and norms), o, q/k norms,
    sinks, ALiBi slopes. Source: the modeling_*.py attention classes (LlamaAttention, Phi3Attention,
    GPTNeoXAttention, DeepseekV3Attention, Qwen3Attention, Olmo2Attention, CohereAttention,
    StableLmAttention, GptOssAttention)."""
    d = m.d_model
    if m.mla is not None:  # DeepseekV3Attention: q_a/kv_a/o biases are attention_bias; q_b, kv_b none
        a, h = m.mla, m.n_heads
        if a.q_lora_rank is None:
            linear("q", "attn.q_proj", d, h * a.qk_head_dim, False)
        else:
            linear("q_a", "attn.q_a_proj", d, a.q_lora_rank, m.qkv_bias)
            norm("attn.q_a_layernorm", (a.q_lora_rank,), m.has_norm_bias)
            linear("q_b", "attn.q_b_proj", a.q_lora_rank, h * a.qk_head_dim, False)
        linear("kv_a", "attn.kv_a_proj_with_mqa", d, a.kv_lora_rank + a.qk_rope_head_dim, m.qkv_bias)
        norm("attn.kv_a_layernorm", (a.kv_lora_rank,), m.has_norm_bias)
        linear("kv_b", "attn.kv_b_proj", a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim), False)
        linear("o", "attn.o_proj", h * a.v_head_dim, d, m.o_bias)
    else:
        if m.fused_qkv:  # one Linear(d, q + 2 kv): one adapter (A: r x d, B: (q + 2 kv) x r)
            linear("qkv", "attn.qkv_proj", d, m.q_dim + 2 * m.kv_dim, m.qkv_bias)
        else:
            linear("q", "attn.q_proj", d, m.q_dim, m.qkv_bias)
            linear("k", "attn.k_proj", d, m.kv_dim, m.qkv_bias)
            linear("v", "attn.v_proj", d, m.kv_dim, m.qkv_bias)
        linear("o", "attn.o_proj", m.q_dim, d, m.o_bias)
    # q/k norms carry no bias in any family (Qwen3/Gemma3/OLMo-2 RMSNorm, CohereLayerNorm(bias=False),
    # StableLmLayerNormPerHead(bias=False))
    qk = {"head": ((m.dim_head,), (m.dim_head,)),
          "head_unshared": ((m.n_heads, m.dim_head), (m.kv_heads, m.dim_head)),
          "full": ((m.q_dim,), (m.kv_dim,))}.get(m.qk_norm)
    if qk is not None:
        norm("attn.q_norm", qk[0], False)
        norm("attn.k_norm", qk[1], False)
    if m.attn_sinks:  # GptOssAttention.sinks: one logit per head
        out.append(ParamTensor(f"layers.{i}.attn.sinks", (m.n_heads,), i, full, "slopes"))
    if m.positions == "alibi" and m.alibi_trainable:
        out.append(ParamTensor(f"layers.{i}.attn.alibi_slopes", (m.n_heads,), i, full, "slopes"))


def _mlp(m: ModelSpec, prefix: str, width: int, bias: bool, linear) -> None:
    """A dense MLP of hidden width ``width``: gated (gate, up, down; or fused gate_up, down) or plain."""
    d = m.d_model
    if m.mlp == "gated":
        if m.fused_gate_up:  # Phi3MLP / Glm4MLP gate_up_proj: Linear(d, 2 * d_ff), one adapter
            linear("gate_up", f"{prefix}.gate_up_proj", d, 2 * width, bias)
        else:
            linear("gate", f"{prefix}.gate_proj", d, width, bias)
            linear("up", f"{prefix}.up_proj", d, width, bias)
        linear("down", f"{prefix}.down_proj", width, d, bias)
    else:
        linear("up", f"{prefix}.fc1", d, width, bias)
        linear("down", f"{prefix}.fc2", width, d, bias)


def _moe(m: ModelSpec, i: int, linear, out: list[ParamTensor], full: bool, lora: Optional[LoraSpec]) -> None:
    """One MoE block: router (E x d, a bias on gpt-oss), routed experts stored as 3-D parameters
    (transformers 5 MixtralExperts / Qwen3MoeExperts / DeepseekV3NaiveMoe / GptOssExperts:
    gate_up_proj E x 2f x d, down_proj E x d x f, biases E x 2f and E x d on gpt-oss), shared
    experts as one dense MLP of width ``shared_width`` (DeepseekV3MoE.shared_experts,
    Qwen2MoeSparseMoeBlock.shared_expert) and Qwen2-MoE's shared_expert_gate Linear(d, 1).

    LoRA: ``target_modules`` reach only nn.Linear modules (shared experts, dense layers), never
    the 3-D expert parameters; target ``experts`` is PEFT's ``target_parameters`` on
    experts.gate_up_proj and experts.down_proj, whose ParamWrapper holds lora_A: (r * E) x in and
    lora_B: out x (r * E) (peft 0.21 tuners/lora/layer.py ParamWrapper.update_layer).
    QLoRA: the expert tensors and the router stay in the weight dtype: transformers 5.23 bitsandbytes
    replaces only ``nn.Linear`` / ``Conv1D`` modules with 4-bit ones (integrations/bitsandbytes.py
    ``replace_with_bnb_linear``; quantizer_bnb_4bit ``param_needs_quantization``: a Linear4bit's
    weight), and the experts are 3-D ``nn.Parameter``s. Shared experts and dense layers (nn.Linear)
    are quantized.
    """
    moe = m.moe
    assert moe is not None
    d, e, f = m.d_model, moe.n_experts, moe.d_ff_expert
    out.append(ParamTensor(f"layers.{i}.moe.router.weight", (e, d), i, full, "router"))
    if moe.router_bias:
        out.append(ParamTensor(f"layers.{i}.moe.router.bias", (e,), i, full, "bias"))
    up_width = 2 * f if m.mlp == "gated" else f
    ranks = expert_lora_ranks(m, lora)
    for name, d_in, d_out in (("gate_up_proj", d, up_width), ("down_proj", f, d)):
        out.append(ParamTensor(f"layers.{i}.moe.experts.{name}", (e, d_out, d_in), i, full, "experts"))
        if moe.expert_bias:
            out.append(ParamTensor(f"layers.{i}.moe.experts.{name}_bias", (e, d_out), i, full, "bias"))
        r = ranks[name]
        if r:
            out.append(ParamTensor(f"layers.{i}.moe.experts.{name}.lora_A", (r * e, d_in), i, True, "lora"))
            out.append(ParamTensor(f"layers.{i}.moe.experts.{name}.lora_B", (d_out, r * e), i, True, "lora"))
    if moe.n_shared_experts:
        _mlp(m, "moe.shared_experts", moe.shared_width, False, linear)
    if moe.shared_expert_gate:
        linear("shared_expert_gate", "moe.shared_expert_gate", d, 1, False)


def param_inventory(m: ModelSpec, lora: Optional[LoraSpec] = None) -> list[ParamTensor]:
    """Every parameter tensor, in module order (embedding, layers, final norm, head). A new list
    each call; the (frozen) tensors are built once per (model, LoRA spec): every simulated step
    asks for them two or three times."""
    return list(_inventory(m, lora))


@lru_cache(maxsize=64)
def _inventory(m: ModelSpec, lora: Optional[LoraSpec]) -> tuple[ParamTensor, ...]:
    return tuple(_build_inventory(m, lora))


def _build_inventory(m: ModelSpec, lora: Optional[LoraSpec]) -> list[ParamTensor]:
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
    if lora is not None and "head" in lora.targets:
        # LoRA on the output projection (PEFT lm_head, torchtune apply_lora_to_output, LitGPT lora_head):
        # A: r x d, B: vocab x r; with tied embeddings PEFT 0.21 still adapts the lm_head module alone
        # (peft/tuners/lora/model.py: the embedding is adapted instead only with ensure_weight_tying)
        out.append(ParamTensor("lm_head.lora_A", (lora.rank, d), None, True, "lora"))
        out.append(ParamTensor("lm_head.lora_B", (m.vocab_size, lora.rank), None, True, "lora"))
        if lora.dora:
            out.append(ParamTensor("lm_head.lora_magnitude", (m.vocab_size,), None, True, "lora"))
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

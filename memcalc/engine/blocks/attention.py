"""The attention block: its parameters (q/k/v or a fused qkv, o, q/k norms, sinks, ALiBi slopes; MLA's
in :mod:`.mla`), and its forward: the plain Llama attention (projections, RoPE, GQA expansion,
SDPA) written here, the families' variants (fused qkv, q/k norms, eager attention, sliding
masks) in :mod:`.attention_variants`, DeepSeek's multi-head latent attention in :mod:`.mla`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.rules import kv_cache
from memcalc.core.spec import ModelSpec
from memcalc.engine.blocks import attention_variants as av
from memcalc.engine.blocks import liger, unsloth_lora
from memcalc.engine.blocks.base import Linear, Norm, ParamTensor
from memcalc.engine.blocks.mla import mla_attention, mla_params

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext
    from memcalc.engine.records import T


def attention_params(m: ModelSpec, i: int, linear: Linear, norm: Norm, out: list[ParamTensor], full: bool) -> None:
    """Attention parameters: q/k/v (or the fused qkv, or MLA's projections and norms), o, q/k norms,
    sinks, ALiBi slopes. Source: the modeling_*.py attention classes (LlamaAttention, Phi3Attention,
    GPTNeoXAttention, DeepseekV3Attention, Qwen3Attention, Olmo2Attention, CohereAttention,
    StableLmAttention, GptOssAttention)."""
    d = m.d_model
    if m.mla is not None:  # DeepseekV3Attention (blocks/mla.py)
        mla_params(m, linear, norm)
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


def attention(fwd: ForwardContext, h: T, i: int) -> T:
    """Layer ``i``'s attention block on ``h``; returns a new reference."""
    o, m = fwd.ops, fwd.m
    if fwd.variant_attention:
        if m.mla is not None:  # DeepSeek multi-head latent attention (blocks/mla.py)
            return mla_attention(fwd, h, i)
        # fused qkv, q/k norms, eager attention, sliding masks (blocks/attention_variants.py)
        return av.attention(fwd, h, i)
    h = fwd.tp.gather(fwd, h) if fwd.tp else o.ref_(h)
    q, k, v = unsloth_lora.qkv_or_none(fwd, h, i) or (  # Unsloth's LoRA_QKV (blocks/unsloth_lora.py)
        fwd.proj(h, i, "attn.q_proj", "q", fwd.q_dim), fwd.proj(h, i, "attn.k_proj", "k", fwd.kv_dim),
        fwd.proj(h, i, "attn.v_proj", "v", fwd.kv_dim))
    o.drop(h)
    out = fwd.strategy.core_attention(fwd, q, k, v, i, lambda: fwd.core_attention(q, k, v, i))
    o.drop(q, k, v)
    y = unsloth_lora.o_or_none(fwd, out, i) or fwd.proj(out, i, "attn.o_proj", "o", m.d_model)
    o.drop(out)
    return fwd.tp.reduce(fwd, y) if fwd.tp else y


def core_attention(fwd: ForwardContext, q: T, k: T, v: T, i: int) -> T:
    """The plain attention core of layer ``i``: ALiBi bias, RoPE, GQA expansion (or SDPA's
    ``enable_gqa``), SDPA."""
    o, m = fwd.ops, fwd.m
    H, D = m.n_heads, fwd.dim_head
    bias, bias_bytes = None, 0
    if m.positions == "alibi":
        slopes = fwd.maybe(f"layers.{i}.attn.alibi_slopes")
        if slopes is not None:
            bias, bias_bytes = o.alibi_mask(H, fwd.T, slopes)
            bias_bytes = bias_bytes * fwd.B
    n_rep = m.n_heads // fwd.kv_heads
    # transformers passes grouped K/V un-expanded (enable_gqa) when use_gqa_in_sdpa holds:
    # no explicit mask, head dim <= 256 (integrations/sdpa_attention.py)
    gqa = n_rep > 1 and fwd.exp.profile.sdpa_gqa and bias is None and D <= 256
    if m.positions == "rope" and fwd.liger is not None and fwd.liger.rope:  # liger_rotary_pos_emb: in place
        q2, k2 = liger.rope(fwd, q, k)
    elif m.positions == "rope":
        q2, k2 = o.rope(q, m.rotary_pct), o.rope(k, m.rotary_pct)
    else:
        q2, k2 = o.ref_(q), o.ref_(k)
    vc = None
    if kv_cache(m, fwd.tr.checkpoint, fwd.exp.profile.kv_cache):  # DynamicCache: K, V copies (attention_variants)
        k2, vc = av.cache_update(fwd, k2, v)
        v = vc
    if gqa or (fwd.kv_heads == 1 and fwd.exp.profile.framework != "litgpt"):
        # one kv head (MQA, or a tensor-parallel rank's share): repeat_kv's reshape of the
        # (B, 1, n_rep, T, D) expand is a view (stride 0 over the heads), no copy; LitGPT's
        # ``k.repeat_interleave(q_per_kv, dim=1)`` copies whatever the groups (litgpt/model.py
        # CausalSelfAttention.forward: skipped only with a KV cache and one group)
        k3, v3 = o.ref_(k2), o.ref_(v)
    else:
        k3, v3 = o.repeat_kv(k2, n_rep), o.repeat_kv(v, n_rep)
    o.drop(k2)
    qa, ka, va = o.autocast_sdpa(q2, k3, v3)
    kernel = o.attention_kernel(bias is not None, qa, enable_gqa=gqa)
    if fwd.cp:  # context parallelism: ring or Ulysses around the kernel, its output's layout copy included
        out = fwd.cp.attention(fwd, qa, ka, va, kernel)  # (engine/context_parallel.py)
    else:
        out = o.sdpa(qa, ka, va, fwd.B, H, fwd.T, D, bias, bias_bytes, m.attn_dropout, kernel,
                     n_rep=n_rep if gqa else 1)
        out = av.output_copy(fwd, out, kernel)  # flash on a partial-rotary q: (B, H, T, D), transposed by a copy
    o.drop(qa, ka, va, q2, k3, v3, bias, vc)
    return out

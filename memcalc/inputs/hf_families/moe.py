"""Readers of the mixture-of-experts families: mixtral, qwen2_moe, qwen3_moe, deepseek_v2,
deepseek_v3, gpt_oss.

Defaults: the transformers 5.23 ``*Config`` classes; layouts: each ``modeling_*.py``
(experts stored as 3-D parameters: MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts,
DeepseekV2Experts/DeepseekV3NaiveMoe, GptOssExperts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Fields, attention_bias, decoder, sliding
from memcalc.inputs.hf_families.dense import _no_qwen_sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_config import _Reader


def _experts(r: "_Reader", *keys: str, default: int) -> int:
    """The number of routed experts under the first of ``keys`` present (configs name it variously)."""
    for k in keys:
        if k in r.cfg:
            for other in keys:
                r.seen.add(other)
            return r.int(k, default)
    return default


def _no_mlp_only_layers(r: "_Reader") -> None:
    v = r.cfg.get("mlp_only_layers")
    r.seen.add("mlp_only_layers")
    if v:
        raise UserError(f"{r.where}: mlp_only_layers {v!r} (dense layers at listed positions) is not supported")


def mixtral(r: "_Reader") -> Fields:
    """MixtralConfig (vocab 32000, hidden 4096, intermediate 14336 per expert, 32 layers, 32 heads,
    8 kv heads, 8 experts, top 2, rms_norm_eps 1e-5, max_position_embeddings 131072); router
    Parameter(E, d), experts gate_up_proj (E, 2f, d) and down_proj (E, d, f); no biases."""
    f = decoder(r, vocab=32000, hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, max_pos=4096 * 32, eps=1e-5)
    f["moe"] = dict(n_experts=_experts(r, "num_local_experts", default=8), top_k=r.int("num_experts_per_tok", 2),
                    d_ff_expert=f["d_ff"], lora_mlp_to_experts=True)
    f.update(sliding(r, default_window=None, default_every=0, n_layers=f["n_layers"]))
    return f


def qwen2_moe(r: "_Reader") -> Fields:
    """Qwen2MoeConfig (hidden 2048, intermediate 5632, 24 layers, 16 heads, 60 experts of 1408,
    top 4, shared expert 5632, decoder_sparse_step 1, qkv_bias true); one shared expert (a
    Qwen2MoeMLP) scaled by shared_expert_gate Linear(d, 1); layers that are not MoE use the dense
    MLP of intermediate_size."""
    f = decoder(r, vocab=151936, hidden=2048, inter=5632, layers=24, heads=16, max_pos=32768)
    b = r.bool("qkv_bias", True)
    f.update(qkv_bias=b, o_bias=False)
    shared = r.int("shared_expert_intermediate_size", 5632)
    f["moe"] = dict(n_experts=_experts(r, "num_experts", "num_local_experts", default=60),
                    top_k=r.int("num_experts_per_tok", 4), d_ff_expert=r.int("moe_intermediate_size", 1408),
                    n_shared_experts=1, d_ff_shared=shared, shared_expert_gate=True,
                    every=r.int("decoder_sparse_step", 1))
    _no_mlp_only_layers(r)
    _no_qwen_sliding(r)
    return f


def qwen3_moe(r: "_Reader") -> Fields:
    """Qwen3MoeConfig (hidden 2048, intermediate 6144, 24 layers, 32 heads, 4 kv heads, 128 experts
    of 768, top 8, decoder_sparse_step 1); Qwen3 attention (q_norm/k_norm RMSNorm(head_dim),
    ``attention_bias``); no shared experts."""
    f = decoder(r, vocab=151936, hidden=2048, inter=6144, layers=24, heads=32, kv_heads=4, max_pos=32768)
    f.update(attention_bias(r), qk_norm="head")
    f["moe"] = dict(n_experts=_experts(r, "num_experts", "num_local_experts", default=128),
                    top_k=r.int("num_experts_per_tok", 8), d_ff_expert=r.int("moe_intermediate_size", 768),
                    every=r.int("decoder_sparse_step", 1), lora_mlp_to_experts=True)
    _no_mlp_only_layers(r)
    _no_qwen_sliding(r)
    return f


def _deepseek(r: "_Reader", *, v3: bool) -> Fields:
    """DeepseekV2Config / DeepseekV3Config: multi-head latent attention (q_a_proj + q_a_layernorm +
    q_b_proj, or one q_proj when q_lora_rank is null; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj; biases ``attention_bias`` on q_a, kv_a and o); the first ``first_k_dense_replace``
    layers dense (intermediate_size), the rest MoE (router Parameter(E, d), routed experts of
    moe_intermediate_size, shared experts as one MLP of n_shared_experts x moe_intermediate_size).
    V3's multi-token-prediction layers (num_nextn_predict_layers) are not built by transformers."""
    if v3:
        f = decoder(r, vocab=129280, hidden=7168, inter=18432, layers=61, heads=128, max_pos=4096)
        dflt = dict(experts=256, shared=1, dff=2048, q_rank=1536, first=3, top_k=8)
    else:
        f = decoder(r, vocab=102400, hidden=4096, inter=11008, layers=32, heads=32, max_pos=2048)
        dflt = dict(experts=64, shared=2, dff=1407, q_rank=1536, first=0, top_k=None)
    f["n_kv_heads"] = f["n_heads"]  # MLA: every head has its keys and values from the latent
    f["head_dim"] = None if f["d_model"] % f["n_heads"] == 0 else r.int("v_head_dim", 128)
    b = r.bool("attention_bias", False)
    f.update(qkv_bias=b, o_bias=b, mlp_bias=r.bool("mlp_bias", False) if not v3 else False)
    q_rank = r.cfg.get("q_lora_rank", dflt["q_rank"])
    r.seen.add("q_lora_rank")
    f["mla"] = dict(q_lora_rank=None if q_rank is None else r.int("q_lora_rank", dflt["q_rank"]),
                    kv_lora_rank=r.int("kv_lora_rank", 512), qk_nope_head_dim=r.int("qk_nope_head_dim", 128),
                    qk_rope_head_dim=r.int("qk_rope_head_dim", 64), v_head_dim=r.int("v_head_dim", 128))
    top_k = r.int("num_experts_per_tok", dflt["top_k"]) if (dflt["top_k"] or "num_experts_per_tok" in r.cfg) else None
    if top_k is None:
        raise UserError(f"{r.where}: num_experts_per_tok is null (DeepseekV2Config's default); give the number")
    d_ff_e = r.int("moe_intermediate_size", dflt["dff"])
    n_shared = r.cfg.get("n_shared_experts", dflt["shared"]) or 0
    r.seen.add("n_shared_experts")
    f["moe"] = dict(n_experts=r.int("n_routed_experts", dflt["experts"]), top_k=top_k, d_ff_expert=d_ff_e,
                    n_shared_experts=n_shared, first_dense_layers=r.cfg.get("first_k_dense_replace", dflt["first"]) or 0,
                    lora_mlp_to_experts=True)
    r.seen.add("first_k_dense_replace")
    return f


def deepseek_v2(r: "_Reader") -> Fields:
    return _deepseek(r, v3=False)


def deepseek_v3(r: "_Reader") -> Fields:
    return _deepseek(r, v3=True)


def gpt_oss(r: "_Reader") -> Fields:
    """GptOssConfig (vocab 201088, hidden 2880, intermediate 2880 per expert, 36 layers, 64 heads,
    8 kv heads, head_dim 64, 128 experts, top 4, sliding_window 128 on every other layer,
    attention_bias true, rms_norm_eps 1e-5); GptOssAttention: q/k/v/o biases, sinks Parameter(heads);
    router weight (E, d) + bias (E); experts gate_up_proj (E, d, 2f) + bias (E, 2f), down_proj
    (E, f, d) + bias (E, d). Every layer is MoE."""
    f = decoder(r, vocab=201088, hidden=2880, inter=2880, layers=36, heads=64, kv_heads=8, head_dim=64,
                max_pos=131072, eps=1e-5)
    f.update(attention_bias(r, default=True), attn_sinks=True)
    f["moe"] = dict(n_experts=_experts(r, "num_local_experts", "num_experts", default=128),
                    top_k=r.int("num_experts_per_tok", 4), d_ff_expert=f["d_ff"], router_bias=True, expert_bias=True)
    f.update(sliding(r, default_window=128, default_every=2, n_layers=f["n_layers"]))
    return f


READERS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "deepseek_v2": deepseek_v2,
           "deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss}

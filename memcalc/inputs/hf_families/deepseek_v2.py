"""DeepSeek-V2 (``model_type`` deepseek_v2), and the reader DeepSeek-V3 shares: multi-head latent
attention (q_a_proj + q_a_layernorm + q_b_proj, or one q_proj when q_lora_rank is null;
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; biases ``attention_bias`` on q_a, kv_a and
o); the first ``first_k_dense_replace`` layers dense (intermediate_size), the rest MoE (router
Parameter(E, d), routed experts of moe_intermediate_size as 3-D parameters, shared experts as one
MLP of n_shared_experts x moe_intermediate_size)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import EXPERT_PARAMS, LLAMA_LORA, Family, Fields
from memcalc.inputs.hf_families.common import decoder

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader

#: memcalc target -> DeepseekV2/V3 module names (MLA's own projections; PEFT 0.21 turns the MLP names
#: into expert adapters, MoeSpec.lora_mlp_to_experts)
MLA_LORA = {"q": ("q_proj",), "q_a": ("q_a_proj",), "q_b": ("q_b_proj",), "kv_a": ("kv_a_proj_with_mqa",),
            "kv_b": ("kv_b_proj",), "o": ("o_proj",), "gate": LLAMA_LORA["gate"], "up": LLAMA_LORA["up"],
            "down": LLAMA_LORA["down"], "experts": ()}

#: the keys MLA makes meaningless (both versions)
MLA_IGNORED = {"num_key_value_heads": "MLA: keys and values come per head from the latent",
               "head_dim": "MLA: the head widths are qk_nope/qk_rope/v_head_dim",
               "qk_head_dim": "qk_nope_head_dim + qk_rope_head_dim"}


def read_mla(r: Reader, *, mlp_bias: bool) -> Fields:
    """DeepseekV2Config / DeepseekV3Config (their defaults in ``r``); ``mlp_bias``: the version's MLP
    reads the key (V2) or has no biases (V3)."""
    f = decoder(r)
    f["n_kv_heads"] = f["n_heads"]  # MLA: every head has its keys and values from the latent
    f["head_dim"] = None if f["d_model"] % f["n_heads"] == 0 else r.int("v_head_dim", 128)
    b = r.bool("attention_bias", False)
    f.update(qkv_bias=b, o_bias=b, mlp_bias=r.bool("mlp_bias", False) if mlp_bias else False)
    q_rank_default = r.default("q_lora_rank")
    q_rank = r.cfg.get("q_lora_rank", q_rank_default)
    r.seen.add("q_lora_rank")
    f["mla"] = dict(q_lora_rank=None if q_rank is None else r.int("q_lora_rank", q_rank_default),
                    kv_lora_rank=r.int("kv_lora_rank", 512), qk_nope_head_dim=r.int("qk_nope_head_dim", 128),
                    qk_rope_head_dim=r.int("qk_rope_head_dim", 64), v_head_dim=r.int("v_head_dim", 128))
    top_default = r.default("num_experts_per_tok")
    top_k = r.int("num_experts_per_tok", top_default) if (top_default or "num_experts_per_tok" in r.cfg) else None
    if top_k is None:
        raise UserError(f"{r.where}: num_experts_per_tok is null (DeepseekV2Config's default); give the number")
    d_ff_e = r.int("moe_intermediate_size")
    n_shared = r.cfg.get("n_shared_experts", r.default("n_shared_experts")) or 0
    r.seen.add("n_shared_experts")
    f["moe"] = dict(n_experts=r.int("n_routed_experts"), top_k=top_k, d_ff_expert=d_ff_e,
                    n_shared_experts=n_shared,
                    first_dense_layers=r.cfg.get("first_k_dense_replace", r.default("first_k_dense_replace")) or 0,
                    lora_mlp_to_experts=True,
                    # DeepseekV3TopkRouter / DeepseekV2TopkRouter: the router linear in fp32, fp32 weights
                    # (V2 softmax-scores them: the same shapes and dtypes as V3's sigmoid)
                    router="sigmoid")
    r.seen.add("first_k_dense_replace")
    return f


def read(r: Reader) -> Fields:
    return read_mla(r, mlp_bias=True)


FAMILY = Family(
    "deepseek_v2", read,
    defaults=dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
                  tie_word_embeddings=False, attention_dropout=0.0, n_routed_experts=64, n_shared_experts=2,
                  moe_intermediate_size=1407, q_lora_rank=1536, first_k_dense_replace=0, num_experts_per_tok=None),
    ignored={"moe_layer_freq": "DeepseekV2DecoderLayer ignores it: MoE from first_k_dense_replace on", **MLA_IGNORED},
    lora=MLA_LORA, lora_params=EXPERT_PARAMS,
)

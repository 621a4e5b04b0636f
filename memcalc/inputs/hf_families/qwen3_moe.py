"""Qwen3-MoE (``model_type`` qwen3_moe): Qwen3MoeConfig (hidden 2048, intermediate 6144, 24 layers,
32 heads, 4 kv heads, 128 experts of 768, top 8, decoder_sparse_step 1); Qwen3 attention
(q_norm/k_norm RMSNorm(head_dim), ``attention_bias``); no shared experts; experts as 3-D parameters
(Qwen3MoeExperts; PEFT 0.21 turns the MLP names into expert adapters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import EXPERT_PARAMS, MOE_LORA, Family, Fields
from memcalc.inputs.hf_families.common import (attention_bias, decoder, experts, no_mlp_only_layers,
                                               no_qwen_sliding)

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), qk_norm="head")
    f["moe"] = dict(n_experts=experts(r, "num_experts", "num_local_experts"),
                    top_k=r.int("num_experts_per_tok"), d_ff_expert=r.int("moe_intermediate_size"),
                    every=r.int("decoder_sparse_step"), lora_mlp_to_experts=True)
    no_mlp_only_layers(r)
    no_qwen_sliding(r)
    return f


FAMILY = Family(
    "qwen3_moe", read,
    defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  hidden_act="silu", tie_word_embeddings=False, attention_dropout=0.0, attention_bias=False,
                  num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1),
    lora=MOE_LORA, lora_params=EXPERT_PARAMS,
)

"""Qwen2-MoE (``model_type`` qwen2_moe): Qwen2MoeConfig (hidden 2048, intermediate 5632, 24 layers,
16 heads, 60 experts of 1408, top 4, shared expert 5632, decoder_sparse_step 1, qkv_bias true); one
shared expert (a Qwen2MoeMLP) scaled by shared_expert_gate Linear(d, 1); layers that are not MoE use
the dense MLP of intermediate_size; experts as 3-D parameters (Qwen2MoeExperts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import EXPERT_PARAMS, MOE_LORA, Family, Fields
from memcalc.inputs.hf_families.common import decoder, experts, no_mlp_only_layers, no_qwen_sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    b = r.bool("qkv_bias")
    f.update(qkv_bias=b, o_bias=False)
    shared = r.int("shared_expert_intermediate_size")
    f["moe"] = dict(n_experts=experts(r, "num_experts", "num_local_experts"),
                    top_k=r.int("num_experts_per_tok"), d_ff_expert=r.int("moe_intermediate_size"),
                    n_shared_experts=1, d_ff_shared=shared, shared_expert_gate=True,
                    every=r.int("decoder_sparse_step"))
    no_mlp_only_layers(r)
    no_qwen_sliding(r)
    return f


FAMILY = Family(
    "qwen2_moe", read,
    defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                  num_attention_heads=16, max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
                  tie_word_embeddings=False, attention_dropout=0.0, qkv_bias=True,
                  shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                  moe_intermediate_size=1408, decoder_sparse_step=1),
    lora=MOE_LORA, lora_params=EXPERT_PARAMS,
)

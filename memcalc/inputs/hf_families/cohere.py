"""Cohere (``model_type`` cohere): CohereConfig (vocab 256000, hidden 8192, intermediate 22528, 40
layers, 64 heads, layer_norm_eps 1e-5, tied head, logit_scale 0.0625); CohereDecoderLayer: one
CohereLayerNorm (weight, no bias), attention and MLP in parallel; q/k/v/o biases ``attention_bias``;
use_qk_norm: CohereLayerNorm((heads, head_dim)) on q and ((kv_heads, head_dim)) on k."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, decoder

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r, eps_key="layer_norm_eps", norm="layernorm")
    # CohereLayerNorm.forward (models/cohere/modeling_cohere.py, transformers 5.24): mean, variance and the
    # weight multiply written as fp32 ops, not F.layer_norm (engine.ops.layernorm_ops)
    f.update(attention_bias(r), norm_bias=False, block="parallel", norm_impl="layernorm-ops",
             logit_scale=r.float("logit_scale", lo=1e-12),
             qk_norm="head_unshared" if r.bool("use_qk_norm") else "none")
    return f


FAMILY = Family(
    "cohere", read,
    defaults=dict(vocab_size=256000, hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                  num_attention_heads=64, max_position_embeddings=8192, layer_norm_eps=1e-5, hidden_act="silu",
                  tie_word_embeddings=True, attention_dropout=0.0, attention_bias=False, logit_scale=0.0625,
                  use_qk_norm=False),
    ignored={"rotary_pct": "unused by CohereAttention"},
)

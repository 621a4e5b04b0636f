"""Qwen3 (``model_type`` qwen3): Qwen3Config (vocab 151936, hidden 4096, intermediate 22016, 32
layers/heads/kv heads, head_dim 128, max_position_embeddings 32768); Qwen3Attention: q/k/v/o biases
``attention_bias``, q_norm and k_norm RMSNorm(head_dim)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, decoder, no_qwen_sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), qk_norm="head")
    no_qwen_sliding(r)
    return f


FAMILY = Family(
    "qwen3", read,
    defaults=dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, attention_dropout=0.0,
                  attention_bias=False),
)

"""GLM-4 (``model_type`` glm4): Glm4Config (vocab 151552, hidden 4096, intermediate 13696, 40
layers, 32 heads, 2 kv heads, head_dim 128, rms_norm_eps 1.5625e-7, partial_rotary_factor 0.5,
attention_bias true); Glm4Attention: q/k/v biases ``attention_bias``, o_proj none; Glm4MLP: one
gate_up_proj; Glm4DecoderLayer: input, post_self_attn, post_attention, post_mlp norms (sandwich)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, decoder, rotary

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r, o=False), fused_gate_up=True, norm_placement="sandwich", rotary_pct=rotary(r))
    return f


FAMILY = Family(
    "glm4", read,
    defaults=dict(vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_hidden_layers=40,
                  num_attention_heads=32, num_key_value_heads=2, head_dim=128, max_position_embeddings=131072,
                  rms_norm_eps=1.5625e-07, hidden_act="silu", tie_word_embeddings=False, attention_dropout=0.0,
                  attention_bias=True, partial_rotary_factor=0.5),
    lora={"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj",), "gate_up": ("gate_up_proj",),
          "down": ("down_proj",)},
)

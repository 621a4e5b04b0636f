"""OLMo 2 (``model_type`` olmo2): Olmo2Config (vocab 50304, rms_norm_eps 1e-5,
max_position_embeddings 2048); Olmo2Attention: q/k/v/o biases ``attention_bias``, q_norm
RMSNorm(heads x head_dim), k_norm RMSNorm(kv_heads x head_dim); Olmo2DecoderLayer: no input norm,
post_attention_layernorm and post_feedforward_layernorm on the sublayer outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, decoder

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), qk_norm="full", norm_placement="output")
    # Olmo2RMSNorm.forward (models/olmo2/modeling_olmo2.py, transformers 5.24):
    # ``(self.weight * hidden_states).to(input_dtype)``: the weight multiply in fp32
    f["norm_impl"] = "weight-fp32"
    return f


FAMILY = Family(
    "olmo2", read,
    defaults=dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5, hidden_act="silu",
                  tie_word_embeddings=False, attention_dropout=0.0, attention_bias=False),
)

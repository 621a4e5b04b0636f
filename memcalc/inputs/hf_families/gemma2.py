"""Gemma 2 (``model_type`` gemma2): Gemma2Config (vocab 256000, hidden 2304, intermediate 9216, 26
layers, 8 heads, 4 kv heads, head_dim 256, sliding_window 4096 on every other layer, softcaps 50 /
30, tied head); Gemma2DecoderLayer: input, post_attention, pre_feedforward, post_feedforward norms."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, cap, decoder, gemma_act, sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), activation=gemma_act(r), embedding_scale=math.sqrt(f["d_model"]),
             norm_placement="sandwich", attn_softcap=cap(r, "attn_logit_softcapping"),
             logit_softcap=cap(r, "final_logit_softcapping"))
    f.update(sliding(r, n_layers=f["n_layers"], every=2))
    r.seen.add("query_pre_attn_scalar")
    # Gemma2RMSNorm.forward (models/gemma2/modeling_gemma2.py, transformers 5.24):
    # ``output * (1.0 + self.weight.float())`` then ``type_as(x)``: in fp32
    f["norm_impl"] = "weight-fp32"
    return f


FAMILY = Family(
    "gemma2", read,
    defaults=dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                  rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                  attention_dropout=0.0, attention_bias=False, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, sliding_window=4096),
)

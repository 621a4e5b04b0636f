"""Gemma 3 text (``model_type`` gemma3_text): Gemma3TextConfig (vocab 262208, hidden 2304,
intermediate 9216, 26 layers, 8 heads, 4 kv heads, head_dim 256, sliding_window 4096 with every 6th
layer full (sliding_window_pattern), no softcaps, tied head); Gemma3Attention q_norm/k_norm
RMSNorm(head_dim); four norms a layer."""

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
             norm_placement="sandwich", qk_norm="head", attn_softcap=cap(r, "attn_logit_softcapping"),
             logit_softcap=cap(r, "final_logit_softcapping"))
    f.update(sliding(r, n_layers=f["n_layers"], every=6, pattern_key="sliding_window_pattern"))
    r.seen.update(("query_pre_attn_scalar", "rope_local_base_freq"))
    # Gemma3RMSNorm.forward (models/gemma3/modeling_gemma3.py, transformers 5.24):
    # ``output * (1.0 + self.weight.float())`` then ``type_as(x)``: in fp32
    f["norm_impl"] = "weight-fp32"
    return f


FAMILY = Family(
    "gemma3_text", read,
    defaults=dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                  rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                  attention_dropout=0.0, attention_bias=False, attn_logit_softcapping=None,
                  final_logit_softcapping=None, sliding_window=4096),
)

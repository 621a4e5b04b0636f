"""Gemma (``model_type`` gemma): GemmaConfig (vocab 256000, hidden 3072, intermediate 24576, 28
layers, 16 heads, head_dim 256, tied head); GemmaAttention/MLP: q/k/v/o biases ``attention_bias``;
embeddings times sqrt(hidden_size) (GemmaModel normalizer)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, decoder, gemma_act

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), activation=gemma_act(r), embedding_scale=math.sqrt(f["d_model"]))
    r.seen.add("hidden_act")
    # GemmaRMSNorm.forward (models/gemma/modeling_gemma.py, transformers 5.24):
    # ``output * (1.0 + self.weight.float())`` then ``type_as(x)``: in fp32
    f["norm_impl"] = "weight-fp32"
    return f


FAMILY = Family(
    "gemma", read,
    defaults=dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6,
                  hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, attention_dropout=0.0,
                  attention_bias=False),
)

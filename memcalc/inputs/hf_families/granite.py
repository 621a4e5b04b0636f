"""Granite (``model_type`` granite): GraniteConfig (llama defaults, max_position_embeddings 2048);
embeddings times ``embedding_multiplier``, sublayer outputs times ``residual_multiplier``, logits
divided by ``logits_scaling`` (GraniteModel / GraniteForCausalLM); attention_multiplier is the
softmax scale."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, decoder

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), mlp_bias=r.bool("mlp_bias"),
             embedding_scale=r.float("embedding_multiplier", lo=1e-12),
             residual_multiplier=r.float("residual_multiplier", lo=1e-12),
             logit_scale=1.0 / r.float("logits_scaling", lo=1e-12))
    r.seen.add("attention_multiplier")
    return f


FAMILY = Family(
    "granite", read,
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu",
                  tie_word_embeddings=False, attention_dropout=0.0, attention_bias=False, mlp_bias=False,
                  embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0),
)

"""SmolLM3 (``model_type`` smollm3): SmolLM3Config (vocab 128256, hidden 2048, intermediate 11008,
36 layers, 16 heads, 4 kv heads, max_position_embeddings 32768, tied head); llama layout with
``attention_bias``/``mlp_bias``; no_rope_layers only skips the rotation on some layers (no
parameters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, decoder, no_qwen_sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), mlp_bias=r.bool("mlp_bias"))
    no_qwen_sliding(r)
    return f


FAMILY = Family(
    "smollm3", read,
    defaults=dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  hidden_act="silu", tie_word_embeddings=True, attention_dropout=0.0, attention_bias=False,
                  mlp_bias=False),
    ignored={"no_rope_layers": "layers that skip the rotation: no parameters",
             "no_rope_layer_interval": "the NoPE layer cadence: no parameters"},
)

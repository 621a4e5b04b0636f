"""StableLM (``model_type`` stablelm): StableLmConfig (vocab 50304, hidden 2560, intermediate 6912,
32 layers/heads, layer_norm_eps 1e-5, max_position_embeddings 4096, partial_rotary_factor 0.25);
LayerNorm with bias; q/k/v biases ``use_qkv_bias``, o none; use_parallel_residual: one norm,
attention and MLP in parallel; qk_layernorm: a LayerNorm(head_dim, no bias) per head on q and k.
head_dim is always hidden // heads (StableLmAttention)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import decoder, rotary

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    heads = r.int("num_attention_heads")
    d = r.int("hidden_size")
    f = decoder(r, eps_key="layer_norm_eps", norm="layernorm")
    f["head_dim"] = d // heads
    b = r.bool("use_qkv_bias")
    f.update(qkv_bias=b, o_bias=False, rotary_pct=rotary(r),
             qk_norm="head_unshared" if r.bool("qk_layernorm") else "none",
             block="parallel" if r.bool("use_parallel_residual") else "sequential",
             resid_dropout=r.float("hidden_dropout", hi=0.999))
    return f


FAMILY = Family(
    "stablelm", read,
    defaults=dict(vocab_size=50304, hidden_size=2560, intermediate_size=6912, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=4096, layer_norm_eps=1e-5, hidden_act="silu",
                  tie_word_embeddings=False, attention_dropout=0.0, partial_rotary_factor=0.25, use_qkv_bias=False,
                  qk_layernorm=False, use_parallel_residual=False, hidden_dropout=0.0),
    ignored={"head_dim": "StableLmAttention uses hidden_size // num_attention_heads"},
)

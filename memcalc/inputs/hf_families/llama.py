"""Llama (``model_type`` llama): LlamaConfig (max_position_embeddings 2048, rms_norm_eps 1e-6);
LlamaAttention biases are ``attention_bias`` on q, k, v, o; LlamaMLP biases ``mlp_bias``. The shape
keys are required (memcalc's contract for llama since issue 3)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memcalc.inputs.hf_families.base import Family, Fields, Inverse
from memcalc.inputs.hf_families.common import attention_bias, decoder, llama_config, llama_shape
from memcalc.inputs.hf_families.ignored import ROPE

if TYPE_CHECKING:
    from memcalc.core.spec import ModelSpec
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), mlp_bias=r.bool("mlp_bias"))
    return f


def mismatches(m: ModelSpec) -> list[str]:
    # LlamaAttention: q/k/v/o all take bias=config.attention_bias; LlamaMLP: bias=config.mlp_bias
    out = llama_shape(m)
    if m.qkv_bias != m.o_bias:
        out.append(f"qkv_bias={m.qkv_bias} with o_bias={m.o_bias} (attention_bias sets both)")
    return out


def config(m: ModelSpec) -> dict[str, Any]:
    return dict(llama_config(m), attention_bias=m.qkv_bias, mlp_bias=m.mlp_bias)


FAMILY = Family(
    "llama", read,
    defaults=dict(max_position_embeddings=2048, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                  attention_dropout=0.0, attention_bias=False, mlp_bias=False),
    ignored={"is_llama_config": "a SmolLM2 export marker", "rope_interleaved": ROPE},
    inverse=Inverse(config, mismatches,
                    shape="RMSNorm, gated MLP, RoPE, GQA, head_dim, attention_bias on q/k/v/o, mlp_bias", order=0),
)

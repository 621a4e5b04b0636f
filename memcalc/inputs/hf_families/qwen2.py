"""Qwen2 (``model_type`` qwen2): Qwen2Config (max_position_embeddings 32768); Qwen2Attention: q/k/v
biases always, none on o_proj or the MLP. use_sliding_window (first max_window_layers full, then
sliding) is refused."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memcalc.inputs.hf_families.base import Family, Fields, Inverse
from memcalc.inputs.hf_families.common import decoder, llama_config, llama_shape, no_qwen_sliding, want

if TYPE_CHECKING:
    from memcalc.core.spec import ModelSpec
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(qkv_bias=True, o_bias=False, mlp_bias=False)
    no_qwen_sliding(r)
    return f


def mismatches(m: ModelSpec) -> list[str]:
    # Qwen2Attention: q/k/v bias=True, o_proj bias=False; Qwen2MLP without bias
    return llama_shape(m) + want(m, qkv_bias=True, o_bias=False, mlp_bias=False)


def config(m: ModelSpec) -> dict[str, Any]:
    return dict(llama_config(m), use_sliding_window=False)


FAMILY = Family(
    "qwen2", read,
    defaults=dict(max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                  attention_dropout=0.0),
    ignored={"use_mrope": "multimodal rotary sections (Qwen2-VL); false in the text models: no parameters"},
    inverse=Inverse(config, mismatches, shape="llama with q/k/v biases only", order=2),
)

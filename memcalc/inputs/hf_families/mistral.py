"""Mistral (``model_type`` mistral): MistralConfig (max_position_embeddings 131072, sliding_window
4096: every layer slides); MistralAttention/MLP have no biases.

The inverse sets ``sliding_window`` None: the estimator assumes no attention mask (Mistral-7B-v0.1's
4096 only matters for longer sequences)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memcalc.inputs.hf_families.base import Family, Fields, Inverse
from memcalc.inputs.hf_families.common import decoder, llama_config, llama_shape, sliding, want

if TYPE_CHECKING:
    from memcalc.core.spec import ModelSpec
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(sliding(r, n_layers=f["n_layers"], every=0))
    return f


def mismatches(m: ModelSpec) -> list[str]:
    # MistralAttention / MistralMLP: bias=False everywhere
    return llama_shape(m) + want(m, qkv_bias=False, o_bias=False, mlp_bias=False)


def config(m: ModelSpec) -> dict[str, Any]:
    return dict(llama_config(m), sliding_window=None)


FAMILY = Family(
    "mistral", read,
    defaults=dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
                  attention_dropout=0.0, sliding_window=4096),
    inverse=Inverse(config, mismatches, shape="llama without biases", order=1),
)

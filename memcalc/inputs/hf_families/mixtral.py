"""Mixtral (``model_type`` mixtral): MixtralConfig (vocab 32000, hidden 4096, intermediate 14336 per
expert, 32 layers, 32 heads, 8 kv heads, 8 experts, top 2, rms_norm_eps 1e-5, max_position_embeddings
131072); router Parameter(E, d), experts gate_up_proj (E, 2f, d) and down_proj (E, d, f) (3-D
parameters, MixtralExperts); no biases.

LoRA: the MLP targets are the v4 expert names ``w1``/``w3``/``w2``, which PEFT 0.21 converts to
expert adapters (peft/utils/transformers_weight_conversion.py ``_convert_peft_config_moe``; memcalc:
``MoeSpec.lora_mlp_to_experts``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import EXPERT_PARAMS, LLAMA_LORA, Family, Fields
from memcalc.inputs.hf_families.common import decoder, experts, sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f["moe"] = dict(n_experts=experts(r, "num_local_experts"), top_k=r.int("num_experts_per_tok"),
                    d_ff_expert=f["d_ff"], lora_mlp_to_experts=True,
                    router="softmax-fp32")  # MixtralTopKRouter: softmax(logits.float()), weights stay fp32
    f.update(sliding(r, n_layers=f["n_layers"], every=0))
    return f


FAMILY = Family(
    "mixtral", read,
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                  rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, attention_dropout=0.0,
                  num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    lora={**LLAMA_LORA, "gate": ("w1",), "up": ("w3",), "down": ("w2",), "experts": ()},
    lora_params=EXPERT_PARAMS,
)

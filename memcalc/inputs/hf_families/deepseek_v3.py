"""DeepSeek-V3 / R1 (``model_type`` deepseek_v3): DeepseekV3Config, read as DeepSeek-V2 is
(:func:`.deepseek_v2.read_mla`: MLA, dense then MoE layers) with V3's defaults and an MLP without
biases; the multi-token-prediction layers (num_nextn_predict_layers) are not built by transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import EXPERT_PARAMS, Family, Fields
from memcalc.inputs.hf_families.deepseek_v2 import MLA_IGNORED, MLA_LORA, read_mla
from memcalc.inputs.hf_families.ignored import ROPE

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    return read_mla(r, mlp_bias=False)


FAMILY = Family(
    "deepseek_v3", read,
    defaults=dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
                  num_attention_heads=128, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
                  tie_word_embeddings=False, attention_dropout=0.0, n_routed_experts=256, n_shared_experts=1,
                  moe_intermediate_size=2048, q_lora_rank=1536, first_k_dense_replace=3, num_experts_per_tok=8),
    ignored={"moe_layer_freq": "DeepseekV3DecoderLayer ignores it: MoE from first_k_dense_replace on",
             "num_nextn_predict_layers": "the multi-token-prediction layer transformers does not build",
             **MLA_IGNORED, "rope_interleave": ROPE, "mlp_bias": "DeepseekV3MLP has no biases"},
    lora=MLA_LORA, lora_params=EXPERT_PARAMS,
)

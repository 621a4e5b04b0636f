"""gpt-oss (``model_type`` gpt_oss): GptOssConfig (vocab 201088, hidden 2880, intermediate 2880 per
expert, 36 layers, 64 heads, 8 kv heads, head_dim 64, 128 experts, top 4, sliding_window 128 on every
other layer, attention_bias true, rms_norm_eps 1e-5); GptOssAttention: q/k/v/o biases, sinks
Parameter(heads); router weight (E, d) + bias (E); experts gate_up_proj (E, d, 2f) + bias (E, 2f),
down_proj (E, f, d) + bias (E, d) (GptOssExperts). Every layer is MoE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import EXPERT_PARAMS, LLAMA_LORA, Family, Fields
from memcalc.inputs.hf_families.common import attention_bias, decoder, experts, sliding
from memcalc.inputs.hf_families.ignored import ROPE

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(attention_bias(r), attn_sinks=True)
    f["moe"] = dict(n_experts=experts(r, "num_local_experts", "num_experts"),
                    top_k=r.int("num_experts_per_tok"), d_ff_expert=f["d_ff"], router_bias=True, expert_bias=True)
    f.update(sliding(r, n_layers=f["n_layers"], every=2))
    # GptOssRMSNorm.forward (models/gpt_oss/modeling_gpt_oss.py, transformers 5.24):
    # ``(self.weight * hidden_states).to(input_dtype)``: in fp32
    f["norm_impl"] = "weight-fp32"
    return f


FAMILY = Family(
    "gpt_oss", read,
    defaults=dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, attention_dropout=0.0,
                  attention_bias=True, num_local_experts=128, num_experts_per_tok=4, sliding_window=128),
    ignored={"experts_per_token": "a duplicate of num_experts_per_tok", "swiglu_limit": "an activation clamp value",
             "swiglu_alpha": "an activation value", "initial_context_length": ROPE},
    lora={**{t: LLAMA_LORA[t] for t in ("q", "k", "v", "o")}, "experts": ()},  # no dense MLP
    lora_params=EXPERT_PARAMS,
)

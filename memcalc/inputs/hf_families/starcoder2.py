"""StarCoder2 (``model_type`` starcoder2): Starcoder2Config (vocab 49152, hidden 3072, intermediate
12288, 30 layers, 24 heads, 2 kv heads, norm_epsilon 1e-5, max_position_embeddings 4096, tied head,
use_bias true); LayerNorm with bias; q/k/v/o and c_fc/c_proj biases ``use_bias``; a plain MLP."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import decoder, sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r, eps_key="norm_epsilon", norm="layernorm")
    b = r.bool("use_bias")
    f.update(mlp="plain", qkv_bias=b, o_bias=b, mlp_bias=b,
             resid_dropout=r.float("residual_dropout", hi=0.999),
             embd_dropout=r.float("embedding_dropout", hi=0.999))
    f.update(sliding(r, n_layers=f["n_layers"], every=0))
    return f


FAMILY = Family(
    "starcoder2", read,
    defaults=dict(vocab_size=49152, hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
                  num_attention_heads=24, num_key_value_heads=2, max_position_embeddings=4096, norm_epsilon=1e-5,
                  hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, attention_dropout=0.0, use_bias=True,
                  residual_dropout=0.0, embedding_dropout=0.0, sliding_window=None),
    ignored={"activation_function": "a duplicate of hidden_act in early configs (Starcoder2 reads hidden_act)",
             "mlp_type": "always default in released configs", "norm_type": "layer_norm (Starcoder2 uses it)",
             "scale_attention_softmax_in_fp32": "a numerics switch", "scale_attn_weights": "a numerics switch",
             "layer_norm_epsilon": "a duplicate of norm_epsilon"},
    lora={"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj",), "up": ("c_fc",),
          "down": ("c_proj",)},
)

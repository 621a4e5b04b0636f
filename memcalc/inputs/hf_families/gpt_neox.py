"""GPT-NeoX (``model_type`` gpt_neox): GPTNeoXConfig (vocab 50432, hidden 6144, 44 layers, 64 heads,
intermediate 24576, gelu, layer_norm_eps 1e-5, partial_rotary_factor (rotary_pct) 0.25,
use_parallel_residual true, attention_bias true, untied embed_out); query_key_value one Linear(d,
3d), dense; MLP dense_h_to_4h / dense_4h_to_h with biases; input and post_attention LayerNorms
(both used in parallel with use_parallel_residual)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import decoder, rotary
from memcalc.inputs.hf_families.ignored import ROPE

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r, eps_key="layer_norm_eps", norm="layernorm")
    f["n_kv_heads"] = f["n_heads"]
    f["head_dim"] = f["d_model"] // f["n_heads"]
    pct = r.float("rotary_pct", lo=1e-9, hi=1.0) if "rotary_pct" in r.cfg else rotary(r)
    b = r.bool("attention_bias")
    parallel = r.bool("use_parallel_residual")
    f.update(mlp="plain", fused_qkv=True, qkv_bias=b, o_bias=b, mlp_bias=True, rotary_pct=pct,
             block="parallel" if parallel else "sequential", resid_dropout=r.float("hidden_dropout", hi=0.999))
    if parallel:
        f["parallel_norms"] = 2
    return f


FAMILY = Family(
    "gpt_neox", read,
    defaults=dict(vocab_size=50432, hidden_size=6144, intermediate_size=24576, num_hidden_layers=44,
                  num_attention_heads=64, max_position_embeddings=2048, layer_norm_eps=1e-5, hidden_act="gelu",
                  tie_word_embeddings=False, attention_dropout=0.0, rotary_pct=0.25, partial_rotary_factor=0.25,
                  attention_bias=True, use_parallel_residual=True, hidden_dropout=0.0),
    ignored={"rotary_emb_base": ROPE, "use_flash_attn": "a kernel switch", "bos_token_id": "a token id"},
    lora={"qkv": ("query_key_value",), "o": ("dense",), "up": ("dense_h_to_4h",), "down": ("dense_4h_to_h",)},
)

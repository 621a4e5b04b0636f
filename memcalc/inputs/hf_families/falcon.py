"""Falcon (``model_type`` falcon): FalconConfig (vocab 65024, hidden 4544, 32 layers, 71 heads,
multi_query true, parallel_attn true, bias false, ffn_hidden_size 4 x hidden, gelu, tied head);
query_key_value one Linear of q + 2 kv (kv heads: num_kv_heads with new_decoder_architecture, 1 with
multi_query, else all); LayerNorm with bias; parallel_attn with new_decoder_architecture: ln_attn and
ln_mlp (num_ln_in_parallel_attn 2), else one input_layernorm; not parallel: two norms; alibi: an
ALiBi bias instead of rotary (no parameters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Family, Fields

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    heads = r.int("num_attention_heads")
    d = r.int("hidden_size")
    if r.bool("apply_residual_connection_post_layernorm"):
        raise UserError(f"{r.where}: falcon with apply_residual_connection_post_layernorm true (the residual is the "
                        "normed input) is not supported")
    new = r.bool("new_decoder_architecture")
    mq = r.bool("multi_query")
    kv = r.int("num_kv_heads", heads) if new else (1 if mq else heads)
    if not new:
        r.seen.add("num_kv_heads")
    parallel = r.bool("parallel_attn")
    n_ln = r.int("num_ln_in_parallel_attn", 2 if new else 1)
    b = r.bool("bias")
    return dict(
        n_layers=r.int("num_hidden_layers"), d_model=d, n_heads=heads, n_kv_heads=kv, head_dim=d // heads,
        d_ff=r.int("ffn_hidden_size", 4 * d), vocab_size=r.int("vocab_size"),
        max_seq_len=r.int("max_position_embeddings"), mlp="plain", activation=r.activation("activation"),
        norm="layernorm", norm_eps=r.float("layer_norm_epsilon"),
        positions="alibi" if r.bool("alibi") else "rope", fused_qkv=True, qkv_bias=b, o_bias=b, mlp_bias=b,
        block="parallel" if parallel else "sequential", parallel_norms=2 if parallel and n_ln == 2 else 1,
        tie_embeddings=r.bool("tie_word_embeddings"), final_norm=True,
        attn_dropout=r.float("attention_dropout", hi=0.999), resid_dropout=r.float("hidden_dropout", hi=0.999),
    )


FAMILY = Family(
    "falcon", read,
    defaults=dict(vocab_size=65024, hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                  max_position_embeddings=2048, layer_norm_epsilon=1e-5, activation="gelu", tie_word_embeddings=True,
                  attention_dropout=0.0, hidden_dropout=0.0, multi_query=True, parallel_attn=True, bias=False,
                  new_decoder_architecture=False, alibi=False, apply_residual_connection_post_layernorm=False),
    ignored={"rotary": "legacy: rotary unless alibi", "head_dim": "FalconAttention uses hidden_size // heads",
             "n_head": "legacy alias", "n_layer": "legacy alias"},
    lora={"qkv": ("query_key_value",), "o": ("dense",), "up": ("dense_h_to_4h",), "down": ("dense_4h_to_h",)},
)

"""Phi (``model_type`` phi): PhiConfig; one LayerNorm per layer, attention and MLP in parallel,
biases on q/k/v/dense/fc1/fc2 and on lm_head, ``partial_rotary_factor`` of each head rotated, final
LayerNorm."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Family, Fields, Inverse
from memcalc.inputs.hf_families.common import HF_ACTIVATIONS, decoder, head_dim_is_default, rotary, want

if TYPE_CHECKING:
    from memcalc.core.spec import ModelSpec
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    if r.bool("qk_layernorm"):
        raise UserError(f"{r.where}: phi with qk_layernorm true has per-head q/k LayerNorms; not supported")
    f = decoder(r, eps_key="layer_norm_eps", norm="layernorm")
    f.update(mlp="plain", block="parallel", rotary_pct=rotary(r), qkv_bias=True, o_bias=True, mlp_bias=True,
             lm_head_bias=True, resid_dropout=r.float("resid_pdrop", hi=0.999),
             embd_dropout=r.float("embd_pdrop", hi=0.999))
    return f


def mismatches(m: ModelSpec) -> list[str]:
    # PhiDecoderLayer: one LayerNorm, attention and MLP in parallel, biases on q/k/v/dense, fc1/fc2 and
    # lm_head, partial RoPE, final_layernorm; head_dim = hidden_size / num_attention_heads
    return want(m, mlp="plain", norm="layernorm", has_norm_bias=True, norm_placement="pre", residual_scale=1.0,
                block="parallel", positions="rope", final_norm=True, lm_head_bias=True, qkv_bias=True,
                o_bias=True, mlp_bias=True) + head_dim_is_default(m)


def config(m: ModelSpec) -> dict[str, Any]:
    return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
                num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads,
                hidden_act=HF_ACTIVATIONS[m.activation], max_position_embeddings=m.max_seq_len,
                layer_norm_eps=m.norm_eps, partial_rotary_factor=m.rotary_pct, tie_word_embeddings=m.tie_embeddings,
                attention_dropout=m.attn_dropout, resid_pdrop=m.resid_dropout, embd_pdrop=m.embd_dropout,
                qk_layernorm=False)


FAMILY = Family(
    "phi", read,
    defaults=dict(vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                  num_attention_heads=32, max_position_embeddings=2048, layer_norm_eps=1e-5, hidden_act="gelu_new",
                  tie_word_embeddings=False, attention_dropout=0.0, partial_rotary_factor=0.5, resid_pdrop=0.0,
                  embd_pdrop=0.0, qk_layernorm=False),
    ignored={"qk_layernorm": "read (refused when true)"},
    lora={"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("dense",), "up": ("fc1",), "down": ("fc2",)},
    inverse=Inverse(config, mismatches, shape="parallel block, one LayerNorm, partial RoPE, all biases incl. lm_head",
                    order=4),
)

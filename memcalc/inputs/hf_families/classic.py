"""Readers of the families with their own key names or fused projections: gpt2, phi, phi3,
gpt_neox, falcon.

Defaults: the transformers 5.23 ``*Config`` classes; layouts: each ``modeling_*.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Fields, decoder, rotary, sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_config import _Reader


def gpt2(r: "_Reader") -> Fields:
    """GPT2Config: Conv1D projections with biases, c_attn one fused q,k,v projection (one LoRA
    adapter), LayerNorm with bias, learned positions (``n_positions``), ``n_inner`` or 4 *
    ``n_embd``, head tied unless ``tie_word_embeddings`` false."""
    if r.bool("add_cross_attention", False):
        raise UserError(f"{r.where}: GPT-2 with add_cross_attention is an encoder-decoder; not supported")
    d = r.int("n_embd", 768)
    return dict(
        n_layers=r.int("n_layer", 12), d_model=d, n_heads=r.int("n_head", 12), d_ff=r.int("n_inner", 4 * d),
        vocab_size=r.int("vocab_size", 50257), max_seq_len=r.int("n_positions", 1024), mlp="plain",
        activation=r.activation("activation_function", "gelu_new"), norm="layernorm",
        norm_eps=r.float("layer_norm_epsilon", 1e-5), positions="learned", qkv_bias=True, o_bias=True,
        mlp_bias=True, fused_qkv=True, tie_embeddings=r.bool("tie_word_embeddings", True), final_norm=True,
        attn_dropout=r.float("attn_pdrop", 0.1, hi=0.999), resid_dropout=r.float("resid_pdrop", 0.1, hi=0.999),
        embd_dropout=r.float("embd_pdrop", 0.1, hi=0.999),
    )


def phi(r: "_Reader") -> Fields:
    """PhiConfig: one LayerNorm per layer, attention and MLP in parallel, biases on q/k/v/dense/
    fc1/fc2 and on lm_head, ``partial_rotary_factor`` of each head rotated, final LayerNorm."""
    if r.bool("qk_layernorm", False):
        raise UserError(f"{r.where}: phi with qk_layernorm true has per-head q/k LayerNorms; not supported")
    f = decoder(r, vocab=51200, hidden=2048, inter=8192, layers=24, heads=32, max_pos=2048, eps=1e-5,
                eps_key="layer_norm_eps", act="gelu_new", norm="layernorm")
    f.update(mlp="plain", block="parallel", rotary_pct=rotary(r, 0.5), qkv_bias=True, o_bias=True, mlp_bias=True,
             lm_head_bias=True, resid_dropout=r.float("resid_pdrop", 0.0, hi=0.999),
             embd_dropout=r.float("embd_pdrop", 0.0, hi=0.999))
    return f


def phi3(r: "_Reader") -> Fields:
    """Phi3Config (vocab 32064, hidden 3072, intermediate 8192, 32 layers/heads, rms_norm_eps 1e-5,
    max_position_embeddings 4096); Phi3Attention: one qkv_proj Linear(d, (heads + 2 kv_heads) x
    head_dim), o_proj, no biases; Phi3MLP: one gate_up_proj Linear(d, 2 x intermediate), down_proj;
    ``partial_rotary_factor`` (Phi-4-mini 0.75)."""
    f = decoder(r, vocab=32064, hidden=3072, inter=8192, layers=32, heads=32, max_pos=4096, eps=1e-5)
    f.update(fused_qkv=True, fused_gate_up=True, rotary_pct=rotary(r, 1.0),
             resid_dropout=r.float("resid_pdrop", 0.0, hi=0.999), embd_dropout=r.float("embd_pdrop", 0.0, hi=0.999))
    f.update(sliding(r, default_window=None, default_every=0, n_layers=f["n_layers"]))
    r.seen.update(("attention_bias", "mlp_bias", "lm_head_bias"))  # Phi3 modules have no biases whatever these say
    if r.cfg.get("attention_bias") or r.cfg.get("mlp_bias") or r.cfg.get("lm_head_bias"):
        raise UserError(f"{r.where}: phi3 with biases (attention_bias / mlp_bias / lm_head_bias true) is not "
                        "what transformers' Phi3 builds (no biases); not supported")
    return f


def gpt_neox(r: "_Reader") -> Fields:
    """GPTNeoXConfig (vocab 50432, hidden 6144, 44 layers, 64 heads, intermediate 24576, gelu,
    layer_norm_eps 1e-5, partial_rotary_factor (rotary_pct) 0.25, use_parallel_residual true,
    attention_bias true, untied embed_out); query_key_value one Linear(d, 3d), dense; MLP
    dense_h_to_4h / dense_4h_to_h with biases; input and post_attention LayerNorms (both used
    in parallel with use_parallel_residual)."""
    f = decoder(r, vocab=50432, hidden=6144, inter=24576, layers=44, heads=64, max_pos=2048, eps=1e-5,
                eps_key="layer_norm_eps", act="gelu", norm="layernorm")
    f["n_kv_heads"] = f["n_heads"]
    f["head_dim"] = f["d_model"] // f["n_heads"]
    pct = r.float("rotary_pct", 0.25, lo=1e-9, hi=1.0) if "rotary_pct" in r.cfg else rotary(r, 0.25)
    b = r.bool("attention_bias", True)
    parallel = r.bool("use_parallel_residual", True)
    f.update(mlp="plain", fused_qkv=True, qkv_bias=b, o_bias=b, mlp_bias=True, rotary_pct=pct,
             block="parallel" if parallel else "sequential", resid_dropout=r.float("hidden_dropout", 0.0, hi=0.999))
    if parallel:
        f["parallel_norms"] = 2
    return f


def falcon(r: "_Reader") -> Fields:
    """FalconConfig (vocab 65024, hidden 4544, 32 layers, 71 heads, multi_query true, parallel_attn
    true, bias false, ffn_hidden_size 4 x hidden, gelu, tied head); query_key_value one Linear of
    q + 2 kv (kv heads: num_kv_heads with new_decoder_architecture, 1 with multi_query, else all);
    LayerNorm with bias; parallel_attn with new_decoder_architecture: ln_attn and ln_mlp
    (num_ln_in_parallel_attn 2), else one input_layernorm; not parallel: two norms; alibi: an
    ALiBi bias instead of rotary (no parameters)."""
    heads = r.int("num_attention_heads", 71)
    d = r.int("hidden_size", 4544)
    if r.bool("apply_residual_connection_post_layernorm", False):
        raise UserError(f"{r.where}: falcon with apply_residual_connection_post_layernorm true (the residual is the "
                        "normed input) is not supported")
    new = r.bool("new_decoder_architecture", False)
    mq = r.bool("multi_query", True)
    kv = r.int("num_kv_heads", heads) if new else (1 if mq else heads)
    if not new:
        r.seen.add("num_kv_heads")
    parallel = r.bool("parallel_attn", True)
    n_ln = r.int("num_ln_in_parallel_attn", 2 if new else 1)
    b = r.bool("bias", False)
    return dict(
        n_layers=r.int("num_hidden_layers", 32), d_model=d, n_heads=heads, n_kv_heads=kv, head_dim=d // heads,
        d_ff=r.int("ffn_hidden_size", 4 * d), vocab_size=r.int("vocab_size", 65024),
        max_seq_len=r.int("max_position_embeddings", 2048), mlp="plain", activation=r.activation("activation", "gelu"),
        norm="layernorm", norm_eps=r.float("layer_norm_epsilon", 1e-5),
        positions="alibi" if r.bool("alibi", False) else "rope", fused_qkv=True, qkv_bias=b, o_bias=b, mlp_bias=b,
        block="parallel" if parallel else "sequential", parallel_norms=2 if parallel and n_ln == 2 else 1,
        tie_embeddings=r.bool("tie_word_embeddings", True), final_norm=True,
        attn_dropout=r.float("attention_dropout", 0.0, hi=0.999), resid_dropout=r.float("hidden_dropout", 0.0, hi=0.999),
    )


READERS = {"gpt2": gpt2, "phi": phi, "phi3": phi3, "gpt_neox": gpt_neox, "falcon": falcon}

"""Readers of the dense decoder families: llama, mistral, qwen2, qwen3, granite, smollm3,
olmo2, glm4, cohere, stablelm, starcoder2, gemma, gemma2, gemma3_text.

Defaults: the transformers 5.23 ``*Config`` classes. Layouts (biases, norms, tied head):
each family's ``modeling_*.py``, cited per reader.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Fields, attention_bias, decoder, rotary, sliding

if TYPE_CHECKING:
    from memcalc.inputs.hf_config import _Reader


def llama(r: "_Reader") -> Fields:
    """LlamaConfig (max_position_embeddings 2048, rms_norm_eps 1e-6); LlamaAttention biases are
    ``attention_bias`` on q, k, v, o; LlamaMLP biases ``mlp_bias``. The shape keys are required
    (memcalc's contract for llama since issue 3)."""
    q = r.REQUIRED
    f = decoder(r, vocab=q, hidden=q, inter=q, layers=q, heads=q, max_pos=2048)
    f.update(attention_bias(r), mlp_bias=r.bool("mlp_bias", False))
    return f


def mistral(r: "_Reader") -> Fields:
    """MistralConfig (max_position_embeddings 131072, sliding_window 4096: every layer slides);
    MistralAttention/MLP have no biases."""
    q = r.REQUIRED
    f = decoder(r, vocab=q, hidden=q, inter=q, layers=q, heads=q, max_pos=4096 * 32)
    f.update(sliding(r, default_window=4096, default_every=0, n_layers=f["n_layers"]))
    return f


def qwen2(r: "_Reader") -> Fields:
    """Qwen2Config (max_position_embeddings 32768); Qwen2Attention: q/k/v biases always, none on
    o_proj or the MLP. use_sliding_window (first max_window_layers full, then sliding) is refused."""
    q = r.REQUIRED
    f = decoder(r, vocab=q, hidden=q, inter=q, layers=q, heads=q, max_pos=32768)
    f.update(qkv_bias=True, o_bias=False, mlp_bias=False)
    _no_qwen_sliding(r)
    return f


def _no_qwen_sliding(r: "_Reader") -> None:
    if r.bool("use_sliding_window", False):
        raise UserError(f"{r.where}: use_sliding_window true (full attention on the first max_window_layers, "
                        "sliding after) is not supported")
    r.seen.update(("sliding_window", "max_window_layers", "layer_types"))


def qwen3(r: "_Reader") -> Fields:
    """Qwen3Config (vocab 151936, hidden 4096, intermediate 22016, 32 layers/heads/kv heads,
    head_dim 128, max_position_embeddings 32768); Qwen3Attention: q/k/v/o biases ``attention_bias``,
    q_norm and k_norm RMSNorm(head_dim)."""
    f = decoder(r, vocab=151936, hidden=4096, inter=22016, layers=32, heads=32, kv_heads=32, head_dim=128,
                max_pos=32768)
    f.update(attention_bias(r), qk_norm="head")
    _no_qwen_sliding(r)
    return f


def granite(r: "_Reader") -> Fields:
    """GraniteConfig (llama defaults, max_position_embeddings 2048); embeddings times
    ``embedding_multiplier``, sublayer outputs times ``residual_multiplier``, logits divided by
    ``logits_scaling`` (GraniteModel / GraniteForCausalLM); attention_multiplier is the softmax scale."""
    f = decoder(r, vocab=32000, hidden=4096, inter=11008, layers=32, heads=32, max_pos=2048)
    f.update(attention_bias(r), mlp_bias=r.bool("mlp_bias", False),
             embedding_scale=r.float("embedding_multiplier", 1.0, lo=1e-12),
             residual_multiplier=r.float("residual_multiplier", 1.0, lo=1e-12),
             logit_scale=1.0 / r.float("logits_scaling", 1.0, lo=1e-12))
    r.seen.add("attention_multiplier")
    return f


def smollm3(r: "_Reader") -> Fields:
    """SmolLM3Config (vocab 128256, hidden 2048, intermediate 11008, 36 layers, 16 heads, 4 kv heads,
    max_position_embeddings 32768, tied head); llama layout with ``attention_bias``/``mlp_bias``;
    no_rope_layers only skips the rotation on some layers (no parameters)."""
    f = decoder(r, vocab=128256, hidden=2048, inter=11008, layers=36, heads=16, kv_heads=4, max_pos=32768, tie=True)
    f.update(attention_bias(r), mlp_bias=r.bool("mlp_bias", False))
    _no_qwen_sliding(r)
    return f


def olmo2(r: "_Reader") -> Fields:
    """Olmo2Config (vocab 50304, rms_norm_eps 1e-5, max_position_embeddings 2048); Olmo2Attention:
    q/k/v/o biases ``attention_bias``, q_norm RMSNorm(heads x head_dim), k_norm RMSNorm(kv_heads x
    head_dim); Olmo2DecoderLayer: no input norm, post_attention_layernorm and
    post_feedforward_layernorm on the sublayer outputs."""
    f = decoder(r, vocab=50304, hidden=4096, inter=11008, layers=32, heads=32, max_pos=2048, eps=1e-5)
    f.update(attention_bias(r), qk_norm="full", norm_placement="output")
    return f


def glm4(r: "_Reader") -> Fields:
    """Glm4Config (vocab 151552, hidden 4096, intermediate 13696, 40 layers, 32 heads, 2 kv heads,
    head_dim 128, rms_norm_eps 1.5625e-7, partial_rotary_factor 0.5, attention_bias true);
    Glm4Attention: q/k/v biases ``attention_bias``, o_proj none; Glm4MLP: one gate_up_proj;
    Glm4DecoderLayer: input, post_self_attn, post_attention, post_mlp norms (sandwich)."""
    f = decoder(r, vocab=151552, hidden=4096, inter=13696, layers=40, heads=32, kv_heads=2, head_dim=128,
                max_pos=131072, eps=1.5625e-07)
    f.update(attention_bias(r, default=True, o=False), fused_gate_up=True, norm_placement="sandwich",
             rotary_pct=rotary(r, 0.5))
    return f


def cohere(r: "_Reader") -> Fields:
    """CohereConfig (vocab 256000, hidden 8192, intermediate 22528, 40 layers, 64 heads,
    layer_norm_eps 1e-5, tied head, logit_scale 0.0625); CohereDecoderLayer: one CohereLayerNorm
    (weight, no bias), attention and MLP in parallel; q/k/v/o biases ``attention_bias``;
    use_qk_norm: CohereLayerNorm((heads, head_dim)) on q and ((kv_heads, head_dim)) on k."""
    f = decoder(r, vocab=256000, hidden=8192, inter=22528, layers=40, heads=64, max_pos=8192, eps=1e-5,
                eps_key="layer_norm_eps", tie=True, norm="layernorm")
    f.update(attention_bias(r), norm_bias=False, block="parallel",
             logit_scale=r.float("logit_scale", 0.0625, lo=1e-12),
             qk_norm="head_unshared" if r.bool("use_qk_norm", False) else "none")
    return f


def stablelm(r: "_Reader") -> Fields:
    """StableLmConfig (vocab 50304, hidden 2560, intermediate 6912, 32 layers/heads, layer_norm_eps
    1e-5, max_position_embeddings 4096, partial_rotary_factor 0.25); LayerNorm with bias; q/k/v
    biases ``use_qkv_bias``, o none; use_parallel_residual: one norm, attention and MLP in
    parallel; qk_layernorm: a LayerNorm(head_dim, no bias) per head on q and k. head_dim is
    always hidden // heads (StableLmAttention)."""
    heads = r.int("num_attention_heads", 32)
    d = r.int("hidden_size", 2560)
    f = decoder(r, vocab=50304, hidden=2560, inter=6912, layers=32, heads=32, max_pos=4096, eps=1e-5,
                eps_key="layer_norm_eps", norm="layernorm")
    f["head_dim"] = d // heads
    b = r.bool("use_qkv_bias", False)
    f.update(qkv_bias=b, o_bias=False, rotary_pct=rotary(r, 0.25),
             qk_norm="head_unshared" if r.bool("qk_layernorm", False) else "none",
             block="parallel" if r.bool("use_parallel_residual", False) else "sequential",
             resid_dropout=r.float("hidden_dropout", 0.0, hi=0.999))
    return f


def starcoder2(r: "_Reader") -> Fields:
    """Starcoder2Config (vocab 49152, hidden 3072, intermediate 12288, 30 layers, 24 heads, 2 kv
    heads, norm_epsilon 1e-5, max_position_embeddings 4096, tied head, use_bias true);
    LayerNorm with bias; q/k/v/o and c_fc/c_proj biases ``use_bias``; a plain MLP."""
    f = decoder(r, vocab=49152, hidden=3072, inter=12288, layers=30, heads=24, kv_heads=2, max_pos=4096, eps=1e-5,
                eps_key="norm_epsilon", act="gelu_pytorch_tanh", tie=True, norm="layernorm")
    b = r.bool("use_bias", True)
    f.update(mlp="plain", qkv_bias=b, o_bias=b, mlp_bias=b,
             resid_dropout=r.float("residual_dropout", 0.0, hi=0.999),
             embd_dropout=r.float("embedding_dropout", 0.0, hi=0.999))
    f.update(sliding(r, default_window=None, default_every=0, n_layers=f["n_layers"]))
    return f


def _gemma_act(r: "_Reader") -> str:
    """``hidden_activation`` (Gemma-2/3), else ``hidden_act``; GemmaConfig maps the legacy "gelu"
    of the first releases to gelu_pytorch_tanh."""
    key = "hidden_activation" if "hidden_activation" in r.cfg else "hidden_act"
    if r.cfg.get(key) == "gelu":
        r.seen.add(key)
        return "gelu_tanh"
    return r.activation(key, "gelu_pytorch_tanh")


def gemma(r: "_Reader") -> Fields:
    """GemmaConfig (vocab 256000, hidden 3072, intermediate 24576, 28 layers, 16 heads, head_dim
    256, tied head); GemmaAttention/MLP: q/k/v/o biases ``attention_bias``; embeddings times
    sqrt(hidden_size) (GemmaModel normalizer)."""
    f = decoder(r, vocab=256000, hidden=3072, inter=24576, layers=28, heads=16, head_dim=256, max_pos=8192, tie=True)
    f.update(attention_bias(r), activation=_gemma_act(r), embedding_scale=math.sqrt(f["d_model"]))
    r.seen.add("hidden_act")
    return f


def gemma2(r: "_Reader") -> Fields:
    """Gemma2Config (vocab 256000, hidden 2304, intermediate 9216, 26 layers, 8 heads, 4 kv heads,
    head_dim 256, sliding_window 4096 on every other layer, softcaps 50 / 30, tied head);
    Gemma2DecoderLayer: input, post_attention, pre_feedforward, post_feedforward norms."""
    f = decoder(r, vocab=256000, hidden=2304, inter=9216, layers=26, heads=8, kv_heads=4, head_dim=256,
                max_pos=8192, tie=True)
    f.update(attention_bias(r), activation=_gemma_act(r), embedding_scale=math.sqrt(f["d_model"]),
             norm_placement="sandwich", attn_softcap=_cap(r, "attn_logit_softcapping", 50.0),
             logit_softcap=_cap(r, "final_logit_softcapping", 30.0))
    f.update(sliding(r, default_window=4096, default_every=2, n_layers=f["n_layers"]))
    r.seen.add("query_pre_attn_scalar")
    return f


def gemma3_text(r: "_Reader") -> Fields:
    """Gemma3TextConfig (vocab 262208, hidden 2304, intermediate 9216, 26 layers, 8 heads, 4 kv
    heads, head_dim 256, sliding_window 4096 with every 6th layer full (sliding_window_pattern),
    no softcaps, tied head); Gemma3Attention q_norm/k_norm RMSNorm(head_dim); four norms a layer."""
    f = decoder(r, vocab=262208, hidden=2304, inter=9216, layers=26, heads=8, kv_heads=4, head_dim=256,
                max_pos=131072, tie=True)
    f.update(attention_bias(r), activation=_gemma_act(r), embedding_scale=math.sqrt(f["d_model"]),
             norm_placement="sandwich", qk_norm="head", attn_softcap=_cap(r, "attn_logit_softcapping", None),
             logit_softcap=_cap(r, "final_logit_softcapping", None))
    f.update(sliding(r, default_window=4096, default_every=6, n_layers=f["n_layers"],
                     pattern_key="sliding_window_pattern"))
    r.seen.update(("query_pre_attn_scalar", "rope_local_base_freq"))
    return f


def _cap(r: "_Reader", key: str, default):
    if key in r.cfg and r.cfg[key] is None:
        r.seen.add(key)
        return None
    return r.float(key, default, lo=1e-9) if (key in r.cfg or default is not None) else None


def gemma3(r: "_Reader") -> Fields:
    raise UserError(f"{r.where}: model_type gemma3 is multimodal Gemma 3 (a SigLIP vision tower memcalc does "
                    "not model); for the text decoder give its text_config as a config of model_type gemma3_text")


READERS = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "granite": granite, "smollm3": smollm3,
    "olmo2": olmo2, "glm4": glm4, "cohere": cohere, "stablelm": stablelm, "starcoder2": starcoder2,
    "gemma": gemma, "gemma2": gemma2, "gemma3_text": gemma3_text,
}

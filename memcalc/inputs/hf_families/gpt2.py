"""GPT-2 (``model_type`` gpt2): GPT2Config; Conv1D projections with biases, c_attn one fused q,k,v
projection (one LoRA adapter), LayerNorm with bias, learned positions (``n_positions``), ``n_inner``
or 4 * ``n_embd``, head tied unless ``tie_word_embeddings`` false."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Family, Fields, Inverse
from memcalc.inputs.hf_families.common import HF_ACTIVATIONS, head_dim_is_default, want

if TYPE_CHECKING:
    from memcalc.core.spec import ModelSpec
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    if r.bool("add_cross_attention"):
        raise UserError(f"{r.where}: GPT-2 with add_cross_attention is an encoder-decoder; not supported")
    d = r.int("n_embd")
    return dict(
        n_layers=r.int("n_layer"), d_model=d, n_heads=r.int("n_head"), d_ff=r.int("n_inner", 4 * d),
        vocab_size=r.int("vocab_size"), max_seq_len=r.int("n_positions"), mlp="plain",
        activation=r.activation("activation_function"), norm="layernorm",
        norm_eps=r.float("layer_norm_epsilon"), positions="learned", qkv_bias=True, o_bias=True,
        mlp_bias=True, fused_qkv=True, tie_embeddings=r.bool("tie_word_embeddings"), final_norm=True,
        attn_dropout=r.float("attn_pdrop", hi=0.999), resid_dropout=r.float("resid_pdrop", hi=0.999),
        embd_dropout=r.float("embd_pdrop", hi=0.999),
    )


def mismatches(m: ModelSpec) -> list[str]:
    # GPT2Block: pre-norm LayerNorm with bias, Conv1D c_attn/c_proj/c_fc/c_proj with biases, learned
    # positions (wpe), one head per key (no GQA), head_dim = n_embd / n_head, final ln_f
    return want(m, mlp="plain", norm="layernorm", has_norm_bias=True, norm_placement="pre", residual_scale=1.0,
                block="sequential", positions="learned", final_norm=True, lm_head_bias=False, qkv_bias=True,
                o_bias=True, mlp_bias=True, kv_heads=m.n_heads) + head_dim_is_default(m)


def config(m: ModelSpec) -> dict[str, Any]:
    return dict(vocab_size=m.vocab_size, n_positions=m.max_seq_len, n_embd=m.d_model, n_layer=m.n_layers,
                n_head=m.n_heads, n_inner=m.d_ff, activation_function=HF_ACTIVATIONS[m.activation],
                layer_norm_epsilon=m.norm_eps, attn_pdrop=m.attn_dropout, resid_pdrop=m.resid_dropout,
                embd_pdrop=m.embd_dropout, tie_word_embeddings=m.tie_embeddings, bos_token_id=0, eos_token_id=0)


FAMILY = Family(
    "gpt2", read,
    defaults=dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                  activation_function="gelu_new", layer_norm_epsilon=1e-5, attn_pdrop=0.1, resid_pdrop=0.1,
                  embd_pdrop=0.1, tie_word_embeddings=True, add_cross_attention=False),
    ignored={"n_special": "legacy OpenAI-GPT key (no special-token rows in GPT2LMHeadModel)",
             "predict_special_tokens": "legacy OpenAI-GPT key"} | {
        k: "GPT2DoubleHeads summary head / attention numerics, not in GPT2LMHeadModel" for k in (
            "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
            "summary_first_dropout", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
            "reorder_and_upcast_attn", "task_specific_params", "n_ctx")},
    # c_proj names both the attention output and the MLP down projection: qualified by their parent
    lora={"qkv": ("c_attn",), "o": ("attn.c_proj",), "up": ("c_fc",), "down": ("mlp.c_proj",)},
    lora_kwargs={"fan_in_fan_out": True},
    inverse=Inverse(config, mismatches, fused_qkv=True,
                    shape="LayerNorm, plain MLP, learned positions, all biases, fused Conv1D c_attn (fused_qkv)",
                    order=3),
)

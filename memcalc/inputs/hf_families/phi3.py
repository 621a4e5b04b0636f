"""Phi-3 (``model_type`` phi3): Phi3Config (vocab 32064, hidden 3072, intermediate 8192, 32
layers/heads, rms_norm_eps 1e-5, max_position_embeddings 4096); Phi3Attention: one qkv_proj
Linear(d, (heads + 2 kv_heads) x head_dim), o_proj, no biases; Phi3MLP: one gate_up_proj Linear(d,
2 x intermediate), down_proj; ``partial_rotary_factor`` (Phi-4-mini 0.75)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Family, Fields
from memcalc.inputs.hf_families.common import decoder, rotary, sliding
from memcalc.inputs.hf_families.ignored import ROPE

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader


def read(r: Reader) -> Fields:
    f = decoder(r)
    f.update(fused_qkv=True, fused_gate_up=True, rotary_pct=rotary(r),
             resid_dropout=r.float("resid_pdrop", hi=0.999), embd_dropout=r.float("embd_pdrop", hi=0.999))
    f.update(sliding(r, n_layers=f["n_layers"], every=0))
    r.seen.update(("attention_bias", "mlp_bias", "lm_head_bias"))  # Phi3 modules have no biases whatever these say
    if r.cfg.get("attention_bias") or r.cfg.get("mlp_bias") or r.cfg.get("lm_head_bias"):
        raise UserError(f"{r.where}: phi3 with biases (attention_bias / mlp_bias / lm_head_bias true) is not "
                        "what transformers' Phi3 builds (no biases); not supported")
    return f


FAMILY = Family(
    "phi3", read,
    defaults=dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu",
                  tie_word_embeddings=False, attention_dropout=0.0, partial_rotary_factor=1.0, resid_pdrop=0.0,
                  embd_pdrop=0.0, sliding_window=None),
    ignored={"interpolate_factor": ROPE, "full_attn_mod": "Phi-4-mini remote-code switch (1 = every layer full)"},
    lora={"qkv": ("qkv_proj",), "o": ("o_proj",), "gate_up": ("gate_up_proj",), "down": ("down_proj",)},
)

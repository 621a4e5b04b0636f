"""Whether a model's decoder layers are all alike (the same allocations, ops and sizes in every
layer), so that a deep stack can be built from a shallow copy of it: the plan's steps in depth
(:mod:`memcalc.plan.depth`) and the compiled forward graph (:func:`memcalc.compile.graph.record_graph`)."""

from __future__ import annotations

from memcalc.core.spec import ModelSpec

#: The ModelSpec fields known to shape every layer alike. A field not listed here (a model family
#: added later: mixture-of-experts layers every K, dense first layers, local/global attention
#: patterns) may make layers differ with a period a shallow copy cannot see, so a model that sets
#: one to anything but its default is simulated (or recorded) at full depth until the field is
#: checked (tests/test_depth.py) and listed.
UNIFORM_FIELDS = frozenset({
    "activation", "alibi_trainable", "attn_dropout", "block", "d_ff", "d_model", "embd_dropout", "final_norm",
    "head_dim", "lm_head_bias", "max_seq_len", "mlp", "mlp_bias", "n_heads", "n_kv_heads", "n_layers", "name",
    "norm", "norm_bias", "norm_eps", "norm_placement", "o_bias", "positions", "qkv_bias", "resid_dropout",
    "residual_scale", "rotary_pct", "tie_embeddings", "vocab_size",
})


def layers_alike(m: ModelSpec) -> bool:
    """Every field of ``m`` outside :data:`UNIFORM_FIELDS` is at its default."""
    for k, f in type(m).model_fields.items():
        if k not in UNIFORM_FIELDS and (f.is_required() or getattr(m, k) != f.get_default(call_default_factory=True)):
            return False
    return True

"""Decoder layers, MLP and head of the model families beyond Llama, op by op as transformers 5
runs them (the validator's replica, ``validate/model.py``, runs the same ops).

- **Norm placements** (``norm_placement``): ``sandwich`` = Gemma2DecoderLayer / Glm4DecoderLayer
  ``x + post_norm(f(pre_norm(x)))`` for attention and MLP (4 norms: norm1 before attention,
  norm2 after it, norm3 before the MLP, norm4 after it); ``output`` = Olmo2DecoderLayer
  ``x + norm(f(x))`` (norm1 after attention, norm2 after the MLP; no pre-norm).
- **Two parallel norms** (``parallel_norms`` 2): GPTNeoXLayer with ``use_parallel_residual``
  ``mlp(post_attention_layernorm(x)) + attn(input_layernorm(x)) + x`` (Falcon's
  ``new_decoder_architecture`` ln_attn / ln_mlp: the same tensors).
- **Multipliers**: ``residual_multiplier`` (GraniteDecoderLayer ``residual + h * m``),
  ``embedding_scale`` (Gemma ``embed * normalizer``, Granite ``embedding_multiplier``),
  ``logit_scale`` (Cohere ``logits * logit_scale``, Granite ``logits / logits_scaling``): each a
  multiply by a Python scalar, a new tensor that saves nothing (``mul``'s formula needs the
  other operand only when it is a tensor). Gemma multiplies by a 0-dim buffer cast to the
  weight dtype, which ``mul`` saves: 2 bytes (one 512-byte block), not modelled.
- **Final logit softcap** (Gemma2ForCausalLM ``final_logit_softcapping``): ``logits / cap``,
  ``tanh`` (saves its output), ``* cap``: three (B, T, V) tensors, one kept for backward.
- **Fused gate/up** (Phi3MLP / Glm4MLP ``gate_up_proj`` then ``chunk(2, -1)``): views of one
  (B, T, 2*d_ff) output; the activation saves the gate view and the product saves the up view,
  so the whole output stays alive for backward, as gate and up do unfused. One LoRA adapter on
  the fused module: its input saved once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.engine.attention_variants import pin_views, split_views, view_map
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext


def layer(fwd: ForwardContext, x: T, i: int) -> T:
    """One decoder layer of a variant placement; takes a reference to x, returns a new one."""
    o, m = fwd.ops, fwd.m
    rm = m.residual_multiplier
    n = f"layers.{i}.norm"
    if m.block == "parallel":  # two norms (NeoX), or one norm with a residual multiplier
        h = fwd.norm(x, n + "1")
        a = _scaled(fwd, fwd.resid_drop(fwd.attention(h, i)), rm)
        if m.parallel_norms == 2:
            o.drop(h)
            h = fwd.norm(x, n + "2")
        f = _scaled(fwd, fwd.resid_drop(fwd.mlp(h, i)), rm)
        o.drop(h)
        s = o.add(f, a)
        o.drop(a, f)
        y = o.add(s, x)
        o.drop(s)
        return y
    if m.norm_placement == "output":
        x1 = _residual(fwd, x, fwd.attention(x, i), n + "1")
        y = _residual(fwd, x1, fwd.mlp(x1, i), n + "2")
        o.drop(x1)
        return y
    sandwich = m.norm_placement == "sandwich"
    h = fwd.norm(x, n + "1")
    x1 = _residual(fwd, x, fwd.attention(h, i), n + "2" if sandwich else None, drop=h)
    h2 = fwd.norm(x1, n + ("3" if sandwich else "2"))
    y = _residual(fwd, x1, fwd.mlp(h2, i), n + "4" if sandwich else None, drop=h2)
    o.drop(x1)
    return y


def _scaled(fwd: ForwardContext, a: T, factor: float) -> T:
    y = fwd.ops.scale(a, factor)
    fwd.ops.drop(a)
    return y


def _residual(fwd: ForwardContext, x: T, f: T, post_norm: str | None, drop: T | None = None) -> T:
    """x + multiplier * post_norm(dropout(f)): ``f`` is the sublayer output (dropped here),
    ``drop`` the sublayer input to release once the sublayer ran."""
    o = fwd.ops
    if drop is not None:
        o.drop(drop)
    f = fwd.resid_drop(f)
    if post_norm is not None:
        g = fwd.norm(f, post_norm)
        o.drop(f)
        f = g
    f = _scaled(fwd, f, fwd.m.residual_multiplier)
    y = o.add(x, f)
    o.drop(f)
    return y


def fused_gate_up_mlp(fwd: ForwardContext, h: T, i: int) -> T:
    """Phi3MLP.forward: ``gate, up = gate_up_proj(x).chunk(2, -1)``; ``down(up * act(gate))``."""
    o, m, sim = fwd.ops, fwd.m, fwd.sim
    n0 = len(sim.nodes)
    base = fwd.proj(h, i, "mlp.gate_up_proj", "gate_up", 2 * m.d_ff)
    g, u = split_views(o, base, [fwd.rows * m.d_ff] * 2, "chunk")
    a = o.activation(g, m.activation)
    x = o.mul(u, a)
    o.drop(a, g, u)
    pin_views(sim, n0, view_map(base, [g, u]))
    o.drop(base)  # the views die here: the storage lives on where a node saved a view
    y = fwd.proj(x, i, "mlp.down_proj", "down", m.d_model)
    o.drop(x)
    return y


def scale_embeddings(fwd: ForwardContext, x: T) -> T:
    """The embeddings times ``embedding_scale`` (a new tensor when the scale is not 1)."""
    return _scaled(fwd, x, fwd.m.embedding_scale)


def post_logits(fwd: ForwardContext, logits: T) -> T:
    """``logit_scale`` then the final softcap on the head's output (takes the reference)."""
    o, m, sim = fwd.ops, fwd.m, fwd.sim
    logits = _scaled(fwd, logits, m.logit_scale)
    cap = m.logit_softcap
    if cap is None:
        return logits
    dt = o.dtype_of(logits)
    d = o.new(logits.numel, dt)
    sim.node("div_scalar", [], [logits], [], [d])
    o.drop(logits)
    t = o.new(d.numel, dt)
    sim.node("tanh", [t], [d], [], [t])
    o.drop(d)
    y = o.new(t.numel, dt)
    sim.node("mul_scalar", [], [t], [], [y])
    o.drop(t)
    return y

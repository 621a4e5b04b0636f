"""One decoder layer: its norms and residuals around the attention and the feed-forward block
(:func:`layer`; the blocks themselves are :mod:`.attention` and :mod:`.mlp` / :mod:`.moe`, reached
through the walk), and the residual dropout. The pre-norm (Llama), parallel (GPT-J, phi) and
post-norm (DeepNet: ``x = norm(x * alpha + f(x))``) placements are written in :func:`layer`; the
families beyond them below, op by op as transformers 5 runs them (the validator's replica,
``validate/model.py``, runs the same ops). Their parameters: the norms
(``norms_per_layer``, :mod:`.norm`).

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
  weight dtype, which ``mul`` saves: 2 bytes (one 512-byte block), not modelled. (The
  embedding's and the logits' are in :mod:`.embedding` and :mod:`.head`.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.spec import ModelSpec
from memcalc.engine.blocks.base import Norm
from memcalc.engine.blocks.base import scaled as _scaled
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext


def layer_norm_params(m: ModelSpec, norm: Norm) -> None:
    """The layer's norms around its sublayers: ``norms_per_layer`` of them (norm1, norm2, ...), each
    a weight (and a bias for LayerNorm) of d_model."""
    d = m.d_model
    for j in range(m.norms_per_layer):
        norm(f"norm{j + 1}", (d,), m.has_norm_bias)


def layer(fwd: ForwardContext, x: T, i: int) -> T:
    """One decoder layer; takes a reference to x and returns a new output reference."""
    o, m = fwd.ops, fwd.m
    if fwd.variant_layer:  # sandwich / output norms, two parallel norms, residual multiplier
        return _variant_layer(fwd, x, i)
    if m.block == "parallel":
        h = fwd.norm(x, f"layers.{i}.norm1")
        a = fwd.resid_drop(fwd.attention(h, i))
        f = fwd.resid_drop(fwd.mlp(h, i))
        o.drop(h)
        s = o.add(a, f)
        o.drop(a, f)
        y = o.add(s, x)
        o.drop(s)
        return y
    if m.norm_placement == "pre":
        # torchtune's TransformerSelfAttentionLayer.forward (modules/transformer.py, 0.6.1) binds the
        # attention output to a local (``attn_out = self.attn(h, h, ...)``; ``h = self.sa_scale(attn_out)
        # + x``; ``mlp_out = self.mlp(self.mlp_norm(h))``; ``return h + ...``): it lives until the layer
        # returns, through the MLP (and its recompute under checkpointing); transformers reassigns it
        keep_attn = fwd.exp.profile.framework == "torchtune" and not fwd.exp.training.compile
        h = fwd.norm(x, f"layers.{i}.norm1")
        a = fwd.resid_drop(fwd.attention(h, i))
        o.drop(h)
        x1 = o.add(x, a)
        if not keep_attn:
            o.drop(a)
        h2 = fwd.norm(x1, f"layers.{i}.norm2")
        f = fwd.resid_drop(fwd.mlp(h2, i))
        o.drop(h2)
        y = o.add(x1, f)
        o.drop(x1, f)
        if keep_attn:
            o.drop(a)
        return y
    # post-norm (DeepNet): x = norm(x * alpha + f(x))
    a = fwd.resid_drop(fwd.attention(x, i))
    r = o.scale(x, m.residual_scale)
    z = o.add(r, a)
    o.drop(r, a)
    x1 = fwd.norm(z, f"layers.{i}.norm1")
    o.drop(z)
    f = fwd.resid_drop(fwd.mlp(x1, i))
    r2 = o.scale(x1, m.residual_scale)
    z2 = o.add(r2, f)
    o.drop(r2, f, x1)
    y = fwd.norm(z2, f"layers.{i}.norm2")
    o.drop(z2)
    return y


def resid_drop(fwd: ForwardContext, x: T) -> T:
    """Residual dropout on ``x`` (a reference the call takes over)."""
    if fwd.m.resid_dropout <= 0:  # dropout(x, 0) is x: a new reference, then x's dropped (nothing changes)
        assert x.alive, f"reference to a freed tensor {x.name}"
        return x
    y = fwd.ops.dropout(x, fwd.m.resid_dropout)
    fwd.ops.drop(x)
    return y


def _variant_layer(fwd: ForwardContext, x: T, i: int) -> T:
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

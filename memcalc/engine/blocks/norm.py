"""The model's norm (``norm``: RMSNorm or LayerNorm) on the residual stream: its parameters (a
weight, and a bias for LayerNorm) and its forward (``ops.rmsnorm`` / ``ops.layernorm``; the
family's own code by ``norm_impl``: ``ops.rmsnorm`` in composite mode, ``ops.layernorm_ops``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.dtypes import DType
from memcalc.core.kernels import pow2_backward_temps
from memcalc.core.rules import rmsnorm_mode
from memcalc.engine.blocks import liger
from memcalc.engine.blocks.base import Norm, ParamTensor

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext
    from memcalc.engine.ops import Ops
    from memcalc.engine.records import Param, T

FP32 = DType.fp32


def norm_params(i: int, full: bool, out: list[ParamTensor]) -> Norm:
    """The rule that adds layer ``i``'s norm called ``name`` (weight, optional bias) to ``out``."""
    def norm(name: str, shape: tuple[int, ...], bias: bool) -> None:
        out.append(ParamTensor(f"layers.{i}.{name}.weight", shape, i, full, "norm"))
        if bias:
            out.append(ParamTensor(f"layers.{i}.{name}.bias", shape, i, full, "bias"))
    return norm


def norm(fwd: ForwardContext, x: T, name: str) -> T:
    """The model's norm with the weights called ``name`` on ``x`` (a new reference): its own code
    where ``norm_impl`` says so (:func:`memcalc.core.rules.rmsnorm_mode`; CohereLayerNorm as
    ``ops.layernorm_ops``), else the framework's."""
    o, m = fwd.ops, fwd.m
    if fwd.liger is not None and fwd.liger.rms_norm and m.norm == "rmsnorm":  # LigerRMSNorm (blocks/liger.py)
        return liger.rms_norm(fwd, x, fwd.p(name + ".weight"))
    if m.norm == "rmsnorm":
        return o.rmsnorm(x, fwd.seq_rows, m.d_model, fwd.p(name + ".weight"), rmsnorm_mode(m, o.profile.rmsnorm))
    if m.norm_impl == "layernorm-ops":
        return layernorm_ops(o, x, fwd.seq_rows, m.d_model, fwd.p(name + ".weight"))
    return o.layernorm(x, fwd.seq_rows, m.d_model, fwd.p(name + ".weight"), fwd.maybe(name + ".bias"))


def layernorm_ops(o: Ops, x: T, rows: int, d: int, w: Param) -> T:
    """A LayerNorm written as fp32 ops (models/cohere/modeling_cohere.py CohereLayerNorm.forward,
    transformers 5.24): ``h = x.to(fp32)``; ``mean = h.mean(-1, keepdim)``; ``var = (h - mean).pow(2)
    .mean(-1, keepdim)``; ``h = (h - mean) * rsqrt(var + eps)``; ``(w.to(fp32) * h).to(input_dtype)``.
    Saved (derivatives.yaml): pow keeps its input (the first h - mean, fp32), the multiply by
    rsqrt keeps the second h - mean (fp32) and the rsqrt (rows), the weight multiply keeps the
    normalised h (fp32) for the weight's gradient; the means and the subtractions keep nothing.
    ``w`` may be (H, D) (Cohere's q/k norm over each head: ``rows`` = B*T*H, ``d`` = D). Ignores
    ``w.to(fp32)`` (one weight-sized copy)."""
    sim, n = o.sim, rows * d
    dt = o.dtype_of(x)
    xf = o.sim.ref(x) if dt == FP32 else o.new(n, FP32)
    if xf is not x:
        xf.requires_grad = x.requires_grad
        sim.node("to_fp32", [], [x], [], [xf])
    mean = o.new(rows, FP32)
    sim.node("mean", [], [xf], [], [mean])
    d1 = o.new(n, FP32)  # h - mean
    sim.node("sub", [], [xf, mean], [], [d1])
    sq = o.new(n, FP32)
    sim.node("pow", [d1], [d1], [], [sq], temps=pow2_backward_temps(n, 4))
    o.drop(d1)
    var = o.new(rows, FP32)
    sim.node("mean", [], [sq], [], [var])
    o.drop(sq)
    d2 = o.new(n, FP32)  # h - mean, again
    sim.node("sub", [], [xf, mean], [], [d2])
    ve = o.new(rows, FP32)  # var + eps
    sim.node("add_scalar", [], [var], [], [ve])
    o.drop(var)
    r = o.new(rows, FP32)
    sim.node("rsqrt", [r], [ve], [], [r])
    o.drop(ve)
    h = o.new(n, FP32)
    sim.node("mul", [d2, r], [d2, r], [], [h])
    o.drop(d2, r, xf, mean)  # the expression's temporaries; hidden_states rebinds to h
    y32 = o.new(n, FP32)
    sim.node("mul_weight", [h] if w.trainable else [], [h], [w], [y32])
    o.drop(h)
    if dt == FP32:
        return y32
    y = o.new(n, dt)
    sim.node("to_dtype", [], [y32], [], [y])
    o.drop(y32)
    return y

"""The model's norm (``norm``: RMSNorm or LayerNorm) on the residual stream: its parameters (a
weight, and a bias for LayerNorm) and its forward (``ops.rmsnorm`` / ``ops.layernorm``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.engine.blocks.base import Norm, ParamTensor

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext
    from memcalc.engine.records import T


def norm_params(i: int, full: bool, out: list[ParamTensor]) -> Norm:
    """The rule that adds layer ``i``'s norm called ``name`` (weight, optional bias) to ``out``."""
    def norm(name: str, shape: tuple[int, ...], bias: bool) -> None:
        out.append(ParamTensor(f"layers.{i}.{name}.weight", shape, i, full, "norm"))
        if bias:
            out.append(ParamTensor(f"layers.{i}.{name}.bias", shape, i, full, "bias"))
    return norm


def norm(fwd: ForwardContext, x: T, name: str) -> T:
    """The model's norm with the weights called ``name`` on ``x`` (a new reference)."""
    o = fwd.ops
    if fwd.m.norm == "rmsnorm":
        return o.rmsnorm(x, fwd.seq_rows, fwd.m.d_model, fwd.p(name + ".weight"))
    return o.layernorm(x, fwd.seq_rows, fwd.m.d_model, fwd.p(name + ".weight"), fwd.maybe(name + ".bias"))

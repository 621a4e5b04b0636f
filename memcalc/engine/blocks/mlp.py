"""The dense feed-forward block: gated (gate, up, down; or Phi-3 / GLM-4's fused ``gate_up_proj``)
or plain (fc1, activation, fc2); its parameters, and its forward under tensor parallelism (the
input gathered, the output reduced). The mixture-of-experts block is :mod:`.moe`.

**Fused gate/up** (Phi3MLP / Glm4MLP ``gate_up_proj`` then ``chunk(2, -1)``): views of one
(B, T, 2*d_ff) output; the activation saves the gate view and the product saves the up view, so
the whole output stays alive for backward, as gate and up do unfused. One LoRA adapter on the
fused module: its input saved once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.spec import ModelSpec
from memcalc.engine.blocks.attention_variants import pin_views, split_views, view_map
from memcalc.engine.blocks import liger, unsloth_lora
from memcalc.engine.blocks.base import Linear

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext
    from memcalc.engine.records import T


def mlp_params(m: ModelSpec, prefix: str, width: int, bias: bool, linear: Linear) -> None:
    """A dense MLP of hidden width ``width``: gated (gate, up, down; or fused gate_up, down) or plain."""
    d = m.d_model
    if m.mlp == "gated":
        if m.fused_gate_up:  # Phi3MLP / Glm4MLP gate_up_proj: Linear(d, 2 * d_ff), one adapter
            linear("gate_up", f"{prefix}.gate_up_proj", d, 2 * width, bias)
        else:
            linear("gate", f"{prefix}.gate_proj", d, width, bias)
            linear("up", f"{prefix}.up_proj", d, width, bias)
        linear("down", f"{prefix}.down_proj", width, d, bias)
    else:
        linear("up", f"{prefix}.fc1", d, width, bias)
        linear("down", f"{prefix}.fc2", width, d, bias)


def mlp(fwd: ForwardContext, h: T, i: int) -> T:
    """Layer ``i``'s dense MLP on ``h``; returns a new reference."""
    o, m = fwd.ops, fwd.m
    if m.fused_gate_up:  # Phi-3 / GLM-4 gate_up_proj
        return fused_gate_up_mlp(fwd, h, i)
    h = fwd.tp.gather(fwd, h) if fwd.tp else o.ref_(h)
    y = unsloth_lora.mlp_or_none(fwd, h, i)  # Unsloth's LoRA_MLP (blocks/unsloth_lora.py)
    if y is not None:
        o.drop(h)
        return y
    if m.mlp == "gated":
        g = fwd.proj(h, i, "mlp.gate_proj", "gate", m.d_ff)
        u = fwd.proj(h, i, "mlp.up_proj", "up", m.d_ff)
        if fwd.liger is not None and fwd.liger.glu:  # LigerSwiGLUMLP / LigerGEGLUMLP (blocks/liger.py)
            x = liger.glu(fwd, g, u)
            o.drop(g, u)
        else:
            a = o.activation(g, m.activation)
            o.drop(g)
            x = o.mul(a, u)
            o.drop(a, u)
        y = fwd.proj(x, i, "mlp.down_proj", "down", m.d_model)
    else:
        f = fwd.proj(h, i, "mlp.fc1", "up", m.d_ff)
        a = o.activation(f, m.activation)
        o.drop(f)
        x = a
        y = fwd.proj(x, i, "mlp.fc2", "down", m.d_model)
    o.drop(x, h)
    return fwd.tp.reduce(fwd, y) if fwd.tp else y


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

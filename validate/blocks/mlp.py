"""The twin of :mod:`memcalc.engine.blocks.mlp`: the dense feed-forward block (gated, fused gate_up,
plain) and its activations. The projections are :mod:`.adapters`' ``Linear``s (the model's ``make``)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- feed-forward --------------------------------------------------------------------------
def activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "relu":
        return F.relu(x)
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu":
        return F.gelu(x)
    if kind in ("gelu_tanh", "gelu_new"):  # gelu_new: the replica runs the fused tanh GELU (profile gelu_new fused)
        return F.gelu(x, approximate="tanh")
    if kind == "gelu_new_chain":  # profile gelu_new chain: transformers activations.py NewGELUActivation.forward
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    raise ValueError(f"unknown activation {kind!r}")


class MLP(nn.Module):
    """gated: ``down(act(gate(x)) * up(x))`` (Forgather's GLUFeedforwardLayer computes gate, up,
    then ``up * act(gate)``; Hugging Face computes gate, act, up); plain: ``fc2(act(fc1(x)))``.
    fused (Phi3MLP / Glm4MLP): ``gate, up = gate_up_proj(x).chunk(2, -1)``; ``down(up * act(gate))``."""

    def __init__(self, kind: str, act: str, make, d: int, d_ff: int, bias: bool, forgather_order: bool,
                 fused: bool = False) -> None:
        super().__init__()
        self.kind, self.act, self.forgather_order, self.fused = kind, act, forgather_order, fused
        if fused:
            self.gate_up_proj = make("gate_up", d, 2 * d_ff, bias)
            self.down_proj = make("down", d_ff, d, bias)
        elif kind == "gated":
            self.gate_proj = make("gate", d, d_ff, bias)
            self.up_proj = make("up", d, d_ff, bias)
            self.down_proj = make("down", d_ff, d, bias)
        else:
            self.fc1 = make("up", d, d_ff, bias)
            self.fc2 = make("down", d_ff, d, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind != "gated":
            return self.fc2(activation(self.fc1(x), self.act))
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            up = up * activation(gate, self.act)
            del gate
            return self.down_proj(up)
        if self.forgather_order:
            gate = self.gate_proj(x)
            up = self.up_proj(x)
            h = up * activation(gate, self.act)
            del gate, up
        else:
            h = activation(self.gate_proj(x), self.act) * self.up_proj(x)
        return self.down_proj(h)

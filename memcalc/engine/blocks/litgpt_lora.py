"""LitGPT's LoRA on the fused qkv projection: ``LoRAQKVLinear`` (litgpt/lora.py, litgpt 0.5.13).

LitGPT's ``CausalSelfAttention.qkv`` is one ``Linear(d, (H + 2G) * hs)``; ``lora_query`` / ``lora_key`` /
``lora_value`` enable parts of one adapter (``enable_lora``), which memcalc names as the LoRA targets
q, k, v on a fused-qkv model (only LitGPT's profile allows them there: ``KernelProfile.fabric_head``).

Parameters (``LoRAQKVLinear.__init__``): ``lora_A`` (r x n_enabled, d), ``lora_B`` (sum of the enabled
parts' widths, r).

Forward (``LoRAQKVLinear.forward``):

- ``pretrained = self.linear(x)``;
- ``after_A = F.linear(self.lora_dropout(x), self.lora_A)``: (rows, r x n), saved by what follows;
- ``after_B = self.conv1d(after_A.transpose(-2, -1), self.lora_B.unsqueeze(-1))``: with as many query
  groups as heads one grouped ``F.conv1d``; otherwise ``input.chunk(n)``, one ``conv1d`` per part and
  ``torch.cat`` (the parts alive until the cat is made). ``ConvolutionBackward`` saves its input (a view
  of ``after_A``) and the weight;
- ``zero_pad(after_B)`` when not all three parts are enabled: ``x.new_zeros(..., out_features)`` and
  ``index_copy_(dim=-1, index=self.lora_ind, source=x)``, whose backward keeps the source (the
  conv output) and the index (``lora_ind`` clones its buffer) for ``grad.index_select(...)``;
- ``* self.scaling`` (a new tensor, nothing saved) and ``pretrained + lora``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.spec import LoraSpec, ModelSpec
from memcalc.engine.blocks.base import ParamTensor
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext
    from memcalc.engine.records import Param

PARTS = ("q", "k", "v")


def qkv_parts(m: ModelSpec, lora: Optional[LoraSpec]) -> list[int]:
    """The widths of the enabled parts (q: H x hs, k and v: G x hs); empty when none is a target."""
    if lora is None:
        return []
    widths = {"q": m.q_dim, "k": m.kv_dim, "v": m.kv_dim}
    return [widths[p] for p in PARTS if p in lora.targets]


def qkv_adapter_params(prefix: str, m: ModelSpec, layer: int, lora: LoraSpec) -> list[ParamTensor]:
    """``lora_A`` (r x n, d) and ``lora_B`` (sum of the enabled widths, r)."""
    parts = qkv_parts(m, lora)
    return [ParamTensor(f"{prefix}.lora_A", (lora.rank * len(parts), m.d_model), layer, True, "lora"),
            ParamTensor(f"{prefix}.lora_B", (sum(parts), lora.rank), layer, True, "lora")]


def qkv_branch(fwd: ForwardContext, x: T, y: T, a_p: Param, b_p: Param, d_out: int) -> T:
    """``pretrained + zero_pad(conv1d(lora_A(dropout(x)))) * scaling`` on the base output ``y`` (takes
    its reference); returns the sum (see the module docstring)."""
    o, sim, m, lora = fwd.ops, fwd.sim, fwd.m, fwd.lora
    assert lora is not None
    rows = fwd.rows
    parts = qkv_parts(m, lora)
    S = sum(parts)
    xd = o.dropout(x, lora.dropout)
    a = o.linear(xd, rows, a_p, None, lora.rank * len(parts))
    o.drop(xd)
    dt = o.dtype_of(a)
    if m.n_heads != m.kv_heads:  # input.chunk(n), one conv1d per part, torch.cat: the parts, then the cat
        pieces = o.new(rows * S, dt)
        c = o.new(rows * S, dt)
        o.drop(pieces)
    else:
        c = o.new(rows * S, dt)
    sim.node("conv1d", [a], [a], [b_p], [c], flops=2 * rows * lora.rank * S)
    o.drop(a)
    if len(parts) < len(PARTS):  # zero_pad: new_zeros, index_copy_ (keeps its source and index)
        z = o.new(rows * d_out, dt)
        index = sim.alloc(8 * S, "activations", o.category)  # lora_ind.clone(): int64
        sim.node("index_copy", [c, index], [c], [], [z], grad_input_bytes=[dt.nbytes(rows * S)])
        o.drop(c, index)
    else:
        z = c
    s = o.scale(z, lora.alpha / lora.rank + 1e-12)
    o.drop(z)
    out = o.add(y, s)
    o.drop(s, y)
    return out

"""LitGPT 0.5.13's mixture-of-experts block (``MoESpec.implementation`` litgpt, which ``--framework litgpt``
sets: :func:`memcalc.core.rules.framework_model`): ``LLaMAMoE`` (litgpt/model.py), an eager loop over
``n_expert`` ``LLaMAMLP`` modules, not transformers' 3-D experts and grouped matmul (:mod:`.moe`).

Parameters (litgpt/model.py ``LLaMAMoE.__init__``; litgpt/lora.py ``LLaMAMoE.__init__`` under LoRA):
``gate`` ``Linear(d, E)`` and ``experts`` ``ModuleList`` of ``LLaMAMLP(config, moe_intermediate_size)``:
``fc_1``, ``fc_2`` ``Linear(d, f)`` and ``proj`` ``Linear(f, d)`` per expert, each its own tensor. LoRA
(``lora_mlp``, memcalc's gate/up/down targets): ``create_lora_linear`` makes every one of them a
``LoRALinear`` of rank r, the router's ``gate`` too (lora.py ``LLaMAMoE.__init__``: ``create_lora_linear
(config, config.n_embd, config.n_expert, bias=False)``): A (r, in), B (out, r) per expert projection.
QLoRA: every ``nn.Linear`` is 4-bit (``BitsandbytesPrecision._convert_layers``), the router's and
experts' bases included.

Forward (``LLaMAMoE.forward``, litgpt/model.py lines 859-885), with ``N`` tokens, ``k`` experts per token:

- ``residual_x = x.clone()`` (N, d): a local until the return (used only by shared experts);
- ``router = self.gate(x)`` (N, E); ``probs, indices = torch.topk(router, k)`` (TopkBackward saves the
  indices; its backward ``value_selecting_reduction_backward``: zeros (N, E) and the ``scatter`` result);
- ``probs.softmax(dim=1, dtype=torch.float)``: ``_softmax(probs.to(float))`` (ATen ``softmax``: only fp16 on
  CUDA takes ``half_to_float``), saves its fp32 output; ``.to(dtype=x.dtype)`` a copy back;
- ``masks = indices.unsqueeze(-1) == torch.arange(E)``: (N, k, E) bool, permuted (a view);
  ``y = torch.zeros_like(x)`` (N, d);
- per expert ``j`` with ``n_j`` rows (``MoESpec.routing`` balanced, :func:`memcalc.core.rules.balanced_rows`):
  ``token_idx, expert_idx = torch.where(mask)`` (``nonzero``: one (n_j, 2) int64, the two indices its
  views), ``x[token_idx]`` (n_j, d; IndexBackward saves the index), ``expert(...)`` (``LLaMAMLP.forward``:
  fc_1, fc_2, ``F.silu(x_fc_1) * x_fc_2``, proj, each with its LoRA branch),
  ``probs[token_idx, expert_idx, None]`` (n_j, 1), its product with the expert output (n_j, d; MulBackward
  saves both), then ``y[token_idx] += ...``: ``y.index`` (n_j, d), ``add_`` in place, ``index_put_`` in place
  on ``y`` (IndexPutBackward0 saves the index; its backward ``grad.index_put(indices, zeros_like(values))``
  is a new (N, d) beside a zeros (n_j, d), and ``grad.index(indices)`` the values' gradient).

The versions of ``y`` are one storage: the (N, d) bytes are the block's output from ``zeros_like`` on;
the earlier versions are zero-byte aliases, so each ``index_put_`` hands its backward the right gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.dtypes import DType
from memcalc.core.rules import balanced_rows
from memcalc.core.spec import LoraSpec, ModelSpec
from memcalc.engine.blocks.adapters import adapter_params
from memcalc.engine.blocks.base import ParamTensor
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

I64 = DType.int64
F32 = DType.fp32
ACT = "activations"

#: memcalc LoRA targets that switch LitGPT's ``lora_mlp`` on (the experts' and the router's LoRALinear)
MLP_TARGETS = frozenset({"gate", "up", "down", "experts"})


def adapted(lora: Optional[LoraSpec]) -> bool:
    """LitGPT's ``lora_mlp``: every ``create_lora_linear`` of the block has rank r."""
    return lora is not None and bool(MLP_TARGETS & set(lora.targets))


def litgpt_moe_params(m: ModelSpec, i: int, lora: Optional[LoraSpec], out: list[ParamTensor]) -> None:
    """The router ``gate`` (E, d) and per expert ``fc_1``, ``fc_2`` (f, d) and ``proj`` (d, f), each with
    its own LoRA A and B under ``lora_mlp`` (see the module docstring); frozen and 4-bit-able under LoRA."""
    moe = m.moe
    assert moe is not None
    d, e, f = m.d_model, moe.n_experts, moe.d_ff_expert
    full = lora is None
    lora_on = adapted(lora)
    shapes = [("moe.router", d, e, "router")] + [
        (f"moe.experts.{j}.{name}", d_in, d_out, "experts")
        for j in range(e) for name, d_in, d_out in (("fc_1", d, f), ("fc_2", d, f), ("proj", f, d))]
    for name, d_in, d_out, kind in shapes:
        out.append(ParamTensor(f"layers.{i}.{name}.weight", (d_out, d_in), i, full, kind, quantizable=not full))
        if lora_on:
            assert lora is not None
            out.extend(adapter_params(f"layers.{i}.{name}", d_in, d_out, i, lora))


def litgpt_moe_block(fwd: ForwardContext, h: T, i: int) -> T:
    """``LLaMAMoE.forward`` of layer ``i`` on ``h`` (N, d); returns the (N, d) output (a new reference)."""
    o, sim, m = fwd.ops, fwd.sim, fwd.m
    moe = m.moe
    assert moe is not None
    N, E, k, d = fwd.rows, moe.n_experts, moe.top_k, m.d_model
    dt = o.dtype_of(h)
    residual = o.clone(h)  # residual_x = x.clone()
    router = fwd.proj(h, i, "moe.router", "gate", E)  # self.gate(x)
    rdt = o.dtype_of(router)
    probs = o.new(N * k, rdt)
    idx = o.new(N * k, I64)
    # torch.topk: TopkBackward0 saves the indices; value_selecting_reduction_backward: zeros + scatter (N, E)
    sim.node("topk", [idx], [router], [], [probs], temps=[rdt.nbytes(N * E)])
    pf_in = o.cast(probs, F32)  # softmax(dim=1, dtype=float): input.toType(float), then _softmax
    pf = o.new(N * k, F32)
    sim.node("softmax", [pf], [pf_in], [], [pf])
    o.drop(pf_in, probs)
    wts = o.cast(pf, dt)  # .to(dtype=x.dtype)
    o.drop(pf)
    arange = o.new(E, I64)  # torch.arange(n_expert)
    masks = sim.alloc(N * k * E, ACT, o.category)  # indices.unsqueeze(-1) == arange: (N, k, E) bool
    y = o.new(N * d, dt)  # torch.zeros_like(x): the output's storage (module docstring)
    ver = sim.alloc(0, ACT, o.category)  # its version before the first index_put_ (no gradient yet)
    rows = fwd.rows
    for j, n in enumerate(balanced_rows(N * k, E)):
        ver = _expert(fwd, i, j, n, N, h, wts, ver, y if j == E - 1 else None, dt)
    fwd.rows = rows
    o.drop(residual, router, idx, wts, arange, masks)
    return ver


def _expert(fwd: ForwardContext, i: int, j: int, n: int, N: int, x: T, wts: T, y_in: T, y_out: Optional[T],
            dt: DType) -> T:
    """``y[token_idx] += probs[token_idx, expert_idx, None] * expert(x[token_idx])`` for expert ``j`` of
    ``n`` rows; returns ``y``'s next version (``y_out``, the storage, after the last expert)."""
    o, sim, m = fwd.ops, fwd.sim, fwd.m
    assert m.moe is not None
    d, f = m.d_model, m.moe.d_ff_expert
    nz = o.new(2 * n, I64)  # torch.where(mask): nonzero (n, 2); token_idx, expert_idx its views
    xe = o.new(n * d, dt)  # x[token_idx]: IndexBackward0 saves the index; backward zeros (N, d) + index_put_
    sim.node("index", [nz], [x], [], [xe], grad_input_bytes=[x.nbytes])
    fwd.rows = n
    pre = f"moe.experts.{j}"
    g = fwd.proj(xe, i, f"{pre}.fc_1", "gate", f)  # LLaMAMLP.forward: x_fc_1 = self.fc_1(x)
    u = fwd.proj(xe, i, f"{pre}.fc_2", "up", f)  # x_fc_2 = self.fc_2(x)
    a = o.activation(g, "silu")  # F.silu(x_fc_1) * x_fc_2
    o.drop(g)
    hm = o.mul(a, u)
    o.drop(a, u)
    eo = fwd.proj(hm, i, f"{pre}.proj", "down", d)  # self.proj(x)
    o.drop(hm, xe)
    pe = o.new(n, o.dtype_of(wts))  # probs[token_idx, expert_idx, None]: zeros (N, k) + index_put_ backward
    sim.node("index", [nz], [wts], [], [pe], grad_input_bytes=[wts.nbytes])
    v = o.mul(pe, eo)  # saves both
    o.drop(pe, eo)
    t = o.new(n * d, dt)  # y[token_idx]
    sim.node("index", [nz], [y_in], [], [t], grad_input_bytes=[dt.nbytes(N * d)])
    sim.node("add_", [], [t, v], [], [t], grad_input_bytes=[t.nbytes, v.nbytes], passes_grad=True)  # +=
    out = y_out if y_out is not None else sim.alloc(0, ACT, o.category)
    # y.index_put_(token_idx, t): IndexPutBackward0 saves the index; grad.index_put(zeros_like(values))
    sim.node("index_put_", [nz], [y_in, t], [], [out], temps=[t.nbytes],
             grad_input_bytes=[dt.nbytes(N * d), t.nbytes])
    o.drop(v, t, nz, y_in)
    return out


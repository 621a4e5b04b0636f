"""Unsloth's LoRA kernels (``--framework unsloth``): the autograd Functions of unsloth 2026.10.9
``unsloth/kernels/fast_lora.py`` that ``FastLlamaModel.patch_peft_model`` (unsloth/models/llama.py) installs on
every layer whose q, k, v (``apply_lora_qkv`` -> ``LoRA_QKV``), o (``apply_lora_o`` -> ``LoRA_W``) and gate, up,
down (``apply_lora_mlp_swiglu`` -> ``LoRA_MLP``) all carry an adapter without bias or DoRA; with ``lora_dropout``
0 (Unsloth's default) each runs its plain path. Read from source, not traced (:mod:`memcalc.core.unsloth`).

Shared by the three (``kernels/utils.py matmul_lora``): a 4-bit base is dequantised by ``fast_dequantize(W,
W_quant, use_global_buffer=True)`` into ``WEIGHT_BUFFERS[device]`` (and its absmax into ``ABSMAX_BUFFERS``): module
globals grown with ``resize_`` to the largest weight and never freed (:func:`global_dequant`); a 16-bit base is
used as it is. The adapter weights (fp32) are cast to the input's dtype on each call (``A.to(dtype)``,
``B.to(dtype)``) and ``XA = X @ A`` (rows x rank) is added into the base output in place (``addmm_(out, XA, B,
alpha=s)``): no fp32 copy of X, no separate LoRA output. Each Function saves X and its adapters only (``LoRA_MLP``
also ``e`` and ``g``, the gate and up outputs).

Backward: the adapters are cast again (rank-sized), the rank-sized products (``dY @ B.t()``, ``A.t() @ X.t()``)
come and go; each base weight is dequantised afresh (``fast_dequantize(W.t(), W_quant)``, default
``use_global_buffer=False``: a weight-sized temporary, one at a time); ``LoRA_QKV`` and ``LoRA_MLP`` write dX into
X's own storage (``torch.matmul(..., out=X if ctx.inplace)``, ``inplace=True`` by default): X becomes its
gradient, no new bytes; ``LoRA_W`` allocates dX. ``LoRA_MLP``: ``DW = matmul_lora(dY, downW.t(), ...)`` (rows x
d_ff, the down projection dequantised into the global buffer), then ``swiglu_DWf_DW_dfg_kernel(DW, e, g)`` writes
h, df and de into DW, e and g in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.dtypes import DType
from memcalc.engine.sim import Node, Param, Sim, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

TMP = "temporaries"
FP32 = DType.fp32


def fused_groups(fwd: ForwardContext) -> frozenset[str]:
    """Which of Unsloth's fused Functions run: ``qkv``, ``o``, ``mlp`` (patch_peft_model: every projection of
    the group adapted, no bias, no DoRA; the plain path: ``lora_dropout`` 0). Empty without LoRA or outside
    ``--framework unsloth``."""
    lora, m = fwd.lora, fwd.m
    if fwd.exp.profile.framework != "unsloth" or lora is None or lora.dora or lora.dropout > 0 or fwd.tp:
        return frozenset()
    t = set(lora.targets)
    groups = set()
    if {"q", "k", "v"} <= t and not m.qkv_bias and not m.fused_qkv:
        groups.add("qkv")
    if "o" in t and not m.o_bias:
        groups.add("o")
    if {"gate", "up", "down"} <= t and m.mlp == "gated" and not m.fused_gate_up and not m.mlp_bias:
        groups.add("mlp")
    return frozenset(groups)


def global_dequant(fwd: ForwardContext) -> None:
    """``fast_dequantize(..., use_global_buffer=True)`` (kernels/utils.py): on the first 4-bit ``matmul_lora``
    the device's ``WEIGHT_BUFFER`` (compute dtype) and ``ABSMAX_BUFFER`` (fp32, one per quantisation block) are
    created, then ``resize_``-d to the largest weight: allocated once per step at that size, held for good."""
    model = fwd.model
    if "unsloth dequant buffer" in model.buffers:
        return
    lora = fwd.lora
    assert lora is not None
    largest = max((p.numel for p in model.params.values() if p.weight.itemsize_bits == 4), default=0)
    model.buffers["unsloth dequant buffer"] = [
        fwd.sim.alloc(model.compute.nbytes(largest), "temporaries", "unsloth dequant buffers"),
        fwd.sim.alloc(4 * -(-largest // lora.quant_block), "temporaries", "unsloth dequant buffers")]


def _base(fwd: ForwardContext, name: str) -> tuple[Param, Param, Param, int]:
    """A projection's base weight, its adapters and the bytes of its fresh backward dequantisation (0: 16-bit)."""
    w, a, b = fwd.p(name + ".weight"), fwd.p(name + ".lora_A"), fwd.p(name + ".lora_B")
    deq = 0
    if w.weight.itemsize_bits == 4:
        global_dequant(fwd)
        lora = fwd.lora
        assert lora is not None
        deq = fwd.model.compute.nbytes(w.numel) + 4 * -(-w.numel // lora.quant_block)  # weight + out_absmax
    return w, a, b, deq


def _matmul_lora(fwd: ForwardContext, x: T, a: Param, b: Param, d_out: int) -> T:
    """``matmul_lora`` on ``x``: the base output (the dequantisation in the global buffer), the adapters cast to
    x's dtype and ``XA`` (rows x rank) alive while ``addmm_`` adds the branch in place."""
    o = fwd.ops
    dt = o.dtype_of(x)
    y = o.new(fwd.rows * d_out, dt)
    lora = fwd.lora
    assert lora is not None
    cast = a.weight.itemsize_bits != dt.bits
    a_cast = o.new(a.numel, dt, kind=TMP) if cast else None  # XA = torch_matmul(X, A.to(dtype))
    xa = o.new(fwd.rows * lora.rank, dt, kind=TMP)
    o.drop(a_cast)
    b_cast = o.new(b.numel, dt, kind=TMP) if cast else None  # addmm_(out, XA, B.to(dtype), alpha=s)
    o.drop(xa, b_cast)
    return y


def _bwd_casts(fwd: ForwardContext, x: T, adapters: list[Param]) -> list[int]:
    """Each adapter cast to the input's dtype at the start of a backward (``gateA.to(dtype)``, ...) and the
    Function's gradient of it (``d_gateA = torch.empty_like(gateA)``, in that dtype), both alive to its return."""
    dt = fwd.ops.dtype_of(x)
    return [dt.nbytes(p.numel) for p in adapters for _twice in (0, 1)]


def _rank_rows(fwd: ForwardContext, x: T) -> int:
    """One rows x rank product in the input's dtype (``dY @ B.t()``, or ``A.t() @ X.t()`` its transpose)."""
    lora = fwd.lora
    assert lora is not None
    return fwd.ops.dtype_of(x).nbytes(fwd.rows * lora.rank)


def _backward(x: T, held: list[int], peak: int, dx_bytes: int = 0, deq: int = 0):
    """A node hook running the Function's backward in its order before the node's own bookkeeping: ``held``
    (alive to the return), a ``peak`` temporary beside them (freed), a 4-bit base's fresh dequantisation ``deq``
    beside a new ``dx_bytes`` dX (``LoRA_W``) or, with ``dx_bytes`` 0, dX written into X (``out=X``): X's storage
    becomes its gradient. Then everything but dX goes; the node itself only adds the adapters' gradients (the
    Function returns them in the input's dtype, counted in ``held``; autograd casts each to the fp32 adapter's
    dtype as it leaves: the fp32 gradients the simulator gives the parameters)."""
    def hook(s: Sim, n: Node) -> None:
        ts = [s.alloc(b, TMP, "backward workspace") for b in held if b]
        if peak:
            s.transient(peak, TMP, "backward workspace")
        dq = s.alloc(deq, TMP, "dequantised weight") if deq else None
        if dx_bytes:
            dx = s.alloc(dx_bytes, TMP, "activation gradients")
            if x.grad_buffer is None:
                x.grad_buffer = dx
            else:  # InputBuffer accumulates in place
                s.unref(dx)
        elif x.grad_buffer is None and x.alive:
            x.grad_buffer = s.ref(x)
        s.unref(dq)
        for t in ts:
            s.unref(t)
    return hook


def qkv(fwd: ForwardContext, x: T, i: int, widths: tuple[int, int, int]) -> tuple[T, T, T]:
    """``LoRA_QKV.apply(X, ...)``: Q, K, V (new references); saves X (the adapters are parameters)."""
    parts = [_base(fwd, f"layers.{i}.attn.{n}_proj") for n in "qkv"]
    outs = tuple(_matmul_lora(fwd, x, a, b, d) for (_w, a, b, _q), d in zip(parts, widths, strict=True))
    params = [p for w, a, b, _q in parts for p in (w, a, b)]
    node = fwd.sim.node("unsloth_lora_qkv", [x], [x], params, list(outs), grad_input_bytes=[0],
                        flops=2 * fwd.rows * sum(w.numel for w, *_r in parts))
    if node is not None:
        # the casts and d_*, q_dB / k_dB / v_dB (alive to the return); one A.t() @ X.t() at a time, then, a 4-bit
        # base, one fresh dequantisation at a time while dX goes into X (torch.matmul(dQ, QW.t(), out=X))
        rr = _rank_rows(fwd, x)
        held = [*_bwd_casts(fwd, x, [p for _w, a, b, _q in parts for p in (a, b)]), rr, rr, rr]
        node.on_backward = _backward(x, held, max(rr, *(q for *_r, q in parts)))
    return outs  # type: ignore[return-value]


def o_proj(fwd: ForwardContext, x: T, i: int, d_out: int) -> T:
    """``LoRA_W.apply(X, OW, ...)`` for the attention output projection; saves X; backward allocates dX."""
    w, a, b, deq = _base(fwd, f"layers.{i}.attn.o_proj")
    y = _matmul_lora(fwd, x, a, b, d_out)
    node = fwd.sim.node("unsloth_lora_w", [x], [x], [w, a, b], [y], grad_input_bytes=[0],
                        flops=2 * fwd.rows * w.numel)
    if node is not None:
        # the casts and d_A, d_B, y_dB = dY @ B.t() (alive to the return); A.t() @ X.t(); then the base dequantised
        # afresh (4-bit) beside dX = dY @ W.t(), into which addmm_ adds the adapter's term
        rr = _rank_rows(fwd, x)
        node.on_backward = _backward(x, [*_bwd_casts(fwd, x, [a, b]), rr], rr, x.nbytes, deq)
    return y


def mlp(fwd: ForwardContext, x: T, i: int) -> T:
    """``LoRA_MLP.apply(X, gate..., up..., down..., swiglu_fg_kernel, swiglu_DWf_DW_dfg_kernel)``: ``e`` and
    ``g`` (rows x d_ff), ``h = swiglu_fg_kernel(e, g)`` (``torch.empty``, freed at the return), the down
    projection's output; saves X, e, g."""
    o, m = fwd.ops, fwd.m
    parts = [_base(fwd, f"layers.{i}.mlp.{n}_proj") for n in ("gate", "up", "down")]
    (gw, ga, gb, gq), (uw, ua, ub, uq), (dw, da, db, _dq) = parts
    e = _matmul_lora(fwd, x, ga, gb, m.d_ff)
    g = _matmul_lora(fwd, x, ua, ub, m.d_ff)
    h = o.new(e.numel, o.dtype_of(e))
    y = _matmul_lora(fwd, h, da, db, m.d_model)
    o.drop(h)
    node = fwd.sim.node("unsloth_lora_mlp", [x, e, g], [x], [gw, ga, gb, uw, ua, ub, dw, da, db], [y],
                        grad_input_bytes=[0], flops=2 * fwd.rows * (gw.numel + uw.numel + dw.numel))
    if node is not None:
        # the casts and d_*, DW = matmul_lora(dY, downW.t(), ...) (rows x d_ff: h after swiglu_DWf_DW_dfg_kernel,
        # down dequantised into the global buffer), up_dB and gate_dB (alive to the return); one A.t() @ h.t() /
        # X.t() at a time, then one fresh dequantisation (up, then gate) while dX goes into X
        rr = _rank_rows(fwd, x)
        held = [*_bwd_casts(fwd, x, [ga, gb, ua, ub, da, db]), o.dtype_of(x).nbytes(e.numel), rr, rr]
        node.on_backward = _backward(x, held, max(rr, gq, uq))
    o.drop(e, g)
    return y


def mlp_or_none(fwd: ForwardContext, x: T, i: int) -> Optional[T]:
    """Layer ``i``'s MLP as ``LoRA_MLP`` when Unsloth patches it, else None (the caller's own rules)."""
    return mlp(fwd, x, i) if "mlp" in fwd.unsloth_lora else None


def qkv_or_none(fwd: ForwardContext, x: T, i: int) -> Optional[tuple[T, T, T]]:
    """Layer ``i``'s q, k, v as ``LoRA_QKV`` when Unsloth patches them, else None."""
    return qkv(fwd, x, i, (fwd.m.q_dim, fwd.m.kv_dim, fwd.m.kv_dim)) if "qkv" in fwd.unsloth_lora else None


def o_or_none(fwd: ForwardContext, x: T, i: int) -> Optional[T]:
    """Layer ``i``'s attention output projection as ``LoRA_W`` when Unsloth patches it, else None."""
    return o_proj(fwd, x, i, fwd.m.d_model) if "o" in fwd.unsloth_lora else None

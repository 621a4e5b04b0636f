"""DoRA (weight-decomposed LoRA) on one projection, as PEFT 0.21 runs it in training.

Follows peft/tuners/lora/variants.py ``DoraLinearVariant.forward`` and peft/tuners/lora/dora.py
``DoraLinearLayer.forward`` / ``get_lora_weight`` / ``get_weight_norm`` (``use_dora=True``):

- ``lora_weight = lora_B(lora_A(eye(in))).T``: an ``in x in`` identity in the adapter dtype, the
  ``in x r`` A output and the ``in x out`` product, all alive until the layer's DoRA forward returns
  (``lora_A`` saves the identity for its weight's gradient; the graph dies with the local, unused);
- ``weight = dequantize_module_weight(base).to(x.dtype)``: a copy of W when its dtype differs from
  the adapter input (fp32 adapters over a 16-bit base), alive until the return; a 4-bit base is
  first dequantised (another transient);
- ``get_weight_norm``: ``weight + scaling * lora_weight`` (two ``out x in`` temporaries) and its row
  norm (``out``); with ``lora_weight.detach()`` and a frozen W nothing of it is saved, and
  ``weight_norm.detach()`` makes ``mag_norm_scale = magnitude / weight_norm`` the only way back
  (to the trainable magnitude vector, ``out`` elements);
- ``lora_result = lora_B(lora_A(x))`` (the adapter branch, as LoRA's);
- ``(mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling``: the two products
  save ``base_result`` (the base output, which plain LoRA frees after its add) and ``lora_result``
  (``rows x out`` in the adapter dtype) for the magnitude's gradient; each product is ``rows x out``
  in the promoted dtype; their backward reduces a ``rows x out`` product to ``out``;
- with dropout (``lora_dropout > 0``) PEFT recomputes the base output on the dropped input:
  ``F.linear(dropout(x), weight)``, which saves the W copy for the input's gradient.

Ignored: the ``out``-sized vectors' exact lifetimes (they are a row of the weight), the
``linalg.vector_norm`` kernel's workspace.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.dtypes import DType
from memcalc.engine.sim import Param, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext


def _promote(a: DType, b: DType) -> DType:
    return a if a.bits >= b.bits else b


def dora_branch(fwd: ForwardContext, xa: T, y: T, w: Param, a_p: Param, b_p: Param, mag: Param, d_out: int,
                quant_bytes: int) -> T:
    """The DoRA term added to the base output ``y`` for the adapter input ``xa`` (already cast as
    the framework casts it); returns ``result_dora`` (a new reference). ``quant_bytes``: the
    dequantised 4-bit base's bytes (0 when not quantised)."""
    o, sim, lora = fwd.ops, fwd.sim, fwd.lora
    rows, r = fwd.rows, lora.rank
    d_in = w.numel // d_out
    adt = o.dtype_of(a_p.weight)
    xdt = o.dtype_of(xa)
    scaling = lora.alpha / lora.rank
    # get_lora_weight: lora_B(lora_A(eye)).T, alive (eye saved by lora_A's node) until the return
    eye = o.new(d_in * d_in, adt, "DoRA temporaries", kind="temporaries")
    t1 = o.new(d_in * r, adt, "DoRA temporaries", kind="temporaries")
    lw = o.new(d_in * d_out, adt, "DoRA temporaries", kind="temporaries")
    # weight = dequantize_module_weight(base_layer).to(x.dtype)
    wdt = DType.bf16 if quant_bytes else o.dtype_of(w.weight)
    deq = sim.alloc(quant_bytes, "temporaries", "dequantised weight") if quant_bytes else None
    wc = o.new(d_out * d_in, xdt, "DoRA temporaries", kind="temporaries") if (quant_bytes or wdt.bits != xdt.bits) else None
    sim.unref(deq)
    # get_weight_norm: weight + scaling * lora_weight, its row norm
    s1 = o.new(d_out * d_in, _promote(xdt, adt), "DoRA temporaries", kind="temporaries")
    s2 = o.new(d_out * d_in, _promote(xdt, adt), "DoRA temporaries", kind="temporaries")
    o.drop(s1)
    wn = o.new(d_out, DType.fp32)
    o.drop(s2)
    # mag_norm_scale = magnitude / weight_norm.detach(): the magnitude's only way back
    mdt = o.dtype_of(mag.weight)
    mns = o.new(d_out, mdt)
    sim.node("div", [wn], [], [mag], [mns])
    o.drop(wn)
    # base_result: the base output, or with dropout the base recomputed on the dropped input
    base_res = o.ref_(y)
    xd = o.dropout(xa, lora.dropout)
    if lora.dropout > 0:
        o.drop(base_res)
        base_res = o.new(rows * d_out, xdt)
        saved = [wc] if (wc is not None and xd.requires_grad) else []
        sim.node("linear", saved, [xd], [], [base_res], flops=2 * rows * d_in * d_out)
    a = o.linear(xd, rows, a_p, None, r)
    o.drop(xd)
    lr = o.linear(a, rows, b_p, None, d_out)
    o.drop(a)
    # (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling
    m1 = o.new(d_out, mdt)
    sim.node("sub_scalar", [], [mns], [], [m1])
    pdt = _promote(mdt, o.dtype_of(base_res))
    p1 = o.new(rows * d_out, pdt)
    sim.node("mul", ([base_res] if m1.requires_grad else []) + ([m1] if base_res.requires_grad else []),
             [m1, base_res], [], [p1], temps=[pdt.nbytes(rows * d_out)], grad_input_bytes=[m1.nbytes, base_res.nbytes])
    o.drop(m1, base_res)
    qdt = _promote(mdt, o.dtype_of(lr))
    p2 = o.new(rows * d_out, qdt)
    sim.node("mul", [lr, mns], [mns, lr], [], [p2], temps=[qdt.nbytes(rows * d_out)], grad_input_bytes=[mns.nbytes, lr.nbytes])
    o.drop(lr, mns)
    p3 = o.scale(p2, scaling + 1e-12)
    o.drop(p2)
    rd = o.add(p1, p3)
    o.drop(p1, p3)
    # the locals die as DoraLinearLayer.forward returns
    o.drop(eye, t1, lw, wc)
    return rd

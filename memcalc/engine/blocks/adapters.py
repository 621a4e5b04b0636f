"""A projection with its adapter: the base linear (a frozen 4-bit base under QLoRA) plus LoRA's
``B(A(dropout(x))) * scaling`` (:func:`proj`), or DoRA's term (:func:`dora_branch`); their
parameters (:func:`projection_params`, :func:`adapter_params`).

DoRA (weight-decomposed LoRA) on one projection, as PEFT 0.21 runs it in training.

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

from typing import TYPE_CHECKING, Optional

from memcalc.core.dtypes import DType
from memcalc.engine.blocks.quant_linear import quant_linear
from memcalc.core.rules import torchao_nf4_dequant_peak_bytes
from memcalc.core.spec import LoraSpec, ModelSpec
from memcalc.engine.blocks import litgpt_lora
from memcalc.engine.blocks.base import Linear, ParamTensor
from memcalc.engine.ops import Ops
from memcalc.engine.sim import Param, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext


def adapter_params(prefix: str, d_in: int, d_out: int, layer: Optional[int], lora: LoraSpec) -> list[ParamTensor]:
    """The LoRA adapter of the projection ``prefix`` (A: r x in, B: out x r) and, with DoRA, PEFT
    DoraLinearLayer.weight: the magnitude vector, one per output row."""
    out = [ParamTensor(f"{prefix}.lora_A", (lora.rank, d_in), layer, True, "lora"),
           ParamTensor(f"{prefix}.lora_B", (d_out, lora.rank), layer, True, "lora")]
    if lora.dora:
        out.append(ParamTensor(f"{prefix}.lora_magnitude", (d_out,), layer, True, "lora"))
    return out


def projection_params(m: ModelSpec, i: int, lora: Optional[LoraSpec], out: list[ParamTensor]) -> Linear:
    """The rule that adds one of layer ``i``'s projections to ``out``: its weight (frozen and
    quantizable under LoRA), its bias, and its adapter when ``lora`` targets it."""
    full = lora is None
    # PEFT 0.21 on transformers 5 moves the gate/up/down targets of some MoE model types onto the routed
    # experts (peft/utils/transformers_weight_conversion.py _convert_peft_config_moe): no MLP Linear is adapted
    to_experts = m.moe is not None and m.moe.lora_mlp_to_experts

    def linear(short: str, name: str, d_in: int, d_out: int, bias: bool) -> None:
        out.append(ParamTensor(f"layers.{i}.{name}.weight", (d_out, d_in), i, full, "linear", quantizable=not full))
        if bias:
            out.append(ParamTensor(f"layers.{i}.{name}.bias", (d_out,), i, full, "bias"))
        if to_experts and short in ("gate", "up", "down"):
            return
        if short == "qkv" and litgpt_lora.qkv_parts(m, lora):  # LitGPT's LoRAQKVLinear (blocks/litgpt_lora.py)
            assert lora is not None
            out.extend(litgpt_lora.qkv_adapter_params(f"layers.{i}.{name}", m, i, lora))
        elif lora is not None and short in lora.targets:
            out.extend(adapter_params(f"layers.{i}.{name}", d_in, d_out, i, lora))
    return linear


def proj(fwd: ForwardContext, x: T, layer: Optional[int], name: str, short: str, d_out: int,
         base: Optional[str] = None, weight: Optional[str] = None) -> T:
    """A projection, with its LoRA adapter when targeted: y = base(x) + B(A(drop(x))) * s.

    With the profile's ``lora_input_cast`` (PEFT ``lora.Linear.forward``, peft/tuners/lora/layer.py):
    ``x = x.to(lora_A.weight.dtype)`` (``_cast_input_dtype``: a copy when the adapters are fp32 over
    16-bit activations, made per target, so q, k and v each cast the same input), then
    ``result = result + lora_B(lora_A(dropout(x))) * scaling`` (16-bit + fp32 promotes to an
    fp32 sum) and ``result.to(torch_result_dtype)`` (a copy back). lora_A saves its input: the
    cast copy, or with dropout the dropout output (the copy then dies; dropout keeps its mask).
    Without it (plain, torchtune, litgpt) the branch runs on x as is. A 4-bit base under PEFT
    runs ``bnb.Linear4bit.forward`` instead (see below)."""
    o = fwd.ops
    key = (layer, name, base, weight)
    got = fwd.projs.get(key)
    if got is None:  # the projection's parameters, looked up once per step (a layer is walked 1-3 times)
        base = base or f"layers.{layer}.{name}"  # the output head: "lm_head" (its weight may be the embedding's)
        got = fwd.projs[key] = (base, fwd.p(weight or base + ".weight"), fwd.maybe(base + ".bias"),
                                fwd.maybe(base + ".lora_A"))
    base, w, bias, a_p = got
    qt = 0
    lora = fwd.lora
    if lora is not None and lora.qlora and w.weight.itemsize_bits == 4:
        qt = fwd.model.compute.nbytes(w.numel)
        if fwd.exp.profile.framework == "torchtune":  # its NF4 weights are torchao's: LinearNF4
            qp = torchao_nf4_dequant_peak_bytes(w.numel, fwd.model.compute.bits // 8)
            y = o.linear(x, fwd.rows, w, bias, d_out, quant_transient_bytes=qt, quant_peak_bytes=qp)
        else:
            y = _linear_4bit(fwd, x, w, bias, d_out, qt)
    elif lora is not None and lora.quant is not None and w.weight.itemsize_bits == 4:  # GPTQ / AWQ base
        y = quant_linear(fwd, x, w, bias, d_out, lora.quant)
    else:
        y = o.linear(x, fwd.rows, w, bias, d_out)
    if fwd.tp and short not in ("o", "down"):
        fwd.tp.colwise(fwd, y, x)
    if a_p is None:
        return y
    assert lora is not None
    if short == "qkv" and litgpt_lora.qkv_parts(fwd.m, lora):  # LitGPT's LoRAQKVLinear
        return litgpt_lora.qkv_branch(fwd, x, y, a_p, fwd.p(base + ".lora_B"), d_out)
    peft = fwd.exp.profile.lora_input_cast
    # PEFT's bnb Linear4bit.forward (peft/tuners/lora/bnb.py) differs for a 4-bit base: the
    # base output is cloned (``result.clone()``), and the casts happen only outside autocast
    # (``requires_conversion = not torch.is_autocast_enabled()``), the branch's output being
    # cast back to the result's dtype before the add
    quant = peft and qt > 0
    if quant:
        y2 = o.clone(y)
        o.drop(y)
        y = y2
    # without the cast rule, fp32 adapters over 16-bit activations still need one (outside
    # autocast a mixed-dtype matmul is an error)
    cast = (peft and not (quant and o.autocast is not None)) or (
        o.autocast is None and x.itemsize_bits != a_p.weight.itemsize_bits)
    xa = o.cast(x, o.dtype_of(a_p.weight)) if cast else o.ref_(x)
    if lora.dora:  # PEFT DoraLinearVariant (dora_branch below)
        bs = dora_branch(fwd, xa, y, w, a_p, fwd.p(base + ".lora_B"), fwd.p(base + ".lora_magnitude"), d_out, qt)
        o.drop(xa)
        return _lora_out(o, y, bs, cast, quant)
    xd = o.dropout(xa, lora.dropout)
    o.drop(xa)
    a = o.linear(xd, fwd.rows, a_p, None, lora.rank)
    o.drop(xd)
    b = o.linear(a, fwd.rows, fwd.p(base + ".lora_B"), None, d_out)
    o.drop(a)
    bs = o.scale(b, lora.alpha / lora.rank + 1e-12)
    o.drop(b)
    return _lora_out(o, y, bs, cast, quant)


def _linear_4bit(fwd: ForwardContext, x: T, w: Param, bias: Optional[Param], d_out: int, deq_bytes: int) -> T:
    """bitsandbytes 0.50 ``Linear4bit.forward`` (bitsandbytes/nn/modules.py): ``x =
    x.to(compute_dtype)`` (a copy when x is not in it: an fp32 residual stream after PEFT's
    ``prepare_model_for_kbit_training``; under autocast the same copy), ``matmul_4bit`` (the
    dequantised weight, :meth:`Ops.linear`), ``.to(inp_dtype)`` (a copy back when the dtypes
    differ). With double quantisation ``gemm_4bit`` first dequantises the uint8 absmax into two
    fp32 buffers of one element per block (backends/cuda/ops.py ``_dequant_linear_fallback``).
    ``LoraSpec.bnb_saves_input``: bitsandbytes < 0.43.2 keeps the (cast) input on the ``ctx`` for
    backward (alive as long as the graph: ``Ops.linear`` ``quant_retain``; a checkpointed region's first
    forward too, since non-reentrant checkpointing's saved-tensor hooks never see ``ctx.tensors``
    (torch/utils/checkpoint.py ``_checkpoint_hook`` packs only what ``save_for_backward`` saves; a reentrant
    checkpoint's first forward runs under ``torch.no_grad()`` and builds no graph); its recompute's graph is
    dropped once the recompute returns, so there it is saved as usual), and 0.41/0.42's
    dequantisation
    (:func:`bnb_legacy_dequant_peak_bytes`)."""
    o, lora = fwd.ops, fwd.lora
    assert lora is not None
    cast = o.autocast is None and x.itemsize_bits != fwd.model.compute.bits
    xc = o.cast(x, fwd.model.compute) if cast else x
    absmax = 4 * -(-w.numel // lora.quant_block) if lora.double_quant else 0
    peak = 0
    if lora.bnb_saves_input:  # 0.41/0.42: the weight dequantised in its quant_state dtype, then cast
        absmax, peak = 0, bnb_legacy_dequant_peak_bytes(w.numel, fwd.model.compute, lora)
    y = o.linear(xc, fwd.rows, w, bias, d_out, quant_transient_bytes=deq_bytes, quant_absmax_bytes=absmax,
                 quant_peak_bytes=peak, quant_saves_input=lora.bnb_saves_input,
                 quant_retain=lora.bnb_saves_input and fwd.sim.ghosts is None
                 and (fwd.sim.grad_enabled or not fwd.tr.checkpoint_reentrant))
    if cast:
        o.drop(xc)
    if y.itemsize_bits == x.itemsize_bits:
        return y
    back = o.cast(y, o.dtype_of(x))
    o.drop(y)
    return back


def bnb_legacy_dequant_peak_bytes(numel: int, compute: DType, lora: LoraSpec) -> int:
    """bitsandbytes 0.41/0.42 ``MatMul4Bit`` (autograd/_functions.py): forward
    ``F.dequantize_4bit(B, quant_state).to(A.dtype)``, backward ``F.dequantize_4bit(B, ctx.state)
    .to(grad_output.dtype)``. ``dequantize_4bit`` (functional.py) makes the weight in
    ``quant_state.dtype``, which is fp16: ``Params4bit.cuda`` quantizes ``self.data.contiguous().half()``
    (nn/modules.py) and Lightning's ``_Linear4bit.quantize`` ``weight.to(device, torch.half)``
    (lightning/fabric/plugins/precision/bitsandbytes.py, every version); with double quantisation
    it first dequantises the absmax to fp32 (one per block, freed on return). ``.to`` then copies
    the fp16 weight into a bf16 compute dtype while it is alive: the peak of the two is
    the compute-dtype copy + the fp16 weight; in fp16 no copy, the fp32 absmax beside the weight."""
    if compute != DType.fp16:
        return compute.nbytes(numel) + 2 * numel
    return 2 * numel + (4 * -(-numel // lora.quant_block) if lora.double_quant else 0)


def _lora_out(o: Ops, y: T, bs: T, cast: bool, quant: bool) -> T:
    """``result + branch`` and the cast back to the result's dtype (lora.Linear.forward)."""
    if quant and cast:  # output.to(expected_dtype) before result + output
        b2 = o.cast(bs, o.dtype_of(y))
        o.drop(bs)
        bs = b2
    out = o.add(y, bs)
    o.drop(bs)
    if cast and out.itemsize_bits != y.itemsize_bits:  # lora.Linear: result.to(torch_result_dtype)
        back = o.cast(out, o.dtype_of(y))
        o.drop(out)
        out = back
    o.drop(y)
    return out


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

"""LitGPT's head and loss as its finetune scripts run them under Lightning Fabric (profile rule
``fabric_head``; LitGPT 0.5.13, lightning 2.6).

What runs (each step below is one rule here; the validator's ``validate/trainers/litgpt.py`` runs the
code itself):

- **the head**: litgpt/model.py ``GPT.forward``: with ``lm_head_chunk_size > 0`` the head runs on
  ``x.split(lm_head_chunk_size, dim=1)`` and returns the list of (B, c, V) chunks; litgpt/finetune/lora.py
  ``fit`` passes ``lm_head_chunk_size=128`` (:data:`~memcalc.core.rules.LITGPT_LM_HEAD_CHUNK`),
  litgpt/finetune/full.py ``fit`` passes nothing (one (B, T, V) tensor). So the head is chunked under
  LoRA and whole under full fine-tuning. The split of ``x`` is views; each chunk's input gradient
  waits in the split node's buffer until ``split_backward`` cats them.
- **Fabric's output conversion**: lightning/fabric/wrappers.py ``_FabricModule.forward`` returns
  ``precision.convert_output(output)``; ``HalfPrecision`` and ``MixedPrecision`` (plugins/precision/
  half.py, amp.py) cast every floating output to ``torch.get_default_dtype()`` (fp32) with
  ``_convert_fp_tensor`` (``tensor.to(fp32)``, plugins/precision/utils.py): an fp32 copy of every
  16-bit chunk, made after the whole list exists (``apply_to_collection`` builds the new list while
  the old one is still bound), whose backward casts the gradient back (``ToCopyBackward``, nothing
  saved). fp32 logits (``32-true``) are returned as they are. The 16-bit chunks go once the
  converted list is returned (the head's ``Linear`` does not save its output).
- **the output outlives the step**: ``logits`` is ``fit``'s local variable, rebound only when the
  next micro-step's ``model(...)`` has returned. So the previous micro-step's fp32 logits are alive
  through this micro-step's forward until the new ones exist, and this step's stay through backward
  and the optimizer step. Here the previous output is carried from one micro-step to the next; in
  the first micro-step of a step a stand-in of the same sizes (the previous step's) is allocated as
  the head starts and freed with the previous output (the steady state: a first training step has
  none, so the first-step peak is over-counted by it), except in the run's first micro-step when
  ``TrainingSpec.first_seq`` says it runs apart (``Forward.run_start``): ``fit`` has bound no
  ``logits`` before its first forward (finetune/lora.py; the sanity ``validate`` before it runs under
  ``torch.inference_mode``, no graph).
- **the shift**: LoRA: ``logits[-1] = logits[-1][..., :-1, :]`` (a view); full:
  ``logits[..., :-1, :]`` (a view). ``SliceBackward`` allocates the unsliced gradient.
- **the loss**: litgpt/utils.py ``chunked_cross_entropy(logits, targets, chunk_size=128)``. A list:
  each chunk ``.reshape(-1, V)`` (a copy of the sliced last chunk when B > 1, a view otherwise), one
  ``cross_entropy(reduction="none")`` per chunk. A tensor: ``logits.reshape(-1, V)`` (a copy of the
  sliced logits when B > 1) ``.split(128)`` (row views), one ``cross_entropy(reduction="none")`` per
  128 rows. Each ``cross_entropy`` is ``log_softmax`` (saves its fp32 output) and ``nll_loss`` (saves
  its 0-dim ``total_weight``); then ``torch.cat(loss_chunks).sum() / non_masked_elems``. The copies
  go when the loss returns. Backward per chunk: ``nll_loss_backward`` a zero (rows, V) gradient,
  ``_log_softmax_backward_data`` another; ``CatBackward`` and ``SumBackward`` hand on views.

**One shape for every batch and length** (``memcalc.plan.fits`` fits the step's allocations in B and T,
so their number must not depend on them): the chunks are simulated as two groups, all but the last
chunk as one and the last chunk on its own, with the same peaks as chunk by chunk. The group's
backward runs as its chunks do: each chunk's saved log-probabilities go as its gradient arrives (the
level stays, plus two chunk-sized gradients at a time), and each head chunk's fp32 gradient goes as its
16-bit cast is made (plus one 16-bit chunk at a time). The head's input gradients of the group come at
once (over by at most the group's (rows, d) input gradient while it is made, a (rows, d) not (rows, V)
size). A copy that B = 1 does not make is a zero-byte allocation there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional
from weakref import WeakKeyDictionary

from memcalc.core.dtypes import DType
from memcalc.core.rules import LITGPT_LM_HEAD_CHUNK
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext
    from memcalc.engine.records import Node, Param
    from memcalc.engine.sim import Sim

CATEGORY = "logits & loss"
#: what the previous micro-step's graph keeps: its 4-bit linears' inputs (bitsandbytes < 0.43.2 ``ctx.tensors``)
RETAINED = "previous step's 4-bit linear inputs"
#: per step (its Sim): the previous micro-step's converted output, which ``fit`` still holds
_HELD: WeakKeyDictionary[Sim, list[T]] = WeakKeyDictionary()
_F32 = DType.fp32
_CH = LITGPT_LM_HEAD_CHUNK


def groups(n: int) -> tuple[int, int]:
    """``n`` positions (or rows) split by 128 as (all but the last chunk, the last chunk)."""
    rest = _CH * ((n - 1) // _CH) if n > 0 else 0
    return rest, n - rest


def head_and_loss(fwd: ForwardContext, x: T) -> T:
    """The head on the final norm's output ``x`` (takes the reference), Fabric's conversion and
    LitGPT's chunked loss; returns the scalar loss (see the module docstring)."""
    sim, o = fwd.sim, fwd.ops
    chunked = fwd.lora is not None  # lora.py fit: lm_head_chunk_size=128; full.py: none
    sizes = list(groups(fwd.T)) if chunked else [fwd.T]
    prev = _HELD.pop(sim, None)
    if prev is None and fwd.run_start:  # the run's first micro-step: fit() has bound no `logits` yet
        prev = []
    if prev is None:  # the previous step's output (the steady state)
        V = fwd.m.vocab_size
        prev = [sim.alloc(_F32.nbytes(fwd.B * c * V), "activations", CATEGORY) for c in sizes]
        kept = _retained_bytes(fwd, x)
        if kept:  # and the 4-bit linears' inputs its graph still holds (bitsandbytes < 0.43.2)
            prev.append(sim.alloc(kept, "activations", RETAINED))
    outs = _head(fwd, x, sizes)
    for t in prev:  # fit(): `logits = model(...)` rebinds the name once the new output exists
        sim.unref(t)
    sim.set_role("loss")
    o.category = CATEGORY
    loss = _loss(fwd, outs, sizes, chunked)
    o.category = "saved activations"
    _HELD[sim] = outs + o.retained.take()  # the graph lives with the output (the module docstring)
    return loss


def _retained_bytes(fwd: ForwardContext, x: T) -> int:
    """The bytes the previous micro-step's graph keeps alive through ``logits`` (the same shapes as
    this one's): each distinct input a 4-bit linear kept on its ``ctx`` (``Ops.retained``, the layers
    so far), and the head's input ``x`` when the head is a 4-bit linear that keeps it."""
    o = fwd.ops
    total = o.retained.nbytes()
    w = fwd.maybe("lm_head.weight")
    if w is not None and _keeps_input(fwd, w, x) and x not in o.retained:
        total += x.nbytes
    return total


def _keeps_input(fwd: ForwardContext, w: Param, x: T) -> bool:
    """Whether the 4-bit head keeps its input ``x`` with the graph (bitsandbytes < 0.43.2, as
    ``Ops.linear`` ``quant_retain``)."""
    lora = fwd.lora
    return (w.weight.itemsize_bits == 4 and lora is not None and lora.bnb_saves_input and x.requires_grad
            and fwd.tr.checkpoint == "none")


def _view(sim: Sim, numel: int, bits: int) -> T:
    v = sim.alloc(0, "activations", CATEGORY)
    v.numel, v.itemsize_bits, v.requires_grad = numel, bits, True
    return v


def _head(fwd: ForwardContext, x: T, sizes: list[int]) -> list[T]:
    """The head (whole, or its chunks as two groups) and ``convert_output``: the fp32 outputs."""
    o, sim, m = fwd.ops, fwd.sim, fwd.m
    V, B = m.vocab_size, fwd.B
    weight = "lm_head.weight" if fwd.maybe("lm_head.weight") is not None else "embed_tokens.weight"
    if len(sizes) == 1:
        ys = [fwd.proj(x, None, "lm_head", "head", V, base="lm_head", weight=weight)]
    else:
        views = [_view(sim, B * c * m.d_model, x.itemsize_bits) for c in sizes]
        # x.split(128, dim=1): views; a LoRA head's lora_A saves them, which keeps x's storage
        head_adapter = fwd.maybe("lm_head.lora_A") is not None
        sim.node("split_head", [x] if head_adapter else [], [x], [], views, grad_input_bytes=[x.nbytes])
        if _keeps_input(fwd, fwd.p(weight), x):  # a 4-bit head's ctx.tensors: the chunks, views of x
            o.retained.add(x)
        rows = fwd.rows
        ys = []
        try:
            for k, (v, c) in enumerate(zip(views, sizes, strict=True)):
                if k == 0 and not head_adapter:  # the group: one Linear call per chunk
                    ys.append(_group_linear(fwd, v, B * c, c // _CH, fwd.p(weight), fwd.maybe("lm_head.bias")))
                    continue
                fwd.rows = B * c  # the chunk's rows (proj reads them from the walk)
                ys.append(fwd.proj(v, None, "lm_head", "head", V, base="lm_head", weight=weight))
        finally:
            fwd.rows = rows
        o.drop(*views)
    o.drop(x)
    outs = []
    for k, y in enumerate(ys):  # _convert_fp_tensor: tensor.to(fp32), a copy of a 16-bit output
        if y.itemsize_bits == 32:
            outs.append(sim.ref(y))
            continue
        f = o.new(y.numel, _F32, CATEGORY)
        nd = sim.node("to_fp32", [], [y], [], [f])
        if nd is not None and k == 0 and len(ys) > 1:  # the group: chunk by chunk, one 16-bit chunk at a time
            nd.on_backward = _cast_chunkwise(o.dtype_of(y).nbytes(min(y.numel, B * _CH * V)))
        outs.append(f)
    o.drop(*ys)
    return outs


def _group_linear(fwd: ForwardContext, x: T, rows: int, calls: int, w: Param, b: Optional[Param]) -> T:
    """``calls`` calls of the frozen head (the group's chunks) as one: under autocast each call casts
    the frozen weight afresh and its backward keeps that copy (``cached_cast`` caches only leaves that
    require grad), and casts the chunk's input for the matmul (:meth:`Ops.linear`, chunk by chunk)."""
    o, sim = fwd.ops, fwd.sim
    V = fwd.m.vocab_size
    ac = o.autocast
    saved: list[T] = []
    temps: list[int] = []
    if ac is not None and w.weight.itemsize_bits != ac.bits:
        wc = o.new(calls * w.numel, ac, "autocast weight copies")
        sim.note_op("to_copy", [], [w], [wc])
        if x.requires_grad:
            saved.append(wc)
    if ac is not None and x.itemsize_bits != ac.bits:  # the input's cast, transient; its gradient cast back
        xc = o.new(x.numel, ac)
        temps.append(xc.nbytes)
        o.drop(xc)
    y = o.new(rows * V, ac or o.dtype_of(x))
    kw: dict[str, Any] = {}
    if calls and w.weight.itemsize_bits == 4:  # LitGPT's 4-bit head (weights.quantized_head): each call dequantises
        deq, peak = _dequant_bytes(fwd, w)
        # the last call's dequantisation beside the other calls' outputs, then its own output beside it
        sim.transient(max(peak - y.nbytes // calls, deq), "temporaries", "dequantised weight")
        temps.append(deq)  # backward, a call at a time: the weight dequantised again beside its input gradient
        if x.requires_grad and peak > deq:
            kw["on_backward"] = lambda s, _n: s.transient(peak, "temporaries", "dequantisation")
    params = [w] + ([b] if b is not None else [])
    sim.node("linear", saved, [x], params, [y], temps=temps, flops=2 * rows * fwd.m.d_model * V, **kw)
    o.drop(*saved)
    return y


def _dequant_bytes(fwd: ForwardContext, w: Param) -> tuple[int, int]:
    """(the dequantised weight in the compute dtype, the dequantisation's peak) of a 4-bit head call, as
    :func:`memcalc.engine.blocks.adapters._linear_4bit` counts them for any 4-bit linear."""
    from memcalc.engine.blocks.adapters import bnb_legacy_dequant_peak_bytes

    lora = fwd.lora
    assert lora is not None
    deq = fwd.model.compute.nbytes(w.numel)
    if lora.bnb_saves_input:
        return deq, bnb_legacy_dequant_peak_bytes(w.numel, fwd.model.compute, lora)
    return deq, deq + (2 * 4 * -(-w.numel // lora.quant_block) if lora.double_quant else 0)


def _cast_chunkwise(chunk_bytes: int):
    """A group's ``ToCopyBackward``: each chunk's fp32 gradient goes as its 16-bit cast is made."""
    def run(sim: Sim, node: Node) -> None:
        sim.transient(chunk_bytes, "temporaries", "activation gradients")
        for out in node.outputs:
            sim.unref(out.grad_buffer)
            out.grad_buffer = None
    return run


def _release_saved(sim: Sim, node: Node) -> None:
    """A group's ``LogSoftmaxBackward``: each chunk's saved output goes as its gradient is made."""
    for t in node.saved:
        sim.unref(t)
    node.saved = []


def _ce(fwd: ForwardContext, x: T, rows: int, V: int, grad_bytes: int, chunk_rows: int = 0) -> T:
    """``cross_entropy(x, target, reduction="none")`` on (rows, V) fp32 ``x``: log_softmax, nll_loss.
    ``chunk_rows`` > 0: a group of chunks of that many rows simulated as one (the module docstring)."""
    group = chunk_rows > 0
    o, sim = fwd.ops, fwd.sim
    lsm = o.new(rows * V, _F32, CATEGORY)
    nd = sim.node("log_softmax", [lsm], [x], [], [lsm], grad_input_bytes=[grad_bytes])
    if nd is not None and group:
        nd.on_backward = _release_saved
    out = o.new(rows, _F32, CATEGORY)
    total_weight = o.new(1, _F32, CATEGORY)  # nll_loss_forward's 0-dim total_weight, saved
    # nll_loss_backward's zero gradient; a group's: two chunks' at a time (with the next one's)
    nll_grad = [_F32.nbytes(2 * min(chunk_rows, rows) * V) if group else lsm.nbytes]
    sim.node("nll_loss", [total_weight], [lsm], [], [out], grad_input_bytes=nll_grad)
    o.drop(lsm, total_weight)
    return out


def _loss(fwd: ForwardContext, outs: list[T], sizes: list[int], chunked: bool) -> T:
    """``chunked_cross_entropy`` after the shift (see the module docstring)."""
    o, sim = fwd.ops, fwd.sim
    B, V = fwd.B, fwd.m.vocab_size
    parts: list[T] = []
    last = outs[-1]
    # the shift: a view of the last chunk (of the whole logits), its gradient the unsliced size
    rows_last = B * (sizes[-1] - 1)
    sv = _view(sim, rows_last * V, 32)
    sim.node("slice", [], [last], [], [sv], grad_input_bytes=[last.nbytes])
    # reshape of a non-contiguous slice (B > 1): a copy (its backward hands the gradient on)
    copy = o.new(rows_last * V if B > 1 else 0, _F32, CATEGORY)
    if chunked:
        first, first_pos = outs[0], sizes[0]
        parts.append(_ce(fwd, first, B * first_pos, V, first.nbytes, B * _CH))
        parts.append(_ce(fwd, sv, rows_last, V, _F32.nbytes(rows_last * V)))
    else:  # logits.reshape(-1, V).split(128): row views
        rows = groups(rows_last)
        views = [_view(sim, r * V, 32) for r in rows]
        sim.node("split_rows", [], [sv], [], views, grad_input_bytes=[_F32.nbytes(rows_last * V)])
        for v, r, chunk in zip(views, rows, (_CH, 0), strict=True):
            parts.append(_ce(fwd, v, r, V, _F32.nbytes(r * V), chunk))
        o.drop(*views)
    o.drop(sv)
    n = sum(p.numel for p in parts)
    cat = o.new(n, _F32, CATEGORY)  # torch.cat(loss_chunks): CatBackward hands on narrowed views
    sim.node("cat", [], parts, [], [cat], grad_input_bytes=[0] * len(parts))
    o.drop(*parts)
    s = o.new(1, _F32, CATEGORY)  # .sum(): SumBackward expands a view
    sim.node("sum", [], [cat], [], [s], grad_input_bytes=[0])
    o.drop(cat)
    # non_masked_elems = (targets != ignore_index).sum(); .maximum(torch.ones_like(...)): small tensors
    mask = sim.alloc(n, "temporaries", CATEGORY)
    count = o.new(1, DType.fp32, CATEGORY)
    sim.unref(mask)
    loss = o.new(1, _F32, CATEGORY)
    sim.node("div", [count], [s], [], [loss])  # DivBackward0 saves the divisor
    o.drop(s, count)
    o.drop(copy)  # the reshaped copy goes when chunked_cross_entropy returns
    return loss

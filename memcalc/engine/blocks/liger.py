"""Liger-Kernel's layers (``--kernels liger``), as liger_kernel 0.8.5's Python allocates around its Triton
kernels: which apply per family is :func:`memcalc.core.liger.liger_plan`; the validator runs the library
itself (``validate/hf_liger.py``). The kernels write into buffers the Python allocates first, so the
allocations below are the library's ``torch.empty`` / ``zeros_like`` lines, each cited.

Gradients computed in place: several of Liger's backwards write the input's gradient into a tensor that
already exists (RMSNorm's ``dX = dY``, SwiGLU's ``a``/``b``, FLCE's ``grad_input`` from forward) and return
it. :func:`_hand_over` makes that tensor the input's gradient buffer before the node runs (the node then
allocates nothing for it), so no second copy is counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.dtypes import DType
from memcalc.core.liger import LIGER_GPU, flce_chunk
from memcalc.engine.records import Node, Param
from memcalc.engine.sim import Sim, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

CATEGORY = "logits & loss"
FP32 = DType.fp32


def _hand_over(pairs: list[tuple[T, Optional[T]]]):
    """A node hook: each (input, buffer) whose input has no gradient yet gets ``buffer`` as it (the
    kernel wrote the gradient there); an input that already has one accumulates into it (the buffer
    is released with the node)."""
    def hook(sim: Sim, node: Node) -> None:
        for inp, buf in pairs:
            if inp in node.inputs and inp.grad_buffer is None and buf is not None and buf.alive:
                inp.grad_buffer = sim.ref(buf)
    return hook


def rms_norm(fwd: ForwardContext, x: T, w: Param) -> T:
    """``LigerRMSNormFunction`` (ops/rms_norm.py): forward ``rms_norm_forward`` allocates ``Y = torch.empty((n_rows,
    n_cols), dtype=X.dtype)`` and ``RSTD = torch.empty(n_rows, dtype=float32)`` (casting modes llama and gemma)
    and saves ``X, W, RSTD`` (``ctx.save_for_backward``; ``ensure_contiguous`` copies nothing for a contiguous
    input). Backward ``rms_norm_backward``: ``in_place=True`` (``_patch_rms_norm_module``'s default) so ``dX =
    dY``; ``_dW = torch.empty((sm_count, n_cols), float32)`` when W trains, then ``_dW.sum(dim=0).to(W.dtype)``."""
    o, sim = fwd.ops, fwd.sim
    rows, d = fwd.seq_rows, fwd.m.d_model
    y = o.new(rows * d, o.dtype_of(x))
    rstd = o.new(rows, FP32)
    temps = [LIGER_GPU.sm_count * d * 4, d * 4] if w.trainable else []
    node = sim.node("liger_rms_norm", [x, rstd], [x], [w], [y], temps=temps, grad_input_bytes=[0])
    if node is not None:
        node.on_backward = lambda s, n: _hand_over([(x, y.grad_buffer)])(s, n)
    o.drop(rstd)
    return y


def glu(fwd: ForwardContext, g: T, u: T) -> T:
    """``LigerSiLUMulFunction`` / ``LigerGELUMulFunction`` (ops/swiglu.py ``swiglu_forward``, ops/geglu.py
    ``geglu_forward``): ``c = torch.empty_like(a)``; saves ``a, b`` (the gate and up projections' outputs).
    Backward writes the gradients into ``a`` and ``b`` in place and returns them (``swiglu_backward`` /
    ``geglu_backward``: ``return a.view(*ori_shape), b.view(*ori_shape)``): no new bytes."""
    o, sim = fwd.ops, fwd.sim
    c = o.new(g.numel, o.dtype_of(g))
    node = sim.node("liger_glu", [g, u], [g, u], [], [c], grad_input_bytes=[0, 0])
    if node is not None:
        node.on_backward = _hand_over([(g, g), (u, u)])
    return c


def rope(fwd: ForwardContext, q: T, k: T) -> tuple[T, T]:
    """``liger_rotary_pos_emb`` (``LigerRopeFunction``, ops/rope.py ``rope_forward``): ``q.transpose(1, 2)`` of
    transformers' ``view(...).transpose(1, 2)`` is the projection's own contiguous (B, T, H, D) output, so
    ``.contiguous()`` copies nothing; the kernel rotates it in place and the function returns it transposed
    back (saves only cos and sin, the step's tables). The backward rotates ``dq``/``dk`` in place the same
    way. So the rotated q and k are the projections' outputs: no bytes, no node."""
    return fwd.ops.ref_(q), fwd.ops.ref_(k)


def rope_tables(fwd: ForwardContext, x: T) -> T:
    """The cos and sin tables ``LigerRopeFunction`` saves (``ctx.save_for_backward(cos, sin)``), as transformers'
    rotary embedding returns them (modeling_llama.py ``LlamaRotaryEmbedding.forward``: ``freqs =
    inv_freq @ position_ids`` over the (1, T) ``position_ids`` of an unpadded batch, ``cos = emb.cos() *
    attention_scaling``, ``return cos.to(dtype=x.dtype), sin.to(...)``): two (1, T, rotary width) tensors in
    the hidden states' dtype (``x``: the embedding output), one set for the step."""
    from memcalc.core.rules import rope_width

    n = fwd.T * rope_width(fwd.m)
    return fwd.sim.alloc(2 * fwd.ops.dtype_of(x).nbytes(n), "activations", "rope tables")


def flce_loss(fwd: ForwardContext, x: T) -> T:
    """Liger's ``lce_forward`` head and loss on the final norm's output ``x`` (takes the reference): the logits
    are never kept.

    ``LigerForCausalLMLoss`` (transformers/model/loss_utils.py): ``labels = nn.functional.pad(labels, (0, 1))``,
    ``shift_labels = labels[..., 1:].contiguous()`` (two int64 (B, T+1) and (B, T) tensors, alive to its
    return). ``fused_linear_cross_entropy_forward`` (ops/fused_linear_cross_entropy.py), on CUDA with the
    inputs in the weight's dtype (``_can_use_mm_out``; autocast is refused: memcalc.core.liger):
    ``grad_input = torch.zeros_like(_input)``; ``grad_weight = torch.zeros_like(weight)`` when the head
    trains; ``loss_1d`` (BT fp32); ``target_mask = target != ignore_index`` (BT bool);
    ``logits_storage = torch.empty((chunk_size, V))`` reused by every chunk's ``torch.mm(out=)``
    (chunk size :func:`memcalc.core.liger.flce_chunk`), released after the loop; ``grad_input`` rows by
    ``mm(out=)``; ``grad_weight`` by ``addmm(out=grad_weight)`` for 16-bit (capability >= 8), else (fp32)
    ``grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()``: a (V, H) fp32 temporary per
    chunk. ``ctx.save_for_backward(grad_input, grad_weight)``: backward only scales them in place and
    returns them as the gradients."""
    o, sim, m = fwd.ops, fwd.sim, fwd.m
    sim.set_role("loss")
    o.category = CATEGORY
    rows, d, V = fwd.B * fwd.T, m.d_model, m.vocab_size
    w = fwd.maybe("lm_head.weight") or fwd.p("embed_tokens.weight")
    dt = o.dtype_of(x)
    padded = o.new(fwd.B * (fwd.T + 1), DType.int64)
    shifted = o.new(rows, DType.int64)
    gi = o.new(rows * d, dt)
    gw = o.new(w.numel, o.dtype_of(w.weight)) if w.trainable else None
    loss_1d = o.new(rows, FP32)
    mask = sim.alloc(rows, "temporaries", CATEGORY)
    chunk, _n = flce_chunk(rows, V, d)
    logits = o.new(chunk * V, dt, kind="temporaries")
    if gw is not None and dt == FP32:  # the legacy fallback's (V, H) fp32 mm, one chunk at a time
        sim.transient(FP32.nbytes(w.numel), "temporaries", CATEGORY)
    o.drop(logits)
    loss = o.new(1, FP32)  # torch.sum(loss_1d)
    saved = [gi] + ([gw] if gw is not None else [])
    node = sim.node("liger_flce", saved, [x], [w], [loss], grad_input_bytes=[0])
    if node is not None:
        def on_backward(s: Sim, n: Node) -> None:
            _hand_over([(x, gi)])(s, n)
            if gw is not None and gw in n.saved:  # the saved grad_weight becomes the parameter's gradient
                n.saved.remove(gw)
                s.unref(gw)
        node.on_backward = on_backward
    o.drop(gi, gw, loss_1d, mask, padded, shifted, x)
    o.category = "saved activations"
    return loss

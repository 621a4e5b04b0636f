"""Cut Cross-Entropy's head and loss (``--kernels cce``), as cut_cross_entropy 25.1.1's Python allocates around
its Triton kernels; which models it applies to is :mod:`memcalc.core.cce` (shared with the validator,
``validate/hf_cce.py``, which runs the library itself). No logits tensor exists: the patched forward
(``transformers/llama.py`` ``cce_forward``) passes the final norm's output and ``lm_head.weight`` to
``linear_cross_entropy(..., shift=True, impl="cce", reduction="mean")`` with ``filter_eps="high"``
(linear_cross_entropy.py's default; not None, so the forward returns the logit average).

Line numbers are of the 25.1.1 wheel's files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.dtypes import DType
from memcalc.engine.records import Node
from memcalc.engine.sim import Sim, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

CATEGORY = "logits & loss"
FP32, I64 = DType.fp32, DType.int64
I32_BYTES = 4  # int32 / uint32 (DType has no 32-bit integer)


def _valids(fwd: ForwardContext, n: int) -> T:
    """utils.py ``_build_flat_valids`` (shift=True), lines 32-48: ``valids = (targets[..., 1:] != ignore_index)
    .nonzero().to(torch.int32)`` (a bool mask of the n = B x (T-1) shifted labels, freed once ``nonzero`` has
    returned its (n, 2) int64 positions, every label counted; the int32 copy, then the int64 freed);
    ``valids[:, i] *= stride`` in place; ``return valids.sum(1)``: n int64 (an integer sum), the int32 freed."""
    o, sim = fwd.ops, fwd.sim
    mask = sim.alloc(n, "temporaries", CATEGORY)
    pos64 = o.new(2 * n, I64, kind="temporaries")
    o.drop(mask)
    pos32 = sim.alloc(I32_BYTES * 2 * n, "temporaries", CATEGORY)
    o.drop(pos64)
    valids = o.new(n, I64)
    o.drop(pos32)
    return valids


def cce_loss(fwd: ForwardContext, x: T) -> T:
    """The loss on the final norm's output ``x`` (takes the reference).

    Forward (cce.py ``cce_linear_cross_entropy``: ``e.contiguous()`` and ``e.flatten(0, -2)`` copy nothing;
    ``LinearCrossEntropyFunction.forward``): :func:`_valids`; cce_lse_forward.py ``cce_lse_forward_kernel``
    ``lse = e.new_full((B,), -inf, float32)``, ``locks = e.new_full((cdiv(B, 128),), 0, uint32)``,
    ``logit_avg = e.new_full((V,), 0.0, float32)`` (B = valids.numel()); indexed_dot.py
    ``indexed_neg_dot_forward_kernel`` ``out = e.new_zeros((B,), float32)`` (``.to(float32)`` copies nothing);
    ``nll = neg_dot.add_(lse)``; ``loss = nll.mean()``; ``ctx.save_for_backward(e, c, lse, targets, valids,
    logit_avg)``.

    Backward (``LinearCrossEntropyFunction.backward``): ``sort_logit_avg(logit_avg)`` = ``argsort(...)
    .to(int32)`` (V int32; the sort's fp32 values and int64 indices before it); cce_backward.py
    ``cce_backward_kernel``: ``de = torch.zeros_like(e)`` (the hidden states' gradient, returned),
    ``dc = torch.zeros_like(c, dtype=e.dtype)`` when the head trains (the weight's gradient, ``dc.to(c.dtype)``
    copying nothing), ``de_locks`` / ``dc_locks`` int32 ``(cdiv(rows, nd), nd)`` with ``nd = cdiv(H, 64)``."""
    o, sim, m = fwd.ops, fwd.sim, fwd.m
    sim.set_role("loss")
    o.category = CATEGORY
    V, d = m.vocab_size, m.d_model
    n = fwd.B * (fwd.T - 1)
    w = fwd.maybe("lm_head.weight") or fwd.p("embed_tokens.weight")
    valids = _valids(fwd, n)
    lse = o.new(n, FP32)
    locks = sim.alloc(I32_BYTES * -(-n // 128), "temporaries", CATEGORY)
    logit_avg = o.new(V, FP32)
    o.drop(locks)
    neg_dot = o.new(n, FP32, kind="temporaries")
    loss = o.new(1, FP32)  # nll.mean()
    o.drop(neg_dot)
    nd = -(-d // 64)
    sort = [FP32.nbytes(V), I64.nbytes(V)]  # argsort's sort (values, indices), then .to(int32)
    temps = [I32_BYTES * V, I32_BYTES * nd * -(-n // nd), I32_BYTES * nd * -(-V // nd)]
    node = sim.node("cce_loss", [x, lse, valids, logit_avg], [x], [w], [loss], temps=temps)
    if node is not None:  # the sort runs before the kernel's buffers exist
        def on_backward(s: Sim, _n: Node) -> None:
            for b in sort:
                s.transient(b, "temporaries", CATEGORY)
        node.on_backward = on_backward
    o.drop(valids, lse, logit_avg, x)
    o.category = "saved activations"
    return loss

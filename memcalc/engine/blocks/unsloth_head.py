"""Unsloth's head and loss (``--framework unsloth``): ``unsloth_fused_ce_loss`` on the final norm's output, as
unsloth 2026.10.9's ``CausalLM_fast_forward`` (unsloth/models/llama.py) calls it whenever labels are given and
``UNSLOTH_RETURN_LOGITS`` is not set: the logits are never a (B, T, V) tensor. With unsloth_zoo 2026.10.9's
defaults it runs ``torch.ops.unsloth_zoo.fused_linear_ce_v2`` (fused_losses/fused_linear.py ``_ce_impl``, reached
through cross_entropy_loss.py ``_chunked_ce`` and chunked_logprob.py ``unsloth_chunked_ce_loss``). Read from
source, not traced (Triton kernels; rules: :mod:`memcalc.core.unsloth`).

Forward: ``_ce_targets`` shifts the labels (``torch.cat((labels[..., 1:], pad))``: a (B, T) int64 copy);
``_keep_index`` keeps the indices of the labelled rows (``keep.nonzero()``: N int64, every row labelled);
``grad_h = torch.zeros((N, H), dtype=hidden.dtype)`` (the hidden states' gradient, written chunk by chunk);
a trainable head's ``acc_w = torch.zeros(weight.shape)``; ``lp_all`` (N fp32); ``_Buffers(R, V)``: one fp32
``(R, stride)`` logits buffer reused by every chunk (:func:`memcalc.core.unsloth.ce_chunk_rows`,
:func:`memcalc.core.unsloth.ce_buffer_bytes`), into which the Triton row kernel also writes the logits' gradient;
per chunk ``gh = _dz_w(dz, w)`` ((R, H) fp32, copied into ``grad_h``); ``nll = -lp_all.to(float64)`` (two N-long
float64 temporaries). The op's outputs ``grad_h`` (and ``grad_w``) are saved (``_ce_setup``); backward returns
``fused_linear_scale_rows(grad_h, s)``: a new (N, H) gradient beside the saved one.

Not modelled: the tiled forward without the (R, V) buffer that ``_ce_impl`` takes for a frozen head with a
vocabulary over 32768 columns on an sm >= 80 GPU (``_FLASH``, ``_tiled_vocab``, ``_flash_ce_ok``): there the
estimate keeps the buffer (high by it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.dtypes import DType
from memcalc.core.unsloth import ce_buffer_bytes, ce_chunk_rows
from memcalc.engine.records import Node
from memcalc.engine.sim import Sim, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

CATEGORY = "logits & loss"
FP32 = DType.fp32


def fused_loss(fwd: ForwardContext, x: T) -> T:
    """The loss on ``x`` (takes the reference); returns the scalar loss."""
    o, sim, m = fwd.ops, fwd.sim, fwd.m
    sim.set_role("loss")
    o.category = CATEGORY
    rows, d, V = fwd.B * fwd.T, m.d_model, m.vocab_size
    w = fwd.maybe("lm_head.weight") or fwd.p("embed_tokens.weight")
    dt = o.dtype_of(x)
    targets = o.new(rows, DType.int64)  # _ce_targets: the shifted labels
    keep = sim.alloc(rows, "temporaries", CATEGORY)  # (targets >= 0) & ... : bool
    idx = o.new(rows, DType.int64)  # keep.nonzero(): every row labelled
    o.drop(keep)
    gh_all = o.new(rows * d, dt)  # grad_h
    gw = o.new(w.numel, o.dtype_of(w.weight)) if w.trainable else None  # acc_w
    lp_all = o.new(rows, FP32)
    buf = sim.alloc(ce_buffer_bytes(ce_chunk_rows(rows, d, V), V), "temporaries", CATEGORY)  # _Buffers
    sim.transient(FP32.nbytes(ce_chunk_rows(rows, d, V) * d), "temporaries", CATEGORY)  # gh = _dz_w(dz, w)
    sim.unref(buf)
    nll = [sim.alloc(8 * rows, "temporaries", CATEGORY) for _ in range(2)]  # -lp_all.to(float64): N float64 each
    loss = o.new(1, FP32)
    for t in nll:
        sim.unref(t)
    o.drop(lp_all, idx)
    saved = [gh_all] + ([gw] if gw is not None else [])
    node = sim.node("unsloth_fused_linear_ce", saved, [x], [w], [loss])
    if node is not None and gw is not None:
        def on_backward(s: Sim, n: Node) -> None:  # the saved acc_w, scaled, is the head's gradient
            if gw in n.saved:
                n.saved.remove(gw)
                s.unref(gw)
        node.on_backward = on_backward
    o.drop(gh_all, gw, targets, x)
    o.category = "saved activations"
    return loss

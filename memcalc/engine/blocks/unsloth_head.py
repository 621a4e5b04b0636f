"""Unsloth's head and loss (``--framework unsloth``): ``unsloth_fused_ce_loss`` on the final norm's output, as
unsloth 2026.10.9's ``CausalLM_fast_forward`` (unsloth/models/llama.py) calls it whenever labels are given and
``UNSLOTH_RETURN_LOGITS`` is not set: the logits are never a (B, T, V) tensor. Read from unsloth_zoo 2026.10.9
``fused_losses/cross_entropy_loss.py``; not traced (the chunk runs under torch.compile on CUDA; rules:
:mod:`memcalc.core.unsloth`).

``UnslothFusedLoss.forward``: ``_labels = torch.empty_like(labels)`` (the shifted labels, B*T int64, alive to the
return); ``grad_inputs = torch.empty_like(hidden_states)`` (the hidden states' gradient, written chunk by chunk in
forward); ``grad_lm_head = torch.zeros_like(lm_head_weight)`` when the head trains; the row count is split into
:func:`memcalc.core.unsloth.ce_chunks` chunks (``torch.chunk``: views); each chunk's ``accumulate_chunk`` runs
``torch.func.grad_and_value`` of ``compute_fused_ce_loss`` (its logits, fp32 upcast, log-softmax and gradient:
:data:`memcalc.core.unsloth.CE_CHUNK_BYTES_PER_LOGIT` bytes per logit, freed with the chunk) and, the head
training, adds the chunk's head gradient (a (V, H) temporary) into ``grad_lm_head``; ``ctx.save_for_backward(
grad_inputs, grad_lm_head, ...)``. ``backward`` scales them by ``grad_output`` and returns them: they become the
hidden states' and the head's gradients (no new bytes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.dtypes import DType
from memcalc.core.unsloth import CE_CHUNK_BYTES_PER_LOGIT, ce_chunk_rows, ce_chunks
from memcalc.engine.blocks.liger import _hand_over
from memcalc.engine.records import Node
from memcalc.engine.sim import Sim, T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

CATEGORY = "logits & loss"


def fused_loss(fwd: ForwardContext, x: T) -> T:
    """The loss on ``x`` (takes the reference); returns the scalar loss."""
    o, sim, m = fwd.ops, fwd.sim, fwd.m
    sim.set_role("loss")
    o.category = CATEGORY
    rows, d, V = fwd.B * fwd.T, m.d_model, m.vocab_size
    w = fwd.maybe("lm_head.weight") or fwd.p("embed_tokens.weight")
    dt = o.dtype_of(x)
    labels = o.new(rows, DType.int64)
    gi = o.new(rows * d, dt)
    gw = o.new(w.numel, o.dtype_of(w.weight)) if w.trainable else None
    fixed = gi.nbytes + (2 * gw.nbytes if gw is not None else 0)
    chunk = ce_chunk_rows(rows, ce_chunks(rows, V, fixed))
    if gw is not None:  # the chunk's head gradient, added into grad_lm_head
        sim.transient(gw.nbytes, "temporaries", CATEGORY)
    sim.transient(chunk * V * CE_CHUNK_BYTES_PER_LOGIT, "temporaries", CATEGORY)
    loss = o.new(1, DType.fp32)  # accumulated_loss
    saved = [gi] + ([gw] if gw is not None else [])
    node = sim.node("unsloth_fused_ce", saved, [x], [w], [loss], grad_input_bytes=[0])
    if node is not None:
        def on_backward(s: Sim, n: Node) -> None:
            _hand_over([(x, gi)])(s, n)
            if gw is not None and gw in n.saved:  # the saved grad_lm_head becomes the parameter's gradient
                n.saved.remove(gw)
                s.unref(gw)
        node.on_backward = on_backward
    o.drop(gi, gw, labels, x)
    o.category = "saved activations"
    return loss

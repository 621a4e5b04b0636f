"""torchtune's head and loss (torchtune 0.6.1): ``TransformerDecoder.unembed`` and the recipes' loss.

torchtune/modules/transformer.py ``TransformerDecoder.unembed``::

    h = self.norm(h)
    if self.num_output_chunks > 0:
        output = self.chunked_output(h)        # [self.output(chunk) for chunk in h.chunk(n, dim=1)]
    else:
        output = self.output(h).float()

The recipes (recipes/full_finetune_single_device.py and lora_finetune_single_device.py
``setup``: ``model.set_num_output_chunks(loss_fn.num_output_chunks)`` when the loss is
``CEWithChunkedOutputLoss``; ``_loss_step``: ``loss = self._loss_fn(logits, labels)`` then
``del logits``) pair the chunked output with ``CEWithChunkedOutputLoss``
(torchtune/modules/loss/ce_chunked_output_loss.py: per chunk
``F.cross_entropy(logits.float(), labels, reduction="sum")``, summed, ``/ total_elements``).

**Chunked** (:func:`chunked_head`; profile ``cross_entropy`` chunked, ``loss_chunks`` =
``num_output_chunks``):

- ``h.chunk(n, dim=1)`` splits the sequence: ``ceil(T / n)`` positions a chunk, and fewer
  chunks than ``n`` when ``T`` does not fill them (:func:`seq_chunks`); the chunks are views.
- ``self.output(chunk)``: with batch > 1 and more than one chunk the chunk is not contiguous, so
  ``matmul`` folds it with a copy (``reshape`` of a (B, Tc, d) view: B x Tc x d in the model
  dtype), which the mm saves for the weight's gradient; with batch 1 it is a view of h. Each
  chunk's logits (B x Tc x V, model dtype) stay alive in the returned list.
- the loss, chunk by chunk: the fp32 copy (``logits.float()``, gone when the chunk's
  cross-entropy returns), ``log_softmax`` saves its fp32 output: after the last chunk every
  chunk's log-probabilities (rows x V fp32) and every chunk's logits (rows x V, model dtype) are
  alive; ``del logits`` then frees the logits (``_to_copy`` saves nothing).
- backward runs in reverse creation order: every chunk's cross-entropy first (each leaves a
  chunk-sized gradient in the model dtype, ``_to_copy``'s backward), so all the logits'
  gradients (rows x V) are alive before the first output projection's backward; then each
  chunk's mm backward (its input gradient, the weight gradient accumulated over the chunks),
  and ``chunk``'s backward concatenates the chunks' input gradients into one (B, T, d).

**Not chunked** (:func:`whole_head`): the output projection, then ``.float()`` (an fp32 copy;
the 16-bit logits go at once, nothing saves them), then ``torch.nn.CrossEntropyLoss`` on the fp32
logits (:func:`~memcalc.engine.blocks.head.lm_loss` on an fp32 tensor: log_softmax saves fp32).
No shifted copy: the recipes shift the labels (``torch.hstack((labels[..., 1:], ignore))``).

**Compiled** (``compile_scope layer``): ``training.compile_loss`` replaces ``CEWithChunkedOutputLoss``'s
``compute_cross_entropy`` in place (:func:`chunked_head`: each chunk's compiled cross-entropy) and returns
``torch.compile(loss)`` for any other loss. recipes/lora_finetune_single_device.py (v0.6.1) keeps what it
returns (``self._loss_fn = training.compile_loss(self._loss_fn)``): the unchunked CrossEntropyLoss on the fp32
logits is one compiled graph (:func:`~memcalc.engine.blocks.compiled_loss.compiled_cross_entropy`: the logits
and two row statistics saved, no log-probabilities). recipes/full_finetune_single_device.py calls
``training.compile_loss(self._loss_fn)`` and drops the return value, so there the unchunked loss runs eagerly.
Traced: validate/trainers/torchtune.py ``setup_loss`` does as each recipe does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.dtypes import DType
from memcalc.engine.blocks.compiled_loss import compiled_cross_entropy, compiles_loss
from memcalc.engine.blocks.head import CATEGORY, lm_loss, logits
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext


def seq_chunks(seq: int, chunks: int) -> list[int]:
    """Sequence positions per chunk of ``Tensor.chunk(chunks, dim=1)``: ``ceil(seq / chunks)`` each,
    the last one shorter, and only as many chunks as that size fills (aten ``chunk``:
    ``split(ceil(size / chunks))``)."""
    size = -(-seq // chunks)
    out = [size] * (seq // size)
    if seq % size:
        out.append(seq % size)
    return out


def head_and_loss(fwd: ForwardContext, x: T) -> T:
    """torchtune's head on the final norm's output ``x`` (takes the reference) and its loss."""
    if fwd.exp.profile.cross_entropy == "chunked":
        return chunked_head(fwd, x)
    return whole_head(fwd, x)


def whole_head(fwd: ForwardContext, x: T) -> T:
    """``self.output(h).float()`` and the cross-entropy on the fp32 logits."""
    o = fwd.ops
    y = logits(fwd, x)
    fwd.sim.set_role("loss")
    o.category = CATEGORY
    if y.itemsize_bits != 32:
        yf = o.new(y.numel, DType.fp32, CATEGORY)
        fwd.sim.node("to_fp32", [], [y], [], [yf])
        o.drop(y)
        y = yf
    if compiles_loss(fwd) and fwd.tr.lora is not None:  # the LoRA recipe's CrossEntropyLoss, compiled whole
        out = compiled_cross_entropy(fwd, y, fwd.B * fwd.T)
    else:
        out = lm_loss(o, y, fwd.B, fwd.T, fwd.m.vocab_size)
    o.category = "saved activations"
    o.drop(y)
    return out


def chunked_head(fwd: ForwardContext, x: T) -> T:
    """``chunked_output`` and ``CEWithChunkedOutputLoss`` (see the module docstring)."""
    o, sim, m = fwd.ops, fwd.sim, fwd.m
    B, d = fwd.B, m.d_model
    dt = o.dtype_of(x)
    sizes = seq_chunks(fwd.T, fwd.exp.profile.loss_chunks)
    views = []
    for n in sizes:
        v = sim.alloc(0, "activations", "head")
        v.numel, v.itemsize_bits, v.requires_grad = B * n * d, x.itemsize_bits, x.requires_grad
        views.append(v)
    # chunk's backward (SplitBackward) concatenates the chunks' gradients into one (B, T, d). A chunk
    # that is a view (batch 1, or one chunk) is what a trainable head's mm saves: h stays alive
    copies = B > 1 and len(sizes) > 1
    w = fwd.maybe("lm_head.weight") or fwd.p("embed_tokens.weight")
    keep = [x] if not copies and w.trainable else []
    sim.node("chunk", keep, [x], [], views, grad_input_bytes=[dt.nbytes(fwd.rows * d)])
    o.drop(x)
    outs = []
    rows = fwd.rows
    for v, n in zip(views, sizes, strict=True):
        xc = v
        if copies:  # matmul folds a non-contiguous (B, n, d) view: a copy (its backward passes the
            xc = o.new(v.numel, dt)  # gradient on: counted as a chunk-sized gradient of the view)
            sim.node("reshape_copy", [], [v], [], [xc], grad_input_bytes=[dt.nbytes(v.numel)])
        try:
            fwd.rows = B * n  # the projection's rows (ForwardContext.rows) for this chunk
            outs.append(logits(fwd, xc))
        finally:
            fwd.rows = rows
        if xc is not v:
            o.drop(v)
    sim.set_role("loss")
    o.category = CATEGORY
    total = None
    for y in outs:
        if compiles_loss(fwd):  # training.compile_loss compiles compute_cross_entropy (compiled_loss.py)
            part = compiled_cross_entropy(fwd, y, y.numel // m.vocab_size)
            total = part if total is None else _add(fwd, total, part)
            continue
        yf = o.new(y.numel, DType.fp32, CATEGORY)  # logits.float()
        sim.node("to_fp32", [], [y], [], [yf], grad_input_bytes=[dt.nbytes(y.numel)])
        lsm = o.new(y.numel, DType.fp32, CATEGORY)
        sim.node("log_softmax", [lsm], [yf], [], [lsm], grad_input_bytes=[DType.fp32.nbytes(y.numel)])
        o.drop(yf)
        part = o.new(1, DType.fp32, CATEGORY)
        sim.node("nll_loss", [], [lsm], [], [part])
        o.drop(lsm)
        total = part if total is None else _add(fwd, total, part)
    assert total is not None
    loss = o.new(1, DType.fp32, CATEGORY)  # total_loss / total_elements
    sim.node("div", [], [total], [], [loss])
    o.drop(total)
    o.drop(*outs)  # the recipe's ``del logits``
    o.category = "saved activations"
    return loss


def _add(fwd: ForwardContext, total: T, part: T) -> T:
    """``total_loss += ...``: add's backward hands the same gradient on (no new bytes)."""
    o = fwd.ops
    s = o.new(1, DType.fp32, CATEGORY)
    fwd.sim.node("add", [], [total, part], [], [s], grad_input_bytes=[0, 0])
    o.drop(total, part)
    return s

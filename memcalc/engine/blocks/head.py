"""The model's head: the final norm (:func:`final_norm`), the output projection and the logits'
post-processing (:func:`logits`: ``logit_scale``, Gemma-2's final softcap), the loss (:func:`loss`);
their parameters (:func:`head_params`).

**Final logit softcap** (Gemma2ForCausalLM ``final_logit_softcapping``): ``logits / cap``,
``tanh`` (saves its output), ``* cap``: three (B, T, V) tensors, one kept for backward.

The causal LM loss (:func:`lm_loss`), and the chunked cross-entropy: the loss rows in
``loss_chunks`` pieces, each upcast and reduced on its own (:func:`chunked_cross_entropy`).

What the chunked code does (the validator's ``validate/model.py`` ``lm_loss`` runs exactly this):
the (rows, V) logits -- after the profile's optional fp32 upcast and shifted contiguous copy --
are split along the rows with :func:`~memcalc.core.rules.chunk_rows` sizes (``Tensor.split``: views, no bytes);
each chunk is ``.float()``-ed and reduced with ``F.cross_entropy(reduction="sum")``; the
partial sums are added and divided by the count of non-ignored labels. That is torchtune's
``CEWithChunkedOutputLoss`` (torchtune/modules/loss/ce_chunked_output_loss.py: per chunk
``F.cross_entropy(logits.float(), labels, reduction="sum")``, summed, ``/ total_elements``;
8 chunks by default, labels split with ``tensor_split``) applied to one logits tensor split
along its rows, as LitGPT's ``chunked_cross_entropy`` does when the head was not chunked
(litgpt/utils.py: ``logits.split(chunk_size)``, one cross_entropy per chunk).

What is alive when (``tools/autograd/derivatives.yaml``):

- forward, per chunk: the fp32 copy of a 16-bit chunk (``_to_copy``; its backward saves
  nothing) lives only until that chunk's cross_entropy returns; ``log_softmax`` saves its
  fp32 output, so after the last chunk all chunks' log-probabilities are alive (rows x V fp32
  in all) beside the logits being split, which go away when the loss returns;
- backward, chunk by chunk (last chunk first): ``nll_loss_backward`` allocates a zero
  (chunk, V) gradient, ``_log_softmax_backward_data`` another; then the chunk's saved output
  and the first gradient go; a 16-bit chunk's ``_to_copy`` backward casts the gradient back
  (a chunk-sized 16-bit tensor; the fp32 one goes). Every chunk's gradient waits in the split
  node's input buffer; ``split_backward`` then ``cat``\\ s them into one (rows, V) gradient
  and frees them.

So the fp32 copy never exists whole and the log_softmax gradient is at most one chunk at a
time; the saved log-probabilities and the gradient in the logits' dtype still are full size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.dtypes import DType
from memcalc.core.rules import chunk_rows
from memcalc.core.spec import LoraSpec, ModelSpec
from memcalc.engine.blocks.adapters import adapter_params
from memcalc.engine.blocks.base import ParamTensor, scaled
from memcalc.engine.blocks.embedding import ORIGINAL_EMBED
from memcalc.engine.ops import Ops
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext


CATEGORY = "logits & loss"


def chunked_cross_entropy(ops: Ops, x: T, rows: int, V: int) -> T:
    """The chunked loss on ``x`` ((rows, V) logits, one reference owned by this call, dropped
    when the loss is returned). Returns the scalar loss (see the module docstring)."""
    sim = ops.sim
    dt = ops.dtype_of(x)
    # split: the chunks are views (no bytes); split_backward cats their gradients (rows x V, x's dtype)
    views = []
    for n in chunk_rows(rows, ops.profile.loss_chunks):
        v = sim.alloc(0, "activations", CATEGORY)
        v.numel, v.itemsize_bits, v.requires_grad = n * V, x.itemsize_bits, x.requires_grad
        views.append(v)
    sim.node("loss_split", [], [x], [], views, grad_input_bytes=[dt.nbytes(rows * V)])
    total = None
    for v in views:
        n = v.numel
        src = v
        if dt != DType.fp32:  # chunk.float(): a transient fp32 copy; its gradient is cast back
            src = ops.new(n, DType.fp32, CATEGORY)
            sim.node("to_fp32", [], [v], [], [src], grad_input_bytes=[dt.nbytes(n)])
        lsm = ops.new(n, DType.fp32, CATEGORY)
        sim.node("log_softmax", [lsm], [src], [], [lsm], grad_input_bytes=[DType.fp32.nbytes(n)])
        part = ops.new(1, DType.fp32, CATEGORY)
        sim.node("nll_loss", [], [lsm], [], [part])
        ops.drop(lsm)
        if src is not v:
            ops.drop(src)
        ops.drop(v)
        if total is None:
            total = part
        else:  # total + part: add's backward hands the same gradient to both (no new bytes)
            s = ops.new(1, DType.fp32, CATEGORY)
            sim.node("add", [], [total, part], [], [s], grad_input_bytes=[0, 0])
            ops.drop(total, part)
            total = s
    assert total is not None
    loss = ops.new(1, DType.fp32, CATEGORY)  # total / (labels != ignore_index).sum()
    sim.node("div", [], [total], [], [loss])
    ops.drop(total)
    ops.drop(x)
    return loss


def lm_loss(ops: Ops, logits: T, B: int, Tq: int, V: int, loss_parallel: bool = False) -> T:
    """Causal LM loss on (B,T,V) logits: optional fp32 upcast (HF), optional shifted
    contiguous copy (``logits[..., :-1, :].contiguous()``; its backward, slice_backward,
    allocates a full zero (B,T,V) gradient), then cross_entropy = log_softmax (saves its
    output) + nll_loss (saves target and total_weight; backward allocates a zero
    (N,V) gradient and scatters into it). ``cross_entropy="chunked"``: the rows in
    ``loss_chunks`` pieces after the upcast and the shift (:func:`chunked_cross_entropy`).

    ``loss_parallel`` (tensor parallelism, ``V`` this rank's vocabulary shard): DTensor's
    ``loss_parallel()`` handlers (torch/distributed/tensor/parallel/loss.py ``_log_softmax``) run
    log_softmax in fp32 (``elementwise_dtypes``' computation dtype): a 16-bit x is copied to fp32,
    then ``x - max``, ``exp(x - max)`` and the fp32 result are made and the result is cast back (three
    fp32 logits-sized tensors alive as the output is allocated); an fp32 x keeps ``x - max`` and
    ``exp(x - max)`` before the output. And
    ``_nll_loss_and_log_softmax_backward`` as ``(zeros_like(x) + exp(x)) * grad`` in nll_loss's
    backward (two more logits-sized tensors beside its result; log_softmax's backward then only
    casts). The chunked loss ignores it."""
    x = logits
    if ops.profile.logits_fp32 and x.itemsize_bits != 32:
        xf = ops.new(x.numel, DType.fp32, "logits & loss")
        ops.sim.node("to_fp32", [], [x], [], [xf])
        x = xf
    else:
        ops.sim.ref(x)
    dt = ops.dtype_of(x)
    rows = B * Tq
    if ops.profile.shift_copy:
        # with batch 1, logits[..., :-1, :] is already contiguous and .contiguous() copies nothing
        # (a traced rank shows no copy); the copy is still counted here so that the step stays
        # one closed form in batch for memcalc.plan.fits (a known over-count of one (T-1) x V
        # tensor at batch 1 while it and the logits are both alive)
        rows = B * (Tq - 1)
        xs = ops.new(rows * V, dt, "logits & loss")
        ops.sim.node("shift_slice", [], [x], [], [xs], grad_input_bytes=[x.nbytes])
        ops.drop(x)
        x = xs
    if ops.profile.cross_entropy == "chunked":
        return chunked_cross_entropy(ops, x, rows, V)
    held = None
    if loss_parallel:  # fp32 x: x - max (held) and exp(.) before the output; 16-bit x: its fp32 copy,
        # x - max and exp(.) (fp32) before, then the copy, x - max and the fp32 result held as it is cast
        f = DType.fp32.nbytes(rows * V)
        hold, before = (f, 2 * f) if dt == DType.fp32 else (3 * f, 3 * f)
        held = ops.sim.alloc(hold, "temporaries", "logits & loss")
        ops.sim.transient(before - hold, "temporaries", "logits & loss")
    lsm = ops.new(rows * V, dt, "logits & loss")
    ops.sim.unref(held)
    # the gradient w.r.t. the (shifted) logits is a whole (rows, V) tensor, also when they are a view
    ops.sim.node("log_softmax", [lsm], [x], [], [lsm], grad_input_bytes=[dt.nbytes(rows * V)])
    if ops.autocast is not None and dt != DType.fp32:
        # under autocast cross_entropy_loss keeps log_softmax in the logits' dtype (it passes
        # ops.scalar_type()), but nll_loss is an fp32 op: it upcasts its input and saves that
        l32 = ops.new(rows * V, DType.fp32, "logits & loss")
        ops.sim.node("to_fp32", [], [lsm], [], [l32])
        ops.drop(lsm)
        lsm = l32
    ops.drop(x)  # the caller's shifted logits live until cross_entropy returns
    loss = ops.sim.alloc(4, "activations", "logits & loss")
    loss.numel, loss.itemsize_bits = 1, dt.bits
    ops.sim.node("nll_loss", [], [lsm], [], [loss], temps=[2 * lsm.nbytes] if loss_parallel else [])
    ops.drop(lsm)
    return loss


# -- the head's parameters and forward ----------------------------------------------------------
def head_params(m: ModelSpec, lora: Optional[LoraSpec], full: bool) -> list[ParamTensor]:
    """The final norm, the untied head (vocab x d) and its bias, the head's adapter."""
    d = m.d_model
    out = []
    if m.final_norm:
        out.append(ParamTensor("final_norm.weight", (d,), None, full, "norm"))
        if m.has_norm_bias:
            out.append(ParamTensor("final_norm.bias", (d,), None, full, "bias"))
    save = lora.modules_to_save if lora is not None else ()
    if "lm_head" in save and not m.tie_embeddings:  # ModulesToSaveWrapper: the original, frozen
        out.append(ParamTensor("lm_head.original_module.weight", (m.vocab_size, d), None, False, "embedding"))
    if not m.tie_embeddings or "lm_head" in save:
        # with tied embeddings PEFT's copy of lm_head is a new, untied, trainable weight (peft 0.21
        # utils/other.py ModulesToSaveWrapper.update: copy.deepcopy of the module)
        out.append(ParamTensor("lm_head.weight", (m.vocab_size, d), None, full or "lm_head" in save, "embedding"))
    if m.lm_head_bias:
        out.append(ParamTensor("lm_head.bias", (m.vocab_size,), None, full, "bias"))
    if lora is not None and "head" in lora.targets:
        # LoRA on the output projection (PEFT lm_head, torchtune apply_lora_to_output, LitGPT lora_head):
        # A: r x d, B: vocab x r; with tied embeddings PEFT 0.21 still adapts the lm_head module alone
        # (peft/tuners/lora/model.py: the embedding is adapted instead only with ensure_weight_tying)
        out.extend(adapter_params("lm_head", d, m.vocab_size, None, lora))
    return out


def final_norm(fwd: ForwardContext, x: T) -> T:
    """The final norm on the last layer's output, when the model has one (takes the reference)."""
    if not fwd.m.final_norm:
        return x
    h = fwd.norm(x, "final_norm")
    fwd.ops.drop(x)
    return h


def logits(fwd: ForwardContext, x: T) -> T:
    """The head on ``x`` (takes the reference): the untied head or the embedding's weight, as a
    projection (with LoRA target head, its adapter branch is a vocab-wide B output), then
    :func:`post_logits`."""
    o, m = fwd.ops, fwd.m
    # tied embeddings: the embedding's weight, or its frozen original when PEFT trains a copy of the
    # embedding alone (modules_to_save embed_tokens: lm_head keeps the original's tensor)
    weight = ("lm_head.weight" if fwd.maybe("lm_head.weight") is not None else
              ORIGINAL_EMBED if fwd.maybe(ORIGINAL_EMBED) is not None else "embed_tokens.weight")
    if fwd.tp:  # the head is column-parallel on the vocabulary
        h = fwd.tp.gather(fwd, x)
        o.drop(x)
        x = h
    out = fwd.proj(x, None, "lm_head", "head", m.vocab_size, base="lm_head", weight=weight)
    o.drop(x)
    return post_logits(fwd, out)


def post_logits(fwd: ForwardContext, logits: T) -> T:
    """``logit_scale`` then the final softcap on the head's output (takes the reference)."""
    o, m, sim = fwd.ops, fwd.m, fwd.sim
    logits = scaled(fwd, logits, m.logit_scale)
    cap = m.logit_softcap
    if cap is None:
        return logits
    dt = o.dtype_of(logits)
    d = o.new(logits.numel, dt)
    sim.node("div_scalar", [], [logits], [], [d])
    o.drop(logits)
    t = o.new(d.numel, dt)
    sim.node("tanh", [t], [d], [], [t])
    o.drop(d)
    y = o.new(t.numel, dt)
    sim.node("mul_scalar", [], [t], [], [y])
    o.drop(t)
    return y


def loss(fwd: ForwardContext, logits: T) -> T:
    """The LM loss on the logits (takes the reference), its tensors in the category "logits & loss"."""
    fwd.sim.set_role("loss")
    o = fwd.ops
    o.category = CATEGORY
    out = lm_loss(o, logits, fwd.B, fwd.T, fwd.m.vocab_size, fwd.tp is not None)
    o.category = "saved activations"
    o.drop(logits)
    return out

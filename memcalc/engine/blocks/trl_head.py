"""TRL's fused LM head and its loss (``cross_entropy="trl-fused"``, ``--framework trl``).

What ``SFTTrainer`` runs (trl 1.16.0; every step below is a line of it):

- ``SFTTrainer.__init__`` (trl/trainer/sft_trainer.py) calls ``add_fused_lm_head(model,
  outputs=("log_probs", "entropy", "is_top1"))``; ``compute_loss`` calls ``model(**inputs,
  fused_lm_head=True)`` (``loss_type="nll"``, the default; ``"chunked_nll"`` is its deprecated alias);
- ``_fused_forward`` (trl/trainer/utils.py ``add_fused_lm_head``): the backbone's
  ``last_hidden_state[:, :-1]`` (a view: its backward makes a zero (B, T, H) gradient) and
  ``labels[:, 1:]``; ``mask = labels != -100`` (bool, B x (T-1)); on CUDA (``_use_triton``: the compact
  path) ``hidden_states[mask]`` (N x H, N = the loss tokens, :func:`memcalc.core.rules.loss_token_count`;
  ``index`` runs ``nonzero`` first, an (N, 2) int64 tensor; IndexBackward saves the mask and makes a
  zero (B, T-1, H) gradient) and ``labels[mask]`` (N int64, with its own ``nonzero``);
- ``ChunkedLogProbFunction.forward`` (trl/kernels/chunked_logprob.py): seven fp32 N-vectors (running
  max, sum of exp, its x-weighted and squared sums, the z sum, the max before the target, the target
  logit) and one tile buffer ``mm_buf`` of ``min(N, TOKEN_CHUNK_SIZE) x chunk_size`` in the compute
  dtype (``_CHUNKED_LOGPROB_CHUNK_SIZE`` = 32768 columns whatever the vocabulary); the projection
  goes into it tile by tile (``torch.mm(..., out=tile)``) and a Triton kernel folds each tile in place;
  then ``log_z`` (through a ``log`` temporary), the log-probabilities, the entropy (through a
  quotient temporary) and ``is_top1`` (two bool temporaries); it saves the hidden rows, the weight,
  the targets, ``log_z`` and the entropy;
- back in ``_fused_forward``, each per-token output is scattered to (B, T-1): ``new_zeros`` then
  ``masked_scatter`` (MaskedScatterBackward saves the mask; its backward ``masked_select``\\ s an N
  gradient); the loss of the model output is a scalar; ``compute_loss`` takes ``-outputs.log_probs``
  (B x (T-1) fp32), sums it and divides: everything but the saved tensors goes when it returns;
- ``ChunkedLogProbFunction.backward``: fp32 zero gradients for the hidden rows (N x H) and, when
  the head trains, the weight (V x H), a new ``mm_buf``, the tiles turned into their gradient in place
  and accumulated in fp32 (``_addmm_fp32``: ``torch.addmm(..., out_dtype=torch.float32, out=acc)`` on
  CUDA); they are returned cast to the inputs' dtypes (``.to``: no copy when already fp32) while the
  fp32 buffers and the tile are still alive.

Under AMP the tiles are in the autocast dtype: each token chunk of the hidden rows and each
vocabulary chunk of the weight are cast first (``.to(compute_dtype)``: copies); read from the
source, not traced (the validator refuses AMP: meta has no autocast state to read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.dtypes import DType
from memcalc.core.rules import loss_token_count
from memcalc.engine.sim import T, param_id

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext

CATEGORY = "logits & loss"
#: trl/kernels/chunked_logprob.py TOKEN_CHUNK_SIZE: tokens per projection tile
TOKEN_CHUNK_SIZE = 4096
#: trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE: the tile's columns (vocabulary per tile)
VOCAB_CHUNK_SIZE = 32768
#: ChunkedLogProbFunction.forward's fp32 per-token buffers (running_max ... target_logit)
FORWARD_BUFFERS = 7


def _view(fwd: ForwardContext, numel: int, like: T) -> T:
    """A view (no bytes) of ``numel`` elements of ``like``'s dtype."""
    v = fwd.sim.alloc(0, "activations", CATEGORY)
    v.numel, v.itemsize_bits, v.requires_grad = numel, like.itemsize_bits, like.requires_grad
    return v


def fused_loss(fwd: ForwardContext, x: T) -> T:
    """TRL's fused head and ``compute_loss`` on the final norm's output ``x`` (takes the reference);
    returns the scalar loss (see the module docstring)."""
    sim, o, m = fwd.sim, fwd.ops, fwd.m
    sim.set_role("loss")
    o.category = CATEGORY
    B, Tq, H, V = fwd.B, fwd.T, m.d_model, m.vocab_size
    P = B * (Tq - 1)
    N = loss_token_count(B, Tq, fwd.exp.profile.loss_tokens)
    dt = o.dtype_of(x)
    compute = o.autocast or dt
    weight = fwd.maybe("lm_head.weight") or fwd.p("embed_tokens.weight")
    bias = fwd.maybe("lm_head.bias")
    wdt = o.dtype_of(weight.weight)
    # last_hidden_state[:, :-1]: a view; SliceBackward's gradient is a zero (B, T, H) tensor
    hv = _view(fwd, P * H, x)
    sim.node("slice", [], [x], [], [hv], grad_input_bytes=[x.nbytes])
    mask = o.new(P, DType.bool_)  # labels[:, 1:] != -100
    nz = o.new(2 * N, DType.int64)  # hidden_states[mask]: index's nonzero, then the rows
    hs = o.new(N * H, dt)
    o.drop(nz)
    sim.node("index", [mask], [hv], [], [hs], grad_input_bytes=[dt.nbytes(P * H)])
    nz = o.new(2 * N, DType.int64)  # labels[mask]
    targets = o.new(N, DType.int64)
    o.drop(nz)
    # ChunkedLogProbFunction.forward
    bufs = [o.new(N, DType.fp32) for _ in range(FORWARD_BUFFERS)]
    tile_bytes = compute.nbytes(min(N, TOKEN_CHUNK_SIZE) * VOCAB_CHUNK_SIZE)
    mm_buf = sim.alloc(tile_bytes, "temporaries", CATEGORY)
    if compute != dt:  # AMP: hidden[token chunk].to(compute) and weight[vocab chunk].to(compute)
        hc = o.new(min(N, TOKEN_CHUNK_SIZE) * H, compute)
        sim.transient(compute.nbytes(min(V, VOCAB_CHUNK_SIZE) * H), "temporaries", CATEGORY)
        o.drop(hc)
    tmp = o.new(N, DType.fp32)  # torch.log(sum_exp)
    log_z = o.new(N, DType.fp32)
    o.drop(tmp)
    logprobs = o.new(N, DType.fp32)
    tmp = o.new(N, DType.fp32)  # x_sum_exp / sum_exp
    entropy = o.new(N, DType.fp32)
    o.drop(tmp)
    a, b = o.new(N, DType.bool_), o.new(N, DType.bool_)  # target >= max, target > max before target
    top1 = o.new(N, DType.bool_)
    o.drop(a, b)
    logprobs.requires_grad = entropy.requires_grad = True
    temps = [tile_bytes]
    if dt != DType.fp32:
        temps.append(DType.fp32.nbytes(N * H))  # grad_hidden accumulates in fp32, returned .to(hidden.dtype)
    if weight.trainable and wdt != DType.fp32:
        temps.append(DType.fp32.nbytes(weight.numel))  # grad_weight likewise
    if compute != dt:  # AMP: the token chunk's cast and two vocabulary chunks' casts alive at once
        temps += [compute.nbytes(min(N, TOKEN_CHUNK_SIZE) * H)] + [compute.nbytes(min(V, VOCAB_CHUNK_SIZE) * H)] * 2
    params = [weight] + ([bias] if bias is not None else [])
    p = param_id(sim)  # save_for_backward(hidden, weight, bias, targets, log_z, entropy): the parameters' pack ids
    saved = [hs, *p, *(p if bias is not None else []), targets, log_z, entropy]
    sim.node("trl_chunked_logprob", saved, [hs], params, [logprobs, entropy],
             temps=temps, flops=2 * N * H * V)
    o.drop(*bufs)
    sim.unref(mm_buf)
    o.drop(hs, targets, log_z)
    # per_token: x.new_zeros(mask.shape).masked_scatter(mask, x) for log_probs, entropy, is_top1
    full = []
    for t, dtype in ((logprobs, DType.fp32), (entropy, DType.fp32), (top1, DType.bool_)):
        z = o.new(P, dtype)
        y = o.new(P, dtype)
        o.drop(z)
        y.requires_grad = t.requires_grad
        if t.requires_grad:
            sim.node("masked_scatter", [mask], [t], [], [y], grad_input_bytes=[DType.fp32.nbytes(N)])
        full.append(y)
    o.drop(logprobs, entropy, top1)  # the generator is exhausted: the Function's outputs go (entropy stays saved)
    model_loss = o.new(1, DType.fp32)  # -log_probs.sum() / mask.sum().clamp(min=1): FusedCausalLMOutput.loss
    o.drop(x, hv)  # the backbone's output goes when the fused forward returns
    # compute_loss: per_token_loss = -outputs.log_probs; loss = per_token_loss.sum() / num_tokens
    ptl = o.new(P, DType.fp32)
    sim.node("neg", [], [full[0]], [], [ptl])
    s = o.new(1, DType.fp32)
    sim.node("sum", [], [ptl], [], [s], grad_input_bytes=[0])  # SumBackward expands: a view
    loss = o.new(1, DType.fp32)
    sim.node("div", [], [s], [], [loss])
    o.drop(s, ptl, model_loss, *full, mask)  # compute_loss returns: the outputs go
    o.category = "saved activations"
    return loss

"""Expert parallelism (``--ep``): what one rank of an expert-parallel MoE step holds and allocates.

The rules shared with the validator are :mod:`memcalc.core.expert_parallel` (torchtitan 0.3.0's
``ParallelDims`` mesh, the experts' ``Shard(0)`` placement, the capacity factor). Here:

- **Parameters** (:func:`memcalc.engine.blocks.moe.moe_params` with ``ep``): each rank holds
  ``n_experts / ep`` routed experts (their weights, gradients and optimizer state: the optimizer
  steps what the rank holds); the router and the shared experts are whole on every rank. The
  experts are divided by ``ep`` alone, not by the data-parallel degree: without ZeRO / FSDP the
  ``gpus / ep`` expert-parallel groups each hold a whole copy of the experts.
- **The routed experts' step** (:func:`ep_experts`), op by op as torchtitan's
  ``AllToAllTokenDispatcher`` (``torchtitan/models/common/token_dispatcher.py``, 0.3.0) runs
  around the grouped experts (the experts' own ops are transformers' ``grouped_mm_experts_forward``,
  as in :mod:`memcalc.engine.blocks.moe`, on the rows this rank receives):

  with ``N`` tokens on this rank, ``k = top_k``, ``S = N x k`` rows sent, ``R`` rows received
  (:func:`memcalc.core.expert_parallel.received_rows`: ``S`` x ``ep_capacity_factor``), ``E``
  experts, ``e = E / ep`` local ones, ``d = d_model``:

  - ``MoE.forward``: the routing map (``N x E`` bool, ``zeros_like(...).scatter_``) and its
    per-expert counts (``E`` int64), alive until the block's experts return;
  - ``dispatch`` / ``_local_reorder``: ``argsort`` of the ``S`` expert ids (int64, with sort's
    values beside it), the ``S`` scores gathered (their gradient scattered back), ``// top_k`` (the
    token of each row, int64), the rows gathered ``x[token]`` (``S x d``); the counts exchanged by
    an all-to-all (``E`` int64) and summed per rank (two ``ep`` int64 sums, copied to the host);
    the rows sent by ``all_to_all_single`` (``R x d`` received; its backward sends the gradient
    back: ``S x d``); ``_permute``: cumsums, transposed copies and ``repeat_interleave`` of the
    ``E`` counts, the ``R`` permuted indices (int64, made through three more ``R`` int64
    temporaries) and the permuted rows ``R x d`` (the grouped matmul's input);
  - the grouped experts on ``R`` rows with ``e`` experts (the projections ``R x 2f``, ``R x f``,
    ``R x f``, ``R x d``);
  - ``combine``: ``_unpermute`` (``new_empty`` ``R x d`` and ``index_put_``), the rows sent back
    by ``all_to_all_single`` (``S x d``), ``zeros_like(x)`` (``N x d``), the fp32 copy of the rows
    (``S x d`` fp32, saved for the scores' gradient), its product with the scores (``S x d`` fp32)
    cast back (``S x d``), and ``deterministic_scatter_add`` into a new ``N x d`` output (saving
    the token indices; its backward gathers an ``S x d`` gradient).

Ignored: torchtitan's MoE buffers (``tokens_per_expert_E``, ``expert_bias_E``: ``E`` fp32 each, per
layer), NCCL's all-to-all staging (inside NCCL; ``core/gpu_side.py`` counts NCCL's own buffers),
DeepEP / HybridEP dispatchers (their symmetric-memory buffers), and the host copies of the splits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from memcalc.core.dtypes import DType
from memcalc.core.expert_parallel import check_ep, received_rows
from memcalc.core.spec import ExperimentSpec

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.sim import T

#: the MoE block on the walk (``memcalc.engine.blocks.moe._Block``, which calls :func:`ep_experts`;
#: not imported here, not even for typing: blocks.moe imports this module)
_Block = Any

I64 = DType.int64
F32 = DType.fp32


def expert_degree(exp: ExperimentSpec) -> int:
    """The expert-parallel degree of ``exp``'s step (after :func:`check_ep`): the experts one rank
    holds are ``n_experts / expert_degree``."""
    check_ep(exp)
    return exp.training.ep


def _dispatch(b: _Block, x: T, wts: T, idx: T, R: int) -> tuple:
    """``AllToAllTokenDispatcher.dispatch``; returns (the permuted rows ``R x d``, the local counts,
    and the metadata tensors kept for combine: token indices, sorted scores, permuted indices)."""
    o = b.o
    N, E, k, d = b.N, b.moe.n_experts, b.moe.top_k, b.m.d_model
    ep = b.fwd.exp.training.ep
    S = N * k
    dt, wdt = o.dtype_of(x), o.dtype_of(wts)
    # _local_reorder: argsort(ids.view(-1), stable=True) (sort's values and indices; the values go)
    vals = b.new(S, I64)
    order = b.new(S, I64)
    b.drop(vals)
    sc = b.new(S, wdt)  # topk_scores.view(-1)[order]
    b.node("index", [order], [(wts, wts.nbytes)], [], [sc], temps=[wdt.nbytes(S)])
    tok = b.new(S, I64)  # order // top_k
    b.drop(order)
    rows = b.new(S * d, dt)  # x[tok]
    b.node("index", [tok], [(x, dt.nbytes(N * d))], [], [rows], temps=[dt.nbytes(N * d)])
    # the token counts exchanged (no grad), then summed per rank for the splits
    glob = b.new(E, I64)
    sums = [b.new(ep, I64), b.new(ep, I64)]
    b.drop(*sums)
    recv = b.new(R * d, dt)  # all_to_all_single: its backward sends the gradient back (S x d)
    b.node("all_to_all", [], [(rows, rows.nbytes)], [], [recv])
    perm, local = _permute(b, recv, glob, R, E, dt)
    b.drop(rows, glob)  # dispatch's locals
    return perm, local, tok, sc


def _permute(b: _Block, recv: T, glob: T, R: int, E: int, dt: DType) -> tuple:
    """``AllToAllTokenDispatcher._permute``: rank-major to expert-major order."""
    ep = b.fwd.exp.training.ep
    cs = b.new(E, I64)  # cumsum(0)
    starts = b.new(E, I64)  # - counts
    b.drop(cs)
    seg_lens = b.new(E, I64)  # t_mat.t().reshape(-1): a copy
    starts_t = b.new(E, I64)  # input_starts.t().reshape(-1)
    b.drop(starts)
    ar = b.new(E, I64)  # arange(E)
    seg_ids = b.new(R, I64)  # .repeat_interleave(segment_lens, output_size=total)
    b.drop(ar)
    cs2 = b.new(E, I64)
    out_starts = b.new(E, I64)
    b.drop(cs2)
    t1 = b.new(R, I64)  # input_starts[seg_ids]
    t2 = b.new(R, I64)  # arange(R)
    t3 = b.new(R, I64)  # +
    b.drop(t1, t2)
    t4 = b.new(R, I64)  # output_starts[seg_ids]
    pidx = b.new(R, I64)  # -
    b.drop(t3, t4)
    local = b.new(E // ep, I64)  # t_mat.sum(0)
    perm = b.new(recv.numel, dt)  # routed_input[permuted_indices, :]
    b.node("index", [pidx], [(recv, recv.nbytes)], [], [perm], temps=[recv.nbytes])
    b.drop(recv, seg_lens, starts_t, seg_ids, out_starts, pidx)
    return perm, local


def _combine(b: _Block, y: T, x: T, tok: T, sc: T, R: int) -> T:
    """``AllToAllTokenDispatcher.combine``; returns the ``N x d`` output."""
    o = b.o
    N, k, d = b.N, b.moe.top_k, b.m.d_model
    S = N * k
    dt = o.dtype_of(y)
    u = b.new(R * d, dt)  # _unpermute: new_empty, then index_put_ (its backward gathers by the indices)
    b.node("index_put_", [], [(y, y.nbytes)], [], [u])
    back = b.new(S * d, dt)  # all_to_all_single back: its backward sends R x d
    b.node("all_to_all", [], [(u, u.nbytes)], [], [back])
    b.drop(u)
    z = b.new(N * d, dt)  # zeros_like(x_TD)
    if dt != F32:
        f = b.new(S * d, F32)  # .to(float32)
        b.node("to_fp32", [], [(back, back.nbytes)], [], [f])
    else:
        f = o.ref_(back)
    pdt = F32  # fp32 x scores (promotion)
    prod = b.new(S * d, pdt)
    b.node("mul", ([f] if sc.requires_grad else []) + ([sc] if f.requires_grad else []),
           [(f, f.nbytes), (sc, sc.nbytes)], [], [prod], temps=[pdt.nbytes(S * d)])
    b.drop(f)
    if dt != F32:
        c = b.new(S * d, dt)  # .to(routed_output.dtype)
        b.node("to_dtype", [], [(prod, prod.nbytes)], [], [c])
        b.drop(prod)
    else:
        c = prod
    b.drop(back)
    out = b.new(N * d, dt)  # deterministic_scatter_add: out.scatter_add(0, index, src), a new tensor
    # its autograd saves the index (a view of the token indices); backward: gather (S x d) for src
    b.node("scatter_add", [tok], [(z, z.nbytes), (c, c.nbytes)], [], [out])
    b.drop(z, c)
    return out


def ep_experts(b: _Block, x: T, wts: T, idx: T, dt: DType) -> T:
    """The routed experts of one MoE block on an expert-parallel rank (see the module docstring)."""
    o, sim = b.o, b.sim
    N, E, k = b.N, b.moe.n_experts, b.moe.top_k
    tr = b.fwd.exp.training
    R = received_rows(N * k, tr.ep_capacity_factor)
    gated = b.m.mlp == "gated"
    f = b.moe.d_ff_expert
    up_w = 2 * f if gated else f
    rmap = b.raw(N * E)  # MoE.forward: zeros_like(scores, dtype=bool).scatter_(-1, ids, True)
    counts = b.new(E, I64)  # routing_map.sum(dim=(0, 1))
    perm, local, tok, sc = _dispatch(b, x, wts, idx, R)
    offsets = b.raw(4 * (E // tr.ep))  # cumsum(counts, dtype=int32)
    gu, dn = b.p("experts.gate_up_proj"), b.p("experts.down_proj")
    proj = b.new(R * up_w, dt)
    b.grouped_mm(perm, gu, None, offsets, proj)
    if gated:
        gv = sim.alloc(0, "activations", o.category)
        uv = sim.alloc(0, "activations", o.category)
        b.node("chunk", [], [(proj, proj.nbytes)], [], [gv, uv])
        a = b.new(R * f, dt)
        b.node(b.m.activation, [a] if b.m.activation == "relu" else [proj], [(gv, dt.nbytes(R * f))], [], [a])
        h = b.new(R * f, dt)
        b.node("mul", [a, proj], [(a, a.nbytes), (uv, dt.nbytes(R * f))], [], [h])
        b.drop(a, gv, uv)
    else:
        h = b.new(R * f, dt)
        b.node(b.m.activation, [h] if b.m.activation == "relu" else [proj], [(proj, proj.nbytes)], [], [h])
    b.drop(proj)
    y = b.new(R * b.m.d_model, dt)
    b.grouped_mm(h, dn, None, offsets, y)
    b.drop(h)
    out = _combine(b, y, x, tok, sc, R)
    # the experts' call returns: its locals go (the saved ones stay with their nodes)
    b.drop(rmap, counts, perm, local, offsets, y, tok, sc)
    return out

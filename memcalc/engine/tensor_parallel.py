"""Tensor parallelism: what one rank of a ``tp``-way Megatron-style tensor-parallel group holds.

Follows torchtitan's ``apply_tp`` (torchtitan/models/llama3/infra/parallelize.py) on a Llama,
applied with DTensor's ``parallelize_module`` (torch/distributed/tensor/parallel/style.py):

- attention ``wq``/``wk``/``wv`` and feed-forward ``w1``/``w3`` are ``ColwiseParallel``: the
  weight (and bias) is ``Shard(0)``, the output is this rank's ``1/tp`` of the heads (of the
  hidden width);
- ``wo`` and ``w2`` are ``RowwiseParallel``: the weight is ``Shard(1)`` (a bias stays whole,
  ``Replicate``), the output is a ``Partial`` sum of the full ``(B, T, d)`` shape, all-reduced
  (``output_layouts=Replicate()``) or, with sequence parallelism, reduce-scattered to
  ``Shard(1)``;
- ``tok_embeddings`` is ``RowwiseParallel``: vocabulary rows ``Shard(0)``; its output is a
  ``Partial`` ``(B, T, d)``, all-reduced or reduce-scattered the same way;
- ``output`` (the head) is ``ColwiseParallel``: vocabulary rows ``Shard(0)``; its output stays
  sharded on the vocabulary (``Shard(-1)``) for the loss: torchtitan's default loss parallel
  (``loss_parallel()``, torch/distributed/tensor/parallel/loss.py), whose ``_log_softmax``
  keeps ``x - max`` and ``exp(x - max)`` at once and whose backward adds ``exp(x)`` to a zeroed
  gradient (one more local-logits-sized tensor each way than aten's fused kernels);
- norms are whole on every rank. Without sequence parallelism they see the whole residual
  stream ``(B, T, d)``; with it (``SequenceParallel``) the residual stream, the norms and the
  embedding output are ``1/tp`` of the sequence, and every colwise input is all-gathered whole
  (``PrepareModuleInput`` ``Shard(1) -> Replicate``): the gathered ``(B, T, d)`` tensor is what
  the q/k/v (w1/w3, head) linears save for their weight gradients.

In backward a colwise linear's input gradient is a ``Partial`` ``(B, T, d)`` that is
all-reduced (no sequence parallelism: one per linear, in ``from_local``'s backward) or
reduce-scattered once (with it, by the all-gather's backward).

So each rank holds, of every sharded parameter, ``1/tp`` (weights, gradients, optimizer
state), and runs the step of a *local model*: the same decoder with ``n_heads / tp`` query
heads, ``n_kv_heads / tp`` key/value heads, ``d_ff / tp`` hidden width and ``vocab / tp``
vocabulary rows (:func:`local_model`), plus the collectives above (:class:`TensorParallel`,
called by :mod:`memcalc.engine.forward`). 2-D FSDP2 x TP composes: ZeRO shards the local
model's parameters over the ``gpus`` data-parallel ranks.

Mixture-of-experts layers follow torchtitan 0.3.0's ``set_moe_sharding_config(enable_ep=False)``
(``torchtitan/models/common/moe_sharding.py``): ``_moe_sharding_config`` redistributes the MoE's
input to ``Replicate`` (the same gather as a column-parallel input) and its ``Partial`` output to
the residual layout (the same reduce as a row-parallel output); the router is ``Replicate``
(``_router_sharding_config``: every rank routes every token); ``expert_param_placement_dense``
shards the routed experts' ``w1``/``w3`` on dim 1 and ``w2`` on dim 2, so the local model has
``d_ff_expert / tp`` (:func:`local_model`; the walk is ``engine/blocks/moe.py`` ``moe_block``).
DeepSeek-V3's shared experts are column/row-parallel on the same replicated input
(``_shared_expert_colwise_config`` / ``_rowwise_config``: ``shared_width / tp``; their outputs meet the routed
experts' at the boundary: ``engine/blocks/moe.py`` ``_Block.tp_shared``). Qwen2-MoE's gated shared expert,
expert biases and ``--ep`` with ``--tp`` are refused (``core/rules.check_tp``).

Ignored: async TP (micro-pipelined collectives and their symmetric-memory buffers), Float8
TP, context parallelism, the ids mask of the vocabulary-parallel embedding (``_MaskPartial``:
an int64 copy and a bool mask of ``B x T``, bytes per token), NCCL's own buffers. Only
Llama-style blocks are modelled (separate q/k/v, gated or plain MLP, pre-norm); fused
projections, MLA and the other block variants are refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.errors import UserError
from memcalc.core.rules import check_tp as check
from memcalc.core.spec import ExperimentSpec, ModelSpec

if TYPE_CHECKING:  # the decoder walk (memcalc.engine.forward) passes itself in
    from memcalc.engine.sim import T
    from memcalc.engine.strategy import Walk


def local_model(m: ModelSpec, tp: int) -> ModelSpec:
    """The decoder one rank runs: heads, kv heads, hidden width and vocabulary divided by ``tp``,
    head dimension and model width unchanged (the replicated norms, the row-parallel biases and
    the residual stream keep ``d_model``). ``tp == 1``: ``m`` itself."""
    if tp == 1:
        return m
    upd = {}
    if m.moe is not None:  # torchtitan moe_sharding.expert_param_placement_dense: each expert's hidden width / tp
        moe = {"d_ff_expert": m.moe.d_ff_expert // tp}
        if m.moe.d_ff_shared is not None:  # _shared_expert_colwise_config: w1/w3 Shard(0), w2 Shard(1)
            moe["d_ff_shared"] = m.moe.d_ff_shared // tp
        upd["moe"] = m.moe.model_copy(update=moe)
    return m.model_copy(update={
        **upd,
        "n_heads": m.n_heads // tp,
        "n_kv_heads": m.kv_heads // tp,
        "head_dim": m.dim_head,
        "d_ff": m.d_ff // tp,
        "vocab_size": m.vocab_size // tp,
    })


def local_experiment(exp: ExperimentSpec) -> ExperimentSpec:
    """``exp`` with its model replaced by :func:`local_model` (after :func:`check`)."""
    if exp.training.tp == 1:
        return exp
    check(exp)
    return exp.model_copy(update={"model": local_model(exp.model, exp.training.tp)})


class TensorParallel:
    """The collectives of one tensor-parallel rank, as the decoder walk meets them (see the module
    docstring). ``rows`` is ``B x T``; ``seq_rows`` the rows of the residual stream on this rank
    (``B x T / tp`` with sequence parallelism)."""

    def __init__(self, tp: int, sequence_parallel: bool, rows: int, batch: int = 1) -> None:
        self.tp = tp
        self.sp = sequence_parallel
        self.rows = rows
        self.seq_rows = rows // tp if sequence_parallel else rows
        #: sequence parallelism gathers and scatters along dim 1: funcol's all-gather returns its
        #: dim-0 buffer re-concatenated (``_maybe_view_chunk_cat``: a view only when batch is 1), the
        #: reduce-scatter first concatenates its input's chunks on dim 0 (``_chunk_or_narrow_cat``,
        #: a copy) -- torch/distributed/_functional_collectives.py, torch/_utils.py
        self.gather_copy = batch > 1

    @staticmethod
    def of(exp: ExperimentSpec, rows: int) -> Optional["TensorParallel"]:
        """The collectives of ``exp``'s step (None without tensor parallelism); with sequence
        parallelism ``seq`` must divide by ``tp`` (torchtitan's ``parallelize_llama`` asserts it)."""
        tr = exp.training
        tp = tr.tp
        if tp == 1:
            return None
        if tr.sequence_parallel and tr.seq % tp:
            raise UserError(f"--sequence-parallel shards the sequence over --tp {tp}: seq ({tr.seq}) / {tp} = "
                            f"{tr.seq / tp:g} (remainder {tr.seq % tp}); torchtitan requires seq divisible by tp")
        return TensorParallel(tp, tr.sequence_parallel, rows, tr.batch)

    def _new(self, fwd: Walk, like: "T", numel: int) -> "T":
        return fwd.ops.new(numel, fwd.ops.dtype_of(like))

    def reduce(self, fwd: Walk, partial: "T") -> "T":
        """A row-parallel output (embedding, ``wo``, ``w2``): the ``Partial`` ``(B, T, d)`` sum is
        all-reduced (a new tensor; ``_c10d_functional.all_reduce`` is out of place) or, with
        sequence parallelism, reduce-scattered to ``B x T / tp`` rows. The partial goes; the
        backward hands it a gradient of its own size (DTensor's redistribute backward)."""
        cat = fwd.sim.alloc(partial.nbytes, "temporaries", "tensor-parallel collectives") if self.sp else None
        out = self._new(fwd, partial, partial.numel // self.rows * self.seq_rows)
        fwd.sim.unref(cat)
        # backward: the gradient all-gathered (with sequence parallelism: its dim-0 buffer beside the cat)
        fwd.sim.node("tp_all_reduce" if not self.sp else "tp_reduce_scatter", [], [partial], [], [out],
                     grad_input_bytes=[partial.nbytes],
                     temps=[partial.nbytes] if self.sp and self.gather_copy else [])
        fwd.ops.drop(partial)
        return out

    def gather(self, fwd: Walk, x: "T") -> "T":
        """The input of a group of column-parallel linears. Sequence parallelism: the ``1/tp``
        sequence shard all-gathered whole (``PrepareModuleInput``; a new ``(B, T, d)`` tensor that
        the linears save); its backward reduce-scatters the summed ``Partial`` gradient. Without
        it: the same tensor (``DTensor.from_local``, no copy)."""
        if not self.sp:
            return fwd.ops.ref_(x)
        n = x.numel // self.seq_rows * self.rows
        buf = fwd.sim.alloc(fwd.ops.dtype_of(x).nbytes(n), "temporaries", "tensor-parallel collectives") \
            if self.gather_copy else None
        full = self._new(fwd, x, n)
        fwd.sim.unref(buf)
        # backward: the summed gradient's chunks concatenated on dim 0 (a copy), then reduce-scattered
        fwd.sim.node("tp_all_gather", [], [x], [], [full], temps=[full.nbytes])
        return full

    def colwise(self, fwd: Walk, y: "T", x: "T") -> None:
        """A column-parallel linear ``y`` just made from input ``x``: without sequence parallelism
        its input gradient (a ``Partial`` ``(B, T, d)``) is all-reduced in ``from_local``'s
        backward, a second input-sized tensor alive beside it (a backward temporary of the node)."""
        if not self.sp and y.producer is not None and x.requires_grad:
            y.producer.temps.append(x.nbytes)


def grad_numel(name: str, numel: int, tp: int) -> int:
    """Elements of a parameter's gradient on one rank. The vocabulary-parallel embedding's is the
    whole table: DTensor's ``embedding_dense_backward`` strategy gives the ``Shard(0)`` weight a
    ``Replicate`` gradient (torch 2.13: ``RowwiseParallel`` ``tok_embeddings``, output ``Replicate`` or
    ``Shard(1)``; checked on the fake process group), kept as ``.grad`` until the optimizer step."""
    return numel * tp if tp > 1 and name == "embed_tokens.weight" else numel

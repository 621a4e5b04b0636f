"""Context parallelism: what one rank of a ``cp``-way context-parallel group holds.

Every rank runs the whole model on ``seq / cp`` tokens of each sequence (:func:`local_experiment`):
embedding, norms, projections, MLP, head and loss see ``B x seq / cp`` rows, the RoPE table its
``seq / cp`` positions. Only attention needs the other ranks' tokens, in one of two ways
(``TrainingSpec.cp_method``):

**ring** -- torch 2.13's ``context_parallel`` as torchtitan applies it
(torch/distributed/tensor/experimental/_context_parallel/_attention.py; torchtitan's
``maybe_enable_cp`` with the default ``allgather`` rotate method). The head-tail load balancer
(``_load_balancer.py`` ``_HeadTailLoadBalancer``) gives rank ``r`` chunks ``r`` and ``2 cp - 1 - r`` of
``2 cp`` equal chunks. The SDPA kernel (flash for 16-bit inputs) is dispatched through DTensor to
``_scaled_dot_product_ring_flash_attention``; :func:`ring_forward` and :func:`ring_backward` replay what
``_templated_ring_attention`` and ``_templated_ring_attention_backward`` allocate, line by line:

- forward: ``key/value.contiguous()`` (copies of a transposed k or v), ``cat([k, v])`` all-gathered once
  (``_AllGatherRotater``: a ``cp x 2 x kv`` buffer alive through the ring), per step one kernel call
  on the whole local q and the first half of the incoming k/v (steps ``i <= r``) or the second half of
  q and the whole k/v (``i > r``: ``partial``), merged by ``_SDPAMerger`` in fp32
  (``convert_to_f32``: the block output cast, ``out - sigmoid(block_lse - lse) * (out - block_out)``,
  ``lse - logsigmoid(lse - block_lse)``, ``_partial_update``'s ``cat`` for a partial step), the result
  cast back; saved for backward: q, k, v, the output and the merged logsumexp (as the kernel saves);
- backward: fp32 zeros for dq, dk, dv, the k/v all-gathered again (its ``cat`` kept by ``next_kv``), per
  step the flash backward kernel (its scratch inside each call), the dk/dv accumulators concatenated
  in fp32 and rotated by ``permute_tensor`` (``_AllToAllRotater``), ``_partial_update``'s ``cat``
  (steps ``i <= r`` for dk/dv, ``i > r`` for dq), the contiguous half logsumexp of a partial step,
  the results cast back to the input dtype (dk and dv one buffer).

Which rank holds most differs by step; :func:`memcalc.core.ring_attention.worst_rank` replays each
rank's ring (integers only) and the step is simulated for the worst one.

**ulysses** -- DeepSpeed 0.19's ``DistributedAttention`` (deepspeed/sequence/layer.py) around the SDPA
call: q, k and v each go through ``_SeqAllToAll`` (``single_all_to_all``: ``pre_all2all_fun``'s reshape
and permute ``.contiguous()`` copy, ``empty_like`` receive buffer, ``post_all2all``'s permute
``.contiguous()``) from ``(B, seq / cp, H, D)`` to ``(B, seq, H / cp, D)``; the kernel runs on all ``seq``
tokens of ``H / cp`` heads (:func:`ulysses_attention`); its output goes back the same way. The backward of
each all-to-all is the reverse all-to-all of the gradient.

Everything else is as without context parallelism, on ``seq / cp`` tokens. Ignored: the originals of the
sharded batch (torchtitan passes inputs and labels as ``no_restore_buffers``), NCCL's own buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol
from collections.abc import Callable, Iterable

from memcalc.core.dtypes import DType
from memcalc.core.ring_attention import Event, ring_events, ring_shapes, worst_rank
from memcalc.core.rules import check_cp
from memcalc.core.spec import ExperimentSpec

#: the simulator's category of the ring's and the all-to-alls' temporaries
CATEGORY = "context-parallel attention"

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.core.spec import ModelSpec
    from memcalc.engine.ops import Ops
    from memcalc.engine.records import T
    from memcalc.engine.sim import Sim


class _Walk(Protocol):
    """What the context-parallel attention reads of the decoder walk (:class:`memcalc.engine.forward.Forward`)."""

    sim: Sim
    ops: Ops
    m: ModelSpec
    B: int
    T: int
    dim_head: int


def local_experiment(exp: ExperimentSpec) -> ExperimentSpec:
    """The experiment one context-parallel rank runs: ``seq / cp`` tokens (:meth:`ContextParallel.of` checks)."""
    tr = exp.training
    if tr.cp == 1:
        return exp
    return exp.model_copy(update={"training": tr.model_copy(update={"seq": tr.seq // tr.cp})})


def shard_group(exp: ExperimentSpec) -> ExperimentSpec:
    """The experiment as ZeRO sees it: with context parallelism the sharded data-parallel group is
    ``gpus x cp`` ranks (torchtitan's ``apply_fsdp`` on the ``dp_shard_cp`` mesh dimension,
    torchtitan/models/llama3/infra/parallelize.py; DeepSpeed's ZeRO over its ``seq_data_parallel_group``,
    deepspeed/runtime/engine.py), since the cp ranks of one batch hold the same parameters."""
    tr = exp.training
    if tr.cp == 1 or tr.zero == 0:
        return exp
    return exp.model_copy(update={"training": tr.model_copy(update={"gpus": tr.gpus * tr.cp})})


class _Replay:
    """Events on the simulator: each allocation a temporary of :data:`CATEGORY`; ``keep`` names the
    results that ``make`` allocates instead (the kernel's saved outputs)."""

    def __init__(self, sim: Sim, make: Optional[dict[str, Callable[[], T]]] = None) -> None:
        self.sim = sim
        self.make = make or {}
        self.live: dict[str, T] = {}

    def run(self, events: Iterable[Event], free_rest: bool = False) -> None:
        for op, name, b in events:
            if op == "+":
                mk = self.make.get(name)
                self.live[name] = mk() if mk is not None else self.sim.alloc(b, "temporaries", CATEGORY)
            else:
                t = self.live.pop(name, None)
                if t is not None:
                    self.sim.unref(t)
        if free_rest:  # what the replayed function returns, freed here: its caller allocates it again
            for t in self.live.values():
                self.sim.unref(t)
            self.live.clear()


class ContextParallel:
    """The context-parallel attention of one rank (the module docstring): ``cp`` ranks, the method,
    and (ring) the rank simulated."""

    def __init__(self, exp: ExperimentSpec) -> None:
        self.exp = exp  # the experiment as given (ring_shapes divides seq by cp and heads by tp)
        self.cp = exp.training.cp
        self.method = exp.training.cp_method
        self.rank: Optional[int] = None

    @staticmethod
    def of(exp: ExperimentSpec, full: Optional[ExperimentSpec] = None) -> Optional[ContextParallel]:
        """``exp``'s context-parallel attention (None without it); ``exp`` is the rank's decoder (tensor
        parallelism's local model), ``full`` the experiment as given, which :func:`check_cp` checks."""
        tr = exp.training
        if tr.cp == 1:
            return None
        full = full if full is not None else exp
        check_cp(full)
        return ContextParallel(full)

    def attention(self, fwd: _Walk, q: T, k: T, v: T, kernel: str) -> T:
        """The attention core on this rank's q, k, v (``(B, H, seq / cp, D)``, as the kernel takes them);
        returns the output as the o projection takes it (``(B, seq / cp, H x D)``, a copy where the
        output's layout needs one)."""
        if self.method == "ulysses":
            return ulysses_attention(fwd, q, k, v, kernel, self.cp)
        return self.ring(fwd, q, k, v, kernel)

    def ring(self, fwd: _Walk, q: T, k: T, v: T, kernel: str) -> T:
        o, sim, m = fwd.ops, fwd.sim, fwd.m
        if kernel != "flash":
            from memcalc.core.errors import UserError

            raise UserError(f"--cp-method ring is modelled with the flash kernel (16-bit attention inputs); this "
                            f"setup runs {kernel} (use bf16 or fp16 compute, or --cp-method ulysses)")
        B, H, D, S = fwd.B, m.n_heads, fwd.dim_head, fwd.T
        dt = o.dtype_of(q)
        s = ring_shapes(self.exp)
        assert (s.S, s.H, s.dt, s.K) == (S, H, dt, k.nbytes), "the walk's attention shapes differ from ring_shapes"
        if self.rank is None:
            self.rank = worst_rank(self.cp, s)
        r, c = self.rank, self.cp
        res: dict[str, T] = {}

        def make(name: str, numel: int, dtype: DType) -> Callable[[], T]:
            def mk() -> T:
                res[name] = o.new(numel, dtype)
                return res[name]
            return mk

        rep = _Replay(sim, {"out": make("out", B * H * S * D, dt), "lse": make("lse", B * H * S, DType.fp32)})
        fwd_events, bwd_events = ring_events(r, c, s, sim._round)
        rep.run(fwd_events)
        out, lse = res["out"], res["lse"]
        rep.live.pop("out")
        rep.live.pop("lse")
        node = sim.node("sdpa_ring_flash", [q, k, v, out, lse], [q, k, v], [], [out],
                        grad_input_bytes=[q.nbytes, k.nbytes, v.nbytes], flops=4 * B * H * S * S * D * c)
        if node is not None:  # the ring's backward up to its return; its results are the node's gradients
            node.on_backward = lambda sim_, _n: _Replay(sim_).run(bwd_events, free_rest=True)
        o.drop(lse)
        # the merged output is made by _partial_update's torch.cat (a contiguous (B, H, S, D) tensor) once a
        # step is partial (i > r), else it keeps the flash output's (B, S, H, D) layout, unless q itself
        # is contiguous (B, H, S, D) (partial rotary's cat: blocks/attention_variants.output_copy): then the
        # attention's transpose(1, 2).reshape copies it (the o projection saves the copy)
        if r < c - 1 or (m.positions == "rope" and m.rotary_pct < 1):
            y = o.new(out.numel, dt)
            sim.node("contiguous", [], [out], [], [y])
            o.drop(out)
            out = y
        return out


def _all_to_all(fwd: _Walk, x: T, contiguous: bool) -> T:
    """One ``_SeqAllToAll`` (deepspeed 0.19 sequence/layer.py ``single_all_to_all``): ``pre_all2all_fun``'s
    ``reshape(...).contiguous()`` (a copy only of a transposed input) and ``permute(...).contiguous()``,
    the ``empty_like`` receive buffer, ``post_all2all``'s ``permute(...).contiguous()`` (the result);
    the copies before it freed as the function returns. It saves nothing; its backward is the reverse
    all-to-all of the (contiguous) gradient: a permuted copy and a receive buffer beside the result."""
    o, sim = fwd.ops, fwd.sim
    pre = None if contiguous else sim.alloc(x.nbytes, "temporaries", CATEGORY)
    perm = sim.alloc(x.nbytes, "temporaries", CATEGORY)
    sim.unref(pre)
    recv = sim.alloc(x.nbytes, "temporaries", CATEGORY)
    y = o.new(x.numel, o.dtype_of(x))
    sim.unref(perm)
    sim.unref(recv)
    sim.node("ulysses_all_to_all", [], [x], [], [y], temps=[x.nbytes, x.nbytes], grad_input_bytes=[x.nbytes])
    return y


def ulysses_attention(fwd: _Walk, q: T, k: T, v: T, kernel: str, c: int) -> T:
    """DeepSpeed's ``DistributedAttention`` around the SDPA call (the module docstring): q, k, v as the
    ``(B, seq / cp, H, D)`` views of the kernel's inputs through ``_SeqAllToAll`` to ``(B, seq, H / cp, D)``,
    the kernel on those, its output back to ``(B, seq / cp, H, D)``, which the o projection takes as it is.
    q (RoPE's output) and un-expanded k, v are contiguous in that layout; ``repeat_kv``'s copies are
    ``(B, H, S, D)`` tensors, copied by ``pre_all2all_fun``'s ``contiguous()``."""
    o, m = fwd.ops, fwd.m
    H, D, B, S = m.n_heads, fwd.dim_head, fwd.B, fwd.T
    n_rep = H * D * B * S // max(k.numel, 1)  # the kernel's K/V: expanded (n_rep 1) or grouped
    expanded = n_rep == 1 and m.n_heads != m.kv_heads
    qs = _all_to_all(fwd, q, True)
    ks = _all_to_all(fwd, k, not expanded)
    vs = _all_to_all(fwd, v, not expanded)
    out = o.sdpa(qs, ks, vs, B, H // c, S * c, D, None, 0, m.attn_dropout, kernel, n_rep=n_rep)
    o.drop(qs, ks, vs)
    y = _all_to_all(fwd, out, True)
    o.drop(out)
    return y

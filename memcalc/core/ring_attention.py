"""Ring attention's allocations, replayed: torch 2.13's ``_templated_ring_attention`` and
``_templated_ring_attention_backward`` (torch/distributed/tensor/experimental/_context_parallel/_attention.py)
on one rank, as ``(op, name, bytes)`` events in program order (Python frees a tensor when its last name is
rebound, which the events follow line by line).

Shared by the estimator (:mod:`memcalc.engine.context_parallel` replays them on its simulator) and the
validator (``validate/sharded/context_parallel.py`` traces the rank :func:`worst_rank` names).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from memcalc.core.dtypes import DType
from memcalc.core.kernels import flash_head_dim_rounded, flash_seq_rounded

#: an event of a replayed ring: ("+", name, bytes) allocates, ("-", name, 0) frees
Event = tuple[str, str, int]


@dataclass(frozen=True)
class Shapes:
    """The local attention's sizes in bytes: q (``Q``), k or v (``K``), the flash logsumexp (``L``),
    the fp32 twins (``Qf``, ``Kf``), and the flash backward scratch of a call (:meth:`scratch`).
    ``copies``: ``key/value.contiguous()`` copy them (transposed views)."""

    B: int
    H: int
    kvH: int
    S: int
    D: int
    dt: DType
    copies: bool

    @property
    def Q(self) -> int:
        return self.dt.nbytes(self.B * self.H * self.S * self.D)

    @property
    def K(self) -> int:
        return self.dt.nbytes(self.B * self.kvH * self.S * self.D)

    @property
    def Qf(self) -> int:
        return 4 * self.B * self.H * self.S * self.D

    @property
    def Kf(self) -> int:
        return 4 * self.B * self.kvH * self.S * self.D

    @property
    def L(self) -> int:
        return 4 * self.B * self.H * self.S

    def scratch(self, sq: int, sk: int) -> list[int]:
        """FA2 ``mha_bwd``'s scratch for a call on ``sq`` query and ``sk`` key tokens
        (:meth:`memcalc.engine.ops.Ops.sdpa`'s rule): ``dq_accum``, ``softmax_d``, and with grouped K/V
        ``dk_expanded`` / ``dv_expanded``."""
        B, H, D = self.B, self.H, self.D
        tr = flash_seq_rounded(sq)
        out = [B * tr * H * flash_head_dim_rounded(D) * 4, B * H * tr * 4]
        if self.kvH != H:
            out += [self.dt.nbytes(B * sk * H * D)] * 2
        return out


def ring_forward(r: int, c: int, s: Shapes) -> Iterator[Event]:
    """``_templated_ring_attention`` on rank ``r`` of ``c`` (load balanced, causal, all-gather rotater):
    the allocations and frees in order; ``out`` and ``lse`` are the results the kernel node saves."""
    Q, K, L = s.Q, s.K, s.L
    if s.copies:
        yield from (("+", "kc", K), ("+", "vc", K))
    yield from (("+", "cat", 2 * K), ("+", "buf", c * 2 * K), ("-", "cat", 0))
    yield from (("+", "o0", Q), ("+", "lse0", L), ("+", "mout0", 2 * Q))  # block out, its lse, out.to(f32)
    m_out, m_lse = "mout0", "lse0"
    for i in range(1, c):
        if i == 1 and s.copies:
            yield from (("-", "kc", 0), ("-", "vc", 0))
        if i < c - 1:  # the next k/v concatenated for the rotater (the all-gather rotater drops it)
            yield from (("+", "cat", 2 * K), ("-", "cat", 0))
        part = i > r  # the second half of q against the whole k/v
        n = 2 if part else 1
        yield from (("+", f"o{i}", Q // n), ("+", f"lse{i}", L // n), ("-", f"o{i - 1}", 0))
        if f"lse{i - 1}" != m_lse:
            yield ("-", f"lse{i - 1}", 0)
        last = i == c - 1
        nl, no = ("lse" if last and not part else f"nl{i}"), f"no{i}"
        yield ("+", "of", 2 * Q // n)  # the block output in fp32
        # out - sigmoid(block_lse - lse) * (out - block_out); lse - logsigmoid(lse - block_lse)
        yield from (("+", "s1", L // n), ("+", "s2", L // n), ("-", "s1", 0), ("+", "d", 2 * Q // n),
                    ("+", "p", 2 * Q // n), ("-", "s2", 0), ("-", "d", 0), ("+", no, 2 * Q // n), ("-", "p", 0),
                    ("+", "a", L // n), ("+", "b", L // n), ("-", "a", 0), ("+", nl, L // n), ("-", "b", 0))
        if part:  # _partial_update: the merged halves concatenated into new whole-size tensors
            new_lse, new_out = ("lse" if last else f"ml{i}"), f"mo{i}"
            yield from (("+", new_lse, L), ("-", m_lse, 0), ("+", new_out, 2 * Q), ("-", m_out, 0),
                        ("-", nl, 0), ("-", no, 0))
        else:
            new_lse, new_out = nl, no
            yield from (("-", m_lse, 0), ("-", m_out, 0))
        yield ("-", "of", 0)
        m_out, m_lse = new_out, new_lse
    yield from (("+", "out", Q), ("-", m_out, 0), ("-", "buf", 0), ("-", f"o{c - 1}", 0))
    if f"lse{c - 1}" != m_lse:
        yield ("-", f"lse{c - 1}", 0)


def ring_backward(r: int, c: int, s: Shapes) -> Iterator[Event]:
    """``_templated_ring_attention_backward`` on rank ``r`` of ``c``: the allocations and frees in order,
    up to its return (``dq`` and ``dkv``, the gradients it returns, are the node's own)."""
    Q, K, L, Qf, Kf, S = s.Q, s.K, s.L, s.Qf, s.Kf, s.S
    yield from (("+", "gq", Qf), ("+", "gk", Kf), ("+", "gv", Kf))  # zeros_like(..., fp32)
    if s.copies:
        yield from (("+", "kc", K), ("+", "vc", K))
    yield from (("+", "cat0", 2 * K), ("+", "buf", c * 2 * K))  # next_kv keeps its cat; the all-gather
    held_kv = ["gk", "gv"]  # what grad_key / grad_value hold
    gq = "gq"
    prev_a2a = ""
    outs: list[str] = []
    for i in range(c):
        if 0 < i < c - 1:
            yield from (("+", f"cat{i}", 2 * K), ("-", f"cat{i - 1}", 0))
        if i == 1 and s.copies:
            yield from (("-", "kc", 0), ("-", "vc", 0))
        half_q = i > r  # else the whole q; with the first half of k/v for 0 < i <= r
        if half_q:
            yield ("+", f"lh{i}", L // 2)  # logsumexp.chunk(2)[1].contiguous()
            if i - 1 > r:
                yield ("-", f"lh{i - 1}", 0)
        sq, sk = (S // 2, S) if half_q else (S, S if i == 0 else S // 2)
        scratch = s.scratch(sq, sk)
        for j, b in enumerate(scratch):
            yield ("+", f"sc{j}", b)
        new = [f"dq{i}", f"dk{i}", f"dv{i}"]
        kn = S // sk
        yield from (("+", new[0], Q * sq // S), ("+", new[1], K // kn), ("+", new[2], K // kn))
        for j in range(len(scratch)):
            yield ("-", f"sc{j}", 0)
        for name in outs:
            yield ("-", name, 0)
        outs = new
        if i > 0:  # next_grad_kv = the rotated buffer; grad_key / grad_value views of it
            yield ("-", f"ng{i - 1}", 0)
            for name in held_kv:
                yield ("-", name, 0)
            held_kv = [prev_a2a]
            if i <= r:  # _partial_update: new whole-size dk, dv
                yield from (("+", f"pk{i}", Kf), ("+", f"pv{i}", Kf))
                held_kv = [f"pk{i}", f"pv{i}"]
        yield from (("+", f"ng{i}", 2 * Kf), ("+", f"a2a{i}", 2 * Kf))  # cat, permute_tensor
        if prev_a2a and prev_a2a not in held_kv:
            yield ("-", prev_a2a, 0)
        prev_a2a = f"a2a{i}"
        if half_q:  # grad_query: _partial_update's cat
            yield from (("+", f"gq{i}", Qf), ("-", gq, 0))
            gq = f"gq{i}"
    yield from (("+", "dq", Q), ("-", gq, 0), ("+", "dkv", 2 * K), ("-", f"ng{c - 1}", 0))
    for name in held_kv:
        yield ("-", name, 0)
    for name in [f"cat{max(c - 2, 0)}", "buf", *outs, prev_a2a] + ([f"lh{c - 1}"] if c - 1 > r else []):
        yield ("-", name, 0)


def _round(b: int, rb: int) -> int:
    return -(-b // rb) * rb if rb > 1 and b > 1 else b


def _peak(events: Iterable[Event], rb: int = 1) -> int:
    return summary(events, rb)[0]


def summary(events: Iterable[Event], rb: int = 1) -> tuple[int, dict[str, int]]:
    """The largest live sum of ``events`` (each block rounded up to ``rb`` bytes, as the simulator rounds)
    and what is alive at their end (name -> bytes)."""
    live: dict[str, int] = {}
    cur = top = 0
    for op, name, b in events:
        if op == "+":
            b = _round(b, rb)
            live[name] = b
            cur += b
            if cur > top:
                top = cur
        else:
            cur -= live.pop(name, 0)
    return top, live


def compressed(events: Iterable[Event], rb: int = 1) -> list[Event]:
    """``events`` as few as give the same live peak and the same end (the simulator's peak is exact; the
    caching allocator's replay sees one block for the ring's transients): one block of the peak less what
    survives, the survivors, the block freed. A ring of ``cp`` steps is a few events instead of
    ``O(cp)`` per layer (Llama-3.1-8B at cp 32: 32 layers x about 1,200 events otherwise)."""
    top, end = summary(events, rb)
    rest = top - sum(end.values())
    out: list[Event] = [("+", "ring transients", rest)] if rest > 0 else []
    out += [("+", name, b) for name, b in end.items()]
    if rest > 0:
        out.append(("-", "ring transients", 0))
    return out


@lru_cache(maxsize=256)
def ring_events(r: int, c: int, s: Shapes, rb: int) -> tuple[list[Event], list[Event]]:
    """Rank ``r``'s forward and backward ring, :func:`compressed` (cached: every layer runs the same)."""
    return compressed(ring_forward(r, c, s), rb), compressed(ring_backward(r, c, s), rb)


@lru_cache(maxsize=256)
def worst_rank(c: int, s: Shapes) -> int:
    """The rank whose ring holds most at once (forward and backward replayed; the lowest on a tie)."""
    return max(range(c), key=lambda r: (max(_peak(ring_forward(r, c, s)), _peak(ring_backward(r, c, s))), -r))


def ring_shapes(exp) -> Shapes:
    """The shapes one rank's ring sees for ``exp`` (``seq / cp`` tokens of ``heads / tp`` heads, as
    :func:`memcalc.engine.tensor_parallel.local_model` divides them): the kernel's
    k/v are ``repeat_kv``'s contiguous copies with all heads when the model expands grouped K/V (the
    engine's and the replica's attention core), else the grouped (transposed, so copied by
    ``key.contiguous()``) ones, passed with ``enable_gqa`` where transformers' ``use_gqa_in_sdpa`` holds
    (the profile's ``sdpa_gqa``, head dim <= 256)."""
    m, tr = exp.model, exp.training
    H, kvH = m.n_heads // tr.tp, m.kv_heads // tr.tp
    n_rep = H // kvH
    native = n_rep > 1 and exp.profile.sdpa_gqa and m.dim_head <= 256
    expanded = n_rep > 1 and not native and kvH != 1
    return Shapes(tr.batch, H, H if expanded else kvH, tr.seq // tr.cp, m.dim_head, tr.compute_dtype,
                  copies=not expanded)


def gpus_in_all(tr) -> str:
    """Every GPU of the mesh with its factors: ``--gpus`` counts data-parallel replicas, each a
    ``tp x cp x pp`` group (``--ep`` borrows its ranks from ``--gpus``), e.g. ``1,024 GPUs in all (32
    data-parallel x cp 32)``."""
    parts = [f"{tr.gpus} data-parallel"] + [f"{k} {n}" for k, n in (("tp", tr.tp), ("cp", tr.cp), ("pp", tr.pp))
                                            if n > 1]
    n = tr.gpus * tr.tp * tr.cp * tr.pp
    return f"{n:,} GPU{'s' if n > 1 else ''} in all" + (f" ({' x '.join(parts)})" if len(parts) > 1 else "")


def zero_ranks_unit(tr) -> str:
    """What ``--gpus`` counts in the sharding row: `` GPU(s)``, or with ZeRO and ``--cp`` the flattened dp x cp
    ranks FSDP2 shards over (torchtitan's ``dp_shard_cp``), `` data-parallel x cp 4 = 4 ranks``."""
    if tr.zero and tr.cp > 1:
        return f" data-parallel x cp {tr.cp} = {tr.gpus * tr.cp} ranks"
    return " GPUs" if tr.gpus > 1 else " GPU"


def gpus_note(tr) -> Optional[str]:
    """A note where ``--gpus`` equals a model-parallel degree (``--gpus 32 --cp 32``): the GPUs in all are
    their product, not ``--gpus`` (None otherwise)."""
    same = [k for k, n in (("tp", tr.tp), ("cp", tr.cp), ("pp", tr.pp)) if n > 1 and n == tr.gpus]
    if not same:
        return None
    group = tr.tp * tr.cp * tr.pp
    return (f"gpus {tr.gpus} counts data-parallel replicas, each of {group} GPUs ({same[0]} {tr.gpus}"
            + "".join(f" x {k} {n}" for k, n in (("tp", tr.tp), ("cp", tr.cp), ("pp", tr.pp))
                      if n > 1 and k != same[0])
            + f"): {gpus_in_all(tr)}; for {group} GPUs in all set gpus 1")


def tp_line(tr, tp_mark: str = "", sp_mark: str = "") -> Optional[str]:
    """The setup table's tensor-parallel row (memcalc.engine.tensor_parallel), beside :func:`cp_line`."""
    if not (tr.tp > 1 or tr.sequence_parallel):
        return None
    return (f"TP {tr.tp}{tp_mark}" + (f" (sequence parallel{sp_mark})" if tr.sequence_parallel else "")
            + f"; {gpus_in_all(tr)}")


def cp_line(tr, cp_mark: str = "", method_mark: str = "") -> Optional[str]:
    """The setup table's context-parallel row (``tr``: the training spec), or None without it."""
    if tr.cp == 1:
        return None
    return (f"CP {tr.cp}{cp_mark} ({tr.cp_method}{method_mark}); seq {tr.seq // tr.cp} a rank; "
            f"{gpus_in_all(tr)}" + (f"; ZeRO over {tr.gpus} x {tr.cp} ranks" if tr.zero else ""))

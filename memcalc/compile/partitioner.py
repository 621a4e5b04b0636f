"""AOTAutograd's min-cut rematerialization partitioner, over memcalc's op graph.

Under ``torch.compile`` the forward and backward of the compiled region are one
joint graph, and ``torch/_functorch/partitioners.py``
(``min_cut_rematerialization_partition``) decides which forward values the
backward graph receives (saved) and which it recomputes. This module re-implements
that decision, in bytes, on a small graph of :class:`Value` s:

- **the cut** (``solve_min_cut``): every value is an edge ``in -> out`` whose
  capacity is its size; values the backward formulas read are tied to the sink,
  values that may not be recomputed to the source; the minimum cut is the
  cheapest set of values to save. Weights follow the partitioner's
  ``get_node_weight``: size times ``1.1 ** dist_from_bw`` (prefer values close
  to backward), doubled when every user could fuse it (it would not otherwise be
  materialised). Parameters are free to save (they are alive anyway).
- **what may not be recomputed** (``should_ban_recomputation``): ops outside
  the recomputable allowlist (matmuls, attention, embedding, random ops),
  reductions whose output is 4x smaller than their inputs (norm statistics),
  and values a non-fusible backward op reads ("materialised in backward", e.g.
  a matmul's input, kept for its weight gradient).
- **the memory budget** (``choose_saved_values_set``, ``activation_memory_budget``):
  1.0 is the cut above; 0.0 saves only the graph inputs; in between, two more
  aggressive cuts are tried, then a 0/1 knapsack (``dp_knapsack``, quantised to
  1e-4 of the budget range) keeps the banned values with the most recompute
  FLOPs that fit in ``budget x (max - min)`` bytes, where ``max`` is the default
  saved set and ``min`` the graph inputs, and the cut is solved again with the
  rest allowed to be recomputed.

Ignored: the ``used_far_apart`` and ``long_fusible_chains`` heuristics (they
keep some pointwise values that feed far-away users; in a decoder the values
they would keep are already kept as matmul inputs), views (memcalc's graph has
no view nodes), RNG functionalisation and collectives.

Speed (issue 15, ``MEMCALC_WORKERS=1 plan --model llama-3.1-8b --gpu rtx-4090 --compile``, CPU
time in one process, 2-core machine under load, the branch point and the change alternated):
the plan asks for 43 compiled points over 30 recorded graphs (3 shapes). Before, a Dinic
max-flow over each whole network (a LoRA graph: 4,540 nodes, 7,419 arcs) for each of 166 cuts:
``compiled_plan`` 18.3-20.5 s of 26.7-29.8 s (cProfile: 66 of 102 s in ``solve_min_cut``).
After, 3.5-4.0 s of 12.4-14.0 s (2.1x in all): the cut is solved piece by piece
(:mod:`memcalc.compile.mincut`: merged along infinite arcs, split into ~360 pieces, the ~20
distinct ones solved; the residual stream through every layer is the one large piece), cuts are
cached per graph (166 asked, 114 solved: budgets 0.5 and 0.1 share the default and the two
aggressive cuts), the networks' arcs once per graph shape and ban, the weight factors once per
shape, and the GC is paused while ``compiled_plan`` works (2 s of full collections). Left: the
30 graph recordings (1.6 s, half of it the forward walk), the cuts (1.3 s: the residual
stream's piece again at each new batch and sequence, 25 networks built), ``_backward_steps``
(0.4 s); the plan's 43 full-depth compiled steps (3.3 s) and 206 eager ones (4 s) are the
simulator's. Every answer is the former solver's (``tests/unit/test_mincut.py``,
``benchmarks/mincut_equality.py``: 108 cuts and 72 partitions on 12 setups, the snapshots,
``plan --compile --json`` byte for byte).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Hashable, Optional

from memcalc.compile.mincut import Interner, Network, Shape


#: op kinds: "input" (a graph input: parameter or batch), "compute" (compute-intensive:
#: matmul, attention), "random" (dropout), "other" (outside the recomputable allowlist but
#: cheap, e.g. embedding), "pointwise" (what inductor fuses, reductions included; a
#: reduction is banned by its size)
KINDS = ("input", "compute", "random", "other", "pointwise")


@dataclass(eq=False)
class Value:
    """One forward value of the joint graph (an op's output)."""

    name: str
    nbytes: int
    kind: str
    args: list["Value"] = field(default_factory=list)
    flops: int = 0  # forward FLOPs to recompute it (FlopCounterMode's count; 0 for pointwise)
    bw_read: bool = False  # a backward formula reads it
    bw_materialized: bool = False  # a non-fusible backward op (matmul, attention) reads it
    param: bool = False  # a parameter (static lifetime: free to save)
    layer: Optional[int] = None
    extern_aux: bool = False  # a second output of a compute kernel (logsumexp): its own buffer
    users: list["Value"] = field(default_factory=list)
    dist_from_bw: int = 0
    order: int = 0

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"unknown op kind {self.kind!r}"


@dataclass(frozen=True)
class MinCutOptions:
    """Which of the partitioner's recompute bans are on (``config.ban_recompute_*``)."""

    ban_if_materialized_backward: bool = True
    ban_if_not_in_allowlist: bool = True
    ban_if_reduction: bool = True


#: graph shape -> id (see Graph.shape)
_SHAPES = Interner(64)
#: graph shape id -> per value: (a parameter?, 1.1 ** dist_from_bw as _weight takes it, 1 or 2)
_WEIGHT_FACTORS: dict[int, list[tuple[bool, float, int]]] = {}


def _put(cache: dict, key: Hashable, value: Any, limit: int = 64) -> Any:
    """``cache[key] = value``, the cache emptied first when it holds ``limit`` entries."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


class Graph:
    """Forward values in topological order, with users and ``dist_from_bw`` filled in. The values
    must not change once the graph is built: the partitioner caches its cuts on the graph."""

    def __init__(self, values: list[Value]) -> None:
        self.values = values
        for i, v in enumerate(values):
            v.order = i
            v.users = []
        for v in values:
            for a in v.args:
                a.users.append(v)
        # partitioners.py: dist_from_bw = min over users of (user's + 1); a value the
        # backward reads is one step from it
        for v in reversed(values):
            d = 1 if v.bw_read else int(1e9)
            for u in v.users:
                d = min(d, u.dist_from_bw + 1)
            v.dist_from_bw = d
        # the partitioner's caches: (options, dont_ban) -> (saved, banned), and the below
        self._cuts: dict[tuple, tuple[list[Value], list[Value]]] = {}
        self._shape: Optional[int] = None
        self._weights: Optional[list[float]] = None
        self._aux: Optional[dict[Value, list[Value]]] = None
        self._tied: dict[MinCutOptions, list[Value]] = {}  # options -> the values they ban

    def shape(self) -> int:
        """An id of what the flow network depends on besides the ban (each value's kind, flags and
        args): graphs of one shape share it."""
        if self._shape is None:
            shape = tuple((v.kind, v.bw_read, v.bw_materialized, v.param, v.extern_aux,
                           tuple(a.order for a in v.args)) for v in self.values)
            self._shape = _SHAPES(shape)
        return self._shape

    def weights(self) -> list[float]:
        """Each value's ``_weight``, by order (its factors, which depend on the shape only, are
        worked out once per shape)."""
        if self._weights is None:
            factors = _WEIGHT_FACTORS.get(self.shape())
            if factors is None:
                factors = _put(_WEIGHT_FACTORS, self.shape(), [
                    (v.param, 1.1 ** max(min(v.dist_from_bw, 100), 1), 1 if _materialized(v) else 2)
                    for v in self.values])
            # as _weight: 0 for a parameter, else int(bytes x 1.1**dist), doubled if not materialised
            self._weights = [0.0 if param else float(int(v.nbytes * m) * k)
                             for v, (param, m, k) in zip(self.values, factors)]
        return self._weights

    def aux(self) -> dict[Value, list[Value]]:
        """``_aux_of`` this graph."""
        if self._aux is None:
            self._aux = _aux_of(self)
        return self._aux

    @property
    def inputs(self) -> list[Value]:
        return [v for v in self.values if v.kind == "input"]


def _fusible(v: Value) -> bool:
    return v.kind == "pointwise"


def _materialized(v: Value) -> bool:
    """``is_materialized``: an input, or some user cannot fuse it."""
    if v.kind == "input":
        return True
    return v.bw_materialized or any(not (_fusible(v) and _fusible(u)) for u in v.users)


def _ban_reason(v: Value, opts: MinCutOptions) -> Optional[str]:
    """``should_ban_recomputation`` for a forward value."""
    if opts.ban_if_not_in_allowlist:
        if v.kind in ("compute", "random", "other"):
            return "not in recomputable allowlist"
    elif v.kind in ("compute", "random"):
        return "compute intensive" if v.kind == "compute" else "random op"
    if opts.ban_if_materialized_backward and v.bw_materialized:
        return "materialized in backward"
    if opts.ban_if_reduction and v.args:
        if v.nbytes * 4 < sum(a.nbytes for a in v.args):
            return "reduction"
    return None


def _weight(v: Value) -> float:
    """``get_node_weight``: bytes x 1.1**dist_from_bw, doubled if it would not be materialised."""
    if v.param:
        return 0.0
    w = int(v.nbytes * (1.1 ** max(min(v.dist_from_bw, 100), 1)))
    return float(w if _materialized(v) else 2 * w)


def _aux_of(g: Graph) -> dict[Value, list[Value]]:
    """Multi-output kernels: main value -> its extra outputs (``extern_aux``)."""
    aux: dict[Value, list[Value]] = {}
    for v in g.values:
        if v.extern_aux and v.args:
            aux.setdefault(v.args[0], []).append(v)
    return aux


def solve_min_cut(g: Graph, opts: MinCutOptions, dont_ban: frozenset = frozenset()) -> tuple[list[Value], list[Value]]:
    """The saved values (in forward order) and the values banned from recomputation.

    A kernel with several outputs (attention: out and logsumexp) is, in the joint graph, a
    tuple node followed by one ``getitem`` per output. The tuple cannot be saved (its weight
    is infinite) and carries the ban; getitems are never banned themselves
    (``should_ban_recomputation`` returns False for them) but each can be saved. So every
    output of a banned kernel is saved where the backward reads it, and none is recomputed
    from another. Here the main value stands for the tuple plus its first output: its extra
    outputs hang off a tuple node placed in front of it."""
    key = (opts, dont_ban)
    hit = g._cuts.get(key)
    if hit is None:
        banned = _banned(g, opts, dont_ban)
        net_key = (g.shape(), tuple(v.order for v in banned))
        net = _NETWORKS.get(net_key)
        if net is None:
            shape = _FLOW_SHAPES.get(g.shape())
            if shape is None:
                shape = _put(_FLOW_SHAPES, g.shape(), _flow_shape(g), 16)
            entry = _entries(g)
            net = _put(_NETWORKS, net_key, shape.network([entry[v.order] for v in banned]), 256)
        sink = net.sink_side(g.weights())
        saved = [v for v in g.values if not sink[2 * v.order] and sink[2 * v.order + 1]]
        hit = g._cuts[key] = (saved, banned)
    return list(hit[0]), list(hit[1])


#: graph shape -> the arcs of its flow networks but the source's (see _flow_shape)
_FLOW_SHAPES: dict[int, Shape] = {}
#: (graph shape, banned values' orders) -> its flow network (which arcs are infinite, and the
#: pieces it falls into; the capacities are the graph's weights, looked up per solve)
_NETWORKS: dict[tuple, Network] = {}


def _banned(g: Graph, opts: MinCutOptions, dont_ban: frozenset) -> list[Value]:
    """The values tied to the source (may not be recomputed), in forward order."""
    tied = g._tied.get(opts)
    if tied is None:
        aux = g.aux()
        tied = g._tied[opts] = [
            v for v in g.values
            if not (v.extern_aux and v.args and v.args[0] in aux)  # a getitem: its kernel (the tuple) carries the ban
            and (v.kind == "input" or _ban_reason(v, opts))]
    return [v for v in tied if v not in dont_ban] if dont_ban else list(tied)


def _entries(g: Graph) -> list[int]:
    """Per value (by order), the node a source arc ties when it is banned: its in-node, or the
    tuple node in front of a multi-output kernel."""
    n = len(g.values)
    entry = [2 * i for i in range(n)]
    for k, m in enumerate(g.aux()):
        entry[m.order] = 2 * n + 2 + k
    return entry


def _flow_shape(g: Graph) -> Shape:
    """The flow network of ``solve_min_cut`` without the source's arcs. Nodes: ``2 * order`` a
    value's in, ``+ 1`` its out, then source, sink and the tuple nodes; arcs: tail, head, and -1
    (infinite) or the value whose weight is the capacity."""
    n = len(g.values)
    aux = g.aux()
    tuple_of = {m: 2 * n + 2 + k for k, m in enumerate(aux)}
    SRC, SNK = 2 * n, 2 * n + 1
    arcs: list[tuple[int, int, int]] = []
    add = arcs.append
    for v in g.values:
        i_in, i_out = 2 * v.order, 2 * v.order + 1
        if v.bw_read:
            add((i_out, SNK, -1))
        if v in tuple_of:  # args -> tuple -> (main, aux...)
            entry = tuple_of[v]
            add((entry, i_in, -1))
            for a in aux[v]:
                add((entry, 2 * a.order, -1))
        add((i_in, i_out, v.order))
        for u in v.users:
            if not (u.extern_aux and u.args and u.args[0] is v and v in tuple_of):
                add((i_out, tuple_of.get(u, 2 * u.order), -1))
    return Shape(2 * n + 2 + len(tuple_of), arcs, SRC, SNK)


def dp_knapsack(memory: list[float], runtime: list[float], max_memory: float) -> tuple[float, list[int], list[int]]:
    """``torch/_functorch/_activation_checkpointing/knapsack.py::dp_knapsack``: 0/1 knapsack
    maximising saved runtime with memory quantised to 1e-4; returns (runtime, saved, recomputed)."""
    import numpy as np  # here: an estimate with checkpointing imports this module, not numpy

    S = 10000
    qm = [int(round(m * S)) for m in memory]
    rt = np.asarray(runtime, dtype=np.float32)
    cap = int(round(max_memory * S))
    n = len(memory)
    dp = np.zeros((n + 1, cap + 1), dtype=np.float32)
    for i in range(1, n + 1):
        c, r = qm[i - 1], rt[i - 1]
        dp[i, :] = dp[i - 1, :]
        if c == 0:
            dp[i, :] = dp[i - 1, :] + r
        elif c <= cap:
            dp[i, c:] = np.maximum(dp[i - 1, c:], dp[i - 1, :-c] + r)
    saved, recomputed = [], []
    j = cap
    for i in range(n, 0, -1):
        if dp[i][j] != dp[i - 1][j]:
            saved.append(i - 1)
            j -= qm[i - 1]
        else:
            recomputed.append(i - 1)
    saved.reverse()
    return float(dp[n][cap]), saved, recomputed


@dataclass
class Partition:
    """The partitioner's answer: what the backward receives and what it recomputes."""

    saved: list[Value]
    recomputed: list[Value]  # forward values the backward graph computes again
    budget: float
    how: str  # which branch of choose_saved_values_set decided

    @property
    def saved_bytes(self) -> int:
        """Bytes of saved activations (graph inputs excluded: they are alive anyway)."""
        return sum(v.nbytes for v in self.saved if v.kind != "input")

    @property
    def recompute_flops(self) -> int:
        """Forward FLOPs the backward graph spends recomputing."""
        return sum(v.flops for v in self.recomputed)


def _recomputed(g: Graph, saved: list[Value]) -> list[Value]:
    """Forward values the backward needs that are neither saved nor graph inputs, and everything
    on their path back to saved values (the backward graph computes them again)."""
    keep = set(saved)
    out: dict[Value, None] = {}
    stack = [v for v in g.values if v.bw_read and v not in keep and v.kind != "input"]
    while stack:
        v = stack.pop()
        if v in out or v in keep or v.kind == "input":
            continue
        out[v] = None
        stack.extend(v.args)
    return sorted(out, key=lambda v: v.order)


def _size(vs: list[Value]) -> int:
    """``estimate_activations_size`` (in bytes rather than GB)."""
    return sum(v.nbytes for v in vs)


class _Knapsack:
    """The knapsack stage of ``choose_saved_values_set``: the values the fully aggressive
    cut bans that the backward needs, each with its size as a fraction of the budget range
    (``max - min``: default saved set minus graph inputs) and its recompute FLOPs."""

    def __init__(self, g: Graph, aggressive: MinCutOptions, banned: list[Value], min_act: int, max_act: int) -> None:
        self.g, self.opts, self.min_act, self.span = g, aggressive, min_act, max_act - min_act
        aux = _aux_of(g)

        def tuple_bytes(v: Value) -> int:  # _size_of a multi-output kernel: all its outputs
            return v.nbytes + sum(a.nbytes for a in aux.get(v, ()))

        def needed(v: Value) -> bool:  # dist_from_bw < 1e9 (of the tuple: of any output)
            return min([v.dist_from_bw] + [a.dist_from_bw for a in aux.get(v, ())]) < int(1e9)

        self.cands = [v for v in banned if v.kind != "input" and needed(v)]
        self.cands.sort(key=tuple_bytes, reverse=True)  # stable, as Python's sorted
        self.mem = [tuple_bytes(v) / self.span for v in self.cands]
        self.rt = [float(max(v.flops, 1)) for v in self.cands]  # estimate_runtime, "flops" mode

    def ratio(self, vs: list[Value]) -> float:
        """``get_mem_ratio``: where a saved set lies between the inputs (0) and the default (1)."""
        return (_size(vs) - self.min_act) / self.span

    def solve(self, budget: float) -> tuple[list[Value], float, int]:
        """(saved set, FLOPs recomputed as the knapsack counts them, candidates recomputed)."""
        kept_rt, _, recomp = dp_knapsack(self.mem, self.rt, max(budget, 0.0))
        saved, _ = solve_min_cut(self.g, self.opts, frozenset(self.cands[i] for i in recomp))
        return saved, sum(self.rt) - kept_rt, len(recomp)


def _stages(g: Graph, default: list[Value]) -> tuple[Optional[_Knapsack], list[tuple[list[Value], str]]]:
    """Below budget 1: the knapsack stage (None when the default cut is no larger than the
    inputs) and the two cheaper answers tried before it (more aggressive, aggressive)."""
    opts = MinCutOptions()
    min_act, max_act = _size(g.inputs), _size(default)
    if max_act <= min_act:
        return None, []
    more = replace(opts, ban_if_materialized_backward=False)
    more_saved, _ = solve_min_cut(g, more)
    aggr = replace(more, ban_if_not_in_allowlist=False)
    aggr_saved, banned = solve_min_cut(g, aggr)
    ks = _Knapsack(g, aggr, banned, min_act, max_act)
    return ks, [(more_saved, "more aggressive min-cut fits the budget"),
                         (aggr_saved, "aggressive min-cut fits the budget")]


def choose_saved_values_set(g: Graph, memory_budget: float = 1.0) -> Partition:
    """``choose_saved_values_set`` from ``torch/_functorch/partitioners.py`` (see module doc)."""
    if not 0 <= memory_budget <= 1:
        raise ValueError(f"memory budget must be within [0, 1], got {memory_budget}")

    def done(saved: list[Value], how: str) -> Partition:
        return Partition(saved, _recomputed(g, saved), memory_budget, how)

    if memory_budget == 0:
        return done(g.inputs, "budget 0: save only the graph inputs")
    default, _ = solve_min_cut(g, MinCutOptions())
    if memory_budget == 1:
        return done(default, "default min-cut")
    ks, cheaper = _stages(g, default)
    if ks is None:
        return done(default, "default min-cut (no larger than the inputs)")
    for saved, how in cheaper:
        if ks.ratio(saved) < memory_budget:
            return done(saved, how)
    if not ks.cands:
        return done(g.inputs, "nothing recomputable: save the inputs")
    saved, _, n_recomp = ks.solve(memory_budget)
    return done(saved, f"knapsack: keep {len(ks.cands) - n_recomp} of {len(ks.cands)} banned values")


@dataclass(frozen=True)
class FrontierPoint:
    """One corner of the memory-budget trade-off."""

    budget: float  # a budget at which the knapsack makes this choice
    mem_ratio: float  # get_mem_ratio of the saved set: 0 = the graph inputs, 1 = the default set
    saved_bytes: int  # activations saved (graph inputs excluded)
    recompute_flops: int  # FLOPs of the banned values recomputed, as the knapsack counts them


def budget_frontier(g: Graph, resolution: float = 1e-3) -> list[FrontierPoint]:
    """The Pareto frontier of memory budget against recomputation that PyTorch draws with
    ``torch._functorch.config.visualize_memory_budget_pareto`` (partitioners.py, 2.8): the
    knapsack solved at budgets 0 and 1, then bisected wherever two budgets choose differently,
    down to ``resolution``. Sorted by budget; one point per distinct choice (the lowest budget
    that makes it). Empty when the default saved set is no larger than the inputs."""
    ks, _ = _stages(g, solve_min_cut(g, MinCutOptions())[0])
    if ks is None or not ks.cands:
        return []
    cache: dict[float, tuple[float, float, float, int]] = {}

    def at(b: float) -> tuple[float, float, float, int]:
        if b not in cache:
            saved, rt, _ = ks.solve(b)
            cache[b] = (b, rt, ks.ratio(saved), _size([v for v in saved if v.kind != "input"]))
        return cache[b]

    lo, hi = at(0.0), at(1.0)
    found = [lo, hi]
    todo = [(lo, hi)] if lo[1:] != hi[1:] else []
    while todo:
        left, right = todo.pop()
        if right[0] - left[0] < resolution:
            found += [left, right]
            continue
        mid = at((left[0] + right[0]) / 2)
        if mid[1:] != left[1:]:
            todo.append((left, mid))
        if mid[1:] != right[1:]:
            todo.append((mid, right))
    points: dict[tuple, FrontierPoint] = {}
    for b, rt, ratio, nbytes in sorted(found):
        points.setdefault((rt, ratio), FrontierPoint(b, ratio, nbytes, int(rt)))
    return sorted(points.values(), key=lambda p: p.budget)

"""The sink side of a minimum s-t cut, solved piece by piece (exactly).

:meth:`Network.sink_side` answers what the partitioner asks of a max-flow: which nodes can
still reach the sink in the residual graph of a maximum flow (networkx's ``minimum_cut`` takes
these as the sink side; torch's partitioner saves the values whose edge crosses into it). That
set does not depend on which maximum flow is found: it is the smallest sink side among all
minimum cuts (for any maximum flow ``f``, the nodes that reach ``t`` in ``G_f`` form a minimum
cut's sink side, and every minimum cut's sink side contains them). So it depends only on the
capacity of every cut, and any change to the network that keeps the capacity of every finite
cut keeps it. These make the partitioner's networks (a value is an edge ``in -> out`` of its
weight, every other arc infinite) fall apart into small pieces:

- nodes that ``s`` reaches along infinite arcs are on the source side of every finite cut, and
  nodes that reach ``t`` along infinite arcs on the sink side: they are merged into ``s`` and
  ``t`` (a cut that separates them from ``s`` or ``t`` is infinite in both networks);
- then an arc out of ``t`` or into ``s`` never crosses a finite cut forwards, and an arc
  ``s -> t`` crosses every cut (a constant): they go; parallel arcs become one arc of their
  summed capacity;
- what is left falls apart into pieces joined only through ``s`` and ``t``; the minimum cut is
  the union of each piece's own, and so is the sink side (a residual path to ``t`` never passes
  through ``s``, which cannot reach ``t`` after a maximum flow).

Which arcs are infinite decides all of that (:class:`Shape`, :class:`Network`, built once per
graph shape and ban); the finite capacities are looked up per solve. A decoder's layers give
identical pieces (same arcs, same capacities), so each distinct piece is solved once (Dinic's
algorithm on the piece) and its answer cached by its exact shape and capacities. Capacities are
integers (floats holding integers below 2**53, ``inf`` for infinite arcs), so sums and ``> 0``
tests are exact, and every answer is the one a whole-network max-flow gives
(``tests/unit/test_mincut.py``, ``benchmarks/mincut_equality.py``).
"""

from __future__ import annotations

import itertools
from typing import Hashable, Optional, Sequence

INF = float("inf")

#: (piece shape id, its arcs' capacities) -> which of its nodes reach the sink; bounded
_PIECES: dict[tuple, tuple[bool, ...]] = {}
_MAX_PIECES = 200_000


def _closure(start: int, adj: list[list[int]], n: int) -> list[bool]:
    seen = [False] * n
    seen[start] = True
    stack = [start]
    while stack:
        u = stack.pop()
        for v in adj[u]:
            if not seen[v]:
                seen[v] = True
                stack.append(v)
    return seen


class Shape:
    """A family of flow networks that differ only in which nodes the source feeds (by infinite
    arcs) and in their finite capacities.

    ``arcs``: (tail, head, ref) with ``ref`` -1 for an infinite arc, else the index of its
    capacity in the vector :meth:`Network.sink_side` takes. What only the infinite arcs into the
    sink decide (the nodes merged into it) is worked out once here."""

    def __init__(self, n: int, arcs: Sequence[tuple[int, int, int]], s: int, t: int) -> None:
        self.n, self.arcs, self.s, self.t = n, list(arcs), s, t
        self.fwd: list[list[int]] = [[] for _ in range(n)]
        bwd: list[list[int]] = [[] for _ in range(n)]
        for u, v, r in arcs:
            if r < 0:
                self.fwd[u].append(v)
                bwd[v].append(u)
        self.snk = _closure(t, bwd, n)  # on the sink side of every finite cut

    def network(self, fed: Sequence[int]) -> "Network":
        """The network with infinite arcs from the source to ``fed``."""
        src = [False] * self.n  # on the source side of every finite cut
        src[self.s] = True
        stack = [self.s]
        for v in fed:
            if not src[v]:
                src[v] = True
                stack.append(v)
        fwd = self.fwd
        while stack:
            u = stack.pop()
            for v in fwd[u]:
                if not src[v]:
                    src[v] = True
                    stack.append(v)
        return Network(self.n, self.arcs + [(self.s, v, -1) for v in fed], src, self.snk)


class Network:
    """A flow network whose finite capacities are given per solve (see :class:`Shape`), merged and
    split as the module doc says: which arcs are infinite decides that, so it is done once here.
    ``src`` / ``snk``: the nodes the source reaches along infinite arcs / that reach the sink."""

    def __init__(self, n: int, arcs: Sequence[tuple[int, int, int]], src: list[bool], snk: list[bool]) -> None:
        self.unbounded = any(a and b for a, b in zip(src, snk))
        self.base = snk
        where = [_S if a else _T if b else i for i, (a, b) in enumerate(zip(src, snk))]
        refs, nbr = _merged_arcs(n, arcs, where)
        piece, members = _pieces(n, where, nbr)
        #: (nodes, the piece's shape id, its arcs' ends, their capacity refs)
        self.pieces: list[tuple[list[int], int, tuple, list[Optional[tuple[int, ...]]]]] = []
        for group, pa in zip(members, _arcs_by_piece(n, refs, piece, members)):
            pa.sort()
            ends = tuple(e for e, _ in pa)
            sid = _PIECE_SHAPES((len(group), ends))
            self.pieces.append((group, sid, ends, [rs for _, rs in pa]))

    def sink_side(self, caps: Sequence[float]) -> list[bool]:
        """Which nodes can reach the sink in the residual graph of a maximum flow with these
        capacities (integers as floats, >= 0). Raises ``ValueError`` when the maximum flow is
        unbounded (an all-infinite path from source to sink)."""
        if self.unbounded:
            raise ValueError("the cut is unbounded (a value must be both saved and recomputed)")
        out = list(self.base)
        for group, sid, ends, refs in self.pieces:
            key = (sid, tuple([INF if rs is None else caps[rs[0]] if len(rs) == 1 else sum(caps[r] for r in rs)
                               for rs in refs]))
            ans = _PIECES.get(key)
            if ans is None:
                ans = _solve_piece(len(group), [(a, b, c) for (a, b), c in zip(ends, key[1])])
                if len(_PIECES) >= _MAX_PIECES:
                    _PIECES.clear()
                _PIECES[key] = ans
            for v, r in zip(group, ans):
                out[v] = r
        return out


#: the source and the sink, once the nodes merged into them are (:class:`Network`)
_S, _T = -1, -2

#: arcs by their ends after merging -> their capacity refs (None: infinite)
_Refs = dict[tuple[int, int], Optional[list[int]]]


def _merged_arcs(n: int, arcs: Sequence[tuple[int, int, int]], where: list[int]) -> tuple[_Refs, list[list[int]]]:
    """What is left once the source side is merged into s and the sink side into t (``where``: each
    node's new end, ``_S``, ``_T`` or itself): arcs between free nodes, from s, to t (arcs out of t,
    into s, or s -> t never cross a finite cut forwards); parallel arcs are one, of their summed
    capacity (None: infinite). Returns them and each free node's neighbours through free-free arcs."""
    refs: _Refs = {}
    nbr: list[list[int]] = [[] for _ in range(n)]
    for u, v, r in arcs:
        a, b = where[u], where[v]
        if a in (_T, b) or b == _S or (a == _S and b == _T):
            continue
        key = (a, b)
        if key not in refs:
            refs[key] = []
            if a >= 0 and b >= 0:
                nbr[a].append(b)
                nbr[b].append(a)
        have = refs[key]
        if have is not None:
            refs[key] = None if r < 0 else have + [r]
    return refs, nbr


def _pieces(n: int, where: list[int], nbr: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The pieces: free nodes joined by free-free arcs, each numbered in node order. Returns each
    node's piece (-1: merged) and each piece's nodes, sorted."""
    piece = [-1] * n
    members: list[list[int]] = []
    for i in range(n):
        if where[i] != i or piece[i] >= 0:
            continue
        k = len(members)
        piece[i] = k
        group, stack = [i], [i]
        while stack:
            u = stack.pop()
            for v in nbr[u]:
                if piece[v] < 0:
                    piece[v] = k
                    group.append(v)
                    stack.append(v)
        group.sort()
        members.append(group)
    return piece, members


def _arcs_by_piece(n: int, refs: _Refs, piece: list[int], members: list[list[int]]
                   ) -> list[list[tuple[tuple[int, int], Optional[tuple[int, ...]]]]]:
    """Each piece's arcs, with their ends in the piece's own numbering (``_S``, ``_T`` kept) and
    their capacity refs (None: infinite)."""
    local = [0] * n
    for group in members:
        for j, v in enumerate(group):
            local[v] = j
    per: list[list[tuple[tuple[int, int], Optional[tuple[int, ...]]]]] = [[] for _ in members]
    for (a, b), rs in refs.items():
        k = piece[a] if a >= 0 else piece[b]
        per[k].append(((local[a] if a >= 0 else _S, local[b] if b >= 0 else _T), None if rs is None else tuple(rs)))
    return per


class Interner:
    """Ids for hashable keys: equal keys get one id while remembered. Ids are never reused, so the
    table may be cleared (at ``limit`` keys): a key seen again then gets a new id, which only
    misses the caches keyed by ids, never hits a wrong entry."""

    def __init__(self, limit: int) -> None:
        self.ids: dict[Hashable, int] = {}
        self.fresh = itertools.count()
        self.limit = limit

    def __call__(self, key: Hashable) -> int:
        i = self.ids.get(key)
        if i is None:
            if len(self.ids) >= self.limit:
                self.ids.clear()
            i = self.ids[key] = next(self.fresh)
        return i


#: a piece's shape (its nodes, its arcs' ends in local numbering) -> an id for _PIECES' keys
_PIECE_SHAPES = Interner(50_000)


def _solve_piece(m: int, arcs: Sequence[tuple[int, int, float]]) -> tuple[bool, ...]:
    """Dinic's max-flow on one piece (nodes 0..m-1, ``-1`` the source, ``-2`` the sink); which
    nodes reach the sink in the residual graph afterwards."""
    s, t = m, m + 1
    n = m + 2
    adj: list[list[int]] = [[] for _ in range(n)]
    to: list[int] = []
    cap: list[float] = []
    for u, v, c in arcs:
        u = s if u == -1 else u
        v = t if v == -2 else v
        adj[u].append(len(to))
        to.append(v)
        cap.append(c)
        adj[v].append(len(to))
        to.append(u)
        cap.append(0.0)
    if adj[s] and adj[t]:
        _max_flow(n, adj, to, cap, s, t)
    # nodes that reach t: backwards over arcs with residual capacity (e ^ 1 runs the other way)
    seen = [False] * n
    seen[t] = True
    stack = [t]
    while stack:
        v = stack.pop()
        for e in adj[v]:
            u = to[e]
            if not seen[u] and cap[e ^ 1] > 0:
                seen[u] = True
                stack.append(u)
    return tuple(seen[:m])


def _max_flow(n: int, adj: list[list[int]], to: list[int], cap: list[float], s: int, t: int) -> None:
    """Dinic: BFS levels, then a blocking flow by an iterative DFS with current-arc pointers
    that, after each augmentation, resumes from the tail of the first saturated arc."""
    while True:
        level = [-1] * n
        level[s] = 0
        queue = [s]
        for u in queue:
            lu = level[u] + 1
            for e in adj[u]:
                if cap[e] > 0:
                    v = to[e]
                    if level[v] < 0:
                        level[v] = lu
                        queue.append(v)
        if level[t] < 0:
            return
        it = [0] * n
        path: list[int] = []
        u = s
        while True:
            if u == t:
                push = min(cap[e] for e in path)
                if push == INF:  # unreachable: sink_side merged every all-infinite path into s and t
                    raise ValueError("the cut is unbounded (a value must be both saved and recomputed)")
                cut = -1
                for i, e in enumerate(path):
                    cap[e] -= push
                    cap[e ^ 1] += push
                    if cut < 0 and cap[e] <= 0:
                        cut = i
                del path[cut:]
                u = to[path[-1]] if path else s
                continue
            a = adj[u]
            i = it[u]
            nxt = level[u] + 1
            while i < len(a):
                e = a[i]
                if cap[e] > 0 and level[to[e]] == nxt:
                    break
                i += 1
            it[u] = i
            if i < len(a):
                path.append(a[i])
                u = to[a[i]]
            elif u == s:
                break
            else:
                level[u] = -1  # dead end for this phase
                e = path.pop()
                u = to[e ^ 1]
                it[u] += 1

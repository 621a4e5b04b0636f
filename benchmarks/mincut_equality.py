"""Not a speed test: the partitioner's min cuts on real joint graphs against the reference.

``memcalc.compile.mincut.sink_side`` (the network merged into source / sink along infinite arcs,
split into pieces, each distinct piece solved once) replaced a Dinic max-flow over the whole
network followed by a residual search from the sink. This script keeps that earlier solver
verbatim (``_RefFlow``, ``reference_min_cut``) and compares, on the graphs ``plan --compile``
and the compiled reference configs partition (several models, precisions, LoRA / QLoRA, batch
and sequence points), every cut the partitioner asks for: the default, more aggressive and
aggressive options, and knapsack-style cuts with random subsets of the banned values allowed
to be recomputed. The saved and banned lists must be identical (same values, same order), and
so must the whole answer of ``choose_saved_values_set`` at several budgets. It prints the CPU
time of both solvers.

    python benchmarks/mincut_equality.py [--quick]
    python benchmarks/mincut_equality.py --dump plans.pkl      # in one checkout
    python benchmarks/mincut_equality.py --against plans.pkl   # in another

``--quick``: two graphs instead of all (about 20 s). ``--dump`` / ``--against``: the whole
``compiled_plan`` (saved bytes per layer, what the backward holds across steps, the MLP pool,
recompute FLOPs, which branch decided) of every case at seven budgets, written by one checkout
and compared by another (84 plans; the branch point of issue 15's change and the change gave the
same). Exit code 1 on any difference.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from dataclasses import replace
from typing import Optional

from memcalc.compile import partitioner as P
from memcalc.compile.graph import record_graph
from memcalc.compile.partitioner import Graph, MinCutOptions, Value, _aux_of, _ban_reason, _weight

INF = float("inf")


class _RefFlow:
    """The partitioner's former solver, verbatim: Dinic's max-flow on the whole network."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def add(self, u: int, v: int, c: float) -> None:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(c)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)

    def _bfs(self, s: int, t: int) -> Optional[list[int]]:
        level = [-1] * self.n
        level[s] = 0
        q = deque([s])
        while q:
            u = q.popleft()
            for e in self.adj[u]:
                if self.cap[e] > 0 and level[self.to[e]] < 0:
                    level[self.to[e]] = level[u] + 1
                    q.append(self.to[e])
        return level if level[t] >= 0 else None

    def max_flow(self, s: int, t: int) -> float:
        total = 0.0
        while True:
            level = self._bfs(s, t)
            if level is None:
                return total
            it = [0] * self.n
            while True:
                f = self._dfs(s, t, INF, level, it)
                if f <= 0:
                    break
                if f == INF:
                    raise ValueError("the cut is unbounded (a value must be both saved and recomputed)")
                total += f

    def _dfs(self, s: int, t: int, f: float, level: list[int], it: list[int]) -> float:
        path: list[int] = []
        u = s
        while True:
            if u == t:
                push = min([f] + [self.cap[e] for e in path])
                for e in path:
                    self.cap[e] -= push
                    self.cap[e ^ 1] += push
                return push
            adj = self.adj[u]
            while it[u] < len(adj):
                e = adj[it[u]]
                v = self.to[e]
                if self.cap[e] > 0 and level[v] == level[u] + 1:
                    break
                it[u] += 1
            else:
                if not path:
                    return 0.0
                level[u] = -1
                e = path.pop()
                u = self.to[e ^ 1]
                it[u] += 1
                continue
            e = adj[it[u]]
            path.append(e)
            u = self.to[e]

    def reaches(self, t: int) -> list[bool]:
        seen = [False] * self.n
        seen[t] = True
        q = deque([t])
        while q:
            v = q.popleft()
            for e in self.adj[v]:
                u = self.to[e]
                if self.cap[e ^ 1] > 0 and not seen[u]:
                    seen[u] = True
                    q.append(u)
        return seen


def reference_min_cut(g: Graph, opts: MinCutOptions, dont_ban: frozenset = frozenset()) -> tuple[list[Value], list[Value]]:
    """``solve_min_cut`` as it was (network built here, not by ``partitioner._network``)."""
    n = len(g.values)
    aux = _aux_of(g)
    tuple_of = {m: 2 * n + 2 + k for k, m in enumerate(aux)}
    SRC, SNK = 2 * n, 2 * n + 1
    fl = _RefFlow(2 * n + 2 + len(tuple_of))
    banned: list[Value] = []
    for v in g.values:
        i_in, i_out = 2 * v.order, 2 * v.order + 1
        if v.bw_read:
            fl.add(i_out, SNK, INF)
        if v.extern_aux and v.args and v.args[0] in tuple_of:
            reason = None
        else:
            reason = "primal input" if v.kind == "input" else _ban_reason(v, opts)
        entry = i_in
        if v in tuple_of:
            entry = tuple_of[v]
            fl.add(entry, i_in, INF)
            for a in aux[v]:
                fl.add(entry, 2 * a.order, INF)
        if reason and v not in dont_ban:
            banned.append(v)
            fl.add(SRC, entry, INF)
        fl.add(i_in, i_out, _weight(v))
        for u in v.users:
            if not (u.extern_aux and u.args and u.args[0] is v and v in tuple_of):
                fl.add(i_out, tuple_of.get(u, 2 * u.order), INF)
    fl.max_flow(SRC, SNK)
    sink_side = fl.reaches(SNK)
    saved = [v for v in g.values if not sink_side[2 * v.order] and sink_side[2 * v.order + 1]]
    return saved, banned


#: (label, options as memcalc.api.options_from takes them): plan --compile's three options on
#: llama-3.1-8b at batch / seq points of its searches, the compiled reference configs, other families
CASES: list[tuple[str, dict]] = [
    ("llama-3.1-8b bf16 b1 s2048", dict(model="llama-3.1-8b", bf16=True, batch=1, seq=2048)),
    ("llama-3.1-8b lora b3 s2048", dict(model="llama-3.1-8b", lora=True, batch=3, seq=2048)),
    ("llama-3.1-8b qlora b7 s2048", dict(model="llama-3.1-8b", qlora=True, batch=7, seq=2048)),
    ("llama-3.1-8b qlora b1 s13000", dict(model="llama-3.1-8b", qlora=True, batch=1, seq=13000)),
    ("llama-3.1-8b lora b2 s777", dict(model="llama-3.1-8b", lora=True, batch=2, seq=777)),
    ("config compile", dict(config="compile")),
    ("config bf16_budget_60", dict(config="bf16_budget_60")),
    ("gpt2 fp32 b4 s1024", dict(model="gpt2", batch=4, seq=1024)),
    ("gemma-2-9b lora b1 s4096", dict(model="gemma-2-9b", lora=True, batch=1, seq=4096)),
    ("phi-1.5 amp-bf16 b2 s2048", dict(model="phi-1.5", precision="amp-bf16", batch=2, seq=2048)),
    ("mixtral-8x7b qlora b1 s1024", dict(model="mixtral-8x7b", qlora=True, batch=1, seq=1024)),
    ("olmo-2-7b lora b2 s2048", dict(model="olmo-2-7b", lora=True, batch=2, seq=2048)),
]


def experiments(quick: bool) -> list:
    from memcalc.api import options_from
    from memcalc.inputs.resolve import resolve

    cases = CASES[:2] if quick else CASES
    return [(name, resolve(options_from(compile=True, **kw)).exp) for name, kw in cases]


def compare(g: Graph, rng: random.Random, n_random: int) -> tuple[int, float, float]:
    """(cuts compared, reference CPU seconds, new CPU seconds); AssertionError on a difference."""
    default = MinCutOptions()
    more = replace(default, ban_if_materialized_backward=False)
    aggr = replace(more, ban_if_not_in_allowlist=False)
    cases: list[tuple[MinCutOptions, frozenset]] = [(default, frozenset()), (more, frozenset()), (aggr, frozenset())]
    _, banned = reference_min_cut(g, aggr)
    cands = [v for v in banned if v.kind != "input"]
    for _ in range(n_random):
        k = rng.randint(0, len(cands))
        cases.append((aggr, frozenset(rng.sample(cands, k))))
    t_ref = t_new = 0.0
    for opts, dont in cases:
        t0 = time.process_time()
        want = reference_min_cut(g, opts, dont)
        t1 = time.process_time()
        got = P.solve_min_cut(g, opts, dont)
        t2 = time.process_time()
        t_ref += t1 - t0
        t_new += t2 - t1
        if [v.order for v in got[0]] != [v.order for v in want[0]] or [v.order for v in got[1]] != [v.order for v in want[1]]:
            raise AssertionError(f"different cuts: {opts}, {len(dont)} banned values allowed")
    new_solver = P.solve_min_cut
    for budget in BUDGETS:
        P.solve_min_cut = reference_min_cut
        try:
            want_p = P.choose_saved_values_set(g, budget)
        finally:
            P.solve_min_cut = new_solver
        got_p = P.choose_saved_values_set(g, budget)
        if ([v.order for v in got_p.saved], [v.order for v in got_p.recomputed], got_p.how) != \
                ([v.order for v in want_p.saved], [v.order for v in want_p.recomputed], want_p.how):
            raise AssertionError(f"different partitions at budget {budget}")
    return len(cases), t_ref, t_new


#: the budgets whose whole partition (saved, recomputed, which branch decided) is compared
BUDGETS = (1.0, 0.6, 0.5, 0.1, 0.05, 0.0)


#: the budgets of --dump / --against
PLAN_BUDGETS = (1.0, 0.6, 0.5, 0.3, 0.1, 0.05, 0.0)


def plans() -> list:
    """(case, budget, compiled_plan as a dict) for every case and budget."""
    import dataclasses

    from memcalc.api import options_from
    from memcalc.compile.compiled import compiled_plan
    from memcalc.inputs.resolve import resolve

    return [(name, b, dataclasses.asdict(compiled_plan(resolve(options_from(compile=True, memory_budget=b, **kw)).exp)))
            for name, kw in CASES for b in PLAN_BUDGETS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dump", metavar="FILE", help="write every case's compiled plans to FILE")
    ap.add_argument("--against", metavar="FILE", help="compare every case's compiled plans with FILE")
    a = ap.parse_args()
    if a.dump or a.against:
        import pickle

        got = plans()
        if a.dump:
            with open(a.dump, "wb") as f:
                pickle.dump(got, f)
            print(f"{len(got)} compiled plans written to {a.dump}")
            return
        with open(a.against, "rb") as f:
            want = pickle.load(f)
        bad = [(n, b) for (n, b, p), (_, _, q) in zip(got, want) if p != q] + ([("count", len(got))] if len(got) != len(want) else [])
        for n, b in bad:
            print(f"DIFFERENT: {n} at budget {b}", file=sys.stderr)
        print(f"{len(got) - len(bad)} of {len(got)} compiled plans identical")
        sys.exit(1 if bad else 0)
    rng = random.Random(15)
    total = 0
    t_ref = t_new = 0.0
    for name, exp in experiments(a.quick):
        g, _ = record_graph(exp)
        try:
            k, r, n = compare(g, rng, 2 if a.quick else 6)
        except AssertionError as e:
            print(f"{name}: {e}", file=sys.stderr)
            sys.exit(1)
        total += k
        t_ref += r
        t_new += n
        print(f"{name:30s} {len(g.values):5d} values  {k:2d} cuts and {len(BUDGETS)} partitions identical"
              f"  reference {r:5.2f} s  new {n:5.2f} s")
    print(f"all {total} cuts identical; CPU: reference {t_ref:.2f} s, new {t_new:.2f} s ({t_ref / max(t_new, 1e-9):.1f}x)")


if __name__ == "__main__":
    main()

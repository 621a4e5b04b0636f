"""The piecewise min-cut solver gives the same cut as the partitioner's former whole-network Dinic.

``memcalc.compile.mincut`` merges nodes into the source / sink along infinite arcs, splits the
rest into pieces and caches each piece's answer; the partitioner saves the values whose edge
crosses into the sink side (the nodes that reach the sink in the residual graph). That set is
the same for every maximum flow, so any exact solver must give it. The reference is the former
solver, kept verbatim in ``benchmarks/mincut_equality.py`` (``_RefFlow``, ``reference_min_cut``).
"""

from __future__ import annotations

import importlib.util
import random
from dataclasses import replace
from pathlib import Path

import pytest

from memcalc.compile.mincut import INF, Interner, Shape
from memcalc.compile.partitioner import Graph, MinCutOptions, Value, _weight, solve_min_cut

_spec = importlib.util.spec_from_file_location(
    "mincut_equality", Path(__file__).resolve().parents[2] / "benchmarks" / "mincut_equality.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

DEFAULT = MinCutOptions()
MORE = replace(DEFAULT, ban_if_materialized_backward=False)
AGGRESSIVE = replace(MORE, ban_if_not_in_allowlist=False)


def _reference_sink_side(n: int, arcs: list[tuple[int, int, float]], s: int, t: int) -> list[bool]:
    fl = ref._RefFlow(n)
    for u, v, c in arcs:
        fl.add(u, v, c)
    fl.max_flow(s, t)
    return fl.reaches(t)


def _seeds(n: int, quick: int) -> list:
    """Seeds 0..n-1, the first ``quick`` in the quick lane and the rest marked slow (the quick lane
    has a 30 s budget)."""
    return [s if s < quick else pytest.param(s, marks=pytest.mark.slow) for s in range(n)]


def _random_network(rng: random.Random) -> tuple[int, list[tuple[int, int, int]], list[float], list[int]]:
    """n nodes (source n-2, sink n-1), arcs (tail, head, ref: -1 infinite or an index into the
    capacities, several arcs may share one), capacities (some 0), the nodes the source feeds."""
    n = rng.randint(3, 14)
    s, t = n - 2, n - 1
    caps = [float(rng.choice([0, 1, 2, 3, 5, 8, 1000])) for _ in range(rng.randint(1, 12))]
    arcs = []
    for _ in range(rng.randint(0, 3 * n)):
        u, v = rng.randrange(n), rng.randrange(n)
        if u != v and u != s:  # the source's arcs are the fed ones
            arcs.append((u, v, -1 if rng.random() < 0.4 else rng.randrange(len(caps))))
    fed = rng.sample(range(n - 2), rng.randint(0, min(3, n - 2)))
    return n, arcs, caps, fed


@pytest.mark.parametrize("seed", _seeds(120, quick=30))
def test_random_networks(seed):
    """sink_side against Dinic over the whole network and a residual search from the sink, on
    random networks (parallel and opposite arcs, zero capacities, unbounded flows)."""
    rng = random.Random(seed)
    n, arcs, caps, fed = _random_network(rng)
    s, t = n - 2, n - 1
    full = [(u, v, INF if r < 0 else caps[r]) for u, v, r in arcs] + [(s, v, INF) for v in fed]
    try:
        want = _reference_sink_side(n, full, s, t)
    except ValueError:
        want = None
    net = Shape(n, arcs, s, t).network(fed)
    if want is None:
        with pytest.raises(ValueError, match="unbounded"):
            net.sink_side(caps)
    else:
        assert net.sink_side(caps) == want


def _random_graph(rng: random.Random) -> list[Value]:
    """A random forward graph with the partitioner's kinds and flags, multi-output kernels
    (extern_aux values) among them."""
    values: list[Value] = []
    for i in range(rng.randint(1, 30)):
        kind = rng.choice(["input", "input", "compute", "pointwise", "pointwise", "pointwise", "random", "other"])
        args = [] if kind == "input" or not values else rng.sample(values, rng.randint(1, min(3, len(values))))
        v = Value(f"v{i}", rng.choice([4, 64, 1024, 4096, 2**20]), kind, args,
                  flops=rng.choice([0, 10, 1000]), param=kind == "input" and rng.random() < 0.3)
        v.bw_read = rng.random() < 0.4
        v.bw_materialized = v.bw_read and rng.random() < 0.5
        values.append(v)
        if kind in ("compute", "other") and rng.random() < 0.3:
            aux = Value(f"v{i} (aux)", rng.choice([4, 256]), "pointwise", [v])
            aux.extern_aux = True
            aux.bw_read = rng.random() < 0.7
            values.append(aux)
    return values


@pytest.mark.parametrize("seed", _seeds(60, quick=15))
def test_random_graphs(seed):
    """solve_min_cut against the former solver on random graphs: default, more aggressive and
    aggressive options, and a random part of the banned values allowed to be recomputed (the
    knapsack's cuts); asked twice (the second answer comes from the graph's cache)."""
    rng = random.Random(seed)
    g = Graph(_random_graph(rng))
    assert g.weights() == [_weight(v) for v in g.values]  # factors cached per shape
    for opts in (DEFAULT, MORE, AGGRESSIVE):
        try:
            _, banned = ref.reference_min_cut(g, opts)
        except ValueError:
            banned = []
        allowed = frozenset(v for v in banned if v.kind != "input" and rng.random() < 0.5)
        for dont in (frozenset(), allowed):
            try:
                want = ref.reference_min_cut(g, opts, dont)
            except ValueError:
                with pytest.raises(ValueError, match="unbounded"):
                    solve_min_cut(g, opts, dont)
                continue
            for _ in range(2):
                saved, got_banned = solve_min_cut(g, opts, dont)
                assert [v.order for v in saved] == [v.order for v in want[0]]
                assert [v.order for v in got_banned] == [v.order for v in want[1]]


@pytest.mark.slow  # records full-size graphs (a few seconds)
@pytest.mark.parametrize("name,options", ref.CASES[:4], ids=[c[0] for c in ref.CASES[:4]])
def test_real_graphs(name, options):
    """The real joint graphs of plan --compile's options (benchmarks/mincut_equality.py runs all
    of its cases): every cut identical."""
    from memcalc.api import options_from
    from memcalc.compile.graph import record_graph
    from memcalc.inputs.resolve import resolve

    g, _ = record_graph(resolve(options_from(compile=True, **options)).exp)
    ref.compare(g, random.Random(15), 3)  # AssertionError on a difference


def _resized(values: list[Value], rng: random.Random) -> list[Value]:
    """The same graph (kinds, flags, args) with other sizes: a new batch or sequence length."""
    new: dict[Value, Value] = {}
    for v in values:
        c = Value(v.name, rng.choice([4, 64, 1024, 4096, 2**20]), v.kind, [new[a] for a in v.args],
                  flops=v.flops, param=v.param, extern_aux=v.extern_aux)
        c.bw_read, c.bw_materialized = v.bw_read, v.bw_materialized
        new[v] = c
    return list(new.values())


@pytest.mark.parametrize("seed", _seeds(20, quick=5))
def test_same_shape_other_sizes(seed):
    """Graphs of one shape share their flow networks and weight factors (cached by shape) while
    their capacities differ: every cut still the former solver's."""
    rng = random.Random(1000 + seed)
    values = _random_graph(rng)
    for _ in range(4):
        g = Graph(_resized(values, rng))
        assert g.weights() == [_weight(v) for v in g.values]
        for opts in (DEFAULT, MORE, AGGRESSIVE):
            want = ref.reference_min_cut(g, opts)
            saved, banned = solve_min_cut(g, opts)
            assert [v.order for v in saved] == [v.order for v in want[0]]
            assert [v.order for v in banned] == [v.order for v in want[1]]


def test_interner_ids_stay_unique_when_cleared():
    ids = Interner(limit=2)
    a, b = ids("a"), ids("b")
    assert ids("a") == a and a != b
    c = ids("c")  # the table is full: cleared, "c" gets a fresh id
    assert c not in (a, b) and ids("a") not in (a, b, c)

"""The min-cut partitioner and its memory budget, on PyTorch's own small exact cases.

source: pytorch/pytorch test/functorch/test_ac.py (MemoryBudgetTest). Each case there
compiles a tiny function and measures the activation memory held after forward (in MiB;
a 512x512 fp32 tensor is 1 MiB) and the backward FLOPs (in units of one 512^3 matmul,
2*512^3). Here the same functions are written as memcalc graphs and the partitioner's
saved set and recompute FLOPs must give the same numbers, exactly.
"""

from __future__ import annotations

import random

import pytest

from memcalc.compile.partitioner import Graph, Value, choose_saved_values_set, dp_knapsack

MiB = 2**20
UNIT = 2 * 512**3  # FLOPs of one 512x512 @ 512x512 matmul


class G:
    """A tiny graph builder; sizes are in 512-blocks (1 block = 512 elements of fp32 rows)."""

    def __init__(self) -> None:
        self.values: list[Value] = []

    def add(self, v: Value) -> Value:
        self.values.append(v)
        return v

    def input(self, rows: int, cols: int, name: str = "x") -> Value:
        """A leaf tensor of (rows*512, cols*512) fp32 (test_ac's inputs; they require grad)."""
        v = self.add(Value(name, rows * cols * MiB, "input"))
        v.shape = (rows, cols)
        return v

    def cos(self, a: Value) -> Value:
        a.bw_read = True  # cos_backward reads its input
        v = self.add(Value("cos", a.nbytes, "pointwise", [a]))
        v.shape = a.shape
        return v

    def mm(self, a: Value, b: Value) -> Value:
        """mm: backward reads both inputs (grad_a = g b^T, grad_b = a^T g), in matmuls."""
        for t in (a, b):
            t.bw_read = t.bw_materialized = True
        (m, k), (_, n) = a.shape, b.shape
        v = self.add(Value("mm", m * n * MiB, "compute", [a, b], flops=m * k * n * UNIT))
        v.shape = (m, n)
        return v

    def sdpa(self, q: Value) -> Value:
        """SDPA(q, q, q) on one head of (S*512, D*512): reads q and its output, plus a logsumexp
        (S*512 fp32); FlopCounterMode counts 4*S^2*D (two matmuls)."""
        S, D = q.shape
        q.bw_read = q.bw_materialized = True
        out = self.add(Value("sdpa", S * D * MiB, "compute", [q], flops=2 * S * S * D * UNIT))
        out.shape = q.shape
        out.bw_read = out.bw_materialized = True
        lse = self.add(Value("lse", S * 512 * 4, "pointwise", [out]))
        lse.bw_read = lse.bw_materialized = True
        return out

    def total(self, *xs: Value) -> Value:
        return self.add(Value("sum", 4, "pointwise", list(xs)))

    def partition(self, budget: float):
        return choose_saved_values_set(Graph(self.values), budget)


def mem_mib(p) -> float:
    return round(p.saved_bytes / MiB, 1)


def flops_units(p) -> float:
    return p.recompute_flops / UNIT


def rematerializes_cheap() -> G:
    g = G()
    x, w = g.input(1, 1), g.input(1, 1, "w")
    g.total(g.mm(g.cos(x), w))
    return g


@pytest.mark.parametrize("budget,mem,extra", [
    (1.0, 1.0, 0),  # source: test_rematerializes_cheap ("Recomputing .cos() is not free here")
    (0.5, 0.0, 0),  # source: test_rematerializes_cheap (recompute cos from the inputs)
])
def test_rematerializes_cheap(budget, mem, extra):
    p = rematerializes_cheap().partition(budget)
    assert (mem_mib(p), flops_units(p)) == (mem, extra)


def even_chain() -> G:
    g = G()
    x = g.cos(g.input(1, 1))
    for i in range(5):
        x = g.cos(g.mm(x, g.input(1, 1, f"w{i}")))
    g.total(x)
    return g


@pytest.mark.parametrize("tenths", range(11))
def test_matmul_even_chain(tenths):
    # source: test_matmul_even_chain: up to 0.5 the matmuls are saved one by one (each one
    # not saved is recomputed); from 0.6 only the cos are recomputed; 1.0 saves everything
    p = even_chain().partition(tenths / 10)
    if tenths <= 5:
        assert (mem_mib(p), flops_units(p)) == (tenths, 5 - tenths)
    elif tenths < 10:
        assert (mem_mib(p), flops_units(p)) == (5.0, 0)
    else:
        assert (mem_mib(p), flops_units(p)) == (10.0, 0)


def uneven(shapes: list[int]) -> G:
    g = G()
    x = g.input(1, 1)
    g.total(*[g.cos(g.mm(x, g.input(1, d, "w"))) for d in shapes])
    return g


def _random_case():
    # source: test_matmul_uneven_chain's third case, generated as the test does
    random.seed(0)
    arr = [random.randint(0, 50) for _ in range(10)]
    sums = []
    for i in range(10):
        random.shuffle(arr)
        sums.append(sum(arr[:i]))
    return arr, sums


UNEVEN = [
    ([11, 3, 4, 2], [18, 17, 16, 15, 14, 13, 11, 7, 6, 5]),  # source: test_matmul_uneven_chain
    ([3, 5, 11, 17, 14], [42, 30, 19, 8, 3]),  # source: test_matmul_uneven_chain
    _random_case(),
]


@pytest.mark.parametrize("shapes,solves", UNEVEN)
def test_matmul_uneven_chain(shapes, solves):
    g = uneven(shapes)
    assert mem_mib(g.partition(1.0)) == sum(shapes)
    for target in solves:
        assert mem_mib(uneven(shapes).partition(target / sum(shapes))) == target


def pairs(data) -> G:
    g = G()
    outs = []
    for b, o in data:
        x, w = g.input(b, b), g.input(b, o, "w")
        outs.append(g.cos(g.mm(x, w)))
    g.total(*outs)
    return g


@pytest.mark.parametrize("data,budget,mem,extra", [
    ([(1, 4), (2, 2)], 1.0, 8, 0),  # source: test_prioritize_cheaper_matmul (eager)
    ([(1, 4), (2, 2)], 0.5, 4, 4),  # source: test_prioritize_cheaper_matmul ("recomputing x1 @ w1")
    ([(4, 4), (6, 2), (2, 6)], 1.0, 40, 0),  # source: test_prioritize_cheaper_matmul2 (eager)
    ([(4, 4), (6, 2), (2, 6)], 28 / 40, 28, 2 * 2 * 6),  # source: ...cheaper_matmul2 (save w1, w2)
    ([(4, 4), (6, 2), (2, 6)], 16 / 40, 12, 2 * 2 * 6 + 4 * 4 * 4),  # source: ...2 (save w2 only)
])
def test_prioritize_cheaper_matmul(data, budget, mem, extra):
    p = pairs(data).partition(budget)
    assert (mem_mib(p), flops_units(p)) == (mem, extra)


def attention_vs_linear(S: int, D: int) -> G:
    g = G()
    x, w = g.input(S, D), g.input(D, D, "w")
    g.total(g.cos(g.mm(g.sdpa(x), w)))
    return g


@pytest.mark.parametrize("S,D,recomputed", [
    (1, 1, "mm"), (1, 3, "attn"), (2, 2, "mm"), (2, 1, "mm"),  # source: test_attention_vs_linear
    (2, 5, "attn"), (4, 7, "mm"), (4, 9, "attn"),  # source: test_attention_vs_linear
])
def test_attention_vs_linear(S, D, recomputed):
    eager = attention_vs_linear(S, D).partition(1.0)
    assert mem_mib(eager) == S * D * 2
    p = attention_vs_linear(S, D).partition(0.6)
    assert mem_mib(p) == S * D
    expect = 2 * S * S * D if recomputed == "attn" else S * D * D
    assert flops_units(p) == expect


def test_budget_zero_saves_only_inputs():
    p = even_chain().partition(0.0)
    assert p.saved_bytes == 0 and flops_units(p) == 5


@pytest.mark.parametrize("budget", [-0.1, 1.5])
def test_budget_out_of_range(budget):
    with pytest.raises(ValueError, match="within"):
        even_chain().partition(budget)


def test_dp_knapsack_small():
    # three items; capacity 0.5 fits {0, 2} (runtime 5) better than {1} (runtime 4)
    best, saved, recomp = dp_knapsack([0.2, 0.5, 0.3], [2.0, 4.0, 3.0], 0.5)
    assert (best, saved, sorted(recomp)) == (5.0, [0, 2], [1])

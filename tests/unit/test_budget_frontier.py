"""The memory-budget Pareto frontier against the one PyTorch drew on CUDA for the reference run.

Forgather's peak_memory experiment ran ``memory_budget_05`` with
``PARTITIONER_MEMORY_BUDGET_PARETO=1`` on an RTX 4090 (PyTorch 2.8) and committed the plot:
for every budget at which the knapsack changes its mind, the saved set's memory ratio and the
FLOPs it recomputes. ``data/reference/forgather_budget_pareto.csv`` holds its 606 points read
from that SVG. memcalc records the graph from its own op inventory and runs its own
partitioner; this checks every point of the real run, not just the two budgets in the table.
"""

from __future__ import annotations

import pytest

from memcalc.compile.graph import record_graph
from memcalc.inputs.configs import load_config
from memcalc.inputs.data_files import data_root
from memcalc.compile.partitioner import budget_frontier

# the CSV prints the ratio to 4 decimals (as the plot's labels) and the FLOPs to 0.1 GFLOP
TOL_RATIO = 0.6e-4  # 4-decimal rounding, and PyTorch sums sizes in GB floats
TOL_GFLOP = 0.05 + 1e-6


def _published() -> list[tuple[float, float]]:
    text = (data_root() / "reference" / "forgather_budget_pareto.csv").read_text()
    rows = [r for r in text.splitlines() if r and not r.startswith("#")][1:]
    return [(float(a), float(b)) for a, b in (r.split(",") for r in rows)]


@pytest.fixture(scope="module")
def frontier():
    g, _ = record_graph(load_config("memory_budget_05"))
    return budget_frontier(g)


@pytest.mark.slow
def test_frontier_matches_the_cuda_run(frontier):
    """source: memory_budget_pareto_model__0_joint_0.svg (Forgather a0ce9176, PyTorch 2.8, CUDA)."""
    pub = sorted(_published(), key=lambda r: (r[0], -r[1]))
    ours = sorted(((p.mem_ratio, p.recompute_flops / 1e9) for p in frontier), key=lambda r: (round(r[0], 4), -r[1]))
    assert len(ours) == len(pub) == 606
    for (pr, pg), (r, gf) in zip(pub, ours):
        assert abs(r - pr) <= TOL_RATIO, (pr, pg, r, gf)
        assert abs(gf - pg) <= TOL_GFLOP, (pr, pg, r, gf)


@pytest.mark.slow
def test_frontier_is_a_tradeoff(frontier):
    """Along the frontier, more budget saves more and recomputes less (strictly, point to point)."""
    for a, b in zip(frontier, frontier[1:]):
        assert a.budget < b.budget
        assert a.saved_bytes < b.saved_bytes
        assert a.recompute_flops > b.recompute_flops


@pytest.mark.slow
def test_the_tables_budgets_lie_on_it(frontier):
    """source: partitioners.py: a budget takes the last corner at or below it (0.05 keeps 27
    down-projections of 24 MiB; 0.6 keeps about 60% of the default set's range)."""
    from memcalc.compile.compiled import compiled_plan

    for name in ("memory_budget_05", "memory_budget_60"):
        plan = compiled_plan(load_config(name))
        corner = max((p for p in frontier if p.budget <= plan.budget), key=lambda p: p.budget)
        assert plan.saved_bytes == corner.saved_bytes, name

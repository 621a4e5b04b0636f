"""torch.compile and its activation memory budget: the reference rows, the saved set against
PyTorch's own partitioner, and invariants of the budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.compile.compiled import compiled_plan
from memcalc.inputs.configs import load_config
from memcalc.estimate.peak import estimate
from memcalc.core.units import GiB

from conftest import preset_exp, small_config


TOL_PUBLISHED = 0.05  # issue 4: within 5% of the published peak

COMPILED = ["compile", "memory_budget_60", "memory_budget_05", "fused_memory_budget_05", "bf16_budget_60"]
# Rows the model does not yet reproduce within 5% (see docs/how-it-works.md, "torch.compile"):
# bf16_budget_60's published peak is below weights + the saved set the partitioner chooses
# for the configuration as written.
OPEN = {"bf16_budget_60"}


def _err(name: str) -> tuple[float, float, float]:
    exp = load_config(name)
    est = estimate(exp, timeline=False)
    pub = exp.published_peak_bytes
    return est.peak_bytes / GiB, pub / GiB, (est.peak_bytes - pub) / pub


@pytest.mark.slow  # estimates the five full-size compiled configs
def test_print_compiled_table():
    """source: the published peaks in data/configs/<name>.yaml (`published_source`: Forgather's
    examples/tiny_experiments/peak_memory README, github.com/jdinalt/forgather at commit a0ce917)."""
    rows = [(n, *_err(n)) for n in COMPILED]
    print("\n config                   predicted GiB  published GiB    gap")
    for n, p, pub, e in rows:
        print(f" {n:24s} {p:13.3f} {pub:14.3f} {100 * e:+6.1f}%")
    for n, p, pub, e in rows:
        assert abs(e) < 0.25, f"{n}: {100 * e:+.1f}% is far off"  # a regression guard for every row


@pytest.mark.parametrize("name", [  # full-size estimates: the quick lane keeps memory_budget_05
    pytest.param(n, marks=([pytest.mark.xfail(strict=True, reason="open: see OPEN")] if n in OPEN else [])
                 + ([] if n == "memory_budget_05" else [pytest.mark.slow]))
    for n in COMPILED
])
def test_within_published(name):
    # source: data/configs/<name>.yaml published_peak_bytes (Forgather peak_memory README, PyTorch 2.8, RTX 4090)
    _, _, e = _err(name)
    assert abs(e) <= TOL_PUBLISHED


@pytest.mark.slow  # full-size estimates
def test_fusing_the_optimizer_saves_nothing_under_compile():
    # source: data/configs/memory_budget_05.yaml 13.561 vs fused_memory_budget_05.yaml 13.562 GiB;
    # all gradients leave the compiled backward together, before any hook fires
    a = estimate(load_config("memory_budget_05"), timeline=False).peak_bytes
    b = estimate(load_config("fused_memory_budget_05"), timeline=False).peak_bytes
    assert abs(a - b) / a < 0.001


@pytest.mark.slow  # full-size estimates
def test_fusing_still_saves_in_eager():
    # the contrast: eager checkpointing (12.529) vs fused checkpointing (7.425)
    a = estimate(load_config("checkpoint"), timeline=False).peak_bytes
    b = estimate(load_config("fused_checkpoint"), timeline=False).peak_bytes
    assert b < 0.7 * a


@pytest.mark.slow  # full-size estimates
def test_compile_beats_eager_on_the_control():
    # source: data/configs/compile.yaml 19.712 < control.yaml 21.165 GiB (fused pointwise chains keep
    # their inputs, not their intermediates)
    a = estimate(load_config("control"), timeline=False).peak_bytes
    b = estimate(load_config("compile"), timeline=False).peak_bytes
    assert b < a


@pytest.mark.slow  # full-size estimates
def test_report_and_json_carry_the_plan(tmp_path):
    from typer.testing import CliRunner

    from memcalc.cli import app
    import json

    r = CliRunner().invoke(app, ["estimate", "--config", "memory_budget_60", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    c = d["compiled"]
    assert c["memory_budget"] == 0.6 and c["saved_bytes"] < c["default_saved_bytes"]
    assert 0 < d["recompute"]["flops"] < d["recompute"]["forward_flops"]
    r = CliRunner().invoke(app, ["estimate", "--config", "memory_budget_05"])
    assert r.exit_code == 0 and "torch.compile (memory budget 0.05" in r.output


@given(st.lists(st.integers(0, 20), min_size=2, max_size=2, unique=True))
@settings(max_examples=15, deadline=None)
def test_budget_monotone(pair):
    """A smaller budget never saves more and never recomputes less."""
    lo, hi = sorted(b / 20 for b in pair)
    a = compiled_plan(small_config("memory_budget_60", 4, memory_budget=lo))
    b = compiled_plan(small_config("memory_budget_60", 4, memory_budget=hi))
    assert a.saved_bytes <= b.saved_bytes
    assert a.recompute_flops >= b.recompute_flops


def test_amp_budget_changes_nothing():
    # partitioners.py: when the default saved set is no larger than the graph inputs (fp32
    # weights under autocast are the inputs; backward reads their bf16 copies), the budget
    # returns the default cut
    a = compiled_plan(preset_exp("tinyllama-1.1b", 2, 1.0, precision="amp-bf16"))
    b = compiled_plan(preset_exp("tinyllama-1.1b", 2, 0.1, precision="amp-bf16"))
    assert a.saved_bytes == b.saved_bytes and "no larger" in b.how


def test_chain_hold_matches_an_inductor_trace():
    """source: a real inductor step (PyTorch 2.8, CPU; benchmarks/compile_cpu_probe.py) of the
    4-layer model at budget 0.05, batch 4 x 768: the backward first recomputes the chain and,
    per layer, keeps seven (B,T,d) fp32 tensors and one (B,H,T,T) softmax until that layer's
    backward (the CPU path runs math attention). The seventh (B,T,d) is the layer input, which
    the timeline keeps from the forward, so memcalc holds six plus the softmax."""
    exp = small_config("memory_budget_60", 4, memory_budget=0.05)
    exp = exp.model_copy(update={"profile": exp.profile.model_copy(update={"attention": "math"})})
    held = compiled_plan(exp).held
    btd, bhtt = 4 * 768 * 2048 * 4, 4 * 16 * 768 * 768 * 4
    for layer in range(4):
        assert held[(4, layer)] == 6 * btd + bhtt  # computed at the head's step (4)


@pytest.mark.parametrize("budget", [1.0, 0.6, 0.05, 0.0])
def test_nothing_outlives_the_step(budget):
    """Every saved or recomputed activation is freed by the end of the step."""
    from memcalc.estimate.step import simulate

    res = simulate(small_config("memory_budget_60", 4, memory_budget=budget))
    assert res.timeline[-1].by_kind["activations"] == 0


def _probe_exp(layers: int, batch: int, budget: float, precision: str = "fp32"):
    """The CPU probe's model (benchmarks/compile_cpu_probe.py): Deep One's layer, fewer layers."""
    exp = load_config("memory_budget_60")
    return exp.model_copy(update={
        "model": exp.model.model_copy(update={"n_layers": layers, "residual_scale": (2 * layers) ** 0.25}),
        "training": exp.training.model_copy(update={
            "memory_budget": budget, "batch": batch, "seq": 768, "precision": precision,
            "compile_scope": "logits"}),  # the probe compiles the model to its logits, the loss eager
    })


def test_no_mask_is_kept_across_layers():
    """source: the CPU probe with memory-efficient attention (6 layers, budget 0.05, batch 4):
    per layer the recomputed chain keeps q, k, v, the attention output, the o-projection output
    and the first norm's output (six (B,T,d) fp32 tensors) and no (H,T,T) mask: inductor's
    sdpa_constraint copies the mask afresh for each kernel that reads it."""
    plan = compiled_plan(_probe_exp(6, 4, 0.05))
    btd = 4 * 768 * 2048 * 4
    layers_saving_down = [i for i in range(6) if plan.saved_by_layer.get(i)]
    assert layers_saving_down  # the knapsack keeps the down projections of most layers
    for i in layers_saving_down:
        assert plan.held[(6, i)] == 6 * btd


@pytest.mark.parametrize("budget,kept", [
    # source: CPU probe trace (6 layers, budget 0.05): through layer 5's attention backward
    # four ff-wide buffers stay (its MLP values came from the chain: values + one gradient),
    # through layers 4-1 six (recomputed values + gradients, all reused by the next layer)
    (0.05, {5: 4, 4: 6, 3: 6, 2: 6, 1: 6}),
    # source: CPU probe (budget 1.0): up, gate and their product are saved: three gradients
    (1.0, {5: 3, 4: 3, 3: 3, 2: 3, 1: 3}),
])
def test_mlp_reuse_pool(budget, kept):
    plan = compiled_plan(_probe_exp(6, 4, budget))
    btf = 4 * 768 * 5400 * 4
    assert plan.mlp_pool_by_layer == {i: n * btf for i, n in kept.items()}


def test_mlp_reuse_pool_after_chain_layers():
    """source: CPU probe trace of memory_budget_05 itself (32 layers): through layer 31's
    attention backward one ff-wide buffer stays, as layer 30's MLP values come from the chain."""
    plan = compiled_plan(load_config("memory_budget_05"))
    btf = 4 * 768 * 5400 * 4
    assert plan.mlp_pool_by_layer[31] == 1 * btf


# the smallest rows carry a few MiB of the emulated kernels' CPU-only scratch (T x T per head)
TOL_PROBE = 0.06
PROBE = [  # layers, batch, precision, budget, measured peak above the weights (MiB)
    (6, 4, "fp32", 1.0, 3006.2),   # source: benchmarks/compile_cpu_probe.py, PyTorch 2.8 CPU
    (6, 4, "fp32", 0.6, 2476.0),   # source: benchmarks/compile_cpu_probe.py, PyTorch 2.8 CPU
    (6, 4, "fp32", 0.05, 2101.1),  # source: benchmarks/compile_cpu_probe.py, PyTorch 2.8 CPU
    (4, 2, "bf16", 1.0, 647.0),    # source: benchmarks/compile_cpu_probe.py --bf16 --layers 4 --batch 2
    (4, 2, "bf16", 0.6, 625.2),    # source: benchmarks/compile_cpu_probe.py --bf16 --layers 4 --batch 2
    (32, 4, "bf16", 0.6, 5206.2),  # source: compile_cpu_probe.py --bf16 --layers 32: bf16_budget_60 itself
    (32, 4, "fp32", 0.05, 7543.2),  # source: compile_cpu_probe.py --layers 32: memory_budget_05 itself
    # source: compile_cpu_probe.py --layers 32 --budget 0.6: memory_budget_60 itself. memcalc
    # is +6.5%: here inductor inlines the residual stream into the rebuilt chain instead of
    # keeping it (no matmul recomputed there reads it), about 31 x 24 MiB; with bf16, or with
    # 6 layers, it keeps it. Which realization heuristic decides is not modelled yet.
    pytest.param(32, 4, "fp32", 0.6, 9656.4, marks=pytest.mark.xfail(strict=True, reason="residual stream inlined")),
]


def _slow_if_full_size(row):
    """A PROBE row as a param; the full 32-layer model's rows are marked slow."""
    values, marks = (row.values, list(row.marks)) if hasattr(row, "marks") else (row, [])
    return pytest.param(*values, marks=marks + ([pytest.mark.slow] if values[0] >= 32 else []))


@pytest.mark.parametrize("layers,batch,precision,budget,measured_mib", [_slow_if_full_size(r) for r in PROBE])
def test_against_the_cpu_inductor_probe(layers, batch, precision, budget, measured_mib):
    from memcalc.core.units import MiB

    exp = _probe_exp(layers, batch, budget, precision)
    est = estimate(exp, timeline=False)
    step = max(est.phases["forward"], est.phases["backward"]) - exp.training.weight_dtype.nbytes(est.params)
    assert abs(step / MiB - measured_mib) <= TOL_PROBE * measured_mib, (step / MiB, measured_mib)

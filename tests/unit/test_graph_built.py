"""The compiled forward graph of a deep stack built from a shallow recording
(memcalc/compile/graph.py ``record_graph``) is the graph the decoder walk records layer by layer.

``plan --compile`` records the graph at every (batch, seq) it estimates; a stack whose layout
repeats (memcalc/core/layout.py: prefix, periods, suffix) is recorded with five periods and built
out. The partition, the saved set and everything the compiled step reads come from this graph, so
it must be the same graph: every value's name,
size, kind, FLOPs, flags, layer, order and distance from backward, and every edge by position.
"""

from __future__ import annotations

import pytest

from memcalc.api import _resolve
from memcalc.compile import graph as G
from memcalc.compile.compiled import compiled_plan
from memcalc.core.layout import layout_of
from memcalc.core.spec import MoESpec

from conftest import tiny_llama


def _fields(g, outputs):
    idx = {id(v): i for i, v in enumerate(g.values)}
    values = [(v.name, v.nbytes, v.kind, v.flops, v.bw_read, v.bw_materialized, v.param, v.layer, v.extern_aux,
               v.dist_from_bw, v.order, tuple(idx[id(a)] for a in v.args), tuple(idx[id(u)] for u in v.users))
              for v in g.values]
    return values, {k: idx[id(v)] for k, v in outputs.items()}


# each row a different layer body or input table. source: the families' modeling code
# (memcalc/engine/forward.py follows it)
SETUPS = [
    dict(model="llama-3.1-8b", bf16=True, lora=True),  # source: adapters on q,k,v,o, RoPE tables made in layer 0
    dict(model="llama-3.1-8b", bf16=True),  # source: full fine-tune
    dict(model="llama-3.1-8b", qlora=True, batch=2, seq=3000),  # source: dequantised base; flash rows not a multiple of 128
    dict(model="llama-3.1-8b", precision="amp-bf16", lora=True),  # source: autocast copies of the weights
    dict(model="qwen3-8b", bf16=True),  # source: q/k norms
    dict(model="gpt2-xl", bf16=True),  # source: learned positions, LayerNorm with bias, GELU
    dict(model="phi-1.5", bf16=True),  # source: parallel block, partial rotary
    dict(model="gemma-2-9b", bf16=True),  # source: sliding/global alternation (built by periods of two layers)
    dict(model="qwen3-30b-a3b", bf16=True),  # source: mixture of experts
    dict(model="deepseek-v3", bf16=True, seq=256),  # source: MLA, three dense layers, then MoE (a prefix of three)
    dict(model="gemma-3-1b", bf16=True),  # source: five sliding layers and a full one (too shallow: recorded whole)
    dict(model="gpt2", bf16=True),  # source: 12 layers
]


@pytest.mark.parametrize("kw", SETUPS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_built_graph_is_the_recorded_graph(kw):
    exp = _resolve(None, dict(compile=True, **kw)).exp
    # source: definition: the recording of every layer
    assert _fields(*G.record_graph(exp)) == _fields(*G._record(exp))


def test_built_when_the_layout_repeats():
    # source: memcalc/core/layout.py (which stacks may be built from a shallow copy: more layers than
    # five periods of the layout with its prefix and suffix)
    built = []
    real = G._built_deep
    G._built_deep = lambda *a: built.append(1) or real(*a)
    try:
        for model in ("llama-3.1-8b", "gemma-2-9b", "gemma-3-1b"):
            G.record_graph(_resolve(None, dict(model=model, bf16=True, compile=True)).exp)
    finally:
        G._built_deep = real
    assert built == [1, 1]  # gemma-3-1b: 26 layers, five periods of six are 30


# synthetic patterns with a prefix and a suffix. source: memcalc/core/layout.py (prefix_and_period)
PATTERNS = {
    "sliding, full every 3, suffix 2": dict(n_layers=23, sliding_window=64, full_attention_every=3),
    "dense 2 first, MoE every 2, suffix 1": dict(
        n_layers=19, moe=MoESpec(n_experts=4, top_k=2, d_ff_expert=128, first_dense_layers=2, every=2)),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_built_by_periods_is_the_recorded_graph(pattern):
    # source: definition: the recording of every layer; the build must have been taken
    exp = _resolve(None, dict(model="llama-3.1-8b", bf16=True, compile=True, seq=300)).exp
    exp = exp.model_copy(update={"model": tiny_llama(**PATTERNS[pattern])})
    lay = layout_of(exp.model)
    assert (lay.prefix, lay.period, lay.suffix) in ((0, 3, 2), (2, 2, 1))
    built = []
    real = G._built_deep
    G._built_deep = lambda *a: built.append(real(*a))
    try:
        got = _fields(*G.record_graph(exp))
    finally:
        G._built_deep = real
    assert len(built) == 1 and built[0] is not None
    assert got == _fields(*G._record(exp))


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.1])
def test_partition_unchanged(budget, monkeypatch):
    # source: the partition of the recorded graph (the built one must give the same saved set)
    exp = _resolve(None, dict(model="llama-3.1-8b", lora=True, bf16=True, compile=True, memory_budget=budget)).exp
    import memcalc.compile.compiled as C

    def clear():
        for f in (C._plan_cached, C._graph, C._partition, C._realized_values):
            f.cache_clear()

    clear()
    got = compiled_plan(exp)
    clear()
    monkeypatch.setattr(G, "MIN_BUILT_DEPTH", 10**6)
    want = compiled_plan(exp)
    clear()
    assert got == want

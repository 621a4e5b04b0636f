"""The simulator's fast paths keep its bookkeeping exact (memcalc/engine/sim.py).

``Sim.alloc`` and ``Sim.node`` fill in :class:`T` and :class:`Node` without calling their
``__init__``: every field must still be set, to the constructor's defaults. The peak's breakdown
is copied lazily (before the first free after a new peak): it must equal an eager copy taken at
every new peak, on random sequences of allocations and frees (zero-byte blocks and categories that
first appear after the peak included).
"""

from __future__ import annotations

import random

import pytest

from memcalc.engine.checkpoint import Ghosts
from memcalc.engine.observers import AllocEvents, AllocTrace, PeakAbove, StopAbove
from memcalc.engine.result import KINDS
from memcalc.engine.sim import Node, Param, Sim, T


def _fields(obj: object) -> dict:
    return {k: getattr(obj, k) for k in type(obj).__slots__}


def test_alloc_sets_every_field_as_the_constructor_does():
    sim = Sim(512)
    t = sim.alloc(1000, "activations", "saved activations", True, "x", 250, 32)
    expected = T(1024, "activations", "saved activations", requires_grad=True, numel=250, name="x", seq=1)
    assert _fields(t) == _fields(expected)
    with sim.apart(Ghosts(1)):  # a ghost: no bytes, same fields otherwise
        g = sim.alloc(1000, "temporaries", "op workspace")
    assert _fields(g) == _fields(T(0, "temporaries", "op workspace", seq=2))


def test_node_sets_every_field_as_the_constructor_does():
    sim = Sim(512)
    x = sim.alloc(100, "activations", "a")
    x.requires_grad = True
    w = Param("w", sim.alloc(100, "weights", "weights"), True, 100, 0, 25)
    y = sim.alloc(100, "activations", "a")
    n = sim.node("linear", [x], [x], [w], [y], temps=[7], flops=3)
    assert n is not None
    expected = Node("linear", [x], [x], [w], [y], temps=[7], flops=3, offloaded=())
    expected.fwd_label, expected.layer, expected.role = sim.label, sim.layer, sim.role
    assert _fields(n) == _fields(expected)
    m = sim.node("add", [], [x, y], [], [sim.alloc(100, "activations", "a")], grad_input_bytes=[1, 2])
    assert m is not None and m.temps == [] and m.grad_input_bytes == [1, 2] and m.flops == 0


class _Eager(Sim):
    """The breakdown copied at every new peak (the simulator before its lazy copy)."""

    def alloc(self, *args, **kw) -> T:
        before = self.peak
        t = super().alloc(*args, **kw)
        if self.peak > before:
            cats: dict[str, int] = {}
            for (_, cat), v in self.by_cat.items():  # (kind, category) keys, summed per category in first-seen order
                cats[cat] = cats.get(cat, 0) + v
            self.eager_cats = {k: v for k, v in cats.items() if v}
            self.eager_split = {kc: v for kc, v in self.by_cat.items() if v}
            self.eager_kinds = dict(self.by_kind)
        return t


@pytest.mark.parametrize("seed", range(20))
def test_lazy_peak_breakdown_equals_an_eager_copy(seed):
    rng = random.Random(seed)
    sim = _Eager(512)
    alive: list[T] = []
    cats = [f"c{i}" for i in range(8)]
    for _ in range(400):
        if alive and rng.random() < 0.45:
            t = alive.pop(rng.randrange(len(alive)))
            sim.unref(t)
        else:
            size = rng.choice([0, 1, 511, 512, 4096, rng.randrange(1, 10**6)])
            alive.append(sim.alloc(size, rng.choice(KINDS), rng.choice(cats)))
    assert list(sim.peak_categories().items()) == list(sim.eager_cats.items())  # the order too (ties in the breakdown)
    assert sim.peak_kinds_alive() == sim.eager_kinds
    split = sim.peak_by_kind()
    assert {(k, c): v for k, cs in split.items() for c, v in cs.items()} == sim.eager_split
    assert {k: sum(cs.values()) for k, cs in split.items()} == {k: v for k, v in sim.eager_kinds.items() if v}
    assert sum(sim.peak_categories().values()) == sim.peak


def _watched(stop_above=None):
    sim = Sim(512)
    trace, log = AllocTrace(), AllocEvents()
    sim.watch(trace)
    sim.watch(log)
    if stop_above is not None:
        sim.watch(StopAbove(stop_above))
    return sim, trace, log


@pytest.mark.parametrize("seed", range(5))
def test_alloc_many_is_alloc_one_by_one_to_every_observer(seed):
    rng = random.Random(seed)
    rows = [(rng.choice([0, 1, 511, 4096, rng.randrange(1, 10**6)]), rng.choice(["w", "s", "m"]), f"t{i}", i, 16)
            for i in range(50)]
    many, one = _watched(), _watched()
    for sim, _, _ in (many, one):
        sim.mark("weights", "setup")
        sim.unref(sim.alloc(100, "weights", "w"))  # uids and counts already moved
    got = many[0].alloc_many("weights", rows)
    want = [one[0].alloc(nb, "weights", cat, False, name, numel, bits) for nb, cat, name, numel, bits in rows]
    assert [_fields(t) for t in got] == [_fields(t) for t in want]
    assert many[1].rows == one[1].rows and many[2].events == one[2].events
    assert (many[0].peak, many[0].peak_categories(), many[0].phase_peaks) == (
        one[0].peak, one[0].peak_categories(), one[0].phase_peaks)


def test_stop_above_raises_at_the_first_peak_past_it():
    sim, trace, _ = _watched(stop_above=5000)
    sim.alloc(4096, "weights", "w")
    with pytest.raises(PeakAbove) as got:
        sim.alloc(1024, "activations", "a")
    assert (got.value.total, got.value.grads_ready) == (5120, 0) and len(trace.rows) == 1
    bare = Sim(512)  # nothing watched: nothing recorded, no limit
    t = bare.alloc(10**9, "weights", "w")
    assert t.uid == 0 and bare.peak == 10**9

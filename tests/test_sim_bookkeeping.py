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
from memcalc.engine.result import KINDS
from memcalc.engine.sim import Node, Param, Sim, T


def _fields(obj: object) -> dict:
    return {k: getattr(obj, k) for k in type(obj).__slots__}


def test_alloc_sets_every_field_as_the_constructor_does():
    sim = Sim(512)
    t = sim.alloc(1000, "activations", "saved activations", True, "x", 250, 32)
    expected = T(1024, "activations", "saved activations", requires_grad=True, numel=250, name="x", seq=1)
    assert _fields(t) == _fields(expected)
    sim.ghosts = Ghosts(1)  # a ghost: no bytes, same fields otherwise
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
            self.eager_cats = {k: v for k, v in self.by_cat.items() if v}
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
    assert sum(sim.peak_categories().values()) == sim.peak

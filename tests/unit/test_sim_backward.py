"""The simulator's backward (memcalc/engine/sim_backward.py) on hand-made nodes: a gradient goes to
each input that requires one, of the size given for that input, and nothing made in backward outlives
it; AddBackward0 (``passes_grad``) hands the incoming gradient itself to an input of the output's size
and width. Torch-free, a few nodes each."""

from __future__ import annotations

from memcalc.engine.sim import Sim, T


def _act(sim: Sim, nbytes: int, requires_grad: bool, bits: int = 32) -> T:
    return sim.alloc(nbytes, "activations", "a", requires_grad, numel=nbytes * 8 // bits, itemsize_bits=bits)


def test_a_filtered_input_takes_its_size_with_it():
    """q and v need a gradient, k does not (LoRA on q and v, the first layer's frozen k): each gets its
    own size, k's none, and no gradient is left once backward is over (source: the field contract's
    LoraSpec.targets row, whose optimizer-step phase held k's leaked 0.5 MiB gradient)."""
    sim = Sim(512)
    q, k, v = _act(sim, 1024, True), _act(sim, 2048, False), _act(sim, 4096, True)
    out = _act(sim, 1024, False)
    node = sim.node("fused", [], [q, k, v], [], [out], grad_input_bytes=[1024, 2048, 4096])
    assert node is not None and node.inputs == [q, v] and node.grad_input_bytes == [1024, 4096]
    before = sim.total
    sim.backward(out, 1024, lambda n: "bwd")
    assert q.grad_buffer is not None and q.grad_buffer.nbytes == 1024
    assert v.grad_buffer is not None and v.grad_buffer.nbytes == 4096
    assert sim.total == before + 1024 + 4096  # the loss's gradient went with the node


def test_add_passes_the_incoming_gradient_through():
    """y = a + b, a of y's size and width, b fp16: a gets y's gradient itself, b a new 16-bit one
    (torch 2.13 derivatives.yaml add.Tensor; engine.cpp validate_outputs casts b's)."""
    sim = Sim(512)
    a, b = _act(sim, 4096, True), _act(sim, 2048, True, bits=16)
    y = _act(sim, 4096, False)
    assert sim.node("add", [], [a, b], [], [y], grad_input_bytes=[4096, 2048], passes_grad=True) is not None
    sim.backward(y, 4096, lambda n: "bwd")
    g = a.grad_buffer
    assert g is not None and g.refs == 1 and g.nbytes == 4096 and y.grad_buffer is None
    assert b.grad_buffer is not None and b.grad_buffer is not g and b.grad_buffer.nbytes == 2048

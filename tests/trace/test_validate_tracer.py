"""The storage tracer counts what the CUDA caching allocator would: exact small cases by hand."""

from __future__ import annotations

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from memcalc.validate.tracer import StorageTracer, round_up  # noqa: E402


def r512(n: int) -> int:
    return round_up(n, 512)


def test_round_up():
    assert r512(0) == 0 and r512(1) == 512 and r512(512) == 512 and r512(513) == 1024


def test_linear_forward_backward_on_meta_by_hand():
    with torch.device("meta"):
        lin = torch.nn.Linear(1000, 1000)
    x = torch.empty(8, 1000, device="meta")
    tr = StorageTracer("meta")
    tr.track(lin.parameters())
    tr.track([x])
    w, b, xb = r512(4_000_000), r512(4000), r512(32_000)
    assert tr.current == w + b + xb
    with tr:
        y = lin(x)  # addmm: y (8 x 1000 fp32)
        assert tr.current == w + b + xb + r512(32_000)
        tr.set_phase("backward")
        y.sum().backward()  # sum (scalar), its grad (scalar), grad_W, grad_b; x needs no grad
    assert tr.record.bytes == w + b + xb + r512(32_000) + 512 + 512 + w + b
    assert tr.record.phase == "backward"
    del y
    assert tr.current == w + b + xb + w + b  # grads stay, activations are gone


def test_views_count_once_and_frees_are_seen():
    tr = StorageTracer("meta")
    with tr:
        a = torch.empty(1024, device="meta")  # 4096 bytes
        v = a.view(32, 32).t()
        s = a[10:]
        assert tr.current == 4096 and tr.live_storages == 1
        del a, v
        assert tr.current == 4096  # the slice keeps the storage
        del s
        assert tr.current == 0
        z = torch.empty(0, device="meta")
        assert tr.current == 0  # CUDA allocates nothing for zero bytes
        del z
    assert tr.record.bytes == 4096


def test_other_devices_are_ignored_and_reset_peak():
    tr = StorageTracer("meta")
    with tr:
        c = torch.zeros(1000)  # cpu: not the traced device
        big = torch.empty(10_000, device="meta")
        del big
        tr.reset_peak()
        small = torch.empty(10, device="meta")
    assert tr.record.bytes == 512
    del c, small


def test_inplace_and_out_of_place():
    tr = StorageTracer("meta")
    with tr:
        a = torch.empty(256, device="meta")
        a.add_(1)  # in place: no new storage
        assert tr.current == 1024
        b = a + 1
        assert tr.current == 2048
        del a, b

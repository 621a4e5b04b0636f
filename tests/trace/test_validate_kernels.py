"""Kernel emulation on meta: what attention, RMSNorm, dropout and autocast keep, by hand."""

from __future__ import annotations

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from memcalc.validate.amp import Amp  # noqa: E402
from memcalc.validate.blocks.sdpa import choose_kernel, sdpa  # noqa: E402
from memcalc.validate.blocks.adapters import Linear  # noqa: E402
from memcalc.validate.blocks.base import dropout  # noqa: E402
from memcalc.validate.blocks.norm import RMSNorm  # noqa: E402
from memcalc.validate.tracer import StorageTracer, round_up  # noqa: E402

B, H, T, D = 2, 4, 128, 64


def r(n: int) -> int:
    return round_up(n, 512)


def qkv(dtype=torch.float32):
    return [torch.empty(B, H, T, D, device="meta", dtype=dtype, requires_grad=True) for _ in range(3)]


def test_kernel_choice():
    assert choose_kernel("auto", torch.bfloat16, has_mask=False) == "flash"
    assert choose_kernel("auto", torch.bfloat16, has_mask=True) == "efficient"
    assert choose_kernel("auto", torch.float32, has_mask=False) == "efficient"
    assert choose_kernel("flash", torch.float32, has_mask=False) == "efficient"
    assert choose_kernel("math", torch.bfloat16, has_mask=False) == "math"


def test_efficient_saves_output_and_logsumexp_only():
    q, k, v = qkv()
    tr = StorageTracer()
    with tr:
        out = sdpa(q, k, v, None, "efficient", 0.0, True)
        # out (B,H,T,D fp32) + logsumexp (B,H,ceil(T/32)*32 fp32); philox seed/offset live on the host
        assert tr.current == r(B * H * T * D * 4) + r(B * H * 128 * 4)
        del out


def test_flash_saves_output_logsumexp_rng():
    q, k, v = qkv(torch.bfloat16)
    tr = StorageTracer()
    with tr:
        out = sdpa(q, k, v, None, "flash", 0.0, True)
        assert tr.current == r(B * H * T * D * 2) + r(B * H * T * 4) + 512 + 512  # + rng state, unused
        tr.set_phase("backward")
        out.sum().backward()
    assert q.grad.shape == q.shape


def test_math_path_keeps_the_attention_matrix():
    q, k, v = qkv()
    tr = StorageTracer()
    with tr:
        out = sdpa(q, k, v, None, "math", 0.0, True)
        assert tr.current > B * H * T * T * 4  # the softmax output is saved
        del out


def test_alibi_mask_gradient_is_broadcast_to_batch():
    q, k, v = qkv()
    mask = torch.empty(H, T, T, device="meta", requires_grad=True)
    tr = StorageTracer()
    with tr:
        out = sdpa(q, k, v, mask, "efficient", 0.0, False)
        tr.reset_peak()
        out.sum().backward()
    assert mask.grad.shape == (H, T, T)
    # the kernel's bias gradient is (B,H,T,T) before the expand's backward sums it
    assert tr.record.bytes - tr.current >= B * H * T * T * 4 - 4 * H * T * T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_composite_28_vs_fused(dtype):
    n, d = 256, 512
    x = torch.empty(n, d, device="meta", dtype=dtype, requires_grad=True)
    saved = {}
    for mode in ("composite", "composite-legacy", "fused"):
        norm = RMSNorm(d, 1e-6, Amp(), mode=mode, mean_saves_input=False, bias=False, dtype=dtype, device="meta")
        tr = StorageTracer()
        tr.track([x])
        with tr:
            y = norm(x)
            saved[mode] = tr.current - r(n * d * dtype.itemsize)  # what stays besides x
            del y
    rows = r(n * 4)
    fp32 = r(n * d * 4)
    out = r(n * d * dtype.itemsize)
    if dtype == torch.float32:  # xf is x itself; saves rstd and x*rstd; output
        assert saved["composite"] == rows + fp32 + out
    else:  # 2.8: fp32 copy of x, rstd, fp32 x*rstd; output cast back
        assert saved["composite"] == fp32 + rows + fp32 + out
        # legacy casts x*rstd back before the weight multiply: saves the 16-bit copy instead
        assert saved["composite-legacy"] == fp32 + rows + out + out
    assert saved["fused"] == rows + out  # input (already counted) + rstd


def test_dropout_mask_is_bool():
    x = torch.empty(1000, device="meta", requires_grad=True)
    tr = StorageTracer()
    with tr:
        y = dropout(x, 0.1)
        assert tr.current == r(4000) + r(1000)  # output + bool mask
        del y


def test_autocast_caches_trainable_weights_until_region_exit():
    amp = Amp(torch.bfloat16)
    lin = Linear(256, 256, False, amp, dtype=torch.float32, device="meta", init=False)
    x = torch.empty(8, 256, device="meta", requires_grad=True) * 2  # an activation, not a leaf
    tr = StorageTracer()
    tr.track([x, lin.weight])
    base = tr.current
    with tr:
        with amp.region():
            y1 = lin(x)
            y2 = lin(x)
            # one cached bf16 weight copy; x is cast twice (activations are not cached)
            assert tr.current - base == r(256 * 256 * 2) + 2 * r(8 * 256 * 2) + 2 * r(8 * 256 * 2)
            del y1, y2
        assert tr.current == base  # leaving the region clears the cache

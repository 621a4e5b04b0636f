"""Unsloth's LoRA kernels, traced: ``LoRA_QKV``, ``LoRA_W`` and ``LoRA_MLP`` of unsloth 2026.10.9 run unmodified
on meta (only their Triton launches are no-ops: memcalc.validate.unsloth_kernels) against the estimator's blocks
(memcalc.engine.blocks.unsloth_lora) on the same shapes: what each Function leaves saved after forward, its
forward peak and its backward peak above what existed before it. The rest of Unsloth's step is read from source,
not traced (memcalc.core.unsloth; ``memcalc validate --framework unsloth`` says so).

The grid: each group on a 16-bit base, two widths (a Llama-like GQA shape and an MHA one), rank 8 and 16, 64 and
200 rows (200: sizes off the 512-byte rounding).

# source: each row is a trace of unsloth 2026.10.9 unsloth/kernels/fast_lora.py on meta
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

import importlib.util  # noqa: E402

# (not importorskip: a whole ``import unsloth`` takes its CPU fallback and patches transformers)
if importlib.util.find_spec("unsloth") is None or importlib.util.find_spec("triton") is None:
    pytest.skip("unsloth and triton are not installed", allow_module_level=True)

from conftest import tiny_llama  # noqa: E402

from memcalc.core.dtypes import DType  # noqa: E402
from memcalc.core.spec import ExperimentSpec, LoraSpec, TrainingSpec  # noqa: E402
from memcalc.engine.blocks import unsloth_lora  # noqa: E402
from memcalc.engine.forward import Forward  # noqa: E402
from memcalc.engine.sim import Sim  # noqa: E402
from memcalc.engine.strategy import LayerStrategy  # noqa: E402
from memcalc.engine.weights import make_params  # noqa: E402
from memcalc.inputs.profiles import profile_for  # noqa: E402
from memcalc.validate.unsloth_kernels import GroupTrace, trace_group  # noqa: E402

#: each number must agree to the byte: both sides count the same 512-byte-rounded storages
TOLERANCE_BYTES = 0

#: (d_model, heads, kv heads, d_ff, rank, rows)
SHAPES = [
    (256, 4, 1, 688, 8, 1024),  # source: GQA (kv 64 wide), SwiGLU d_ff 688
    (128, 4, 4, 384, 16, 1000),  # source: MHA, rank 16, 1000 rows (off the 512-byte rounding)
]


def engine_group(group: str, d: int, heads: int, kv: int, ff: int, rank: int, rows: int) -> GroupTrace:
    """The estimator's block for ``group`` on a (1, rows, width) bf16 input that exists before it, measured as the
    trace measures: saved bytes after forward besides the outputs, forward and backward peaks above the start."""
    m = tiny_llama(n_layers=1, d_model=d, n_heads=heads, n_kv_heads=kv, d_ff=ff, vocab_size=256)
    tr = TrainingSpec(batch=1, seq=rows, precision="bf16",
                      lora=LoraSpec(rank=rank, alpha=2 * rank, targets=("q", "k", "v", "o", "gate", "up", "down")))
    exp = ExperimentSpec(name="t", model=m, training=tr, profile=profile_for("unsloth"))
    sim = Sim(512)
    high = [0]

    class High:  # the running total's maximum since the last reset (an observer: memcalc.engine.observers)
        def on_row(self, row):
            high[0] = max(high[0], row[0])
    sim.watch(High())
    fwd = Forward(sim, exp, make_params(sim, exp), LayerStrategy())
    width = m.q_dim if group == "o" else d
    x = fwd.ops.new(rows * width, DType.bf16)
    x.requires_grad = True
    n0, base = len(sim.nodes), sim.total
    high[0] = base
    if group == "qkv":
        outs = list(unsloth_lora.qkv(fwd, x, 0, (m.q_dim, m.kv_dim, m.kv_dim)))
    elif group == "o":
        outs = [unsloth_lora.o_proj(fwd, x, 0, d)]
    else:
        outs = [unsloth_lora.mlp(fwd, x, 0)]
    fwd_peak = high[0] - base
    saved = sim.total - base - sum(o.nbytes for o in outs)
    for o in outs:
        o.grad_buffer = sim.alloc(o.nbytes, "temporaries", "grads")
    start = high[0] = sim.total
    sim.run_nodes(sim.nodes[n0:], lambda n: "bwd")
    return GroupTrace(group, saved, fwd_peak, high[0] - start)


CASES = [(g, *s) for s in SHAPES for g in ("qkv", "o", "mlp")]


@pytest.mark.parametrize("group,d,heads,kv,ff,rank,rows", CASES)
def test_unsloth_lora_kernels(group, d, heads, kv, ff, rank, rows):
    dh = d // heads
    dims = {"qkv": (d, kv * dh), "o": (d,), "mlp": (ff,)}[group]
    traced = trace_group(group, rows, d, dims, rank)
    est = engine_group(group, d, heads, kv, ff, rank, rows)
    assert abs(est.saved_bytes - traced.saved_bytes) <= TOLERANCE_BYTES, (est, traced)
    assert abs(est.forward_peak_bytes - traced.forward_peak_bytes) <= TOLERANCE_BYTES, (est, traced)
    assert abs(est.backward_peak_bytes - traced.backward_peak_bytes) <= TOLERANCE_BYTES, (est, traced)

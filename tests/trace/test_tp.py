"""Tensor parallelism: the estimate against DTensor's real ``parallelize_module`` traced on one rank.

Each row builds memcalc's replica, applies torchtitan's ``apply_tp`` plan (``validate/sharded/tp.py``)
on PyTorch's fake process group and traces rank 0's second step (``measure_tp``); the estimate of
the same spec must be within :data:`TOLERANCE_PCT`. Small shapes (d_model 256, 2 layers, vocab 1024)
so each trace takes seconds.
"""

from __future__ import annotations

import pytest

from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec
from memcalc.estimate.peak import estimate

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

#: issue 13: "at least 6 TP setups within 3%"
TOLERANCE_PCT = 3.0


def spec(tp: int, sp: bool = False, kv: int = 4, layers: int = 2, **tr) -> ExperimentSpec:
    m = ModelSpec(name="tiny-llama", n_layers=layers, d_model=256, n_heads=8, n_kv_heads=kv, d_ff=704,
                  vocab_size=1024, max_seq_len=4096)
    return ExperimentSpec(model=m, training=TrainingSpec(batch=2, seq=256, tp=tp, sequence_parallel=sp, **tr))


# (tp, sequence parallel, kv heads, training fields)
ROWS = [
    (2, False, 4, {}),  # source: trace, fp32, plain TP (replicated norms), all-reduces; peak in backward
    (2, True, 4, {}),  # source: trace, fp32, sequence parallel (all-gathered inputs saved, reduce-scatters)
    (4, False, 4, {"precision": "bf16"}),  # source: trace, pure bf16; peak at loss parallel's fp32 log_softmax
    (4, True, 4, {"precision": "bf16"}),  # source: trace, pure bf16 + SP; one kv head per rank (repeat_kv a view)
    (8, True, 8, {}),  # source: trace, fp32, tp 8 + SP
    (2, False, 4, {"checkpoint": "full"}),  # source: trace, full checkpointing, peak in backward
    # source: trace, bf16 + SP + full checkpointing: +1.95% (6,306,304 vs 6,185,472 B) since 6d3d6b9's RoPE tables
    # ((1, T, rot) in the hidden dtype: -98,304 B); +3.54% after bf4ef1b's first-unpack order, +1.55% before. The
    # rest: the trailing reduce-scatter's gradient held through layer 0's recompute, which DTensor's trace holds less
    (4, True, 4, {"precision": "bf16", "checkpoint": "full"}),
    (2, False, 4, {"precision": "amp-bf16"}),  # source: trace, autocast over fp32 weights
    (2, True, 4, {"precision": "bf16", "master_weights": True}),  # source: trace, bf16 + fp32 masters (fused AdamW)
    # source: trace, torchtune's OffloadActivations around the TP step (saved DTensors offloaded and reloaded)
    (2, True, 4, {"checkpoint": "full", "activation_offload": True}),  # fp32 + SP: the recompute keeps the reload
    (2, False, 4, {"checkpoint": "every-k", "activation_offload": True}),  # every 2nd layer checkpointed, fp32
    (2, True, 4, {"precision": "bf16", "checkpoint": "full", "activation_offload": True}),
]


@pytest.mark.parametrize("tp,sp,kv,tr", ROWS)
def test_estimate_matches_traced_rank(tp, sp, kv, tr):
    from memcalc.validate.sharded.tp import measure_tp

    exp = spec(tp, sp, kv, **tr)
    meas = measure_tp(exp)
    assert meas.status == "ok", meas.reason
    est = estimate(exp).peak_bytes
    gap = 100 * (est - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= TOLERANCE_PCT, (f"tp {tp} sp {sp} {tr}: estimate {est:,} vs traced {meas.measured_bytes:,} "
                                       f"({gap:+.2f}%, {meas.peak_phase} {meas.peak_label})")


def test_2d_fsdp2_x_tp_runs_and_shards_more():
    # source: trace, torchtitan's 2-D order (apply_tp, then fully_shard on dp): ZeRO-3 over 2 dp
    # ranks holds less than the TP group alone, in the trace and in the estimate
    from memcalc.validate.sharded.tp import measure_tp

    alone = measure_tp(spec(2, True, precision="bf16"))
    both = measure_tp(spec(2, True, precision="bf16", gpus=2, zero=3))
    assert alone.status == both.status == "ok", (alone.reason, both.reason)
    assert both.measured_bytes < alone.measured_bytes
    assert estimate(spec(2, True, precision="bf16", gpus=2, zero=3)).peak_bytes < estimate(
        spec(2, True, precision="bf16")).peak_bytes


def test_vocabulary_parallel_embedding_gradient_is_whole():
    # source: torch 2.13 DTensor: RowwiseParallel(nn.Embedding)'s weight gradient is Replicate (the whole
    # table), which memcalc.engine.tensor_parallel.grad_numel models; if a PyTorch release shards it,
    # this fails and grad_numel must follow
    import torch.nn as nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from memcalc.validate.sharded.fake_dist import fake_world

    with fake_world(4, 0, shape=(1, 4), names=("dp", "tp")) as mesh:
        emb = nn.Embedding(64, 32, device="meta")
        parallelize_module(emb, mesh["tp"], RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
        emb(torch.empty((2, 8), dtype=torch.int64, device="meta")).sum().backward()
        assert emb.weight.grad._local_tensor.shape == (64, 32)


# 2-D FSDP2 x TP (torchtitan's order: apply_tp, then fully_shard over the dp mesh dimension), bf16
# or bf16 + MixedPrecisionPolicy. fp32 2-D setups are 6-8% low (the peak at the head and loss
# parallel; see docs/multi-gpu.md, "Tensor parallelism") and are not in this table.
ROWS_2D = [
    (2, True, {"precision": "bf16", "gpus": 2, "zero": 3}),  # source: trace, 2 x 2 mesh, +0.51%
    (2, True, {"precision": "bf16", "master_weights": True, "gpus": 2, "zero": 3}),  # source: trace, +0.43%
    (4, True, {"precision": "bf16", "gpus": 2, "zero": 2}),  # source: trace, 2 x 4 mesh, zero 2, -1.69%
    (2, True, {"precision": "bf16", "gpus": 2, "zero": 3, "checkpoint": "full"}),  # source: trace, +0.93%
]


@pytest.mark.parametrize("tp,sp,tr", ROWS_2D)
def test_2d_estimate_matches_traced_rank(tp, sp, tr):
    from memcalc.validate.sharded.tp import measure_tp

    exp = spec(tp, sp, **tr)
    meas = measure_tp(exp)
    assert meas.status == "ok", meas.reason
    est = estimate(exp).peak_bytes
    gap = 100 * (est - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= TOLERANCE_PCT, f"2-D tp {tp} {tr}: estimate {est:,} vs traced {meas.measured_bytes:,} ({gap:+.2f}%)"

"""Expert parallelism: the estimate against torchtitan's all-to-all token dispatcher traced on one rank.

Each row builds memcalc's replica of a scaled-down MoE model, gives every MoE layer ``n_experts / ep``
experts and torchtitan 0.3.0's ``AllToAllTokenDispatcher`` on an ``ep`` mesh of PyTorch's fake process
group (``validate/sharded/expert_parallel.py``), and traces rank 0's second step; the estimate of the
same spec (``memcalc/engine/expert_parallel.py``) must be within :data:`TOLERANCE_PCT`. Small shapes
(d_model 128, 2 layers, 8 experts, vocab 512) so each trace takes a second or two.
"""

from __future__ import annotations

import pytest

from memcalc.core.spec import ExperimentSpec, ModelSpec, MoESpec, TrainingSpec
from memcalc.estimate.peak import estimate

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")

#: issue 31: "the estimate agrees within 2% on a CI grid"
TOLERANCE_PCT = 2.0


def spec(ep: int, moe: dict | None = None, gpus: int | None = None, **tr) -> ExperimentSpec:
    m = ModelSpec(name="tiny-moe", n_layers=2, d_model=128, n_heads=4, d_ff=256, vocab_size=512,
                  moe=MoESpec(**{"n_experts": 8, "top_k": 2, "d_ff_expert": 64, **(moe or {})}))
    return ExperimentSpec(model=m, training=TrainingSpec(batch=2, seq=128, gpus=gpus or ep, ep=ep, **tr))


SIGMOID = {"router": "sigmoid", "n_shared_experts": 1, "first_dense_layers": 1}  # DeepSeek-V3's MoE

# (ep, MoE fields, training fields)
ROWS = [
    (2, {}, {"precision": "bf16"}),  # source: trace, Qwen-style softmax router, bf16, ep 2
    (4, {}, {"precision": "bf16"}),  # source: trace, ep 4: 2 experts per rank
    (4, {}, {"precision": "bf16", "ep_capacity_factor": 1.5}),  # source: trace, the busiest rank gets 1.5x the rows
    (2, {"router": "softmax-fp32"}, {}),  # source: trace, Mixtral's fp32 routing weights, fp32 step
    (4, SIGMOID, {"precision": "bf16"}),  # source: trace, DeepSeek-V3's sigmoid router + shared expert + dense layer
    (2, {}, {"precision": "bf16", "checkpoint": "full"}),  # source: trace, full checkpointing (dispatch recomputed)
    (2, {}, {"precision": "amp-bf16"}),  # source: trace, autocast over fp32 weights
    (2, {"top_k": 1}, {"precision": "bf16"}),  # source: trace, top-1 routing
]


@pytest.mark.parametrize("ep,moe,tr", ROWS)
def test_estimate_matches_traced_rank(ep, moe, tr):
    from memcalc.validate.sharded.expert_parallel import measure_ep

    exp = spec(ep, moe, **tr)
    meas = measure_ep(exp)
    assert meas.status == "ok", meas.reason
    est = estimate(exp).peak_bytes
    gap = 100 * (est - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= TOLERANCE_PCT, (f"ep {ep} {moe} {tr}: estimate {est:,} vs traced {meas.measured_bytes:,} "
                                       f"({gap:+.2f}%, {meas.peak_phase} {meas.peak_label})")


# (ep, gpus, zero, training fields): FSDP2 x EP, torchtitan's apply_fsdp_to_decoder (two parameter groups per
# MoE layer: the experts over efsdp = gpus / ep, the rest over gpus; explicit prefetching)
FSDP_ROWS = [
    (2, 4, 3, {"precision": "bf16"}),  # source: trace, efsdp 2, peak in backward
    # (ep 4 over 8 GPUs, -0.08%, and DeepSeek-V3's router under FSDP2, -0.06%: measured once, left out for time)
    (2, 4, 2, {"precision": "bf16"}),  # source: trace, zero 2 (no reshard after forward)
    (2, 4, 3, {"precision": "bf16", "master_weights": True}),  # source: trace, MixedPrecisionPolicy bf16/fp32
    (2, 16, 3, {"precision": "bf16"}),  # source: trace, efsdp x ep = 16 > 8 experts: Shard(1) on the experts
    (2, 4, 3, {"precision": "bf16", "checkpoint": "full"}),  # source: trace, -1.45%
    (2, 2, 3, {"precision": "bf16"}),  # source: trace, gpus == ep: efsdp 1, FSDP2's world-size-1 path (no all-gather)
]


@pytest.mark.parametrize("ep,gpus,zero,tr", FSDP_ROWS)
def test_fsdp2_x_ep_estimate_matches_traced_rank(ep, gpus, zero, tr):
    from memcalc.validate.sharded.expert_parallel import measure_ep

    exp = spec(ep, gpus=gpus, zero=zero, **tr)
    meas = measure_ep(exp)
    assert meas.status == "ok", meas.reason
    est = estimate(exp).peak_bytes
    gap = 100 * (est - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= TOLERANCE_PCT, (f"ep {ep} gpus {gpus} zero {zero} {tr}: estimate {est:,} vs traced "
                                       f"{meas.measured_bytes:,} ({gap:+.2f}%, {meas.peak_phase} {meas.peak_label})")


def test_experts_are_divided_by_ep_not_by_the_data_parallel_degree():
    # source: torchtitan 0.3.0 parallel_dims.py (efsdp = dp_shard // ep): with 4 data-parallel GPUs and
    # ep 2, two groups of 2 ranks each hold all the experts, so a rank holds half of them (the peer
    # bug divides by gpus x ep); traced and estimated alike
    from memcalc.validate.sharded.expert_parallel import measure_ep

    two = spec(2, precision="bf16")
    wider = spec(2, gpus=4, precision="bf16")
    a, b = measure_ep(two), measure_ep(wider)
    assert a.status == b.status == "ok", (a.reason, b.reason)
    assert a.measured_bytes == b.measured_bytes
    assert estimate(two).peak_bytes == estimate(wider).peak_bytes

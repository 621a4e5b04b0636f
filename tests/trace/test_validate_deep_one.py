"""The Deep One reference experiment traced on meta: the published table within a few percent."""

from __future__ import annotations

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.core.spec import ExperimentSpec, KernelProfile, TrainingSpec  # noqa: E402
from memcalc.core.units import GiB  # noqa: E402
from memcalc.validate.runner import measure  # noqa: E402

#: Forgather examples/tiny_experiments/peak_memory README (RTX 4090, PyTorch 2.8.0), GiB
PUBLISHED = {
    "control": 21.165, "checkpoint": 12.529, "fused": 21.164,
    "fused_checkpoint": 7.425, "bfloat16": 12.418, "bf16_fused_chkpt": 3.975,
}
SETTINGS = {
    "control": dict(precision="fp32", checkpoint="none", fused_optimizer=False),
    "checkpoint": dict(precision="fp32", checkpoint="full", fused_optimizer=False),
    "fused": dict(precision="fp32", checkpoint="none", fused_optimizer=True),
    "fused_checkpoint": dict(precision="fp32", checkpoint="full", fused_optimizer=True),
    "bfloat16": dict(precision="bf16", checkpoint="none", fused_optimizer=True),
    "bf16_fused_chkpt": dict(precision="bf16", checkpoint="full", fused_optimizer=True),
}


def deep_one(name: str) -> ExperimentSpec:
    tr = TrainingSpec(batch=4, seq=768, optimizer="adafactor", optimizer_impl="for-loop", **SETTINGS[name])
    return ExperimentSpec(name=name, model=load_preset("deep-one-1.6b"), training=tr, profile=KernelProfile(),
                          published_peak_bytes=int(PUBLISHED[name] * GiB))


@pytest.fixture(scope="module")
def control_full():
    """The full 1.6B control step, traced once for this module (a few seconds)."""
    return measure(deep_one("control"), "meta", allocator_sim=True)


@pytest.mark.slow
def test_full_size_control_within_3pct_of_published(control_full):
    m = control_full
    assert m.status == "ok" and m.layers == 32 and m.params == 1_631_455_744
    assert abs(m.measured_bytes / GiB - PUBLISHED["control"]) / PUBLISHED["control"] < 0.03
    # grads are None between steps: the peak sits at the forward/backward turn
    assert m.peak_phase == "forward" and m.peak_label == "head & loss"
    # replaying the caching allocator (whole blocks) closes most of the remaining gap
    assert m.sim_allocated_bytes >= m.measured_bytes
    assert abs(m.sim_allocated_bytes / GiB - PUBLISHED["control"]) / PUBLISHED["control"] < 0.01
    # the first step has no optimizer state yet (Adafactor's is about 5 MiB)
    assert 0 < m.measured_bytes - m.first_step_bytes < 16 * 2**20


# Meta traces (about a second each): the whole file is slow; the quick lane traces Deep One's
# layer in tests/trace/test_estimator_vs_trace.py.
@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETTINGS))
def test_scaled_reference_configs_trace(name):
    m = measure(deep_one(name), "meta", scale_layers=2)
    assert m.status == "ok" and m.layers == 2
    assert m.measured_bytes >= m.first_step_bytes > 0


@pytest.mark.slow
def test_scaled_reference_configs_order():
    peak = {n: measure(deep_one(n), "meta", scale_layers=4).measured_bytes for n in SETTINGS}
    assert peak["checkpoint"] < peak["control"]
    assert peak["fused_checkpoint"] < peak["checkpoint"]
    assert peak["bf16_fused_chkpt"] < peak["bfloat16"] < peak["fused"]
    # fusing saves nothing when the peak is the forward/backward turn
    assert abs(peak["fused"] - peak["control"]) < 0.01 * peak["control"]

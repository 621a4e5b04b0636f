"""On a GPU: the real step's max_memory_allocated beside the meta trace of the same step.

Skipped (at module level) without CUDA.
"""

from __future__ import annotations

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.core.spec import ExperimentSpec, KernelProfile, TrainingSpec  # noqa: E402
from memcalc.validate.runner import measure  # noqa: E402


def deep_one(**tr) -> ExperimentSpec:
    base = dict(batch=4, seq=768, optimizer="adafactor", optimizer_impl="for-loop")
    base.update(tr)
    return ExperimentSpec(model=load_preset("deep-one-1.6b"), training=TrainingSpec(**base), profile=KernelProfile())


@pytest.mark.parametrize("tr", [
    dict(),
    dict(checkpoint="full", fused_optimizer=True),
    dict(precision="bf16", checkpoint="full", fused_optimizer=True),
])
def test_cuda_step_matches_meta_trace(tr):
    exp = deep_one(**tr)
    cuda = measure(exp, "cuda", scale_layers=4)
    meta = measure(exp, "meta", scale_layers=4)
    assert cuda.status == meta.status == "ok", cuda.reason
    assert cuda.reserved_bytes >= cuda.measured_bytes
    assert abs(cuda.measured_bytes - meta.measured_bytes) <= 0.03 * cuda.measured_bytes


def test_llama_flash_bf16_matches_meta_trace():
    m = load_preset("tinyllama-1.1b")
    exp = ExperimentSpec(model=m, training=TrainingSpec(batch=2, seq=1024, precision="bf16"), profile=KernelProfile())
    cuda = measure(exp, "cuda", scale_layers=4)
    meta = measure(exp, "meta", scale_layers=4)
    assert cuda.status == "ok", cuda.reason
    assert abs(cuda.measured_bytes - meta.measured_bytes) <= 0.03 * cuda.measured_bytes


def test_snapshot_is_written(tmp_path):
    snap = tmp_path / "snap.pickle"
    m = measure(deep_one(batch=1, seq=128), "cuda", scale_layers=1, snapshot=str(snap))
    assert m.status == "ok" and snap.stat().st_size > 0


def test_oom_is_recorded_not_raised():
    free, _total = torch.cuda.mem_get_info()
    m = load_preset("llama-2-70b")
    exp = ExperimentSpec(model=m, training=TrainingSpec(batch=1, seq=128), profile=KernelProfile())
    if 70e9 * 4 < free:
        pytest.skip("this GPU holds a 70B fp32 model")
    rec = measure(exp, "cuda")
    assert rec.status == "oom" and rec.measured_bytes is None and "memory" in rec.reason.lower()


@pytest.mark.parametrize("budget", [None, 0.6, 0.05])
def test_compiled_step_against_the_estimate(budget):
    """torch.compile on a GPU: the measured peak beside memcalc's compiled timeline (issue 4's
    open question: how much of the recomputed chain inductor keeps). 10%: the CPU inductor
    probe put the model within -17%..+2%, the published rows within -1%..+6%."""
    from memcalc.estimate.peak import estimate

    exp = deep_one(compile=True, memory_budget=budget)
    cuda = measure(exp, "cuda", scale_layers=8)
    assert cuda.status == "ok", cuda.reason
    small = exp.model_copy(update={"model": exp.model.model_copy(update={"n_layers": 8})})
    pred = estimate(small, timeline=False).peak_bytes
    assert abs(pred - cuda.measured_bytes) <= 0.10 * cuda.measured_bytes, (pred, cuda.measured_bytes)

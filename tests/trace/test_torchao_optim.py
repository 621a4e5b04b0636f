"""torchao's low-bit AdamW run unmodified (torchao 0.14.1 torchao/optim/adam.py: AdamW4bit, AdamW8bit,
AdamWFp8, their state subclasses and the per-parameter ``torch.compile(single_param_adam)``, backend
``aot_eager`` on meta) in the replica's step, against the estimate (memcalc.core.optimizers ``TORCHAO``).

One scaled-down Llama layer (d_model 256, every projection 256x256, vocab 4096: three parameter shapes, so
three compiles per optimizer), full fine-tuning in bf16 so that the peak is the optimizer step: the
embedding's (and the head's) quantized step is the largest temporary."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # needs torch and torchao
pytest.importorskip("torchao")

from memcalc.core.spec import ExperimentSpec, TrainingSpec  # noqa: E402
from memcalc.estimate.peak import estimate  # noqa: E402
from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.validate.runner import measure  # noqa: E402

TOLERANCE_PCT = 2.0  # issue 28: a technique's trace row within 2%

ROWS = [
    # source: torchao adam.py AdamW4bit (block 128, 4-bit codes + scale + 16-entry qmap); traced +0.10%
    "adamw-4bit-torchao",
    # source: torchao adam.py AdamW8bit (block 256, uint8 codes + scale + 256-entry qmap); traced +0.05%
    "adamw-8bit-torchao",
    # source: torchao adam.py AdamWFp8 (block 256, float8_e4m3fn codes + scale); traced +0.08%
    "adamw-fp8-torchao",
]


@pytest.mark.parametrize("optimizer", ROWS)
def test_torchao_step_matches_estimate(optimizer: str) -> None:
    m = load_preset("tinyllama-1.1b").model_copy(update={
        "n_layers": 1, "d_model": 256, "n_heads": 4, "n_kv_heads": 4, "d_ff": 256, "vocab_size": 4096})
    exp = ExperimentSpec(name="torchao", model=m,
                         training=TrainingSpec(batch=2, seq=128, precision="bf16", optimizer=optimizer))
    est = estimate(exp, timeline=False)
    meas = measure(exp, "meta")
    assert meas.status == "ok", meas.reason
    assert est.peak_phase == meas.peak_phase == "optimizer step"
    gap = 100 * (est.peak_bytes - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= TOLERANCE_PCT, f"estimate {est.peak_bytes:,} B vs trace {meas.measured_bytes:,} B: {gap:+.2f}%"

"""FSDP1 with LoRA as PEFT wraps it (issue 28): transformers + PEFT under ``FullyShardedDataParallel``
(``use_orig_params=False``) with ``peft.utils.other.fsdp_auto_wrap_policy`` (each ``lora_A`` / ``lora_B``
its own unit, the decoder layers' flat parameters frozen: no gradient), one rank on the fake process group
(``memcalc.validate.sharded.trace_rank(framework="hf")``, validate/sharded/hf.py ``apply_fsdp1_hf``),
against the estimate (memcalc.engine.fsdp1: PEFT's units). Before, the estimate gave each layer's flat
parameter a gradient of its whole (frozen) size: +13.8% on the first row.

# source: each row is one rank of torch 2.13's FSDP1 over transformers 5.x + PEFT 0.21, traced on fake tensors
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("peft")

from memcalc.core.spec import ExperimentSpec, LoraSpec, TrainingSpec  # noqa: E402
from memcalc.estimate.peak import estimate  # noqa: E402
from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.inputs.profiles import get_profile  # noqa: E402
from memcalc.validate.sharded import trace_rank  # noqa: E402

#: issue 28: "a trace row within 2%"
TOLERANCE_PCT = 2.0
ALL = ("q", "k", "v", "o", "gate", "up", "down")

# (targets, training): TinyLlama's shapes at 2 layers, 2 x 256 tokens
GRID = [
    # source: trace_rank(framework="hf"), FSDP1 FULL_SHARD over 2, pure bf16 base, fp32 adapters (PEFT's default)
    (("q", "v"), dict(precision="bf16", zero=3, gpus=2)),
    # source: trace_rank(framework="hf"), SHARD_GRAD_OP over 4, every projection adapted, checkpointing
    (ALL, dict(precision="bf16", zero=2, gpus=4, checkpoint="full")),
]


def _exp(targets, tr) -> ExperimentSpec:
    m = load_preset("tinyllama-1.1b").model_copy(update={"n_layers": 2})
    training = TrainingSpec(batch=2, seq=256, sharding="fsdp1", lora=LoraSpec(rank=16, alpha=32, targets=targets), **tr)
    return ExperimentSpec(name="tinyllama", model=m, training=training, profile=get_profile("hf-torch-2.8-cuda"))


@pytest.mark.parametrize("targets,tr", GRID, ids=[f"{'-'.join(t)}-{'-'.join(f'{k}={v}' for k, v in tr.items())}"
                                                  for t, tr in GRID])
def test_fsdp1_lora_estimate_matches_the_peft_trace(targets, tr):
    exp = _exp(targets, tr)
    out = trace_rank(exp, framework="hf")
    est = estimate(exp, timeline=False)
    gap = 100 * (est.peak_bytes - out["peak_bytes"]) / out["peak_bytes"]
    assert abs(gap) <= TOLERANCE_PCT, (f"estimate {est.peak_bytes:,} B ({est.peak_phase}) vs trace "
                                       f"{out['peak_bytes']:,} B ({out['phase']}): {gap:+.2f}%")

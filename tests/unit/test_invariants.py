"""Properties every estimate must have (hypothesis over small decoders)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.estimate.peak import estimate
from memcalc.engine.result import KINDS

from conftest import experiment, tiny_llama

models = st.builds(
    tiny_llama,
    n_layers=st.integers(1, 4),
    d_model=st.sampled_from([64, 128, 256]),
    n_heads=st.sampled_from([4, 8]),
    n_kv_heads=st.sampled_from([None, 2, 4]),
    d_ff=st.integers(64, 700),
    vocab_size=st.integers(50, 3000),
    norm=st.sampled_from(["rmsnorm", "layernorm"]),
    mlp=st.sampled_from(["gated", "plain"]),
    positions=st.sampled_from(["rope", "learned", "none"]),
    block=st.sampled_from(["sequential", "parallel"]),
)
setups = st.fixed_dictionaries({
    "optimizer": st.sampled_from(["adamw", "sgd", "sgd-momentum", "lion", "adamw-8bit"]),
    "checkpoint": st.sampled_from(["none", "full", "sqrt", "selective"]),
    "fused_optimizer": st.booleans(),
})
SETTINGS = settings(max_examples=40, deadline=None)
# 80 estimates per property (about a second each): the quick lane keeps components_add_up, the
# others are marked slow


@pytest.mark.slow
@SETTINGS
@given(m=models, s=setups, b=st.integers(1, 6), t=st.integers(2, 512), db=st.integers(1, 4))
def test_monotone_in_batch(m, s, b, t, db):
    lo = estimate(experiment(m, batch=b, seq=t, **s), timeline=False)
    hi = estimate(experiment(m, batch=b + db, seq=t, **s), timeline=False)
    assert hi.peak_bytes >= lo.peak_bytes


@pytest.mark.slow
@SETTINGS
@given(m=models, s=setups, b=st.integers(1, 4), t=st.integers(2, 512), dt=st.integers(1, 256))
def test_monotone_in_seq(m, s, b, t, dt):
    lo = estimate(experiment(m, batch=b, seq=t, **s), timeline=False)
    hi = estimate(experiment(m, batch=b, seq=t + dt, **s), timeline=False)
    assert hi.peak_bytes >= lo.peak_bytes


@pytest.mark.slow
@SETTINGS
@given(m=models, s=setups, b=st.integers(1, 4), t=st.integers(1, 4).map(lambda k: 128 * k))
def test_bf16_never_above_fp32(m, s, b, t):
    """Sequences are whole multiples of 128: FlashAttention-2's backward pads its fp32 dq
    accumulator to 128 rows, so for a handful of tokens a bf16 step (flash) can exceed an fp32
    one (memory-efficient kernel, no accumulator) -- a real effect, not a modelling error."""
    fp32 = estimate(experiment(m, batch=b, seq=t, precision="fp32", **s), timeline=False)
    bf16 = estimate(experiment(m, batch=b, seq=t, precision="bf16", **s), timeline=False)
    assert bf16.peak_bytes <= fp32.peak_bytes


@pytest.mark.slow
@SETTINGS
@given(m=models, b=st.integers(1, 4), t=st.integers(2, 512), ck=st.sampled_from(["full", "sqrt", "selective", "every-k"]),
       precision=st.sampled_from(["fp32", "bf16", "amp-bf16"]))
def test_checkpointing_never_raises_activation_memory(m, b, t, ck, precision):
    plain = estimate(experiment(m, batch=b, seq=t, precision=precision), timeline=False)
    ckpt = estimate(experiment(m, batch=b, seq=t, precision=precision, checkpoint=ck), timeline=False)
    assert ckpt.extra["max_activation_bytes"] <= plain.extra["max_activation_bytes"]


@SETTINGS
@given(m=models, s=setups, b=st.integers(1, 4), t=st.integers(2, 512),
       precision=st.sampled_from(["fp32", "bf16", "amp-bf16", "amp-fp16"]), lora=st.booleans())
@pytest.mark.slow  # the quick lane stays under 30 s; CI runs it
def test_components_add_up(m, s, b, t, precision, lora):
    kw = dict(s)
    if lora:
        kw["lora"] = {"rank": 8, "targets": ("q", "v")}
    e = estimate(experiment(m, batch=b, seq=t, precision=precision, **kw))
    assert sum(e.components.values()) == e.peak_bytes
    assert sum(e.components_by_kind.values()) == e.peak_bytes
    assert set(e.components_by_kind) == set(KINDS)
    assert all(isinstance(v, int) and v >= 0 for v in e.components.values())
    assert e.required_bytes == e.device_total_bytes == sum(e.device_parts.values())
    assert e.peak_bytes <= e.step_allocated_bytes < e.allocated_peak_bytes <= e.reserved_peak_bytes
    assert e.reserved_peak_bytes < e.device_total_bytes
    assert max(e.phases.values()) <= e.peak_bytes
    assert e.first_step_peak_bytes <= e.peak_bytes

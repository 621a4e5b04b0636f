"""The first step taken from the steady step's events (:func:`memcalc.engine.twins.first_step_of`)
equals the simulated first step: the same allocation events (up to the block ids), the same peak,
peak phase, phase peaks, offloaded and paged bytes. ``estimate()`` reads its first step this way
outside DeepSpeed, so every first-step number it prints rests on this equality."""

from __future__ import annotations

import pytest

from memcalc.api import _resolve
from memcalc.engine.twins import first_step_of
from memcalc.estimate.step import simulate
from memcalc.plan.depth import shallow

pytestmark = pytest.mark.slow  # ~60 simulated steps

#: Setups that create optimizer state differently inside the first step (the rule's cases); each
#: runs at 3 layers (every layer kind appears) and the first three at full depth too. Tolerance:
#: none (bytes and events exactly equal).
SETUPS = [
    dict(model="llama-3.1-8b", bf16=True, seq=256),  # source: foreach AdamW, state made at the step
    dict(model="llama-3.1-8b", bf16=True, seq=256, fused_optimizer=True, checkpoint="full"),  # source: state made per parameter in backward hooks
    dict(model="llama-3.1-8b", lora=True, bf16=True, seq=256, checkpoint="selective"),  # source: adapters only (frozen base has no state)
    dict(model="llama-3.1-8b", qlora=True, seq=256, checkpoint="sqrt"),  # source: QLoRA base, sqrt segments
    dict(model="llama-3.1-8b", precision="amp-bf16", optimizer="adamw-8bit", seq=128),  # source: blockwise 8-bit state
    dict(model="llama-3.1-8b", optimizer="paged-adamw", bf16=True, seq=128),  # source: paged state (unified memory)
    dict(model="llama-3.1-8b", precision="fp32", optimizer="adafactor", seq=128),  # source: factored state
    dict(model="tinyllama-1.1b", optimizer="sgd-momentum", grad_accum=4, optimizer_impl="for-loop"),  # source: per-parameter step, accumulation
    dict(model="phi-1.5", lora=True, lora_targets="all", optimizer="lion", precision="bf16", seq=256),  # source: lion
    dict(model="llama-3.1-8b", bf16=True, master_weights=True, seq=128, grad_accum=2),  # source: fp32 master weights
    dict(model="llama-3.1-8b", bf16=True, zero=1, gpus=4, seq=128, offload_optimizer=True),  # source: state on the host
    dict(model="llama-3.1-8b", bf16=True, zero=2, gpus=4, seq=128),  # source: generic ZeRO-2 sharded state
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=8, sharding="fsdp2", seq=128, checkpoint="full"),  # source: FSDP2 shards
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=4, sharding="fsdp1", seq=128),  # source: FSDP1 flat units
    dict(model="llama-3.1-8b", bf16=True, tp=2, sequence_parallel=True, zero=3, gpus=4, sharding="fsdp2", seq=128),  # source: 2-D FSDP2 x TP
    dict(model="llama-3.1-8b", bf16=True, compile=True, memory_budget=0.5, seq=128),  # source: compiled step, gradients leave together
    dict(model="llama-3.1-8b", lora=True, compile=True, checkpoint="full", seq=128, fused_optimizer=True),  # source: compiled + fused: deferred hooks
    dict(model="llama-3.1-8b", bf16=True, activation_offload=True, seq=128),  # source: activation offloading
    dict(model="llama-3.1-8b", lora=True, bf16=True, activation_offload=True, checkpoint="full", framework="trl",
         seq=128),  # source: TRL's offloading: the last step's input leaf held into a steady step only (offload_trl)
    dict(model="qwen3-30b-a3b", lora=True, bf16=True, seq=128),  # source: MoE experts
]
#: The rows also run at full depth (32 layers): the first three.
CASES = [(kw, False) for kw in SETUPS] + [(kw, True) for kw in SETUPS[:3]]


def _canonical(events: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Events with block ids renumbered in order of allocation (the two steps number them differently)."""
    ids: dict[int, int] = {}
    return [((ids.setdefault(uid, len(ids)) if n else ids[uid]), n) for uid, n in events]


@pytest.mark.parametrize("kw,full", CASES, ids=[f"{i % len(SETUPS)}-{'full' if f else '3-layers'}"
                                                  for i, (_, f) in enumerate(CASES)])
def test_first_step_from_the_steady_step_equals_the_simulated_one(kw, full):
    exp = _resolve(None, dict(kw)).exp
    exp = exp if full else shallow(exp, 3)
    steady = simulate(exp, first_step=False, record_timeline=False, events=True)
    got = first_step_of(steady)
    want = simulate(exp, first_step=True, record_timeline=False, events=True)
    assert got is not None
    assert (got.peak_bytes, got.peak_phase, got.phases) == (want.peak_bytes, want.peak_phase, want.phases)
    assert got.step_start == want.step_start
    assert _canonical(got.events) == _canonical(want.events)
    assert (got.host_offload, got.paged_state_bytes) == (want.host_offload, want.paged_state_bytes)
    assert got.peak_bytes <= steady.peak_bytes


@pytest.mark.parametrize("kw", [
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=8, sharding="deepspeed", seq=128),  # source: DeepSpeed's own optimizer side
    dict(model="llama-3.1-8b", bf16=True, zero=2, gpus=8, sharding="deepspeed", seq=128),  # source: same, ZeRO-2
])
def test_deepspeed_first_step_is_simulated_not_derived(kw):
    exp = shallow(_resolve(None, dict(kw)).exp, 3)
    assert first_step_of(simulate(exp, first_step=False, record_timeline=False, events=True)) is None


def test_no_events_no_derivation():
    exp = shallow(_resolve(None, dict(model="llama-3.1-8b", bf16=True, seq=128)).exp, 3)
    assert first_step_of(simulate(exp, first_step=False, record_timeline=False)) is None

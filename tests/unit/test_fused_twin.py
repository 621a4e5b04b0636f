"""A fused-optimizer step derived from the unfused one (:func:`memcalc.engine.twins.fused_twin_of`)
equals the simulated fused step: the same allocation trace (running total, phase, label and
request of every allocation), peak, peak phase and peak label; and its allocation events
(:func:`memcalc.engine.twins.fused_events_of`: the same events up to the block ids, phase marks, state
moves, and the first step that follows from them). The plan takes every fused step it reads this way
where it applies (:mod:`memcalc.plan.steps`, and its verdicts' device totals:
:func:`memcalc.plan.simulations.device_total`), so its printed numbers rest on this equality."""

from __future__ import annotations

import pytest

from memcalc.api import _resolve
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.twins import first_step_of, fused_events_of, fused_twin_applies, fused_twin_of
from memcalc.estimate.peak import card_side, estimate
from memcalc.estimate.step import simulate
from memcalc.inputs.gpus import get_gpu
from memcalc.inputs.presets import load_preset
from memcalc.plan.depth import shallow
from memcalc.plan.options import techniques
from memcalc.plan.simulations import TOTAL_BOUNDS, TOTAL_CACHE, UNFUSED_STEADY, device_total
from memcalc.plan.steps import traced_step

pytestmark = pytest.mark.slow  # ~150 simulated steps

#: Setups beyond the plan's grid (each at 3 layers). Tolerance: none (every allocation equal).
SETUPS = [
    dict(model="llama-3.1-8b", bf16=True, seq=256),  # source: foreach AdamW unfused, per-parameter fused
    dict(model="llama-3.1-8b", bf16=True, master_weights=True, seq=128),  # source: fp32 master step temporaries
    dict(model="llama-3.1-8b", precision="fp32", optimizer="adafactor", checkpoint="full", seq=128),  # source: factored state
    dict(model="llama-3.1-8b", bf16=True, optimizer="lion", checkpoint="selective-op", seq=128),  # source: lion, op-level checkpointing
    dict(model="llama-3.1-8b", optimizer="paged-adamw", bf16=True, seq=128),  # source: paged state
    dict(model="tinyllama-1.1b", optimizer="sgd-momentum", optimizer_impl="for-loop"),  # source: per-parameter unfused step
    dict(model="phi-1.5", lora=True, lora_targets="all", lora_dropout=0.05, precision="bf16", seq=256),  # source: LoRA on every linear, dropout
    dict(model="gpt2", precision="amp-fp16", batch=4, seq=256, checkpoint="selective"),  # source: tied embeddings (one gradient, two uses)
    dict(model="llama-3.1-8b", lora=True, dora=True, bf16=True, seq=128),  # source: DoRA magnitudes
    dict(model="qwen3-30b-a3b", lora=True, bf16=True, seq=128),  # source: MoE experts
    dict(model="qwen3-30b-a3b", bf16=True, seq=128, checkpoint="full"),  # source: MoE, full fine-tune
    dict(model="gemma-2-9b", bf16=True, seq=256, framework="hf"),  # source: HF framework, soft-capping
]

#: The plan's grid on two models (every unfused option): what the plan derives in practice.
GRID = [(m, t) for m in ("llama-3.1-8b", "qwen3-4b") for t in techniques() if not t.fused]


def _pair(exp: ExperimentSpec) -> tuple[ExperimentSpec, ExperimentSpec]:
    tr = exp.training
    return (exp.model_copy(update={"training": tr.model_copy(update={"fused_optimizer": False})}),
            exp.model_copy(update={"training": tr.model_copy(update={"fused_optimizer": True})}))


def _canonical(events: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Events with block ids renumbered in order of allocation (the two steps number them differently)."""
    ids: dict[int, int] = {}
    return [((ids.setdefault(uid, len(ids)) if n else ids[uid]), n) for uid, n in events]


def _moves(r) -> tuple:
    """The state moves with block ids renumbered as :func:`_canonical` does."""
    ids: dict[int, int] = {}
    for uid, n in r.events:
        if n:
            ids.setdefault(uid, len(ids))
    setup, moves = r.state_moves
    return sorted(ids[u] for u in setup), [(i, [(ids[u], n) for u, n in ts]) for i, ts in moves]


def _check(exp: ExperimentSpec) -> None:
    unfused, fused = _pair(shallow(exp, 3))
    assert fused_twin_applies(unfused)
    rb = exp.profile.allocator_round_bytes
    want = simulate(fused, first_step=False, record_timeline=False, trace_allocs=True, events=True)
    base = simulate(unfused, first_step=False, record_timeline=False, trace_allocs=True, events=True,
                    fused_twin=True)
    got = fused_twin_of(base, rb)
    assert got is not None
    assert (got.peak_bytes, got.peak_phase, got.peak_label) == (want.peak_bytes, want.peak_phase, want.peak_label)
    assert got.alloc_trace == want.alloc_trace
    ev = fused_events_of(base, rb)
    assert ev is not None
    assert _canonical(ev.events) == _canonical(want.events)
    assert (ev.step_start, ev.event_phases, _moves(ev)) == (want.step_start, want.event_phases, _moves(want))
    assert (ev.peak_bytes, ev.peak_phase, ev.phases) == (want.peak_bytes, want.peak_phase, want.phases)
    first, first_want = first_step_of(ev), first_step_of(want)
    assert first is not None and first_want is not None
    assert _canonical(first.events) == _canonical(first_want.events)
    assert (first.peak_bytes, first.phases) == (first_want.peak_bytes, first_want.phases)


@pytest.mark.parametrize("kw", SETUPS, ids=[str(i) for i in range(len(SETUPS))])
def test_fused_twin_equals_the_simulated_fused_step(kw):
    _check(_resolve(None, dict(kw)).exp)


@pytest.mark.parametrize("model,tech", GRID, ids=[f"{m}-{t.key()}" for m, t in GRID])
def test_fused_twin_over_the_plan_grid(model, tech):
    m = load_preset(model)
    _check(ExperimentSpec(model=m, training=tech.training(2, 128, "bf16", m.attention_lora_targets)))


@pytest.mark.parametrize("kw", [
    dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=8, sharding="fsdp2", seq=128),  # source: FSDP2 reduces gradients per unit
    dict(model="llama-3.1-8b", bf16=True, zero=2, gpus=4, seq=128),  # source: ZeRO-2 gradient shards
    dict(model="llama-3.1-8b", bf16=True, grad_accum=2, seq=128),  # source: a fused step cannot accumulate
    dict(model="llama-3.1-8b", bf16=True, compile=True, seq=128),  # source: gradients leave the compiled backward together
    dict(model="llama-3.1-8b", bf16=True, tp=2, seq=128),  # source: tensor parallelism
    dict(model="llama-3.1-8b", bf16=True, optimizer="galore-adamw", seq=128),  # source: GaLore's own step loop
])
def test_fused_twin_not_derived_outside_its_rule(kw):
    unfused, _ = _pair(_resolve(None, dict(kw)).exp)
    assert not fused_twin_applies(unfused)
    r = simulate(shallow(unfused, 3), first_step=False, record_timeline=False, trace_allocs=True, fused_twin=True)
    assert r.grads_ready is None and fused_twin_of(r, 512) is None


def test_plan_steps_cache_serves_the_fused_step_from_the_unfused_one():
    m = load_preset("llama-3.1-8b")
    t = next(t for t in techniques() if t.adapters == "lora" and t.checkpoint == "full" and not t.fused)
    unfused, fused = _pair(shallow(ExperimentSpec(model=m, training=t.training(1, 256, "bf16",
                                                                                m.attention_lora_targets)), 3))
    u = traced_step(unfused)
    f = traced_step(fused)
    assert u.grads_ready and f.grads_ready is None  # derived, not simulated
    assert f.alloc_trace == simulate(fused, first_step=False, record_timeline=False, trace_allocs=True).alloc_trace


@pytest.mark.parametrize("kw", [
    dict(model="llama-3.1-8b", bf16=True, seq=256),  # source: foreach AdamW unfused, per-parameter fused
    dict(model="llama-3.1-8b", lora=True, bf16=True, seq=256, checkpoint="full"),  # source: adapters only
])
def test_plan_device_total_of_the_fused_step_from_the_unfused_one(kw):
    """:func:`memcalc.plan.simulations.device_total` of a fused step right after its unfused twin's (the events
    derived, not simulated) is the estimate's device total; with a card's limit below it, the lower bound is
    what the simulated step cut short gives."""
    unfused, fused = _pair(shallow(_resolve(None, dict(kw)).exp, 3))
    side = card_side(fused, get_gpu("h100-80gb"))
    want = estimate(fused, timeline=False, replay=True, side=side).device_total_bytes
    for limit in (None, want - 1):
        for cache in (TOTAL_CACHE, TOTAL_BOUNDS, UNFUSED_STEADY):
            cache.clear()
        device_total(unfused, side)
        assert UNFUSED_STEADY, "the unfused step is kept for its twin"
        got = device_total(fused, side, limit)
        if limit is None:
            assert got == want
        else:
            bound = got
            for cache in (TOTAL_CACHE, TOTAL_BOUNDS, UNFUSED_STEADY):
                cache.clear()
            assert bound > limit and bound == device_total(fused, side, limit)  # the same bound, simulated

"""The field contract's other side: every field that moves the estimate moves the traced peak by the
same amount (issue 26: "every config field perturbed moves the simulated and the traced bytes by the
same amount").

Each ``PERTURB`` row of ``tests/test_field_contract.py`` (a setup and one field's perturbed value) is
estimated and traced twice, setup and perturbed, by memcalc's own replica (``framework plain``,
``memcalc.validate.runner.measure`` on ``meta``). The estimated delta and the traced delta must agree
within :func:`delta_tolerance`, and a field that moves the estimate must move the trace the same way.
Rows the replica cannot trace are in :data:`UNTRACED` with the reason, so a new row without a decision
fails here. ``tests/traces/field_contract_record.py`` records the traced peaks for the quick lane
(``tests/test_field_contract_recorded.py``).
"""

from __future__ import annotations

import pytest

from test_field_contract import PERTURB, build, perturbed

#: The deltas agree within the larger of this share of the traced base peak ...
DELTA_TOLERANCE_PCT = 1.0
#: ... or these bytes (a few allocations' 512-byte rounding)
DELTA_TOLERANCE_BYTES = 4096


def delta_tolerance(traced_base_bytes: int) -> int:
    """How far the estimated delta may sit from the traced delta, in bytes."""
    return max(int(traced_base_bytes * DELTA_TOLERANCE_PCT / 100), DELTA_TOLERANCE_BYTES)


#: "Spec.field" -> why the replica cannot trace the row (the field is checked against the estimate
#: only, by tests/test_field_contract.py, and against its own validator where one exists).
_MULTI = ("needs {} processes: the replica runs one (runner.py skips it); the sharded step is traced whole by "
          "{} (a delta check through that validator is still to come)")
_DS = _MULTI.format("4 DeepSpeed", "tests/test_deepspeed.py (validate/deepspeed_trace.py)")
_ZERO3 = _MULTI.format("4 ZeRO-3", "tests/test_fsdp_grid.py and tests/test_deepspeed.py (validate/sharded, "
                                   "validate/deepspeed_trace.py)")
UNTRACED: dict[str, str] = {
    "MoESpec.router_bias": "the replica does not build gpt-oss experts (biases, clamped gate): model.unbuilt_features",
    "MoESpec.expert_bias": "the replica does not build gpt-oss experts (biases, clamped gate): model.unbuilt_features",
    "TrainingSpec.compile": "torch.compile needs CUDA (inductor); off CUDA the partitioner's saved set is compared "
                            "instead (tests/test_compile.py, tests/test_validate_compiled.py)",
    "TrainingSpec.memory_budget": "a torch.compile option: needs CUDA (inductor), as TrainingSpec.compile",
    "TrainingSpec.zero": _ZERO3,
    "TrainingSpec.gpus": _ZERO3,
    "TrainingSpec.sharding": _ZERO3,
    "DeepSpeedSpec.reduce_bucket_size": _DS,
    "DeepSpeedSpec.overlap_comm": _DS,
    "DeepSpeedSpec.contiguous_gradients": _DS,
    "DeepSpeedSpec.prefetch_bucket_size": _DS,
    "DeepSpeedSpec.max_live_parameters": _DS,
    "DeepSpeedSpec.max_reuse_distance": _DS,
    "DeepSpeedSpec.param_persistence_threshold": _DS,
    "TrainingSpec.offload_optimizer": "the optimizer state and step on the CPU: the validator does not measure it "
                                      "(runner.py skips it)",
}

#: "Spec.field" -> the measured disagreement (torch 2.13 on meta) and what is known of it: rows traced
#: whose deltas disagree, kept as strict xfail (a fix on either side makes the row pass and fail here).
_ONE_STATE = "about one (batch, seq, d_model) fp32 hidden state (524,288 B) apart, as in ModelSpec.block"
KNOWN_GAPS: dict[str, str] = {
    "ModelSpec.n_heads": "estimate -65,536 B, trace +32,768 B: opposite signs (gap -98,304 B, within the tolerance); "
                         "mechanism not found",
    "ModelSpec.norm_placement": "estimate -126,976 B, trace 0 B (post-norm with residual_scale 0.5); mechanism not "
                                "found",
    "ModelSpec.block": "estimate -5,789,696 B, trace -6,313,984 B: gap +524,288 B over 491,842 B, one (4, 256, 128) "
                       "fp32 hidden state: the two sides' peaks hold a different set of layer-boundary tensors "
                       "(mechanism not found); the same 0.5 MiB sits inside the tolerance on several other rows",
    "ModelSpec.alibi_trainable": "estimate +5,511,168 B, trace +1,314,816 B: gap +4,196,352 B, on the base: the "
                                 "estimator builds an ALiBi mask only from a slopes parameter (engine.forward "
                                 "core_attention; engine.params makes one only when alibi_trainable), so with fixed "
                                 "slopes it models no mask, where the replica builds the (H, T, T) mask per layer from "
                                 "the slopes buffer and the efficient kernel saves it (4 layers x 1 MiB); an "
                                 "estimator fix changes printed numbers (not in this restructuring)",
    "MoESpec.router": "estimate +1,314,816 B, trace +786,432 B: gap +528,384 B over 373,898 B (softmax-fp32 router "
                      "in bf16), " + _ONE_STATE,
    "MoESpec.lora_mlp_to_experts": "estimate +8,970,240 B, trace +8,446,464 B: gap +523,776 B over 409,405 B, "
                                   + _ONE_STATE + " (the 6 MiB gap before was the replica's grouped-mm fallback "
                                   "saving the input of frozen experts: fixed in validate/moe.py)",
    "LoraSpec.quant_block": "estimate -6,144 B, trace 0 B (block 64 -> 128: half the absmax constants): the "
                            "estimator counts a 4-bit weight's packed codes and absmax constants as one allocation "
                            "(engine.weights quantized_bytes), the replica (as bitsandbytes' QuantState) as separate "
                            "tensors, each rounded to 512 B, so absmax under 512 B per weight moves nothing there; an "
                            "estimator fix changes printed numbers",
    "KernelProfile.rmsnorm": "estimate -2,617,344 B, trace -2,097,152 B: gap -520,192 B over 304,286 B "
                             "(composite -> composite-legacy in bf16), " + _ONE_STATE,
    "KernelProfile.norm_upcast": "estimate -5,459,968 B, trace -5,783,552 B: gap +323,584 B over 304,286 B "
                                 "(the replica's RMSNorm now honours the field: validate/layers.py RMSNorm upcast); "
                                 "the same family as KernelProfile.rmsnorm's gap; mechanism not found",
    "KernelProfile.dropout_mask_bytes": "estimate +3,145,728 B, trace 0 B: the replica runs CUDA's native_dropout, "
                                        "whose mask is bool whatever the field says (aten/src/ATen/native/cuda/"
                                        "Dropout.cu); a wider mask is the non-fused _dropout_impl's (a mask in the "
                                        "input's dtype, Dropout.cpp), which CUDA does not run for 0 < p < 1: the "
                                        "field has no CUDA kernel to trace (KernelProfile.device is cuda only)",
}


_AS_PEAK = "as its peak (KNOWN_GAPS)"
#: "Spec.field" -> the measured disagreement of the per-phase peaks (forward, backward, optimizer
#: step; the same tolerance, against the traced base phase peak): strict xfail in the quick lane
#: (tests/test_field_contract_recorded.py). The phases give the rows whose peak does not move
#: (logit_softcap, logit_scale, fused_gate_up, optimizer_impl, shift_copy) a number that does.
PHASE_GAPS: dict[str, str] = {
    "ModelSpec.n_heads": _AS_PEAK,
    "ModelSpec.norm_placement": _AS_PEAK,
    "ModelSpec.block": _AS_PEAK,
    "ModelSpec.alibi_trainable": _AS_PEAK,
    "MoESpec.router": _AS_PEAK,
    "LoraSpec.quant_block": _AS_PEAK,
    "KernelProfile.rmsnorm": _AS_PEAK,
    "KernelProfile.norm_upcast": _AS_PEAK,
    "KernelProfile.dropout_mask_bytes": _AS_PEAK,
    "LoraSpec.dora": "optimizer step: estimate +1,613,824 B, trace +40,960 B (tolerance 40,197 B); mechanism not found",
    "LoraSpec.dtype": "optimizer step: estimate +1,441,792 B, trace +655,360 B (fp32 adapters over bf16: their "
                      "AdamW step's temporaries); mechanism not found",
    "KernelProfile.lora_dtype": "optimizer step: estimate +1,441,792 B, trace +655,360 B, as LoraSpec.dtype",
    "TrainingSpec.lora": "forward: estimate -14,826,496 B, trace -14,311,424 B (gap 515,072 B over 483,747 B); "
                         "optimizer step: estimate -7,358,464 B, trace -9,455,616 B; mechanism not found",
    "TrainingSpec.activation_offload": "backward: estimate -24,539,136 B, trace -25,522,176 B (gap 983,040 B over "
                                       "351,129 B); mechanism not found",
    "TrainingSpec.sequence_parallel": "forward: estimate -4,473,344 B, trace -3,969,536 B (gap 503,808 B over "
                                      "314,782 B); mechanism not found",
}


def test_every_row_has_a_decision() -> None:
    stale = [k for k in (*UNTRACED, *KNOWN_GAPS, *PHASE_GAPS) if k not in PERTURB]
    assert not stale, f"entries for rows that are not in PERTURB: {stale}"
    assert not set(UNTRACED) & (set(KNOWN_GAPS) | set(PHASE_GAPS))
    assert all(len(r) > 10 for r in (*UNTRACED.values(), *KNOWN_GAPS.values(), *PHASE_GAPS.values()))


TRACED = [k for k in PERTURB if k not in UNTRACED]


@pytest.mark.slow
@pytest.mark.parametrize("key", [pytest.param(k, marks=[pytest.mark.xfail(reason=KNOWN_GAPS[k], strict=True)]
                                              if k in KNOWN_GAPS else []) for k in TRACED])
def test_traced_delta_matches_estimated_delta(key: str) -> None:
    pytest.importorskip("torch")
    from memcalc.estimate.peak import estimate
    from traces.field_contract_record import trace_pair

    setup, value = PERTURB[key]
    base = build(setup)
    pert = perturbed(base, key, value)
    eb, ep = (estimate(e, timeline=False).peak_bytes for e in (base, pert))
    tb, tp = trace_pair(key)
    assert_deltas_agree(key, eb, ep, tb, tp)
    rec = recorded().get(key)
    if rec is not None:  # the recording the quick lane reads is current (else: tests/traces/field_contract_record.py)
        assert (rec["traced_base_bytes"], rec["traced_perturbed_bytes"]) == (tb, tp), f"{key}: record the row again"


def recorded() -> dict[str, dict]:
    """The rows of tests/traces/field_contract.json by field."""
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces", "field_contract.json")
    with open(path, encoding="utf-8") as f:
        return {r["field"]: r for r in json.load(f)["rows"]}


def assert_phase_deltas_agree(key: str, eb: dict[str, int], ep: dict[str, int], tb: dict[str, int],
                              tp: dict[str, int]) -> None:
    """Per phase, the estimated delta against the traced delta (peaks per phase of both setups on both
    sides); each side names the same phases (a fused optimizer has no optimizer-step phase)."""
    assert set(eb) == set(tb) and set(ep) == set(tp), f"{key}: phases {set(eb)}/{set(ep)} vs traced {set(tb)}/{set(tp)}"
    for phase in sorted(set(eb) & set(ep)):
        assert_deltas_agree(f"{key} ({phase})", eb[phase], ep[phase], tb[phase], tp[phase])


def assert_deltas_agree(key: str, eb: int, ep: int, tb: int, tp: int) -> None:
    """The estimated delta ``ep - eb`` against the traced delta ``tp - tb`` (both sides' peaks)."""
    de, dt = ep - eb, tp - tb
    tol = delta_tolerance(tb)
    where = (f"{key}: estimate {eb:,} -> {ep:,} B ({de:+,}), trace {tb:,} -> {tp:,} B ({dt:+,}): "
             f"gap {de - dt:+,} B, tolerance {tol:,} B")
    if de != 0:
        assert dt != 0 and (dt > 0) == (de > 0), "the estimate moves, the trace does not move the same way: " + where
    assert abs(de - dt) <= tol, where

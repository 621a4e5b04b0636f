"""The estimator's rules for the dense family features (issue 12), torch-free: what each feature
adds, in closed form where the rule gives one (``memcalc.engine.blocks.attention_variants``,
``memcalc.engine.blocks.layer``). The byte-for-byte comparison with the replica's trace is
``tests/trace/test_family_activations_trace.py``."""

from __future__ import annotations

from typing import Any

import pytest

from memcalc.core.spec import ExperimentSpec, KernelProfile, LoraSpec, ModelSpec, TrainingSpec
from memcalc.engine.blocks.attention_variants import layer_slides, mask_types, sliding_mask_materialised
from memcalc.engine.params import param_inventory
from memcalc.estimate.peak import estimate

L, D_MODEL, H, D_FF, V = 2, 128, 4, 256, 512
BASE: dict[str, Any] = dict(name="t", n_layers=L, d_model=D_MODEL, n_heads=H, d_ff=D_FF, vocab_size=V,
                            max_seq_len=4096)
B, T = 2, 256
DH = D_MODEL // H


def peak(model: dict, **tr: Any) -> int:
    t = dict(batch=B, seq=T, precision="bf16")
    t.update(tr)
    return estimate(ExperimentSpec(model=ModelSpec(**{**BASE, **model}), training=TrainingSpec(**t)),
                    timeline=False, replay=False).peak_bytes


def added(feature: dict, base: dict | None = None, **tr: Any) -> int:
    base = base or {}
    return peak({**base, **feature}, **tr) - peak(base, **tr)


# -- qk norms ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["head", "head_unshared", "full"])
def test_qk_norm_adds_the_norms_saved_tensors(kind: str) -> None:
    # source: composite RMSNorm (profile default) saves an fp32 copy and the fp32 normalised
    # tensor of q and of k: at least 2 * 2 * B*T*(q + kv) * 4 bytes over the layers
    got = added(dict(qk_norm=kind))
    assert got >= L * 2 * B * T * 2 * D_MODEL * 4


def test_qk_norm_fused_rmsnorm_saves_less_than_composite() -> None:
    # source: _fused_rms_norm saves its 16-bit input and rstd; the composite saves fp32 copies
    def with_profile(model: dict) -> int:
        exp = ExperimentSpec(model=ModelSpec(**{**BASE, **model}), training=TrainingSpec(batch=B, seq=T, precision="bf16"),
                             profile=KernelProfile(rmsnorm="fused"))
        return estimate(exp, timeline=False, replay=False).peak_bytes

    fused = with_profile(dict(qk_norm="head")) - with_profile({})
    assert 0 < fused < added(dict(qk_norm="head"))


# -- eager attention -----------------------------------------------------------------------------
def test_softcap_saves_full_attention_matrices() -> None:
    # source: Gemma-2 eager attention saves tanh (bf16), the fp32 softmax and its bf16 copy: 8 bytes
    # per (B, H, T, T) element per layer at the end of the forward, less flash's output and
    # logsumexp, which eager does not keep (within 1%)
    assert added(dict(attn_softcap=50.0)) >= 0.99 * L * B * H * T * T * 8


def test_softcap_cost_grows_with_the_square_of_the_sequence() -> None:
    small, big = added(dict(attn_softcap=50.0), seq=128), added(dict(attn_softcap=50.0), seq=256)
    assert 3.9 < big / small < 4.1


def test_sinks_save_bf16_probabilities_with_the_sink_column() -> None:
    # source: gpt-oss softmax in the scores' dtype over (B, H, T, T + 1), no fp32 copy
    got = added(dict(attn_sinks=True))
    assert L * B * H * T * (T + 1) * 2 <= got < added(dict(attn_softcap=50.0))


# -- sliding window ------------------------------------------------------------------------------
def test_sliding_layers_follow_full_attention_every() -> None:
    m = ModelSpec(**{**BASE, "n_layers": 6}, sliding_window=128, full_attention_every=3)
    assert [layer_slides(m, i) for i in range(6)] == [True, True, False, True, True, False]
    assert mask_types(m) == ["full", "sliding"]
    assert mask_types(ModelSpec(**BASE, sliding_window=128)) == ["sliding"]
    assert mask_types(ModelSpec(**BASE)) == ["full"]


def test_sliding_mask_only_from_the_window_on() -> None:
    # source: masking_utils._ignore_causal_mask_sdpa: no skip when kv_length >= local_attention_size
    m = ModelSpec(**BASE, sliding_window=T)
    assert sliding_mask_materialised(m, T) and not sliding_mask_materialised(m, T - 1)
    assert added(dict(sliding_window=T + 1)) == 0


def test_sliding_mask_cost() -> None:
    # source: convert_boolean_attn_mask: a (B, 1, T, T) bf16 mask per sliding layer, saved by the
    # memory-efficient kernel (the shared bool mask is gone when the head's peak comes)
    every = added(dict(sliding_window=128))
    half = added(dict(sliding_window=128, full_attention_every=2))
    assert every == L * B * T * T * 2
    assert half == every // 2


# -- head ----------------------------------------------------------------------------------------
def test_logit_softcap_keeps_its_tanh() -> None:
    # source: Gemma2ForCausalLM: tanh saves its (B, T, V) output
    assert added(dict(logit_softcap=30.0)) >= B * T * V * 2


def test_multipliers_are_transient() -> None:
    # a multiply by a Python scalar saves nothing: no peak moves with the default loss
    assert added(dict(embedding_scale=16.0, residual_multiplier=0.25, logit_scale=0.5)) == 0


# -- placements ----------------------------------------------------------------------------------
def test_sandwich_adds_two_norms_per_layer() -> None:
    assert added(dict(norm_placement="sandwich")) > 0
    assert added(dict(parallel_norms=2), base=dict(block="parallel")) > 0


# -- fused projections ---------------------------------------------------------------------------
def test_fused_qkv_keeps_the_whole_projection_output() -> None:
    # source: flash saves the v view (no GQA expansion), which keeps q and k's part of the fused
    # output alive: B*T*(q_dim + kv_dim) bf16 per layer more
    assert added(dict(fused_qkv=True)) == L * B * T * 2 * D_MODEL * 2


def test_fused_qkv_with_gqa_costs_nothing_more() -> None:
    # repeat_kv copies v: no view is saved, the fused output goes as the separate ones do
    assert added(dict(fused_qkv=True), base=dict(n_kv_heads=2)) == 0


def test_fused_gate_up_saves_what_gate_and_up_save() -> None:
    assert added(dict(fused_gate_up=True)) == 0


def test_lora_on_fused_qkv_is_one_adapter() -> None:
    gqa = {**BASE, "n_kv_heads": 2}  # K/V expanded: no view of the fused output is saved
    m = ModelSpec(**gqa, fused_qkv=True)
    inv = [p for p in param_inventory(m, LoraSpec(targets=("qkv",))) if p.kind == "lora" and p.layer == 0]
    assert [p.shape for p in inv] == [(16, D_MODEL), (2 * D_MODEL, 16)]
    tr = dict(batch=B, seq=T, precision="bf16")

    def acts(model: ModelSpec, targets: tuple[str, ...]) -> int:
        exp = ExperimentSpec(model=model, training=TrainingSpec(**tr, lora=LoraSpec(targets=targets, dropout=0.1)))
        return estimate(exp, timeline=False, replay=False).extra["max_activation_bytes"]

    # peft lora.Linear: one dropout of the input, saved by lora_A, instead of one per projection
    assert acts(ModelSpec(**gqa), ("q", "k", "v")) - acts(m, ("qkv",)) >= L * 2 * B * T * D_MODEL * 2


def test_plan_fits_one_side_of_a_sliding_window() -> None:
    # the step changes shape at T = window (an explicit mask from there on): the fit's three
    # sequence lengths stay on one side of it, and its peaks equal direct estimates there
    from memcalc.plan.fits import fit_points, fit_step

    m = ModelSpec(**{**BASE, "max_seq_len": 2048}, sliding_window=768)
    exp = ExperimentSpec(model=m, training=TrainingSpec(precision="bf16"))
    assert fit_points(exp) == (768, 1408, 2048)
    fit = fit_step(exp)
    for seq in (768, 1024):
        direct = estimate(exp.model_copy(update={"training": TrainingSpec(precision="bf16", seq=seq, batch=2)}),
                          timeline=False, replay=False).peak_bytes
        assert abs(fit.peak(2, seq) - direct) <= 0.001 * direct

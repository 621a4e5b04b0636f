"""Mixture-of-experts and MLA activations: torch-free invariants of the estimator (memcalc.engine.blocks.moe / mla).

Each row names the rule it follows; the exact bytes are checked against the replica's meta trace in
tests/trace/test_moe_mla_trace.py (slow).
"""

from __future__ import annotations

import pytest

from memcalc.core.kernels import mla_attention_kernel
from memcalc.core.rules import rope_width
from memcalc.core.spec import ExperimentSpec, LoraSpec, MLASpec, ModelSpec, MoESpec, TrainingSpec
from memcalc.estimate.peak import estimate

BASE = dict(name="tiny-moe", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab_size=512)
MOE = dict(n_experts=16, top_k=2, d_ff_expert=256)


def _act(moe: dict | None = None, mla: dict | None = None, lora: LoraSpec | None = None, profile=None, **tr) -> int:
    """The highest activation bytes alive at any instant of the step (``profile``: a kernel profile, else the
    default)."""
    m = ModelSpec(**BASE, moe=MoESpec(**moe) if moe else None, mla=MLASpec(**mla) if mla else None)
    exp = ExperimentSpec(model=m, training=TrainingSpec(**{"batch": 1, "seq": 256, "precision": "bf16", "lora": lora,
                                                           **tr}), **({"profile": profile} if profile else {}))
    return estimate(exp, timeline=False, replay=False).extra["max_activation_bytes"]


def test_more_experts_active_more_activation_bytes():
    # source: grouped_mm_experts_forward sizes every routed tensor by tokens x top_k
    acts = [_act({**MOE, "top_k": k}) for k in (1, 2, 4, 8)]
    assert acts == sorted(acts) and len(set(acts)) == 4


def test_routed_rows_scale_with_top_k():
    # source: S = tokens x top_k rows in each routed tensor: equal steps of top_k add equal bytes
    a1, a2, a3 = (_act({**MOE, "top_k": k}) for k in (1, 2, 3))
    assert a2 - a1 == a3 - a2 > 0


def test_expert_count_moves_only_the_router_tensors():
    # source: the (tokens, n_experts) logits / softmax are the only activations sized by n_experts;
    # doubling the experts adds at most a few such tensors (here 4 x 256 tokens x 16 experts x 4 B)
    a, b = _act(MOE), _act({**MOE, "n_experts": 32})
    assert 0 < b - a <= 4 * 256 * 16 * 4


def test_fp32_routing_weights_cost_more():
    # source: MixtralTopKRouter keeps fp32 weights, so proj_out * weights is fp32 (tokens x top_k x d)
    assert _act({**MOE, "router": "softmax-fp32"}) > _act({**MOE, "router": "softmax"})


def test_shared_expert_adds_activations():
    # source: DeepseekV3MoE / Qwen2MoeSparseMoeBlock run a dense MLP of the shared width as well
    assert _act({**MOE, "n_shared_experts": 1}) > _act(MOE)


def test_dense_first_layers_change_the_activations():
    # source: first_k_dense_replace: those layers run the dense MLP (d_ff) instead of the routed block
    assert _act({**MOE, "first_dense_layers": 1}) != _act(MOE)


def test_adapted_experts_keep_a_copy_of_the_expert_stack():
    # source: peft 0.21 ParamWrapper / _LoraFactorsProxy: baddbmm(W, B', A') is saved by grouped_mm
    attn = _act(MOE, lora=LoraSpec(targets=("q", "v")))
    experts = _act(MOE, lora=LoraSpec(targets=("q", "v", "experts")))
    stack = 2 * 16 * 3 * 256 * 256 * 2  # 2 layers x E x (2f + f) x d x bf16
    assert experts - attn >= stack


def test_litgpt_expert_lora_keeps_no_merged_stack():
    # source: litgpt 0.5.13 lora.py: LLaMAMoE's experts are LLaMAMLP of LoRALinear, whose forward adds
    # (x @ A.T @ B.T) * scaling to the frozen output (no W + B A): the expert adapters add the branch's (rows, r)
    # products and (rows, f) sums, not a copy of the stack; LoRA stays below the full fine-tune (issue 32: 104.6 vs
    # 22.3 GiB of saved activations on Mixtral under the litgpt profile)
    from memcalc.inputs.profiles import get_profile

    lit = {"profile": get_profile("litgpt-torch-2.8-cuda")}
    moe = {**MOE, "implementation": "litgpt"}  # as --framework litgpt builds it (rules.framework_model)
    full, attn = _act(moe, **lit), _act(moe, lora=LoraSpec(targets=("q", "v")), **lit)
    experts = _act(moe, lora=LoraSpec(targets=("q", "v", "gate", "up", "down")), **lit)
    stack = 2 * 16 * 3 * 256 * 256 * 2  # what PEFT's merged copies would add (above)
    assert attn < experts < attn + stack // 4 and experts <= full


def test_litgpt_expert_adapters_are_per_expert_loralinears():
    # source: litgpt 0.5.13 lora.py LLaMAMoE.__init__: create_lora_linear for the gate (d -> E) and each expert's
    # fc_1, fc_2 (d -> f) and proj (f -> d): r (d + E) + E r (3 d + 3 f) adapter elements per layer (PEFT's
    # ParamWrapper on the 3-D experts would hold E r (3 d + 5 f): gate_up at rank 2r)
    from memcalc.engine.params import count_params

    r, d, e, f = 8, 256, 16, 256
    m = ModelSpec(**BASE, moe=MoESpec(**MOE, implementation="litgpt"))
    got = count_params(m, LoraSpec(rank=r, targets=("gate", "up", "down"))).lora
    assert got == 2 * (r * (d + e) + e * r * (3 * d + 3 * f))


MLA = dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)


@pytest.mark.parametrize("kernel,qk,v,want", [
    ("flash", 192, 128, "efficient"),  # source: sdp_utils.cpp check_head_dim_size_flash (equal head dims)
    ("flash", 128, 128, "flash"),
    ("efficient", 192, 128, "efficient"),
    ("math", 192, 128, "math"),
])
def test_mla_kernel(kernel, qk, v, want):
    assert mla_attention_kernel(kernel, qk, v) == want


def test_mla_rope_tables_use_the_rope_head_dim():
    # source: DeepseekV3Config sets head_dim = qk_rope_head_dim for its rotary embedding
    assert rope_width(ModelSpec(**BASE, mla=MLASpec(**MLA))) == 32


def test_mla_wider_heads_more_activation_bytes():
    # source: the query, key (nope + rope) and kv_b output (nope + v) are per-head tensors
    assert _act(mla={**MLA, "qk_nope_head_dim": 128}) > _act(mla=MLA)
    assert _act(mla={**MLA, "v_head_dim": 128}) > _act(mla=MLA)


def test_moe_notes_state_the_routing_assumption():
    m = ModelSpec(**BASE, moe=MoESpec(**MOE))
    notes = estimate(ExperimentSpec(model=m, training=TrainingSpec()), timeline=False, replay=False).notes
    assert any("routing assumed balanced" in n and "imbalanced" in n for n in notes)

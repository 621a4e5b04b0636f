"""The field contract (memcalc.core.contract): every spec field changes an estimated number on a
setup where it can matter, or is listed as inert with a reason; options that change nothing in a
given setup are named in the estimate's notes.

The fields are read from ``model_fields``, so a new field without a decision fails here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.contract import CONDITIONAL, INERT, NESTED, PENDING
from memcalc.core.spec import (DeepSpeedSpec, ExperimentSpec, KernelProfile, LoraSpec, MLASpec, ModelSpec, MoESpec,
                               TrainingSpec)
from memcalc.estimate.peak import estimate

SPECS = (ModelSpec, MoESpec, MLASpec, LoraSpec, TrainingSpec, KernelProfile, ExperimentSpec, DeepSpeedSpec)

#: A small decoder: 4 layers (so every-k and sqrt differ), shapes big enough that a changed
#: tensor is not hidden by the allocator's 512-byte rounding.
BASE_MODEL: dict[str, Any] = dict(name="tiny", n_layers=4, d_model=128, n_heads=4, d_ff=256, vocab_size=64,
                                  max_seq_len=512)
BASE_TRAINING: dict[str, Any] = dict(batch=4, seq=256)

# setups: updates of the base model / training / profile, and "lora" (LoraSpec kwargs) for LoRA runs
BF16 = {"training": {"precision": "bf16"}}
LORA = {"lora": {}}
QLORA = {"lora": {"qlora": True}, "training": {"precision": "bf16"}}
MOE = {"model": {"moe": dict(n_experts=4, top_k=2, d_ff_expert=128)}}
SHARED = {"model": {"moe": dict(n_experts=4, top_k=2, d_ff_expert=128, n_shared_experts=1)}}
#: DeepSpeed ZeRO-2 over 4 GPUs (memcalc.engine.deepspeed)
DS2 = {"training": {"zero": 2, "gpus": 4, "sharding": "deepspeed", "precision": "bf16", "master_weights": True,
                    "deepspeed": {"stage": 2, "reduce_bucket_size": 10**6}}}
#: DeepSpeed ZeRO-3 over 4 GPUs, no parameter small enough to stay whole
DS3 = {"training": {"zero": 3, "gpus": 4, "sharding": "deepspeed", "precision": "bf16", "master_weights": True,
                    "deepspeed": {"stage": 3, "reduce_bucket_size": 10**6, "param_persistence_threshold": 0}}}
MLA = {"model": {"mla": dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)}}

#: "Spec.field" -> (setup where the field matters, the perturbed value). The base value is the
#: setup's (default unless the setup sets it).
PERTURB: dict[str, tuple[dict, Any]] = {
    # -- ModelSpec
    "ModelSpec.n_layers": ({}, 3),
    "ModelSpec.d_model": ({}, 256),
    "ModelSpec.n_heads": ({}, 8),
    "ModelSpec.n_kv_heads": ({}, 2),
    "ModelSpec.head_dim": ({}, 64),
    "ModelSpec.d_ff": ({}, 512),
    "ModelSpec.vocab_size": ({}, 1024),
    "ModelSpec.max_seq_len": ({"model": {"positions": "learned"}}, 1024),  # the position table's rows
    "ModelSpec.mlp": ({}, "plain"),
    "ModelSpec.activation": ({}, "relu"),  # relu saves its output (silu/gelu save the input: same bytes)
    "ModelSpec.norm": ({}, "layernorm"),
    "ModelSpec.norm_placement": ({"model": {"residual_scale": 0.5}}, "post"),
    "ModelSpec.block": ({}, "parallel"),
    "ModelSpec.positions": ({}, "learned"),
    "ModelSpec.rotary_pct": ({}, 0.5),
    "ModelSpec.alibi_trainable": ({"model": {"positions": "alibi"}}, True),
    "ModelSpec.qkv_bias": ({}, True),
    "ModelSpec.o_bias": ({}, True),
    "ModelSpec.mlp_bias": ({}, True),
    "ModelSpec.norm_bias": ({}, True),
    "ModelSpec.tie_embeddings": ({}, True),
    "ModelSpec.lm_head_bias": ({}, True),
    "ModelSpec.final_norm": ({}, False),
    "ModelSpec.attn_dropout": ({"profile": {"attention": "math"}}, 0.1),  # fused kernels keep an RNG state, not a mask
    "ModelSpec.resid_dropout": ({}, 0.1),
    "ModelSpec.embd_dropout": ({}, 0.1),
    # parameter shapes (engine.params): the weights, grads and optimizer state change
    "ModelSpec.parallel_norms": ({"model": {"block": "parallel"}}, 2),
    "ModelSpec.qk_norm": ({}, "full"),
    "ModelSpec.attn_sinks": ({}, True),
    # activations (engine.blocks.attention_variants, engine.blocks.layer)
    "ModelSpec.attn_softcap": ({}, 30.0),  # eager attention: the (B, H, T, T) scores and probabilities
    "ModelSpec.logit_softcap": ({}, 30.0),  # tanh of the logits saved
    "ModelSpec.sliding_window": ({}, 64),  # seq 256 >= 64: an explicit mask per layer
    "ModelSpec.full_attention_every": ({"model": {"sliding_window": 64}}, 2),  # half the layers lose the mask
    # the scaled copy of the logits beside the logits outlasts the chunked loss's fp32 chunks
    "ModelSpec.logit_scale": ({"profile": {"cross_entropy": "chunked"}, "model": {"vocab_size": 8192}}, 0.5),
    "ModelSpec.fused_qkv": ({}, True),  # flash saves the v view: the whole q,k,v output stays alive
    # one gradient of the fused output (split_backward) in the recomputed layer's backward
    "ModelSpec.fused_gate_up": ({"training": {"checkpoint": "full"}}, True),
    "ModelSpec.moe": ({}, MoESpec(**MOE["model"]["moe"])),
    "ModelSpec.mla": ({}, MLASpec(**MLA["model"]["mla"])),
    # -- MoESpec, MLASpec (parameter shapes)
    "MoESpec.n_experts": (MOE, 8),
    "MoESpec.top_k": (MOE, 1),  # routed rows (engine.blocks.moe): batch x seq x top_k
    "MoESpec.router": ({**MOE, **BF16}, "softmax-fp32"),  # fp32 routing weights: fp32 weighted expert outputs
    "MoESpec.d_ff_expert": (MOE, 64),
    "MoESpec.n_shared_experts": (MOE, 1),
    "MoESpec.d_ff_shared": (SHARED, 64),
    "MoESpec.shared_expert_gate": (SHARED, True),
    "MoESpec.first_dense_layers": (MOE, 1),
    "MoESpec.every": (MOE, 2),
    "MoESpec.router_bias": (MOE, True),
    "MoESpec.expert_bias": (MOE, True),
    # PEFT moves gate/up/down onto the experts: the dense first layer loses its adapters, the experts gain them
    "MoESpec.lora_mlp_to_experts": ({"model": {"moe": dict(n_experts=4, top_k=2, d_ff_expert=128, first_dense_layers=1)},
                                     "lora": {"targets": ("q", "gate", "up", "down")}}, True),
    "MLASpec.q_lora_rank": (MLA, None),
    "MLASpec.kv_lora_rank": (MLA, 64),
    "MLASpec.qk_nope_head_dim": (MLA, 16),
    "MLASpec.qk_rope_head_dim": (MLA, 8),
    "MLASpec.v_head_dim": (MLA, 16),
    # -- LoraSpec
    "LoraSpec.rank": (LORA, 32),
    "LoraSpec.targets": (LORA, ("q", "v")),
    "LoraSpec.dropout": (LORA, 0.1),
    "LoraSpec.qlora": ({**LORA, **BF16}, True),
    "LoraSpec.dora": (LORA, True),  # magnitude vectors, the weight-norm temporaries, saved base and lora results
    "LoraSpec.quant_block": (QLORA, 128),
    "LoraSpec.double_quant": (QLORA, False),
    "LoraSpec.dtype": ({**LORA, **BF16}, "fp32"),  # fp32 adapters, their grads and state; fp32 input copies
    # -- TrainingSpec
    "TrainingSpec.batch": ({}, 3),
    "TrainingSpec.seq": ({}, 128),
    "TrainingSpec.grad_accum": ({}, 2),
    "TrainingSpec.precision": ({}, "bf16"),
    "TrainingSpec.master_weights": (BF16, True),
    "TrainingSpec.optimizer": ({}, "sgd"),
    "TrainingSpec.optimizer_impl": ({}, "for-loop"),
    "TrainingSpec.checkpoint": ({}, "full"),
    "TrainingSpec.checkpoint_every": ({"training": {"checkpoint": "every-k"}}, 3),
    "TrainingSpec.fused_optimizer": ({}, True),
    "TrainingSpec.compile": ({}, True),
    "TrainingSpec.memory_budget": ({"training": {"compile": True}}, 0.0),
    "TrainingSpec.lora": ({}, LoraSpec()),
    "TrainingSpec.zero": ({"training": {"gpus": 4}}, 3),
    "DeepSpeedSpec.reduce_bucket_size": (DS2, 2 * 10**6),  # the bucket's bytes (stage_1_and_2.py setup_buckets)
    "DeepSpeedSpec.overlap_comm": (DS2, True),  # a second bucket
    "DeepSpeedSpec.contiguous_gradients": (DS2, False),  # no bucket: gradients stay until reduced
    "DeepSpeedSpec.prefetch_bucket_size": (DS3, 0),  # no layer gathered ahead
    "DeepSpeedSpec.max_live_parameters": (DS3, 0),  # no room to prefetch
    "DeepSpeedSpec.max_reuse_distance": (DS3, 0),  # layers released after their forward
    "DeepSpeedSpec.param_persistence_threshold": (DS3, 10**5),  # every parameter of the tiny model stays whole
    "TrainingSpec.gpus": ({"training": {"zero": 3}}, 4),
    # FSDP2's per-unit buffers (engine.fsdp) vs the generic ZeRO-3 layer gathers (engine.sharding)
    "TrainingSpec.sharding": ({"training": {"zero": 3, "gpus": 4}}, "fsdp1"),
    "TrainingSpec.offload_optimizer": ({}, True),
    # LoRA: the frozen base's saved weight views go to the host and come back in backward
    "TrainingSpec.activation_offload": (LORA, True),
    "TrainingSpec.tp": ({}, 2),
    "TrainingSpec.sequence_parallel": ({"training": {"tp": 2}}, True),
    # -- KernelProfile
    # flash and efficient differ in the rounding of their backward buffers (T to 128 vs 32)
    "KernelProfile.attention": ({"training": {"precision": "bf16", "checkpoint": "full", "seq": 100}}, "efficient"),
    "KernelProfile.rmsnorm": (BF16, "composite-legacy"),
    "KernelProfile.norm_upcast": (BF16, False),
    "KernelProfile.mean_saves_input": ({}, True),
    "KernelProfile.logits_fp32": (BF16, True),
    "KernelProfile.shift_copy": ({}, False),
    "KernelProfile.dropout_mask_bytes": ({"model": {"resid_dropout": 0.1}}, 4),
    "KernelProfile.allocator_round_bytes": ({}, 1024),
    "KernelProfile.cross_entropy": (BF16, "chunked"),  # each chunk's log-probabilities saved in fp32
    # fewer chunks: bigger fp32 chunk copies (a vocabulary large enough for the loss to set the peak)
    "KernelProfile.loss_chunks": ({**BF16, "profile": {"cross_entropy": "chunked"}, "model": {"vocab_size": 8192}}, 4),
    "KernelProfile.lora_dtype": ({**LORA, **BF16}, "fp32"),  # the framework's adapter dtype (LoraSpec.dtype None)
    # under autocast: o and down get a 16-bit input, which PEFT copies to fp32 before autocast casts it back
    "KernelProfile.lora_input_cast": ({**LORA, "training": {"precision": "amp-bf16"}}, True),
    "KernelProfile.sdpa_gqa": ({**BF16, "model": {"n_kv_heads": 2}}, True),  # k, v saved un-expanded
    "KernelProfile.gelu_new": ({"model": {"activation": "gelu_new"}}, "chain"),  # four saved tensors, not one
}


def build(setup: dict) -> ExperimentSpec:
    tr = {**BASE_TRAINING, **setup.get("training", {})}
    if "lora" in setup:
        tr["lora"] = LoraSpec(**setup["lora"])
    return ExperimentSpec(model=ModelSpec(**{**BASE_MODEL, **setup.get("model", {})}), training=TrainingSpec(**tr),
                          profile=KernelProfile(**setup.get("profile", {})))


def perturbed(exp: ExperimentSpec, key: str, value: Any) -> ExperimentSpec:
    """``exp`` with one field set, re-validated (so cross-field checks still run)."""
    cls, name = key.split(".")
    if cls in ("MoESpec", "MLASpec"):
        part = "moe" if cls == "MoESpec" else "mla"
        sub = type(getattr(exp.model, part))(**{**getattr(exp.model, part).model_dump(), name: value})
        return exp.model_copy(update={"model": ModelSpec(**{**exp.model.model_dump(), part: sub})})
    if cls == "DeepSpeedSpec":
        ds = DeepSpeedSpec(**{**exp.training.deepspeed.model_dump(), name: value})
        return exp.model_copy(update={"training": TrainingSpec(**{**exp.training.model_dump(), "deepspeed": ds})})
    if cls == "LoraSpec":
        lora = LoraSpec(**{**exp.training.lora.model_dump(), name: value})
        return exp.model_copy(update={"training": TrainingSpec(**{**exp.training.model_dump(), "lora": lora})})
    part = {"ModelSpec": "model", "TrainingSpec": "training", "KernelProfile": "profile"}[cls]
    obj = getattr(exp, part)
    new = type(obj)(**{**obj.model_dump(), name: value})
    return exp.model_copy(update={part: new})


def numbers(exp: ExperimentSpec) -> tuple:
    """Every estimated number: peaks, what is alive there, phases, bytes per parameter, counts, and
    the memory over the step's timeline (what --timeline and the HTML report draw)."""
    est = estimate(exp, timeline=True, replay=False)
    return (est.peak_bytes, est.first_step_peak_bytes, est.required_bytes, est.params, est.trainable_params,
            tuple(est.components.items()), tuple(est.phases.items()), tuple(est.bytes_per_param.items()),
            est.extra.get("max_activation_bytes"), repr(est.extra.get("compiled")),
            tuple(p.total_bytes for p in est.timeline))


ALL_FIELDS = [f"{cls.__name__}.{name}" for cls in SPECS for name in cls.model_fields]


def test_decisions_name_real_fields() -> None:
    for table in (INERT, NESTED, CONDITIONAL, PERTURB, PENDING):
        stale = [k for k in table if k not in ALL_FIELDS]
        assert not stale, f"entries for fields that do not exist: {stale}"
    both = set(INERT) & (set(PERTURB) | set(NESTED) | set(PENDING))
    assert not both, f"fields both inert and perturbed/nested/pending: {both}"
    both = set(PENDING) & set(PERTURB)
    assert not both, f"fields both inert and perturbed/nested: {both}"
    assert set(CONDITIONAL) <= set(PERTURB), "a conditional field needs a setup where it matters"


def test_inert_reasons_are_given() -> None:
    assert all(len(reason) > 10 for reason in INERT.values())
    assert all(len(reason) > 10 for reason in PENDING.values())


#: Inert fields that can be perturbed: (setup, value). The estimate must not move; if it does,
#: the field matters and belongs in PERTURB instead.
INERT_CHECK: dict[str, tuple[dict, Any]] = {
    "ModelSpec.name": ({}, "other"),
    "ModelSpec.norm_eps": ({}, 1e-6),
    "ModelSpec.residual_scale": ({"model": {"norm_placement": "post"}}, 0.5),
    "ModelSpec.embedding_scale": ({}, 2.0),
    "ModelSpec.residual_multiplier": ({"training": {"checkpoint": "full"}}, 0.5),
    "LoraSpec.alpha": (LORA, 8.0),
    "KernelProfile.name": ({}, "other"),
    "KernelProfile.torch_version": ({}, "2.4"),
    "KernelProfile.framework": ({}, "hf"),  # the label alone; the rules are the other fields
}


@pytest.mark.parametrize("key", list(INERT_CHECK))
def test_inert_field_is_inert(key: str) -> None:
    assert key in INERT
    setup, value = INERT_CHECK[key]
    base = build(setup)
    assert numbers(perturbed(base, key, value)) == numbers(base), f"{key} changes the estimate: move it out of INERT"


@pytest.mark.parametrize("key", ALL_FIELDS)
def test_field_changes_the_estimate_or_is_inert(key: str) -> None:
    if key in INERT or key in NESTED or key in PENDING:
        return
    assert key in PERTURB, (f"{key} has no decision: give it a setup and a value in PERTURB (where it changes the "
                            f"estimate), or add it to memcalc.core.contract.INERT with the reason")
    setup, value = PERTURB[key]
    base = build(setup)
    cls, name = key.split(".")
    current = getattr(base.training.lora if cls == "LoraSpec" else
                      {"ModelSpec": base.model, "TrainingSpec": base.training, "KernelProfile": base.profile,
                       "MoESpec": base.model.moe, "MLASpec": base.model.mla,
                       "DeepSpeedSpec": base.training.deepspeed}[cls], name)
    assert current != value, f"{key}: the perturbed value equals the setup's"
    assert numbers(perturbed(base, key, value)) != numbers(base), (
        f"{key} = {value!r} changed no estimated number (setup {setup}): list it in INERT with the reason, "
        f"or in CONDITIONAL with a note where it has no effect")


# -- options that change nothing here are named in the notes ---------------------------------

#: (field, setup where it is inert, value): the estimate must not move, and must say so.
NO_EFFECT = [
    ("TrainingSpec.zero", {"training": {"gpus": 1}}, 3),  # source: one GPU, nothing to shard
    ("TrainingSpec.zero", {"training": {"gpus": 4, "offload_optimizer": True}}, 1),  # source: stage-1 state on the CPU
    ("TrainingSpec.gpus", {"training": {"zero": 0}}, 4),  # source: plain data parallelism
    ("TrainingSpec.sharding", {"training": {"zero": 3, "gpus": 1}}, "fsdp1"),  # source: one GPU, nothing sharded
    ("TrainingSpec.checkpoint_every", {"training": {"checkpoint": "full"}}, 3),  # source: K only for every-k
    ("TrainingSpec.memory_budget", {"training": {"compile": True, "checkpoint": "full"}}, 0.5),
    ("TrainingSpec.optimizer_impl", {"training": {"optimizer": "sgd"}}, "for-loop"),  # source: SGD makes no temporaries
    ("TrainingSpec.offload_optimizer", {"training": {"optimizer": "sgd"}}, True),  # source: SGD has no state
    ("LoraSpec.quant_block", LORA, 128),  # source: the base is not quantised
    ("LoraSpec.double_quant", LORA, False),
    ("LoraSpec.dtype", LORA, "fp32"),  # source: fp32 precision: the adapters are fp32 either way
    ("KernelProfile.loss_chunks", {}, 4),  # source: the full loss is not chunked
    ("TrainingSpec.sequence_parallel", {}, True),  # source: tp 1, no tensor-parallel group
]


def test_every_conditional_field_has_a_no_effect_case() -> None:
    assert {k for k, _, _ in NO_EFFECT} == set(CONDITIONAL)


@pytest.mark.parametrize("key,setup,value", NO_EFFECT, ids=[f"{k}-{v}" for k, _, v in NO_EFFECT])
def test_no_effect_is_noted(key: str, setup: dict, value: Any) -> None:
    base = build(setup)
    exp = perturbed(base, key, value)
    assert numbers(exp) == numbers(base), f"{key} = {value!r} does change the estimate here; drop the note"
    name = key.split(".")[1]
    notes = estimate(exp, timeline=False, replay=False).notes
    assert any(name in n for n in notes), f"no note names {name}: {notes}"
    assert not any(name in n for n in estimate(base, timeline=False, replay=False).notes)


def test_effective_setup_has_no_notes() -> None:
    exp = build({"training": {"zero": 3, "gpus": 4, "checkpoint": "every-k", "checkpoint_every": 3}})
    assert estimate(exp, timeline=False, replay=False).notes == []


def test_notes_in_text_and_json() -> None:
    args = ["estimate", "--params", "1e8", "--seq", "128", "--zero", "3", "--gpu", "rtx-4090"]
    r = CliRunner().invoke(app, args + ["--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["notes"] == ["zero 3 has no effect with one GPU: nothing to shard (set gpus)"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "zero 3 has no effect with one GPU" in " ".join(r.stdout.split())

"""The field contract (memcalc.core.contract): every spec field changes an estimated number on a
setup where it can matter, or is listed as inert with a reason; options that change nothing in a
given setup are named in the estimate's notes.

The fields are read from ``model_fields``, so a new field without a decision fails here. The rows
(``PERTURB``: a setup and a perturbed value per field) are in ``tests/contract_tables.py``, which the
trace side (``tests/trace/test_field_contract_trace.py``) reads too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from contract_tables import DS2, LORA, PERTURB, build, perturbed  # the rows: tests/contract_tables.py
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.contract import CONDITIONAL, INERT, NESTED, PENDING
from memcalc.core.spec import (DeepSpeedSpec, ExperimentSpec, KernelProfile, LoraSpec, MLASpec, ModelSpec, MoESpec,
                               TrainingSpec)
from memcalc.estimate.peak import estimate

SPECS = (ModelSpec, MoESpec, MLASpec, LoraSpec, TrainingSpec, KernelProfile, ExperimentSpec, DeepSpeedSpec)


def numbers(exp: ExperimentSpec) -> tuple:
    """Every estimated number: peaks, what is alive there, phases, bytes per parameter, counts, and
    the memory over the step's timeline (what --timeline and the HTML report draw)."""
    est = estimate(exp, timeline=True, replay=False)
    # NCCL's buffers follow the GPU count alone (a process group whenever gpus > 1: tests/unit/test_gpu_side.py)
    step_need = est.required_bytes - est.device_parts["nccl_bytes"]
    return (est.peak_bytes, est.first_step_peak_bytes, step_need, est.params, est.trainable_params,
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
    ("TrainingSpec.galore_rank", {}, 16),  # source: adamw projects nothing (galore_rank is GaLore's)
    ("LoraSpec.quant_block", LORA, 128),  # source: the base is not quantised
    ("LoraSpec.double_quant", LORA, False),
    ("LoraSpec.bnb_saves_input", LORA, True),  # source: the base is not quantised
    ("LoraSpec.dtype", LORA, "fp32"),  # source: fp32 precision: the adapters are fp32 either way
    ("KernelProfile.loss_chunks", {}, 4),  # source: the full loss is not chunked
    ("KernelProfile.loss_tokens", {}, 0.5),  # source: the full loss runs on every position
    ("KernelProfile.liger_ops", {}, ("flce",)),  # source: kernels none: Trainer applies no Liger kernel
    ("TrainingSpec.sequence_parallel", {}, True),  # source: tp 1, no tensor-parallel group
    ("TrainingSpec.ep_capacity_factor", {}, 1.5),  # source: ep 1, no all-to-all dispatch
    ("TrainingSpec.pp_schedule", {}, "gpipe"),  # source: pp 1, no pipeline
    ("TrainingSpec.microbatches", {}, 2),  # source: pp 1, the batch is not split
    ("TrainingSpec.pp_stages_per_rank", {}, 2),  # source: pp 1, no stages
    ("TrainingSpec.pp_first_stage_less_layers", {}, 0),  # source: pp 1, the layers are not split
    ("TrainingSpec.pp_last_stage_less_layers", {}, 2),  # source: pp 1, the layers are not split
    ("DeepSpeedSpec.offload_param", DS2, True),  # source: offload_config.py, offload_param is read at stage 3 only
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

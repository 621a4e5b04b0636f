"""The checkpointing a trainer runs by default (memcalc.inputs.trainer_defaults), resolved as the command
line resolves it: the spec, the origin "default", the reason and the note; a flag, a config or a recipe
that names the checkpointing wins."""

from __future__ import annotations

import pytest

from memcalc.inputs.resolve import Options, resolve

ROWS = [
    # (options, checkpoint, reentrant, a phrase of the note; None: no note)
    # source: peft 0.21.2 utils/other.py prepare_model_for_kbit_training(use_gradient_checkpointing=True);
    # torch 2.13 utils/checkpoint.py (no use_reentrant -> True)
    (dict(model="gpt2", qlora=True), "full", True, "prepare_model_for_kbit_training"),
    # source: memcalc's own default for plain LoRA and full fine-tuning on hf (TrainingArguments: off)
    (dict(model="gpt2", lora=True), "none", False, None),
    (dict(model="gpt2"), "none", False, None),
    # source: a flag wins, and then PEFT's reentrant kind is not assumed (Trainer's own call is non-reentrant)
    (dict(model="gpt2", qlora=True, checkpoint="none"), "none", False, None),
    (dict(model="gpt2", qlora=True, checkpoint="full"), "full", False, None),
    (dict(model="gpt2", qlora=True, checkpoint="full", reentrant=True), "full", True, None),
    # source: trl 1.16.0 trainer/sft_config.py gradient_checkpointing=True; transformers 5
    # _activation_checkpointing_enable -> use_reentrant False
    (dict(model="gpt2", lora=True, framework="trl"), "full", False, "SFTConfig.gradient_checkpointing"),
    (dict(model="gpt2", framework="trl"), "full", False, "SFTConfig.gradient_checkpointing"),
    (dict(model="gpt2", qlora=True, framework="trl"), "full", False, "SFTConfig.gradient_checkpointing"),
    # source: TRL >= 0.20 does not call prepare_model_for_kbit_training; profile qlora_fp32_cast false: no reentrant
    # source: unsloth 2026.10.9 models/llama.py get_peft_model(use_gradient_checkpointing="unsloth")
    (dict(model="llama-3.1-8b", lora=True, framework="unsloth"), "full", False, "use_gradient_checkpointing"),
    # source: torchtune / LitGPT: their recipe files say what they run; no default is assumed
    (dict(model="llama-3.1-8b", qlora=True, framework="torchtune"), "none", False, None),
    (dict(model="llama-3.1-8b", qlora=True, framework="litgpt"), "none", False, None),
    # source: a config's own checkpointing is its own (the reference config "control": none)
    (dict(config="control", qlora=True), "none", False, None),
]


@pytest.mark.parametrize("options,checkpoint,reentrant,note", ROWS)
def test_trainer_checkpointing_default(options, checkpoint, reentrant, note):
    r = resolve(Options(**options))
    tr = r.exp.training
    assert (tr.checkpoint, tr.checkpoint_reentrant) == (checkpoint, reentrant)
    notes = [n for n in r.notes if n.startswith("checkpointing every layer")]
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and note in notes[0] and "--checkpoint none" in notes[0]
        assert r.origin["checkpoint"] == "default" and note.split("(")[0] in r.reasons["checkpoint"]


# -- one precision policy for estimate and plan (issue 29) -----------------------------------------
@pytest.mark.parametrize("options,adapters", [
    # source: memcalc.inputs.trainer_defaults.DEFAULT_PRECISION: Trainer's fp32 without --bf16 (TrainingSpec's
    # own default), a bf16 base under LoRA (the model loaded in bfloat16) and QLoRA (bnb_4bit_compute_dtype)
    (dict(model="gpt2"), "none"),
    (dict(model="gpt2", lora=True), "lora"),
    (dict(model="gpt2", qlora=True), "qlora"),
])
def test_estimate_precision_default_is_the_policy(options, adapters):
    from memcalc.inputs.trainer_defaults import default_precision

    r = resolve(Options(**options))
    precision, why = default_precision(adapters)
    assert (r.exp.training.precision, r.reasons["precision"]) == (precision, why)


def test_plan_setups_take_the_policy():
    # source: plan's multi-GPU LoRA / QLoRA setups run estimate's default precision; its full fine-tune is the one
    # departure (SHARDED_FULL_PRECISION: FSDP2's bf16 MixedPrecisionPolicy over fp32 shards), stated in its command
    from memcalc.inputs.presets import load_preset
    from memcalc.inputs.profiles import DEFAULT_PROFILE, get_profile
    from memcalc.inputs.trainer_defaults import SHARDED_FULL_PRECISION, default_precision
    from memcalc.plan.cluster import cluster_setups

    setups = cluster_setups(load_preset("gpt2"), 64, get_profile(DEFAULT_PROFILE))
    for s in ("lora", "qlora"):
        assert setups[s]["full"].training.precision == default_precision(s)[0]
        assert not setups[s]["full"].training.master_weights
    full = setups["full"]["full"].training
    assert (full.precision, full.master_weights) == SHARDED_FULL_PRECISION

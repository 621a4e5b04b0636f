"""PEFT ``modules_to_save`` (``--modules-to-save``, LoraSpec.modules_to_save; issue 28): the estimate
counts PEFT's ``ModulesToSaveWrapper`` (peft 0.21 utils/other.py: the original module kept frozen, a
trainable ``copy.deepcopy`` beside it in the base's dtype), the flag and the recipes' keys reach it, and
bad input is one line. The trace side is tests/trace/test_modules_to_save_grid.py."""

from __future__ import annotations

import pytest
from conftest import cli_run, one_line_error, resolved

from memcalc.core.spec import ExperimentSpec, KernelProfile, LoraSpec, ModelSpec, TrainingSpec
from memcalc.engine.params import count_params

MODEL = ModelSpec(name="tiny", n_layers=2, d_model=128, n_heads=4, d_ff=256, vocab_size=1024, max_seq_len=512)
TIED = MODEL.model_copy(update={"tie_embeddings": True})
VD = 1024 * 128  # one vocab x d weight


@pytest.mark.parametrize("model,save,added,trainable", [
    # source: ModulesToSaveWrapper: the original stays (frozen), its copy is trainable: +V*d params, +V*d trainable
    (MODEL, ("embed_tokens",), VD, VD),
    (MODEL, ("lm_head",), VD, VD),
    (MODEL, ("embed_tokens", "lm_head"), 2 * VD, 2 * VD),
    # source: tied embeddings: PEFT's copy of lm_head is a new untied weight (the tied original is embed_tokens)
    (TIED, ("lm_head",), VD, VD),
    (TIED, ("embed_tokens", "lm_head"), 2 * VD, 2 * VD),
])
def test_the_copies_are_counted(model, save, added, trainable):
    lora = LoraSpec(targets=("q", "v"))
    base, saved = count_params(model, lora), count_params(model, lora.model_copy(update={"modules_to_save": save}))
    assert (saved.total - base.total, saved.trainable - base.trainable) == (added, trainable)


def test_the_estimate_grows_by_weights_grads_and_state():
    """bf16 copies with AdamW: at the optimizer step, weights 2 B + gradient 2 B + two moments 2 B each, at
    least, per element of each copy."""
    def peak(save):
        tr = TrainingSpec(precision="bf16", batch=1, seq=64, lora=LoraSpec(targets=("q", "v"), modules_to_save=save))
        from memcalc.estimate.peak import estimate

        return estimate(ExperimentSpec(model=MODEL, training=tr, profile=KernelProfile(framework="hf")),
                        timeline=False).phases["optimizer step"]
    assert peak(("embed_tokens", "lm_head")) - peak(()) >= 2 * VD * (2 + 2 + 2 + 2)


@pytest.mark.parametrize("lora,message", [
    # source: LoraSpec lists the valid names
    (dict(modules_to_save=("norm",)), "valid: embed_tokens, lm_head"),
    # source: LoraSpec: a module adapted (target head) and wrapped whole (modules_to_save lm_head)
    (dict(modules_to_save=("lm_head",), targets=("q", "head")), "lm_head is both a LoRA target"),
])
def test_bad_lora_spec(lora, message):
    with pytest.raises(ValueError, match=message):
        LoraSpec(**lora)


def test_only_frameworks_that_build_the_wrapper():
    """source: only transformers + PEFT build ModulesToSaveWrapper (torchtune, LitGPT, TRL's fused head do not)."""
    with pytest.raises(ValueError, match="valid frameworks: hf, plain"):
        ExperimentSpec(model=MODEL, training=TrainingSpec(lora=LoraSpec(modules_to_save=("lm_head",))),
                       profile=KernelProfile(framework="torchtune"))


@pytest.mark.parametrize("args,code,message", [
    # source: memcalc.inputs.resolve.parse_modules_to_save lists the valid names
    (["--modules-to-save", "norm"], 2, "valid: embed_tokens, lm_head"),
])
def test_bad_modules_to_save_is_one_line(args, code, message):
    one_line_error(cli_run(["estimate", "--model", "gpt2", *args]), code, message)


def test_the_flag_implies_lora_and_maps_aliases(monkeypatch):
    res = resolved(["--model", "gpt2", "--modules-to-save", "wte,lm_head"], monkeypatch)
    assert res.exp.training.lora is not None and res.exp.training.lora.modules_to_save == ("embed_tokens", "lm_head")


@pytest.mark.parametrize("cfg,want", [
    # source: PEFT LoraConfig.modules_to_save (a list, or one name); TRL ModelConfig.lora_modules_to_save is read
    # the same
    ({"modules_to_save": ["embed_tokens", "lm_head"]}, "embed_tokens,lm_head"),
    ({"modules_to_save": "lm_head"}, "lm_head"),
])
def test_peft_config_modules_to_save(cfg, want):
    from memcalc.inputs.recipes.common import Recipe
    from memcalc.inputs.recipes.hf import peft

    rec = Recipe(kind="peft", files=[])
    peft({"peft_type": "LORA", **cfg}, rec, "adapter_config.json", "")
    assert rec.values["modules_to_save"] == want
    assert rec.keys["modules_to_save"] == "adapter_config.json:modules_to_save"


def test_peft_config_unknown_module():
    from memcalc.core.errors import UserError
    from memcalc.inputs.recipes.hf import modules_to_save

    with pytest.raises(UserError, match=r"a\.json:modules_to_save: score is not modelled; valid: embed_tokens, lm_h"):
        modules_to_save(["score"], "a.json:modules_to_save")

"""``--kernels liger`` on estimate, plan and validate, and the recipe keys that select it (HF TrainingArguments /
TRL ``use_liger_kernel`` + ``liger_kernel_config``, axolotl's Liger plugin keys): what is resolved, and one-line
errors for what is not modelled. Torch-free and quick: a few CliRunner rows (the resolved spec read through a spy
on ``resolve``; the error rows stop before any simulation), the recipe readers and the estimator's rule
(:func:`memcalc.core.liger.liger_plan`) called directly."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import one_line_error, resolved

from memcalc.cli import app
from memcalc.core.errors import UserError
from memcalc.core.liger import LIGER_OPS, liger_plan
from memcalc.core.spec import KernelProfile, LoraSpec, ModelSpec, TrainingSpec
from memcalc.inputs.recipes import axolotl, hf
from memcalc.inputs.recipes.common import Recipe


def test_flag_sets_the_profile(monkeypatch):
    # source: --kernels liger: every kernel apply_liger_kernel_to_llama applies by default (monkey_patch.py)
    prof = resolved(["--model", "llama-3.1-8b", "--kernels", "liger"], monkeypatch).exp.profile
    assert (prof.kernels, prof.liger_ops) == ("liger", LIGER_OPS)


def test_recipe_sets_the_profile(tmp_path, monkeypatch):
    p = tmp_path / "sft.yaml"
    p.write_text("model_name_or_path: Qwen/Qwen2.5-7B\nbf16: true\nuse_liger_kernel: true\n")
    prof = resolved(["--recipe", str(p)], monkeypatch).exp.profile
    assert (prof.kernels, prof.liger_ops) == ("liger", LIGER_OPS)


#: (CLI args, the one-line message)
CLI_ERRORS = [
    (["estimate", "--model", "llama-3.1-8b", "--kernels", "unsloth"], "Invalid value for '--kernels'"),
    # source: cut_cross_entropy cce_backward.py cce_backward_kernel asserts bf16/fp16 embeddings
    (["estimate", "--model", "llama-3.1-8b", "--kernels", "cce", "--precision", "fp32"], "needs 16-bit hidden states"),
    # source: gemma2's cce_forward passes final_logit_softcapping (memcalc.core.cce: not modelled)
    (["estimate", "--model", "gemma-2-9b", "--kernels", "cce"], "is none of the families whose Cut Cross-Entropy"),
    # source: validate/trainers/trl.py applies Liger only; cce_patch replaces transformers' CausalLM forward
    (["estimate", "--model", "llama-3.1-8b", "--framework", "trl", "--kernels", "cce"], "it needs --framework hf"),
    (["estimate", "--model", "gpt2", "--kernels", "liger"], "gpt2 is none of the families whose Liger kernels"),
    # source: the multi-GPU search runs ZeRO-3 and tensor parallelism, which Liger is not modelled with
    (["plan", "--model", "llama-3.1-8b", "--kernels", "liger"], "plan --kernels liger needs --gpu"),
]


@pytest.mark.parametrize("args,message", CLI_ERRORS)
def test_cli_errors(args, message):
    one_line_error(CliRunner().invoke(app, args), 2, message)


@pytest.mark.parametrize("command", ["estimate_cmd.estimate", "validate_cmd.validate", "plan_cmd.plan"])
def test_commands_take_kernels(command):
    import importlib
    import inspect

    module, func = command.split(".")
    assert "kernels" in inspect.signature(getattr(importlib.import_module(f"memcalc.cli.{module}"), func)).parameters


def test_kernels_need_the_hf_framework():
    from memcalc.inputs.resolve import Options, kernel_flags

    with pytest.raises(UserError, match="it needs --framework hf or trl, not plain"):
        kernel_flags(Options(kernels="liger"), KernelProfile(framework="plain"), {})


HF = {"bf16": True, "use_liger_kernel": True}
AX = {"bf16": True, "plugins": ["axolotl.integrations.liger.LigerPlugin"]}

#: (reader, file keys, kernels, liger_ops; None: not set)
RECIPES: list[tuple[Any, dict, Any, Any]] = [
    # source: transformers training_args.py use_liger_kernel -> Trainer.train apply_liger_kernel
    (hf, HF, "liger", None),
    # source: liger_kernel_config is passed as the apply function's kwargs (integrations/liger.py)
    (hf, {**HF, "liger_kernel_config": {"rope": False, "swiglu": False}}, "liger", ("rms_norm", "flce")),
    (hf, {**HF, "use_liger_kernel": False, "liger_kernel_config": {"rope": False}}, None, None),  # never applied
    (hf, {"bf16": True, "use_liger": True}, "liger", None),  # source: TRL's former name of the same switch
    # source: axolotl integrations/liger plugin.py passes each liger_* key as that kernel's switch
    (axolotl, {**AX, "liger_rms_norm": True, "liger_glu_activation": True}, "liger", ("rms_norm", "glu")),
    (axolotl, {**AX, "liger_rope": True, "liger_rms_norm": True, "liger_glu_activation": True,
               "liger_fused_linear_cross_entropy": True}, "liger", LIGER_OPS),
    (axolotl, {**AX, "liger_rope": False}, None, None),
    # source: axolotl integrations/cut_cross_entropy: cut_cross_entropy: true -> cce_patch(cfg.model_config_type)
    (axolotl, {"bf16": True, "plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"],
               "cut_cross_entropy": True}, "cce", None),
]


@pytest.mark.parametrize("reader,keys,kernels,ops", RECIPES)
def test_recipe_keys(reader, keys, kernels, ops):
    rec = Recipe(kind=reader.__name__.rsplit(".", 1)[1])
    reader.read(dict(keys), rec, "f.yaml")
    assert (rec.values.get("kernels"), rec.values.get("liger_ops")) == (kernels, ops)


#: (reader, file keys, the error's message)
RECIPE_ERRORS = [
    (hf, {**HF, "liger_kernel_config": {"cross_entropy": True}},
     "Liger's cross-entropy on full logits is not modelled"),
    (hf, {**HF, "liger_kernel_config": {"tiled_mlp": True}}, "liger_kernel_config.tiled_mlp: not a Liger kernel"),
    (hf, {**HF, "liger_kernel_config": ["rope"]}, "liger_kernel_config: expected a mapping"),
    (axolotl, {**AX, "liger_cross_entropy": True}, "liger_cross_entropy: Liger's cross-entropy"),
    (axolotl, {**AX, "liger_fused_linear_cross_entropy": True, "cut_cross_entropy": True},
     "cut_cross_entropy: with the Liger plugin too is not modelled"),
]


@pytest.mark.parametrize("reader,keys,message", RECIPE_ERRORS)
def test_recipe_errors(reader, keys, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        reader.read(dict(keys), Recipe(kind="x"), "f.yaml")


LLAMA = ModelSpec(name="llama-mini", n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, d_ff=704, vocab_size=8192)
GEMMA = LLAMA.model_copy(update={"name": "gemma-mini", "activation": "gelu_tanh", "embedding_scale": 16.0})
LIGER = KernelProfile(framework="hf", kernels="liger")


def test_plan_per_family():
    # source: monkey_patch.py apply_liger_kernel_to_llama (swiglu, casting llama) / _gemma (geglu, casting gemma)
    assert (liger_plan(LLAMA, LIGER).glu, liger_plan(LLAMA, LIGER).casting) == ("swiglu", "llama")
    assert (liger_plan(GEMMA, LIGER).glu, liger_plan(GEMMA, LIGER).casting) == ("geglu", "gemma")
    sub = liger_plan(LLAMA, LIGER.model_copy(update={"liger_ops": ("flce",)}))
    assert (sub.rope, sub.rms_norm, sub.glu, sub.flce) == (False, False, None, True)


#: (training, the refusal)
PLAN_ERRORS = [
    (TrainingSpec(precision="amp-bf16"), "under autocast (amp-bf16, amp-fp16) is not modelled"),
    (TrainingSpec(precision="bf16", lora=LoraSpec(qlora=True)), "with QLoRA is not modelled yet"),
    (TrainingSpec(zero=3, gpus=4), "ZeRO-3 or torch.compile is not modelled yet"),
    (TrainingSpec(tp=2), "tensor parallelism"),
]


@pytest.mark.parametrize("tr,message", PLAN_ERRORS)
def test_plan_refusals(tr, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        liger_plan(LLAMA, LIGER, tr)

"""``--kernels liger`` on estimate and validate, and the recipe keys that select it (HF TrainingArguments /
TRL ``use_liger_kernel`` + ``liger_kernel_config``, axolotl's Liger plugin keys): what the CLI resolves, and
one-line errors for what is not modelled. Torch-free and quick: the resolved spec is read through a spy on
``resolve`` (the estimate is a pure function of it); the error rows stop before any simulation."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.liger import LIGER_OPS
from memcalc.inputs.resolve import Resolved


class _Stop(Exception):
    pass


def resolved(args: list[str], monkeypatch) -> Resolved:
    """What `memcalc estimate ARGS` resolves, without running the estimate."""
    import memcalc.inputs.resolve as mod

    got: list[Resolved] = []
    real = mod.resolve

    def spy(o):
        got.append(real(o))
        raise _Stop

    monkeypatch.setattr(mod, "resolve", spy)
    r = CliRunner().invoke(app, ["estimate", *args])
    assert got, r.output
    return got[0]


def _file(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


HF = "model_name_or_path: Qwen/Qwen2.5-7B\nbf16: true\n"
AX = "base_model: mistralai/Mistral-7B-v0.1\nbf16: true\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\n"

#: (args or recipe text, kernels, liger_ops)
ROWS = [
    # source: --kernels liger: every kernel apply_liger_kernel_to_llama applies by default (monkey_patch.py)
    (["--model", "llama-3.1-8b", "--kernels", "liger"], None, "liger", LIGER_OPS),
    (["--model", "llama-3.1-8b"], None, "none", LIGER_OPS),  # source: the default is no kernel library
    # source: transformers training_args.py use_liger_kernel -> Trainer.train apply_liger_kernel
    ([], ("sft.yaml", HF + "use_liger_kernel: true\n"), "liger", LIGER_OPS),
    # source: liger_kernel_config is passed as the apply function's kwargs (integrations/liger.py)
    ([], ("sft.yaml", HF + "use_liger_kernel: true\nliger_kernel_config:\n  rope: false\n  swiglu: false\n"), "liger",
     ("rms_norm", "flce")),
    # source: liger_kernel_config without use_liger_kernel: Trainer never applies it
    ([], ("sft.yaml", HF + "liger_kernel_config:\n  rope: false\n"), "none", LIGER_OPS),
    # source: axolotl integrations/liger plugin.py passes each liger_* key as the kernel's switch
    ([], ("ax.yml", AX + "liger_rms_norm: true\nliger_glu_activation: true\n"), "liger", ("rms_norm", "glu")),
    ([], ("ax.yml", AX + "liger_rope: true\nliger_rms_norm: true\nliger_glu_activation: true\n"
                        "liger_fused_linear_cross_entropy: true\n"), "liger", LIGER_OPS),
]


@pytest.mark.parametrize("args,recipe,kernels,ops", ROWS)
def test_kernels_resolve(args, recipe, kernels, ops, tmp_path, monkeypatch):
    if recipe is not None:
        args = [*args, "--recipe", _file(tmp_path, *recipe)]
    prof = resolved(args, monkeypatch).exp.profile
    assert (prof.kernels, prof.liger_ops) == (kernels, ops)


#: (args, recipe, exit code, the one-line message)
ERRORS = [
    (["--model", "llama-3.1-8b", "--kernels", "cce"], None, 2, "Invalid value for '--kernels'"),
    (["--model", "gpt2", "--kernels", "liger"], None, 2, "gpt2 is none of the families whose Liger kernels"),
    (["--model", "llama-3.1-8b", "--kernels", "liger", "--framework", "plain"], None, 2, "it needs --framework hf"),
    (["--model", "llama-3.1-8b", "--kernels", "liger", "--precision", "amp-bf16"], None, 2,
     "under autocast (amp-bf16, amp-fp16) is not modelled"),
    ([], ("sft.yaml", HF + "use_liger_kernel: true\nliger_kernel_config:\n  cross_entropy: true\n"), 2,
     "Liger's cross-entropy on full logits is not modelled"),
    ([], ("sft.yaml", HF + "use_liger_kernel: true\nliger_kernel_config:\n  tiled_mlp: true\n"), 2,
     "liger_kernel_config.tiled_mlp: not a Liger kernel memcalc models; valid: rope"),
    ([], ("sft.yaml", HF + "use_liger_kernel: true\nliger_kernel_config: [rope]\n"), 2,
     "liger_kernel_config: expected a mapping"),
    ([], ("ax.yml", AX + "liger_cross_entropy: true\n"), 2, "liger_cross_entropy: Liger's cross-entropy"),
    ([], ("ax.yml", AX + "cut_cross_entropy: true\n"), 2, "cut_cross_entropy: custom fused kernels are not modelled"),
]


@pytest.mark.parametrize("args,recipe,code,message", ERRORS)
def test_kernels_errors(args, recipe, code, message, tmp_path):
    if recipe is not None:
        args = [*args, "--recipe", _file(tmp_path, *recipe)]
    r = CliRunner().invoke(app, ["estimate", *args])
    assert r.exit_code == code, r.output
    assert message in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_validate_takes_kernels():
    """validate honours the flag too (its --help lists it; the run itself is the slow grid's)."""
    r = CliRunner().invoke(app, ["validate", "--help"])
    assert "--kernels" in r.output

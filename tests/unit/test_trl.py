"""``--framework trl`` (TRL's fused LM head, memcalc/engine/blocks/trl_head.py), ``--loss-tokens`` and TRL SFTConfig
recipes, on the command line: (args, exit code, message) rows. The trace side is tests/trace/test_trl_grid.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import one_line_error
from memcalc.cli import app

runner = CliRunner()
SPEC = str(Path(__file__).parent.parent / "fixtures" / "tiny-rope.yaml")  # 2 layers: milliseconds per estimate
SMALL = ["estimate", "--model", SPEC, "--bf16", "--seq", "256", "--json"]


def peak(args: list[str]) -> int:
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["peak_bytes"]


# (args, exit code, message on stderr)
ERRORS = [
    # source: KernelProfile.loss_tokens is a fraction in (0, 1] (profiles.with_loss)
    (["--framework", "trl", "--loss-tokens", "0"], 2, "--loss-tokens must be a fraction in (0, 1]"),
    (["--framework", "trl", "--loss-tokens", "1.5"], 2, "--loss-tokens must be a fraction in (0, 1]"),
    # source: Framework in memcalc/core/choices.py lists trl
    (["--framework", "trlx"], 2, "trl"),
]


@pytest.mark.parametrize("args,code,message", ERRORS, ids=[" ".join(a) for a, _, _ in ERRORS])
def test_bad_trl_input_is_one_line(args, code, message):
    one_line_error(runner.invoke(app, SMALL + args), code, message)


def test_fewer_loss_tokens_less_memory_and_inert_elsewhere():
    # source: only hidden_states[labels != -100] reaches ChunkedLogProbFunction (trl/trainer/utils.py)
    full, half = (peak([*SMALL, "--framework", "trl", "--batch", "4", "--loss-tokens", f]) for f in ("1", "0.5"))
    assert half < full
    r = runner.invoke(app, [*SMALL, "--framework", "hf", "--loss-tokens", "0.5"])
    assert r.exit_code == 0
    assert any("loss_tokens 0.5 has no effect" in n for n in json.loads(r.stdout)["notes"])


def _recipe(tmp_path, body: dict) -> str:
    f = tmp_path / "sft.json"
    f.write_text(json.dumps(body))
    return str(f)


def test_an_sft_config_selects_trl(tmp_path):
    # source: trl 1.16 SFTConfig: max_length, activation_offloading, completion_only_loss are TRL keys
    f = _recipe(tmp_path, {"per_device_train_batch_size": 2, "max_length": 512, "activation_offloading": True,
                           "completion_only_loss": True, "torch_dtype": "bfloat16", "output_dir": "out"})
    r = runner.invoke(app, ["estimate", "--model", SPEC, "--recipe", f, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    inputs = json.dumps(out)
    assert '"trl"' in inputs and "trl-fused" in inputs
    assert "--loss-tokens" in inputs  # completion_only_loss: the share is the data's, named in a note
    assert '"activation_offload": true' in inputs and '"checkpoint": "full"' in inputs  # SFTConfig's default


def test_dft_loss_is_refused(tmp_path):
    # source: loss_type "dft" keeps one more (B, T-1) fp32 tensor (sft_trainer.py compute_loss): not modelled
    f = _recipe(tmp_path, {"max_length": 512, "loss_type": "dft", "output_dir": "out"})
    one_line_error(runner.invoke(app, ["estimate", "--model", SPEC, "--recipe", f]), 2, "loss_type 'dft'")


def test_plain_training_arguments_stay_hf(tmp_path):
    # source: no TRL key: transformers' Trainer, whose loss upcasts the whole logits
    from memcalc.inputs.recipes import load_recipe

    f = _recipe(tmp_path, {"per_device_train_batch_size": 2, "bf16": True, "output_dir": "out"})
    assert load_recipe([f]).values["framework"] == "hf"
    assert load_recipe([_recipe(tmp_path, {"max_length": 64})]).values["framework"] == "trl"


def test_use_liger_kernel_keeps_the_fused_head(tmp_path):
    # source: trl 1.16 SFTTrainer.__init__ sets liger_kernel_config fused_linear_cross_entropy False: Liger's
    # layer kernels apply, TRL's fused head stays
    from memcalc.inputs.resolve import Options, resolve

    f = _recipe(tmp_path, {"max_length": 128, "use_liger_kernel": True, "output_dir": "out"})
    p = resolve(Options(model="llama-3.2-1b", recipe=[f])).exp.profile
    assert (p.framework, p.cross_entropy, p.kernels) == ("trl", "trl-fused", "liger")
    from memcalc.core.liger import liger_plan
    from memcalc.inputs.presets import load_preset

    plan = liger_plan(load_preset("llama-3.2-1b"), p)
    assert not plan.flce and plan.rms_norm and plan.rope

"""``memcalc validate --framework torchtune``: torchtune 0.6.1's own builders, loss and recipe step
traced on meta (validate/trainers/torchtune.py), beside ``memcalc estimate --framework torchtune``.

Scaled-down models (1-2 layers, small widths and vocabularies), well under a second a row.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("torchtune")

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from conftest import one_line_error  # noqa: E402


def run(args):
    return CliRunner().invoke(app, args)


def test_cli_framework_torchtune_json():
    r = run(["validate", "--framework", "torchtune", "--model", "llama-3.2-1b", "--bf16", "--seq", "64",
             "--scale-layers", "1", "--device", "meta", "--json"])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(r.stdout)
    assert rec["framework"] == "torchtune" and rec["status"] == "ok", rec
    assert isinstance(rec["measured_bytes"], int) and isinstance(rec["predicted_bytes"], int)


# (args, exit code, message); source: validate/trainers/torchtune.py refusals, each citing the recipe or builder
BAD = [
    (["--model", "gpt2"], 2, "gpt2 has a norm other than pre-norm RMSNorm"),
    (["--model", "llama-3.2-1b", "--bf16", "--activation-offload"], 2,
     "enable_activation_offloading should only be True when enable_activation_checkpointing is True"),
    (["--model", "llama-3.2-1b", "--bf16", "--lora", "--lora-targets", "q,v,gate"], 2,
     "torchtune adapts the MLP whole (apply_lora_to_mlp)"),
    (["--model", "llama-3.2-1b", "--precision", "amp-bf16"], 2, "the recipes train in one dtype, fp32 or bf16"),
    (["--model", "llama-3.2-1b", "--bf16", "--lora", "--lora-targets", "q,v,head"], 2,
     "apply_lora_to_output is not supported when the projection is tied"),
    (["--model", "llama-3.2-1b", "--bf16", "--lora", "--fused-optimizer"], 2,
     "lora_finetune_single_device has no optimizer_in_bwd"),
]


@pytest.mark.parametrize("args,code,message", BAD)
def test_cli_torchtune_bad_input_one_line_exit_2(args, code, message):
    one_line_error(run(["validate", "--framework", "torchtune", *args, "--device", "meta"]), code, message)

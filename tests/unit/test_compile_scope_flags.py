"""``--compile-scope``: what one torch.compile graph is, and torchtune's compile with activation offloading.

The estimate-vs-trace rows are in tests/trace/test_compile_scope.py (slow: dynamo on meta).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app

from conftest import cli_run, one_line_error

SPEC = str(Path(__file__).parent.parent / "fixtures" / "tiny-rope.yaml")  # 2 layers: milliseconds per estimate
#: torchtune's optimization-flags table (its README, Llama 3.2 3B on one A100): each row adds one
#: technique; from "+ Activation Offloading" on, every row has compile, the chunked loss, activation
#: checkpointing and offloading together (the model here is a 2-layer Llama for speed)
TT = ["estimate", "--model", SPEC, "--framework", "torchtune", "--seq", "256", "--bf16", "--compile",
      "--loss", "chunked", "--checkpoint", "full", "--activation-offload", "--json"]

# (args, exit code, message); source: torchtune README optimization-flags table rows
TORCHTUNE_ROWS = [
    ([*TT, "--fused-optimizer"], 0, ""),  # + Activation Offloading (full fine-tuning, optimizer in backward)
    ([*TT, "--fused-optimizer", "--optimizer", "adamw-8bit"], 0, ""),  # + 8-bit AdamW
    ([*TT, "--lora"], 0, ""),  # + LoRA
    ([*TT, "--qlora"], 0, ""),  # + QLoRA
]


@pytest.mark.parametrize("args,code,message", TORCHTUNE_ROWS)
def test_torchtune_table_rows_are_not_refused(args, code, message):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == code, r.output
    inputs = json.loads(r.stdout)["inputs"]
    # torchtune's compile_model compiles each layer apart: the scope defaults to layer, with its reason
    assert inputs["training"]["compile_scope"] == "layer"
    assert inputs["origin"]["compile_scope"] == "default"
    assert "compile_model" in inputs["reasons"]["compile_scope"]


# (args, exit code, message)
ERRORS = [
    # (the whole-model scope's refusal of offloading is a row of tests/unit/test_techniques.py)
    # source: memcalc.core.choices.COMPILE_SCOPES
    (["estimate", "--model", SPEC, "--seq", "256", "--compile-scope", "block"], 2,
     "unknown --compile-scope 'block'; valid: model, logits, layer"),
]


@pytest.mark.parametrize("args,code,message", ERRORS)
def test_refusals(args, code, message):
    one_line_error(cli_run(args), code, message)

"""The spellings users bring (memcalc.core.aliases): Hugging Face ``optim`` names, dtype names, ``4k``
sequence lengths, comma lists of GPUs, ``transformers`` for hf, on estimate, plan, validate and the Python
API. Each resolves to memcalc's name with one ``memcalc: note:`` line on stderr before any output; an
unknown name lists the valid ones and the aliases. Torch-free and quick: the CLI rows stop once the inputs
are resolved (a spy on ``resolve``), the error rows before any simulation."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import one_line_error, resolved_run

import memcalc.api
from memcalc.cli import app
from memcalc.core.errors import UserError
from memcalc.core import aliases


#: (input, the alias, memcalc's value, the note's words)
ALIASES = [
    # source: transformers 5.24 training_args.py OptimizerNames.PAGED_ADAMW_8BIT -> bitsandbytes PagedAdamW8bit
    ("optimizer", "paged_adamw_8bit", "paged-adamw-8bit", "--optimizer paged_adamw_8bit is paged-adamw-8bit "
                                                          "(bitsandbytes PagedAdamW8bit"),
    ("optimizer", "paged_adamw_8bit", "paged-adamw-8bit", "does not model its paging to the host"),
    # source: OptimizerNames.ADAMW_TORCH_FUSED -> torch.optim.AdamW(fused=True)
    ("optimizer", "adamw_torch_fused", "adamw", "--optimizer adamw_torch_fused is adamw (torch.optim.AdamW, two "
                                                "moments; optimizer_impl fused)"),
    # source: OptimizerNames.ADAMW_BNB -> bitsandbytes AdamW(optim_bits=8)
    ("optimizer", "adamw_bnb_8bit", "adamw-8bit", "--optimizer adamw_bnb_8bit is adamw-8bit"),
    # source: OptimizerNames.ADAMW_TORCH_4BIT -> torchao AdamW4bit (transformers passes block_size=256)
    ("optimizer", "adamw_torch_4bit", "adamw-4bit-torchao", "block_size=256"),
    # source: LitGPT's bare torch.optim class name
    ("optimizer", "AdamW", "adamw", "--optimizer AdamW is adamw"),
    # source: torch dtype names; a dtype is what the weights are stored in (pure 16-bit)
    ("precision", "bfloat16", "bf16", "--precision bfloat16 is bf16 (weights, gradients and optimizer state in "
                                      "bfloat16; autocast"),
    ("precision", "torch.bfloat16", "bf16", "--precision torch.bfloat16 is bf16"),
    ("precision", "float16", "fp16", "--precision float16 is fp16"),
    ("precision", "float32", "fp32", "--precision float32 is fp32"),
    ("precision", "BF16", "bf16", "--precision BF16 is bf16"),
    # source: Lightning's precision strings (LitGPT --precision bf16-mixed is autocast)
    ("precision", "bf16-mixed", "amp-bf16", "--precision bf16-mixed is amp-bf16"),
    # source: transformers is the library --framework hf runs (with PEFT)
    ("framework", "transformers", "hf", "--framework transformers is hf (Hugging Face transformers + PEFT)"),
    ("framework", "huggingface", "hf", "--framework huggingface is hf"),
    # source: k = 1024 tokens: a "4k" context is 4096 (Llama 2's max_position_embeddings 4096)
    ("seq", "4k", 4096, "--seq 4k is 4,096 tokens (k = 1,024)"),
    ("seq", "32k", 32768, "--seq 32k is 32,768 tokens"),
    ("seq", "128K", 131072, "--seq 128K is 131,072 tokens"),
    ("seq", "1M", 2**20, "--seq 1M is 1,048,576 tokens (M = 1,048,576)"),
]


@pytest.mark.parametrize("key,alias,value,note", ALIASES)
def test_alias(key, alias, value, note, capsys):
    assert aliases.canonical({key: alias})[key] == value
    err = capsys.readouterr().err
    assert note in err and err.startswith("memcalc: note: ") and err.count("\n") == 1, err


def test_alias_implies_impl():
    # source: OptimizerNames.ADAMW_TORCH_FUSED builds AdamW(fused=True); a given --optimizer-impl wins
    assert aliases.canonical({"optimizer": "adamw_torch_fused"})["optimizer_impl"] == "fused"
    assert aliases.canonical({"optimizer": "adamw_torch_fused", "optimizer_impl": "foreach"})["optimizer_impl"] \
        == "foreach"


def test_canonical_names_say_nothing(capsys):
    values = {"optimizer": "adamw-8bit", "precision": "bf16", "seq": 4096, "framework": "hf"}
    assert aliases.canonical(values) == values and aliases.seq("4096") == 4096
    assert capsys.readouterr().err == ""


def test_estimate_cli(monkeypatch):
    # the CLI end to end: every alias of one run resolved into the spec, a note each on stderr before any output
    r, res = resolved_run(["estimate", "--model", "llama-3.1-8b", "--optimizer", "paged_adamw_8bit", "--precision",
                      "bfloat16", "--seq", "4k", "--framework", "transformers"], monkeypatch)
    tr = res.exp.training
    assert (tr.optimizer, tr.precision, tr.seq, res.exp.profile.framework) == ("paged-adamw-8bit", "bf16", 4096, "hf")
    assert r.stderr.count("memcalc: note: --") == 4, r.stderr


def test_gpu_comma_list():
    # two cards from one --gpu, as the API's gpu= list
    assert [c.name for c in memcalc.api._cards("rtx-4090,rtx-3090")] == ["rtx-4090", "rtx-3090"]
    assert aliases.gpus("rtx-4090, rtx-3090") == ["rtx-4090", "rtx-3090"]
    assert aliases.gpus(["a100-80gb", "rtx-4090,rtx-3090"]) == ["a100-80gb", "rtx-4090", "rtx-3090"]


#: (args, exit code, message)
CLI_ERRORS = [
    (["estimate", "--model", "gpt2", "--optimizer", "paged_adam"], 2,
     "adamw-fp8-torchao; aliases: adamw_torch, adamw_torch_fused"),
    (["estimate", "--model", "gpt2", "--precision", "int8"], 2, "amp-fp16; aliases: bfloat16"),
    (["estimate", "--model", "gpt2", "--framework", "jax"], 2, "unknown --framework 'jax'; valid: "),
    (["estimate", "--model", "gpt2", "--seq", "4x"], 2, "--seq '4x' is not a sequence length"),
    (["estimate", "--model", "gpt2", "--seq", "1.0001k"], 2, "not a whole number"),
    (["estimate", "--model", "gpt2", "--gpu", "rtx-4090,rtx-9999"], 2, "rtx-9999"),
    (["plan", "--model", "gpt2", "--gpu", "rtx-4090,rtx-3090"], 2, "plan --gpu plans for one GPU"),
    (["plan", "--model", "gpt2", "--framework", "jax"], 2, "unknown --framework 'jax'"),
    (["plan", "--model", "gpt2", "--seq", "4q"], 2, "--seq '4q' is not a sequence length"),
    (["validate", "--model", "gpt2", "--framework", "jax"], 2, "unknown --framework 'jax'"),
    (["validate", "--model", "gpt2", "--precision", "int8"], 2, "unknown --precision 'int8'"),
    (["validate", "--model", "gpt2", "--optimizer", "adamw_torch_fussed"], 2, "unknown --optimizer"),
]


@pytest.mark.parametrize("args,code,message", CLI_ERRORS)
def test_cli_errors(args, code, message):
    r = CliRunner().invoke(app, args)
    one_line_error(r, code, message)


def test_plan_and_validate_notes(monkeypatch):
    # plan: a refusal after an alias (--all without --gpu) is one line, the notes dropped with it
    # (aliases.notes_on_success; tests/unit/test_fuzz_doors.py: written when the call returns)
    r = CliRunner().invoke(app, ["plan", "--model", "gpt2", "--seq", "1k", "--framework", "transformers", "--all"])
    one_line_error(r, 2, "--all lists the combinations that do not fit one GPU")
    # validate: likewise (its inputs taken in aliases.notes_held), the alias read before its own checks
    r = CliRunner().invoke(app, ["validate", "--model", "gpt2", "--framework", "huggingface", "--scale-layers", "0"])
    one_line_error(r, 2, "--scale-layers must be positive, got 0")


def test_api_aliases(capsys):
    o = memcalc.api.options_from(model="gpt2", optimizer="paged_adamw_8bit", precision="bfloat16", seq="4k",
                                 framework="transformers")
    assert (o.optimizer, o.precision, o.seq, o.framework) == ("paged-adamw-8bit", "bf16", 4096, "hf")
    assert capsys.readouterr().err.count("memcalc: note: ") == 4
    with pytest.raises(UserError, match="aliases: adamw_torch"):
        memcalc.api.options_from(model="gpt2", optimizer="nope")


def test_help_lists_aliases():
    assert "paged_adamw_8bit (paged-adamw-8bit)" in aliases.alias_help("optimizer")
    assert "bfloat16 (bf16)" in aliases.alias_help("precision")
    assert "transformers (hf)" in aliases.alias_help("framework")

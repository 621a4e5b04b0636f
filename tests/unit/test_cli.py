"""The command line as users run it: (args, exit code, message) rows."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from conftest import one_line_error


def run(args: list[str]):
    return CliRunner().invoke(app, args)


# (args, exit code, text that must appear on stderr/stdout)
BAD_INPUT = [
    (["estimate", "--model", "llama-9"], 2, "unknown model preset 'llama-9'"),  # unknown preset lists valid ones
    (["estimate", "--config", "nope"], 2, "unknown config 'nope'; valid: bf16_budget_60"),
    (["estimate", "--model", "gpt2", "--batch", "-1"], 2, "--batch must be positive, got -1"),
    (["estimate", "--model", "gpt2", "--batch", "0"], 2, "--batch must be positive, got 0"),
    (["estimate", "--model", "gpt2", "--seq", "0"], 2, "--seq must be positive"),
    (["estimate", "--model", "gpt2", "--first-seq", "0"], 2, "--first-seq must be positive, got 0"),
    (["estimate", "--model", "gpt2", "--first-seq", "512", "--pp", "2", "--gpus", "1"], 2,
     "first_seq (a longer first micro-batch) is not modelled under pipeline parallelism"),
    (["estimate", "--model", "gpt2", "--first-seq", "512", "--max-batch", "--gpu", "a100-40gb"], 2,
     "--max-batch searches the steady step; with --first-seq"),
    (["estimate", "--params", "seven"], 2, "seven"),
    (["estimate", "--model", "gpt2", "--precision", "fp8"], 2, "fp8"),
    (["estimate", "--model", "gpt2", "--optimizer", "adamax"], 2, "adamax"),
    (["estimate", "--model", "gpt2", "--bach", "2"], 2, "No such option: --bach (Possible options: --batch,"),
    (["estimate", "--model", "gpt2", "--checkpoint", "every-x"], 2, "unknown --checkpoint 'every-x'"),
    (["estimate", "--model", "gpt2", "--lora", "--lora-targets", "q,z"], 2, "unknown --lora-targets z"),
    # source: memcalc/core/spec.py ExperimentSpec._check_lora_targets: q, k, v of a fused qkv only under LitGPT's
    # LoRAQKVLinear (lit_gpt/lora.py lora_query / lora_value); the parser leaves the fused parts to it
    (["estimate", "--model", "data/reference/models/stablelm-base-alpha-3b.json", "--lora", "--lora-targets", "q,v"],
     2, "q, k, v are one fused projection: target qkv"),
    (["estimate", "--model", "gpt2", "--memory-budget", "1.5"], 2, "--memory-budget must be within [0, 1]"),
    (["estimate", "--model", "gpt2", "--zero", "4"], 2, "--zero must be 0, 1, 2 or 3"),
    (["estimate", "--model", "gpt2", "--fused-optimizer", "--grad-accum", "4"], 2, "cannot accumulate gradients"),
    (["estimate", "--model", "gpt2", "--seq", "4096"], 2, "exceeds gpt2's learned position table (1024)"),
    (["estimate", "--model", "gpt2", "--precision", "fp32", "--master-weights"], 2, "needs precision bf16 or fp16"),
    (["estimate", "--model", "gpt2", "--gpu", "gtx-480"], 2, "gtx-480"),
    (["estimate"], 2, "no model"),
    (["estimate", "--model", "gpt2", "--params", "7e9"], 2, "not both"),
    (["estimate", "--model", "gpt2", "--profile", "torch-3.0"], 2, "unknown profile 'torch-3.0'; valid:"),
    (["validate", "--config", "control", "--device", "tpu"], 2, "unknown --device 'tpu'"),
    (["estimate", "--model", "gpt2", "--loss", "half"], 2, "'half' is not one of 'full', 'chunked'"),
    (["estimate", "--model", "gpt2", "--loss", "chunked", "--loss-chunks", "0"], 2, "--loss-chunks must be positive, got 0"),
    (["estimate", "--model", "gpt2", "--loss-chunks", "-3"], 2, "--loss-chunks must be positive, got -3"),
    (["estimate", "--model", "gpt2", "--loss-chunks", "2.5"], 2, "--loss-chunks"),  # not an integer
    (["plan", "--model", "gpt2", "--loss", "chunked", "--loss-chunks", "0"], 2, "--loss-chunks must be positive, got 0"),
    (["validate", "--model", "gpt2", "--loss", "sparse", "--device", "meta"], 2, "'sparse' is not one of"),
]


@pytest.mark.parametrize("args,code,message", BAD_INPUT)
def test_bad_input_is_one_line_exit_2(args, code, message):
    r = run(args)
    one_line_error(r, code, message)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_malformed_yaml_config(tmp_path):
    path = _write(tmp_path, "bad.yaml", "model: gpt2\ntraining: [batch: 1\n")
    r = run(["estimate", "--config", path])
    assert r.exit_code == 2 and "malformed" in r.stderr and r.stderr.count("\n") == 1


def test_malformed_json_config(tmp_path):
    path = _write(tmp_path, "bad.json", '{"model": "gpt2", ')
    r = run(["estimate", "--config", path])
    assert r.exit_code == 2 and "malformed" in r.stderr


def test_config_key_that_does_not_exist(tmp_path):
    path = _write(tmp_path, "x.yaml", "model: gpt2\ntraining:\n  batchsize: 2\n")
    r = run(["estimate", "--config", path])
    assert r.exit_code == 2 and "batchsize" in r.stderr and r.stderr.count("\n") == 1


def test_heads_that_do_not_divide(tmp_path):
    path = _write(tmp_path, "m.yaml", "n_layers: 2\nd_model: 100\nn_heads: 12\nd_ff: 256\nvocab_size: 100\n")
    r = run(["estimate", "--model", path])
    assert r.exit_code == 2, r.output
    assert "d_model (100) must be divisible by n_heads (12)" in r.stderr


def test_kv_heads_that_do_not_divide(tmp_path):
    path = _write(tmp_path, "m.yaml", "n_layers: 2\nd_model: 120\nn_heads: 12\nn_kv_heads: 5\nd_ff: 256\nvocab_size: 100\n")
    r = run(["estimate", "--model", path])
    assert r.exit_code == 2 and "n_heads (12) must be divisible by n_kv_heads (5)" in r.stderr


def test_json_is_only_json_with_integer_bytes():
    r = run(["estimate", "--model", "gpt2", "--batch", "2", "--seq", "512", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    for key in ("peak_bytes", "peak_phase", "components", "phases", "params", "trainable_params"):
        assert key in doc
    assert isinstance(doc["peak_bytes"], int)
    assert all(isinstance(v, int) for v in doc["components"].values())
    assert all(isinstance(v, int) for v in doc["phases"].values())
    assert sum(doc["components"].values()) == doc["peak_bytes"]
    assert doc["params"] == 124_439_808


def test_defaults_are_printed():
    r = run(["estimate", "--model", "gpt2"])
    assert r.exit_code == 0, r.output
    assert "default" in r.stdout and "1024" in r.stdout  # gpt2's max position table caps the default seq
    assert "adamw" in r.stdout


@pytest.mark.slow  # a 7B estimate; tests/snapshots runs the same command in the quick lane
def test_params_inference_says_inferred():
    r = run(["estimate", "--params", "7e9", "--bf16", "--lora", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["inputs"]["origin"]["model"] == "inferred"
    assert any("inferred" in n for n in doc["inferred"])
    assert abs(doc["params"] - 7e9) / 7e9 <= 0.02
    assert doc["trainable_params"] < 0.01 * doc["params"]


def test_flags_override_config():
    base = json.loads(run(["estimate", "--config", "control", "--json"]).stdout)
    over = json.loads(run(["estimate", "--config", "control", "--batch", "1", "--json"]).stdout)
    assert over["inputs"]["training"]["batch"] == 1
    assert over["peak_bytes"] < base["peak_bytes"]
    assert over["published_peak_bytes"] is None  # the published figure no longer applies


def test_loss_chunks_in_a_config_and_flags_over_it(tmp_path):
    cfg = _write(tmp_path, "c.yaml", "model: gpt2\ntraining: {batch: 2, seq: 512, precision: bf16}\n"
                 "profile: {cross_entropy: chunked, loss_chunks: 2}\n")
    two = json.loads(run(["estimate", "--config", cfg, "--json"]).stdout)
    assert two["inputs"]["profile"]["loss_chunks"] == 2 and two["inputs"]["origin"]["profile"] == "config"
    eight = json.loads(run(["estimate", "--config", cfg, "--loss-chunks", "8", "--json"]).stdout)
    assert eight["inputs"]["profile"]["loss_chunks"] == 8 and eight["inputs"]["origin"]["loss_chunks"] == "flag"
    assert eight["peak_bytes"] < two["peak_bytes"]  # smaller transient fp32 copies
    full = json.loads(run(["estimate", "--config", cfg, "--loss", "full", "--json"]).stdout)
    assert full["inputs"]["profile"]["cross_entropy"] == "full" and full["inputs"]["origin"]["cross_entropy"] == "flag"
    assert any("loss_chunks 2 has no effect" in n for n in full["notes"])  # said, not silently ignored
    bad = _write(tmp_path, "bad.yaml", "model: gpt2\nprofile: {cross_entropy: chunked, loss_chunks: 0}\n")
    r = run(["estimate", "--config", bad])
    assert r.exit_code == 2 and "loss_chunks" in r.stderr and r.stderr.count("\n") == 1


def test_loss_chunks_flag_without_chunked_loss_is_noted():
    doc = json.loads(run(["estimate", "--model", "gpt2", "--seq", "512", "--loss-chunks", "8", "--json"]).stdout)
    assert any("--loss-chunks 8 has no effect" in n for n in doc["inferred"])


@pytest.mark.slow  # two catalog plans for gpt2 (~4 s)
def test_plan_takes_the_loss_flags():
    args = ["plan", "--model", "gpt2", "--seq", "1024", "--json"]
    full = json.loads(run(args).stdout)
    chunked = run(args + ["--loss", "chunked", "--loss-chunks", "4"])
    assert chunked.exit_code == 0, chunked.output
    assert json.loads(chunked.stdout) != full


@pytest.mark.parametrize("cmd", [["models"], ["configs"], ["gpus"], ["profiles"]])
def test_listing_commands_have_json(cmd):
    r = run(cmd + ["--json"])
    assert r.exit_code == 0, r.output
    assert isinstance(json.loads(r.stdout), list)


def test_models_lists_presets():
    r = run(["models"])
    for name in ("deep-one-1.6b", "gpt2", "llama-3.1-70b", "phi-1.5"):
        assert name in r.stdout


@pytest.mark.parametrize("flag", ["--qlora", *[  # full-size estimates: the quick lane keeps --qlora
    pytest.param(f, marks=pytest.mark.slow) for f in ("--lora", "--master-weights", "--fused-optimizer")]])
def test_technique_flags_run(flag):
    args = ["estimate", "--model", "tinyllama-1.1b", "--seq", "512", "--json", flag]
    if flag == "--master-weights":
        args += ["--bf16"]
    r = run(args)
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("argv,code", [
    # source: memcalc.cli.main: the group's status as the process's (usage errors: 2)
    (["memcalc", "gpus", "--json"], 0),
    (["memcalc", "--version"], 0),
    (["memcalc", "estimat"], 2),
    (["memcalc"], 2),
])
def test_main_exits_with_the_commands_status(monkeypatch, capsys, argv, code):
    import sys

    import memcalc.cli as cli

    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == code


@pytest.mark.parametrize("args,shown", [
    # source: memcalc.cli.group._Group.list_commands (the order they are added)
    (["--help"], "  estimate  Predict the peak memory"),
    (["--help"], "\n  plan      Which GPU, how many"),
    # source: the commands' docstrings: each example a whole line (click's \\b: not rewrapped)
    (["estimate", "--help"],
     "\n    memcalc estimate --model llama-3.1-8b --batch 2 --seq 4096 --qlora --checkpoint full --gpu rtx-4090\n"),
    (["plan", "--help"], "\n    memcalc plan --model llama-3.1-8b --gpu rtx-4090 --seq 4096 --all --json\n"),
    (["validate", "--help"], "\n    memcalc validate --all --device meta --scale-layers 1 --output results.json\n"),
    (["estimate", "--help"], "--precision <fp32|bf16|fp16|amp-bf16|amp-fp16>"),
])
def test_help_shows(args, shown):
    r = run(args)
    assert r.exit_code == 0 and shown in r.stdout, r.stdout


@pytest.mark.parametrize("args,code", [
    # source: memcalc.cli.main: the process's status and every byte of its output as the command
    # gives them in-process (CliRunner)
    (["estimate", "--params", "125M", "--seq", "64", "--gpu", "t4", "--json"], 0),
    (["estimate", "--params", "7e9", "--gpu", "t4", "--check"], 3),
    (["estimate", "--params", "125M", "--batch", "0"], 2),
    (["gpus"], 0),
])
def test_the_console_script_exits_with_all_its_output(args, code):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "FORCE_COLOR")}
    p = subprocess.run([sys.executable, "-m", "memcalc.cli", *args], capture_output=True, text=True, env=env)
    r = CliRunner().invoke(app, args)
    assert p.returncode == r.exit_code == code
    assert p.stdout == r.stdout
    if code == 2:
        assert p.stderr.startswith("memcalc: error:") and p.stderr.count("\n") == 1



def test_no_double_quant_sets_lora_double_quant():
    """--no-double-quant (LitGPT's bnb.nf4, compress_statistics=False) is LoraSpec.double_quant False; its bytes
    (the fp32 absmax: memcalc.engine.weights.quantized_bytes) are the field contract's LoraSpec.double_quant row."""
    from memcalc.inputs.resolve import Options, resolve

    specs = [resolve(Options(model="llama-3.2-1b", qlora=True, no_double_quant=flag)).exp for flag in (False, True)]
    assert [s.training.lora.double_quant for s in specs] == [True, False]


def test_litgpt_fused_qkv_query_value_targets(monkeypatch):
    """lit-gpt 8641822 finetune/lora.py (lora_query True, lora_key False, lora_value True) on a fused-qkv model
    written as a config file: --lora-targets q,v reaches LitGPT's LoRAQKVLinear (was refused by the parser)."""
    from conftest import resolved

    res = resolved(["--model", "data/reference/models/stablelm-base-alpha-3b.json", "--profile",
                    "litgpt-2023.10-torch-2.1-cuda", "--lora", "--lora-targets", "q,v"], monkeypatch)
    assert res.exp.training.lora.targets == ("q", "v") and res.exp.model.fused_qkv

"""What a newcomer and a fuzzer trip on (issue 16, first part): (args, exit code, message) rows.

Every bad input is one line on stderr, "memcalc: error: ...", exit 2, fast, and never a
traceback; the few good inputs added here (--version, --gpu 48GiB, PEFT target names) are
checked by what they print.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from conftest import cli_run as run  # memcalc ARGS in-process, and the one-line error check
from conftest import one_line_error

from memcalc import __version__
from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec, LoraSpec
from memcalc.core.units import GB, GiB
from memcalc.inputs.gpus import MAX_CAPACITY_BYTES, get_gpu
from memcalc.inputs.presets import list_presets, load_preset
from memcalc.inputs.resolve import parse_targets


# -- 1. --version, a bare `memcalc` ----------------------------------------------------

def test_version():
    r = run(["--version"])
    assert r.exit_code == 0, r.output
    assert r.stdout == f"memcalc {__version__}\n"


def test_bare_memcalc_prints_the_help_screen():
    """Click >= 8.2's convention for a group run without a command (NoArgsIsHelpError): the
    help screen on stderr, exit 2, as is (not flattened into one error line)."""
    r = run([])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("Usage: memcalc [OPTIONS] COMMAND [ARGS]...")
    assert "memcalc: error" not in r.stderr
    helped = run(["--help"])
    assert helped.exit_code == 0
    assert r.stderr == helped.stdout  # the same screen as --help: the command list, one line each
    for line in ("  estimate  Predict the peak memory", "  validate  Run the real training step", "  --version"):
        assert line in r.stderr


# -- 2. numbers at the boundary ----------------------------------------------------------

LONG = "a" * 10_000
EVERY_BIG = "every-" + "9" * 200

BAD_NUMBERS = [
    (["estimate", "--params", "1e999999999"], 2, "--params '1e999999999' is out of range; give between 1e6 and 1e13"),
    (["estimate", "--params", "1e999999"], 2, "--params '1e999999' is out of range"),
    (["estimate", "--params", "9" * 5000], 2, "is out of range"),
    (["estimate", "--params", "2e13"], 2, "is out of range; give between 1e6 and 1e13"),
    # issue 32: 10T-A1M inferred 202 million experts per layer (infer.MOE_MAX_EXPERTS)
    (["estimate", "--params", "10T-A1M"], 2, "takes 202,396,360 experts per layer; memcalc infers at most 2,048"),
    (["estimate", "--params", "1e-999999999"], 2, "--params must be positive"),
    (["estimate", "--params", "nan"], 2, "--params 'nan' is not a parameter count"),
    (["estimate", "--params", "inf"], 2, "--params 'inf' is not a parameter count"),
    (["estimate", "--params", "-inf"], 2, "--params '-inf' is not a parameter count"),
    (["estimate", "--model", "gpt2", "--checkpoint", EVERY_BIG], 2, "K must be between 1 and 100,000"),
    (["estimate", "--model", "gpt2", "--checkpoint", "every-100001"], 2, "--checkpoint every-100001: K must be between 1 and 100,000"),
    (["estimate", "--model", LONG], 2, "--model value is 10,000 characters long; a name or path has at most 4,096"),
    (["estimate", "--config", LONG], 2, "--config value is 10,000 characters long"),
    (["estimate", "--model", "b" * 300], 2, "unknown model preset 'bbbb"),  # a file name over 255 bytes
    (["estimate", "--model", "b" * 300 + ".yaml"], 2, "model file not found"),
    (["estimate", "--model", "gpt2", "--lora", "--lora-alpha", "inf"], 2, "--lora-alpha must be a finite number, got inf"),
    (["estimate", "--model", "gpt2", "--lora", "--lora-alpha", "nan"], 2, "--lora-alpha must be a finite number, got nan"),
    (["estimate", "--model", "gpt2", "--lora", "--lora-dropout", "nan"], 2, "--lora-dropout must be a finite number, got nan"),
    (["estimate", "--model", "gpt2", "--memory-budget", "nan"], 2, "--memory-budget must be a finite number, got nan"),
    # issue 32: a rank of 1e8 gave a 100-TiB peak (LoraSpec.rank: at most MAX_LORA_RANK)
    (["estimate", "--model", "gpt2", "--lora", "--lora-rank", "65537"], 2,
     "lora.rank = 65537: Input should be less than or equal to 65536"),
]


@pytest.mark.parametrize("args,code,message", BAD_NUMBERS, ids=lambda a: str(a)[:40] if isinstance(a, list) else None)
def test_bad_numbers_are_one_line_and_fast(args, code, message):
    t0 = time.perf_counter()
    r = run(args)
    assert time.perf_counter() - t0 < 2.0  # 1e999999 took 26 s before parse_count bounded the exponent
    one_line_error(r, code, message)
    # a 10,000-character input is not echoed whole (the list of valid presets, which grows with them, aside)
    assert len(r.stderr.replace(", ".join(list_presets()), "")) < 600


_MODEL = "name: t\nn_layers: 2\nd_model: 64\nn_heads: 4\nd_ff: 128\nvocab_size: 100\nmax_seq_len: 128\n"

# (text replacing or adding one line of a tiny model spec, message)
BAD_SPEC_VALUES = [
    ("norm_eps: .inf", "norm_eps = inf: Input should be a finite number"),
    ("norm_eps: .nan", "norm_eps = nan: Input should be a finite number"),
    ("d_model: .nan", "d_model = nan: Input should be a finite number"),
    ("d_ff: .inf", "d_ff = inf: Input should be a finite number"),
    ("n_layers: true", "n_layers = true: expected a number, not a boolean"),
    ("n_kv_heads: true", "n_kv_heads = true: expected a number, not a boolean"),
    ("rotary_pct: false", "rotary_pct = false: expected a number, not a boolean"),
    ("attn_dropout: .nan", "attn_dropout = nan: Input should be a finite number"),
]


@pytest.mark.parametrize("line,message", BAD_SPEC_VALUES)
def test_bad_model_spec_values(tmp_path, line, message):
    key = line.split(":")[0]
    text = "".join(x + "\n" for x in _MODEL.splitlines() if not x.startswith(key + ":")) + line + "\n"
    path = tmp_path / "m.yaml"
    path.write_text(text)
    one_line_error(run(["estimate", "--model", str(path)]), 2, message)


BAD_CONFIG_VALUES = [
    ("model: gpt2\ntraining:\n  batch: true\n", "training: batch = true: expected a number, not a boolean"),
    ("model: gpt2\ntraining:\n  zero: true\n", "training: zero = true: expected a number, not a boolean"),
    ("model: gpt2\ntraining:\n  lora: {alpha: .inf}\n", "training.lora.alpha = inf: Input should be a finite number"),
    ("model: gpt2\ntraining:\n  lora: {dropout: .nan}\n", "training.lora.dropout = nan: Input should be a finite number"),
    ("model: gpt2\nprofile: {base: torch-2.8-cuda, loss_chunks: true}\n", "invalid experiment"),
    ("model: gpt2\nprofile: {base: [1]}\n", "unknown profile [1]; valid: "),  # issue 32: unhashable list
    # an integer of more digits than Python converts: a ValueError from the YAML loader
    ("model: gpt2\ntraining:\n  batch: " + "9" * 5000 + "\n", "Exceeds the limit (4300 digits)"),
    ("model: gpt2\npublished_peak_bytes: .nan\n", "published_peak_bytes = nan: Input should be a finite number"),
]


@pytest.mark.parametrize("text,message", BAD_CONFIG_VALUES)
def test_bad_config_values(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    one_line_error(run(["estimate", "--config", str(path)]), 2, message)


# -- 3. output paths, checked before any work -------------------------------------------

def _bad_paths(tmp_path):
    (tmp_path / "sub").mkdir()
    return [
        ("", "an empty path"),
        ("   ", "an empty path"),
        (str(tmp_path / "missing" / "x.out"), "does not exist"),
        (str(tmp_path / "sub"), "it is a directory"),
    ]


@pytest.mark.parametrize("which", [0, 2])
def test_estimate_html_path(tmp_path, which):
    path, message = _bad_paths(tmp_path)[which]
    one_line_error(run(["estimate", "--model", "gpt2", "--html", path]), 2, f"cannot write --html {path!r}: an empty path" if not path else message)


# (flag, which bad path): each flag and each kind of bad path once
@pytest.mark.parametrize("flag,which", [("--output", 0), ("--output", 3), ("--html", 1), ("--output", 2), ("--snapshot", 3)])
def test_validate_output_path_is_checked_before_torch(tmp_path, monkeypatch, flag, which):
    """The path is refused before the validator (and torch) is imported: with the import made
    to fail, the path's error still comes first."""
    monkeypatch.setitem(sys.modules, "memcalc.validate.command", None)
    path, message = _bad_paths(tmp_path)[which]
    one_line_error(run(["validate", "--config", "control", "--device", "meta", flag, path]), 2, message)


def _special_paths(tmp_path):
    """(path, message): what is not a regular file, a kernel interface, a file memcalc did not write (issue 32:
    a FIFO blocked forever; /dev/full, /proc and /sys failed after the run; a text file was replaced)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    return [
        (str(fifo), "it is a FIFO (named pipe), not a regular file"),
        ("/dev/full", "/dev/full is a kernel interface, not a file"),
        ("/proc/self/status", "is a kernel interface, not a file"),
        ("/sys/kernel/notes", "/sys/kernel/notes is a kernel interface, not a file"),
        (str(text), "exists and is not a "),
    ]


@pytest.mark.parametrize("which", range(5))
@pytest.mark.parametrize("command,flag", [("estimate", "--html"), ("validate", "--output"), ("validate", "--html"),
                                          ("validate", "--snapshot")])
def test_special_output_paths_are_refused_before_any_work(tmp_path, monkeypatch, command, flag, which):
    monkeypatch.setitem(sys.modules, "memcalc.validate.command", None)
    path, message = _special_paths(tmp_path)[which]
    args = ["--model", "gpt2"] if command == "estimate" else ["--config", "control", "--device", "meta"]
    one_line_error(run([command, *args, flag, path]), 2, message)


@pytest.mark.parametrize("flag", ["--html", "--snapshot", "--output", "output="])
def test_a_nul_byte_or_a_symlink_loop_is_one_line(tmp_path, flag):
    """memcalc.core.files.check_output_path, every output's check (issue 32 fuzz: a NUL byte was a ValueError
    traceback; a symlink loop an OSError from the snapshot's writer after the work)."""
    from memcalc.core.files import check_output_path

    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for path, message in ((str(tmp_path / "a\x00b"), "a path holds no NUL byte"),
                          (str(loop), "Too many levels of symbolic links")):
        with pytest.raises(UserError, match=message):
            check_output_path(path, flag)


def test_estimate_snapshot_path_is_checked_before_any_work(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    r = run(["estimate", "--model", "gpt2", "--snapshot", str(loop)])
    one_line_error(r, 2, "Too many levels of symbolic links")


def test_force_replaces_a_file_memcalc_did_not_write(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    r = run(["estimate", "--model", "gpt2", "--html", str(text), "--force"])
    assert r.exit_code == 0 and text.read_text().startswith("<!DOCTYPE html>")
    assert run(["estimate", "--model", "gpt2", "--html", str(text)]).exit_code == 0  # now memcalc's own report


# -- 4. --device cuda without CUDA: tests/trace/test_robustness_trace.py (imports torch) ------

# -- 5. --gpu as a capacity --------------------------------------------------------------

GPU_SIZES = [  # (--gpu, name, capacity_bytes): GiB = 2**30, GB = 10**9 (memcalc.core.units)
    ("48GiB", "48gib", 48 * GiB),
    ("24GB", "24gb", 24 * GB),
    ("80gib", "80gib", 80 * GiB),
    ("47.5GiB", "47-5gib", 47 * GiB + GiB // 2),
    ("1.5e1 GB", "15gb", 15 * GB),
]


@pytest.mark.parametrize("value,name,capacity", GPU_SIZES)
def test_gpu_capacity(value, name, capacity):
    g = get_gpu(value)
    assert (g.name, g.capacity_bytes) == (name, capacity)
    assert g.vendor == "any"


def test_gpu_capacity_in_the_fits_table():
    r = run(["estimate", "--model", "gpt2", "--seq", "64", "--gpu", "24GB", "--gpu", "rtx-4090", "--json"])
    assert r.exit_code == 0, r.output
    import json

    gpus = {g["name"]: g["capacity_bytes"] for g in json.loads(r.stdout)["gpus"]}
    assert gpus["24gb"] == 24 * GB and "rtx-4090" in gpus


BAD_GPUS = [
    (["estimate", "--model", "gpt2", "--gpu", "0GB"], 2, "--gpu 0GB: a capacity must be positive"),
    (["estimate", "--model", "gpt2", "--gpu", "-5GiB"], 2, "--gpu -5GiB: a capacity must be positive"),
    (["estimate", "--model", "gpt2", "--gpu", "1e400GB"], 2, f"--gpu 1e400GB: capacity out of range; give at most {MAX_CAPACITY_BYTES >> 40:,} TiB"),
    (["estimate", "--model", "gpt2", "--gpu", "1e-30GB"], 2, "a capacity must be positive"),
    # issue 32: decimal.Overflow before the sign was checked
    (["estimate", "--model", "gpt2", "--gpu", "-1e999999999GB"], 2,
     "--gpu -1e999999999GB: a capacity must be positive"),
    (["estimate", "--model", "gpt2", "--gpu", "1e-999999999GB"], 2, "a capacity must be positive"),
    (["estimate", "--model", "gpt2", "--gpu", "48TB"], 2, "or a capacity such as 48GiB or 24GB"),
    (["plan", "--model", "gpt2", "--gpu", "0GiB"], 2, "--gpu 0GiB: a capacity must be positive"),
]


@pytest.mark.parametrize("args,code,message", BAD_GPUS)
def test_bad_gpu_capacity(args, code, message):
    one_line_error(run(args), code, message)


# -- 6. LoRA targets: PEFT names, and what the model has --------------------------------

# source: PEFT target_modules for Llama-family models (q_proj, k_proj, v_proj, o_proj,
# gate_proj, up_proj, down_proj: the module names of transformers' LlamaAttention/LlamaMLP)
PEFT_TARGETS = [
    ("q_proj,v_proj", ("q", "v")),
    ("gate_proj", ("gate",)),
    ("up_proj,down_proj", ("up", "down")),
    ("o_proj,k_proj", ("o", "k")),
    ("Q_PROJ, q", ("q",)),  # case-insensitive; an alias and its short name are one target
    ("all", ("q", "k", "v", "o", "gate", "up", "down")),
]


@pytest.mark.parametrize("value,targets", PEFT_TARGETS)
def test_peft_target_names(value, targets):
    assert parse_targets(value, load_preset("llama-2-7b")) == targets
    assert LoraSpec(targets=value.split(",") if value != "all" else targets).targets == targets


def test_all_targets_of_a_plain_mlp():
    assert parse_targets("all", load_preset("gpt2")) == ("qkv", "o", "up", "down")  # source: GPT2Attention c_attn


BAD_TARGETS = [
    (["estimate", "--model", "gpt2", "--lora", "--lora-targets", "gate"], 2,
     "--lora-targets: LoRA target(s) gate not in gpt2 (its MLP is plain: fc1 = up, fc2 = down, no gate); its targets: qkv, o, up, down"),
    (["estimate", "--model", "gpt2", "--lora", "--lora-targets", "q,gate_proj"], 2, "LoRA target(s) q, gate not in gpt2"),
    (["estimate", "--model", "gpt2", "--lora", "--lora-targets", "wte"], 2, "unknown --lora-targets wte; valid: q, k, v, o, gate, up, down, qkv, gate_up"),
]


@pytest.mark.parametrize("args,code,message", BAD_TARGETS)
def test_bad_lora_targets(args, code, message):
    one_line_error(run(args), code, message)


def test_config_lora_gate_on_a_plain_mlp(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: gpt2\ntraining:\n  seq: 64\n  lora: {targets: [q_proj, gate]}\n")
    one_line_error(run(["estimate", "--config", str(path)]), 2, "invalid experiment")
    with pytest.raises(ValueError, match="LoRA target"):
        ExperimentSpec(model=load_preset("gpt2"), training={"lora": {"targets": ["gate"]}})


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e400"])
def test_hf_config_nan_size(tmp_path, value):
    """Python's json reads NaN and Infinity; a Hugging Face config.json with them is one line."""
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": %s, "num_attention_heads": 4, '
                    '"intermediate_size": 128, "vocab_size": 100}' % value)
    one_line_error(run(["estimate", "--model", str(path)]), 2, "num_hidden_layers in")

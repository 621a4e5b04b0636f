"""Size limits (issue 16): layers, sequence, widths and counts have upper bounds stated in the
spec; config/spec files have a size, value-count (YAML aliases expanded) and depth limit. Each
is one line, exit 2, fast; every-K past the last layer says what it means."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from conftest import one_line_error
from memcalc.core.spec import MAX_COUNT, MAX_LAYERS, MAX_SEQ, MAX_WIDTH, ModelSpec, TrainingSpec
from memcalc.inputs.data_files import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES


def run(args: list[str]):
    return CliRunner().invoke(app, args, prog_name="memcalc")


_MODEL = "name: t\nn_layers: {layers}\nd_model: 64\nn_heads: 4\nd_ff: 128\nvocab_size: 100\nmax_seq_len: 128\n"

# (args, message); a {model} is replaced by a tiny spec file
TOO_BIG = [
    (["estimate", "--model", "gpt2", "--batch", str(10**30)], f"batch = {10**30}: Input should be less than or equal to {MAX_COUNT}"),
    (["estimate", "--model", "llama-2-7b", "--seq", str(MAX_SEQ + 1)], f"less than or equal to {MAX_SEQ}"),
    (["estimate", "--model", "gpt2", "--grad-accum", str(10**12)], "grad_accum = 1000000000000"),
    (["estimate", "--model", "gpt2", "--zero", "3", "--gpus", str(10**10)], "gpus = 10000000000"),
    (["estimate", "--model", "{model}"], f"n_layers = 100000: Input should be less than or equal to {MAX_LAYERS}"),
    (["plan", "--model", "{model}", "--gpu", "a100-80gb"], "n_layers = 100000"),
    (["validate", "--config", "control", "--scale-layers", "100000", "--device", "meta"],
     f"--scale-layers 100,000 is more than {MAX_LAYERS:,}"),
]


@pytest.mark.parametrize("args,message", TOO_BIG, ids=lambda a: " ".join(a)[:50] if isinstance(a, list) else None)
def test_sizes_past_the_bounds_are_one_line_and_fast(tmp_path, args, message):
    spec = tmp_path / "deep.yaml"
    spec.write_text(_MODEL.format(layers=100_000))
    t0 = time.perf_counter()
    r = run([str(spec) if a == "{model}" else a for a in args])
    assert time.perf_counter() - t0 < 2.0  # a 100,000-layer estimate ran for minutes
    one_line_error(r, 2, message)


def test_bounds_are_in_the_field_descriptions():
    # source: the bound named in the help text is the one enforced
    assert f"{MAX_LAYERS:,}" in ModelSpec.model_fields["n_layers"].description
    assert f"{MAX_SEQ:,}" in TrainingSpec.model_fields["seq"].description
    assert f"{MAX_WIDTH:,}" in ModelSpec.model_fields["vocab_size"].description
    assert f"{MAX_COUNT:,}" in TrainingSpec.model_fields["batch"].description


def _laughs(levels: int) -> str:
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nmodel: gpt2\nname: x\nmeta: *a{levels - 1}\n"


BAD_FILES = [
    ("laughs.yaml", _laughs(9), f"holds more than {MAX_VALUES:,} values once its YAML aliases are expanded"),
    ("flow.yaml", "model: " + "[" * 20_000 + "]" * 20_000 + "\n", f"nests deeper than {MAX_DEPTH} levels"),
    ("deep.json", "[" * 100_000 + "]" * 100_000, f"nests deeper than {MAX_DEPTH} levels"),
    ("block.yaml", "".join(" " * i + f"k{i}:\n" for i in range(200)) + " " * 200 + "1\n", f"nests deeper than {MAX_DEPTH} levels"),
    ("big.yaml", "# padding\n" * (MAX_FILE_BYTES // 10 + 1), "is larger than 1 MiB"),
    ("latin1.yaml", None, "not UTF-8 text"),
]


@pytest.mark.parametrize("flag", ["--config", "--model"])
@pytest.mark.parametrize("name,text,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_hostile_files_are_one_line_and_fast(tmp_path, flag, name, text, message):
    path = tmp_path / name
    if text is None:
        path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    else:
        path.write_text(text)
    t0 = time.perf_counter()
    r = run(["estimate", flag, str(path)])
    assert time.perf_counter() - t0 < 2.0
    one_line_error(r, 2, message)


def test_a_few_aliases_are_fine(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: gpt2\ntraining: &t {batch: 2, seq: 128}\n")
    assert run(["estimate", "--config", str(path)]).exit_code == 0


@pytest.mark.parametrize("k, layers, noted", [("every-50", 12, True), ("every-11", 12, False)])
def test_every_k_past_the_last_layer_is_noted(k, layers, noted):
    # source: engine/checkpoint.py Checkpointing.run: layer i is checkpointed when i % K == 0
    r = run(["estimate", "--model", "gpt2", "--checkpoint", k, "--json"])
    assert r.exit_code == 0, r.output
    assert ("checkpoints layer 0 only" in r.stdout) is noted

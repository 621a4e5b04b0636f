"""A fuzzer on the command line (issue 16): random argument lists from a grammar of flags with
good, extreme and bad values, and random model-spec / config documents (YAML or JSON), through
``estimate`` and ``plan`` on small models. Whatever comes in: the exit code is 0 or 2 (3 with
``--check``), never a traceback, and an exit 2 is one line on stderr ("memcalc: error: ...").

Torch-free, but each example runs an estimate (a plan: dozens), so a few seconds in all: slow lane.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memcalc.cli import app

pytestmark = pytest.mark.slow

BIG = str(10**30)
# flag -> values: good ones, boundaries, and garbage (each a string, as typed)
VALUES: dict[str, list[str]] = {
    "--batch": ["1", "2", "0", "-1", BIG, "1e3", "x", "1048577"],
    "--seq": ["64", "128", "0", "1", "-5", BIG, "nan", "16777217", "2k", "9" * 400 + "k"],  # k: an alias note first
    "--grad-accum": ["1", "2", "0", BIG],
    "--precision": ["fp32", "bf16", "amp-bf16", "fp8", ""],
    "--optimizer": ["adamw", "sgd", "lion", "adafactor", "nope"],
    "--optimizer-impl": ["foreach", "fused", "for-loop", "bogus"],
    "--checkpoint": ["none", "full", "every-2", "every-0", "every-99999999999", "sqrt", "selective", "every-", "?"],
    "--lora-rank": ["8", "0", "-3", BIG],
    "--lora-alpha": ["16", "nan", "inf", "-1", "1e308"],
    "--lora-targets": ["q,v", "all", "gate", "q_proj,v_proj", "bogus", "", ",,,"],
    "--lora-dropout": ["0.1", "2", "nan", "-0.5"],
    "--zero": ["0", "1", "2", "3", "5", "-1"],
    "--gpus": ["1", "8", "0", "1000000000000"],
    "--profile": ["torch-2.8-cuda", "torch-2.1-cuda", "hf-torch-2.8-cuda", "bogus"],
    "--loss": ["full", "chunked", "x"],
    "--loss-chunks": ["8", "1", "0", BIG],
    "--memory-budget": ["0.5", "0", "1", "2", "nan", "-inf"],
    "--gpu": ["rtx-4090", "48GiB", "24GB", "0GB", "1e40GB", "bogus", "-1GiB", "nanGB"],
    "--params": ["1e8", "350M", "7B", "0", "1e999", "abc", ""],
    # issue 32 fuzz (stop 30): a first micro-batch past gpt2's position table, an empty path taken as not given
    "--first-seq": ["64", "2048", BIG],
    "--adapter-config": ["", str(Path(__file__).parents[2] / "examples" / "adapter_config.json"), "/dev/full"],
    "--config": ["", "/"],
}
SWITCHES = ["--lora", "--qlora", "--bf16", "--master-weights", "--fused-optimizer", "--compile",
            "--offload-optimizer", "--check", "--json", "--all", "--max-batch"]
MODELS = ["gpt2", "tinyllama-1.1b", "no-such-model", ""]

# model spec fields and values a document may hold (good, extreme, wrong type)
SPEC_VALUES = st.one_of(
    st.integers(min_value=-2, max_value=8), st.sampled_from([64, 128, 10**6, 10**30, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=6), st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
SPEC_KEYS = ["name", "n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "max_seq_len",
             "mlp", "activation", "norm", "positions", "tie_embeddings", "rotary_pct", "bogus_key"]
TINY_SPEC = {"name": "t", "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128, "vocab_size": 100, "max_seq_len": 256}


@st.composite
def spec_doc(draw) -> dict:
    doc = dict(TINY_SPEC)
    for k in draw(st.lists(st.sampled_from(SPEC_KEYS), max_size=4, unique=True)):
        doc[k] = draw(SPEC_VALUES)
    return doc


@st.composite
def config_doc(draw) -> object:
    training = {k: draw(SPEC_VALUES) for k in draw(st.lists(st.sampled_from(
        ["batch", "seq", "grad_accum", "precision", "optimizer", "checkpoint", "checkpoint_every", "lora", "zero",
         "gpus", "memory_budget", "compile"]), max_size=3, unique=True))}
    doc = {"name": "fuzz", "model": draw(st.one_of(st.sampled_from(["gpt2", "tinyllama-1.1b"]), spec_doc())),
           "training": {"seq": 64, **training}}
    return draw(st.one_of(st.just(doc), SPEC_VALUES))  # sometimes not a mapping at all


@st.composite
def command(draw, folder: Path) -> list[str]:
    cmd = draw(st.sampled_from(["estimate", "estimate", "estimate", "plan"]))
    args = [cmd]
    source = draw(st.sampled_from(["preset", "spec", "config", "params"]))
    if source == "preset":
        args += ["--model", draw(st.sampled_from(MODELS))]
    elif source in ("spec", "config"):
        doc = draw(spec_doc()) if source == "spec" else draw(config_doc())
        suffix = draw(st.sampled_from([".yaml", ".json"]))
        path = folder / f"doc{len(list(folder.iterdir()))}{suffix}"
        path.write_text(json.dumps(doc, allow_nan=True) if suffix == ".json" else yaml.safe_dump(doc))
        args += ["--model" if source == "spec" else "--config", str(path)]
    else:
        args += ["--params", draw(st.sampled_from(VALUES["--params"]))]
    if "--seq" not in args and cmd == "estimate":
        args += ["--seq", "64"]  # keep the default examples small
    for flag in draw(st.lists(st.sampled_from(sorted(VALUES)), max_size=4, unique=True)):
        if flag != "--params":
            args += [flag, draw(st.sampled_from(VALUES[flag]))]
    args += draw(st.lists(st.sampled_from(SWITCHES), max_size=3, unique=True))
    return args


_FOLDER = Path(tempfile.mkdtemp(prefix="memcalc-fuzz-"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(args=command(_FOLDER))
def test_any_command_line_exits_cleanly(args):
    r = CliRunner().invoke(app, args, prog_name="memcalc", env={"COLUMNS": "100"})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"{args}: raised {type(r.exception).__name__}: {r.exception}") from r.exception
    allowed = {0, 2} | ({3} if "--check" in args else set())
    assert r.exit_code in allowed, (args, r.exit_code, r.stderr[-500:])
    assert "Traceback" not in r.output, args
    if r.exit_code == 2:
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("memcalc: error: "), (args, r.stderr)
    if r.exit_code == 0 and args[0] == "estimate" and "--json" not in args:
        _json_invariants(args)


def _byte_fields(doc, path="") -> list[tuple[str, object]]:
    """Every (path, value) of a key ending in ``_bytes``, at any depth."""
    out: list[tuple[str, object]] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            if isinstance(k, str) and k.endswith("_bytes"):
                out.append((f"{path}.{k}", v))
            out += _byte_fields(v, f"{path}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _byte_fields(v, f"{path}[{i}]")
    return out


def _json_invariants(args: list[str]) -> None:
    """The same command with --json: bytes are integers (never floats), and the components of the
    peak add up to it (both groupings)."""
    r = CliRunner().invoke(app, [*args, "--json"], prog_name="memcalc")
    assert r.exit_code in (0, 3), (args, r.exit_code, r.stderr[-300:])
    doc = json.loads(r.stdout)
    bad = [(p, v) for p, v in _byte_fields(doc) if v is not None and (isinstance(v, bool) or not isinstance(v, int))]
    assert not bad, (args, bad[:5])
    assert sum(doc["components"].values()) == doc["peak_bytes"], args
    assert sum(doc["components_by_kind"].values()) == doc["peak_bytes"], args

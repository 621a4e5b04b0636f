"""Presets, model resolution (preset / config.json / spec file) and one-line validation errors."""

from __future__ import annotations

import fnmatch
import json
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from memcalc.inputs.data_files import data_root
from memcalc.core.errors import UserError
from memcalc.engine.params import count_params
from memcalc.inputs.presets import list_presets, load_preset, preset_summary, resolve_model
from memcalc.inputs.pydantic_errors import pydantic_error_line
from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec

REPO = Path(__file__).resolve().parents[2]
EXPECTED = ["deep-one-1.6b", "gpt2", "gpt2-xl", "llama-2-13b", "llama-2-70b", "llama-2-7b", "llama-3.1-70b",
            "llama-3.1-8b", "mistral-7b", "phi-1.5", "qwen2.5-7b", "tinyllama-1.1b",
            # read from data/hf_configs (issue 12)
            "deepseek-v3", "gemma-2-9b", "gemma-3-1b", "gpt-oss-20b", "granite-3.1-8b", "llama-3.1-405b",
            "llama-3.2-1b", "llama-3.2-3b", "llama-3.3-70b", "mistral-7b-v0.3", "mixtral-8x7b", "olmo-2-7b", "phi-4",
            "qwen3-0.6b", "qwen3-14b", "qwen3-30b-a3b", "qwen3-32b", "qwen3-4b", "qwen3-8b", "smollm3-3b"]


def test_list_presets():
    assert list_presets() == sorted(EXPECTED)


@pytest.mark.parametrize("name", EXPECTED)
def test_preset_name_matches_file_and_cites_a_source(name):
    m = load_preset(name)
    assert m.name == name
    text = (data_root() / "models" / f"{name}.yaml").read_text(encoding="utf-8")
    assert text.startswith("#")  # the source comment


def test_presets_are_package_data():
    """A non-editable install ships data/ as memcalc.data; the globs must cover every data file."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["memcalc.data"]
    files = [p.relative_to(REPO / "data").as_posix() for p in (REPO / "data").rglob("*.yaml")]
    assert files
    for f in files:
        assert any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs), f


def test_load_preset_case_insensitive():
    assert load_preset("GPT2").name == "gpt2"


def test_unknown_preset_suggests_and_lists():
    with pytest.raises(UserError) as e:
        load_preset("llama2-7b")
    msg = str(e.value)
    assert "'llama2-7b'" in msg and "did you mean 'llama-2-7b'" in msg
    assert all(n in msg for n in EXPECTED) and "\n" not in msg


def test_preset_summary():
    s = preset_summary("llama-3.1-8b")
    assert s == {"name": "llama-3.1-8b", "hf_id": "meta-llama/Llama-3.1-8B", "params": 8_030_261_248, "n_layers": 32, "d_model": 4096, "n_heads": 32,
                 "n_kv_heads": 8, "d_ff": 14336, "vocab_size": 128256, "max_seq_len": 131072}
    assert preset_summary("llama-2-7b")["n_kv_heads"] == 32


@pytest.mark.parametrize("name,max_seq", [("gpt2", 1024), ("gpt2-xl", 1024), ("tinyllama-1.1b", 2048),
                                          ("llama-2-7b", 4096), ("llama-2-70b", 4096), ("llama-3.1-8b", 131072),
                                          ("mistral-7b", 32768), ("qwen2.5-7b", 131072), ("phi-1.5", 2048)])
def test_max_seq_is_published_max_positions(name, max_seq):
    assert load_preset(name).max_seq_len == max_seq


# ---------------------------------------------------------------- resolve_model


def test_resolve_preset():
    assert resolve_model("mistral-7b") == load_preset("mistral-7b")


def test_resolve_yaml_spec(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("n_layers: 2\nd_model: 64\nn_heads: 4\nd_ff: 128\nvocab_size: 100\n")
    m = resolve_model(str(p))
    assert m.name == "mine" and m.n_layers == 2


def test_resolve_json_spec_keeps_its_name(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"name": "tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "d_ff": 128,
                             "vocab_size": 100}))
    assert resolve_model(str(p)).name == "tiny"


def test_resolve_preset_yaml_roundtrip(tmp_path):
    p = tmp_path / "copy.yaml"
    p.write_text((data_root() / "models" / "phi-1.5.yaml").read_text())
    assert count_params(resolve_model(str(p))).total == 1_418_270_720


def test_divisibility_error_is_one_line(tmp_path):
    p = tmp_path / "foo.yaml"
    p.write_text("n_layers: 2\nd_model: 60\nn_heads: 12\nn_kv_heads: 5\nd_ff: 128\nvocab_size: 100\n")
    with pytest.raises(UserError) as e:
        resolve_model(str(p))
    assert str(e.value) == f"invalid model spec {p}: n_heads (12) must be divisible by n_kv_heads (5) (remainder 2)"


def test_unknown_key_lists_valid(tmp_path):
    p = tmp_path / "foo.yaml"
    p.write_text("n_layer: 2\nd_model: 64\nn_heads: 4\nd_ff: 128\nvocab_size: 100\n")
    with pytest.raises(UserError) as e:
        resolve_model(str(p))
    msg = str(e.value)
    assert msg.startswith(f"unknown key 'n_layer' in {p}; valid: name, n_layers, d_model")
    assert msg.endswith("did you mean 'n_layers'?") and "\n" not in msg


def test_bad_value_names_field_and_value(tmp_path):
    p = tmp_path / "foo.yaml"
    p.write_text("n_layers: 0\nd_model: 64\nn_heads: 4\nd_ff: 128\nvocab_size: 100\nmlp: swiglu\n")
    with pytest.raises(UserError) as e:
        resolve_model(str(p))
    msg = str(e.value)
    assert msg.startswith(f"invalid model spec {p}: n_layers = 0: ") and "(and 1 more)" in msg


def test_missing_key(tmp_path):
    p = tmp_path / "foo.yaml"
    p.write_text("n_layers: 2\nd_model: 64\nn_heads: 4\nvocab_size: 100\n")
    with pytest.raises(UserError, match="missing required key 'd_ff'"):
        resolve_model(str(p))


def test_not_a_mapping(tmp_path):
    p = tmp_path / "foo.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must be a mapping"):
        resolve_model(str(p))


def test_malformed_yaml(tmp_path):
    p = tmp_path / "foo.yaml"
    p.write_text("n_layers: [2\n")
    with pytest.raises(UserError, match="malformed"):
        resolve_model(str(p))


def test_missing_file():
    with pytest.raises(UserError, match="model file not found: nowhere/model.yaml"):
        resolve_model("nowhere/model.yaml")


def test_unknown_name_is_preset_error():
    with pytest.raises(UserError, match="unknown model preset 'mistral-8b'.*did you mean 'mistral-7b'"):
        resolve_model("mistral-8b")


def test_wrong_suffix(tmp_path):
    p = tmp_path / "model.txt"
    p.write_text("x")
    with pytest.raises(UserError, match=r"must be \.json, \.yaml or \.yml"):
        resolve_model(str(p))


# ---------------------------------------------------------------- pydantic_error_line


def _err(fn):
    with pytest.raises(ValidationError) as e:
        fn()
    return e.value


def test_error_line_nested_unknown_key():
    e = _err(lambda: ExperimentSpec(model={"n_layer": 1}))
    line = pydantic_error_line(e, "exp.yaml")
    assert line.startswith("unknown key 'model.n_layer' in exp.yaml; valid: name, n_layers")


def test_error_line_nested_model_rule():
    e = _err(lambda: ExperimentSpec(model=dict(n_layers=1, d_model=60, n_heads=12, n_kv_heads=5, d_ff=8,
                                               vocab_size=10)))
    assert pydantic_error_line(e, "exp.yaml") == (
        "invalid experiment exp.yaml: model: n_heads (12) must be divisible by n_kv_heads (5) (remainder 2)")


def test_error_line_without_file_uses_where():
    e = _err(lambda: TrainingSpec(batch=0))
    assert pydantic_error_line(e, "training options").startswith("invalid training options: batch = 0: ")


def test_error_line_training_rule():
    e = _err(lambda: TrainingSpec(master_weights=True))
    line = pydantic_error_line(e, "training options")
    assert line.startswith("invalid training options: --master-weights") and "\n" not in line


def test_error_line_nested_lora_unknown_key():
    e = _err(lambda: TrainingSpec(lora={"rnak": 4}))
    line = pydantic_error_line(e, "t.yaml")
    assert line.startswith("unknown key 'lora.rnak' in t.yaml; valid: rank, alpha") and "'rank'" in line


def test_error_line_long_input_is_truncated():
    e = _err(lambda: ModelSpec(n_layers="x" * 500, d_model=1, n_heads=1, d_ff=1, vocab_size=1))
    line = pydantic_error_line(e, "m.yaml")
    assert len(line) < 300 and "..." in line


HF_PRESETS = [n for n in EXPECTED if "hf_config:" in (REPO / "data" / "models" / f"{n}.yaml").read_text()]


@pytest.mark.parametrize("name", HF_PRESETS)
def test_hf_config_preset_is_its_config(name):
    """A preset naming a shipped config.json is exactly that config read by hf_config (it cannot drift)."""
    import yaml

    from memcalc.inputs.hf_config import from_hf_config

    raw = yaml.safe_load((REPO / "data" / "models" / f"{name}.yaml").read_text())
    assert set(raw) == {"hf_id", "hf_config"} and "/" in raw["hf_id"]
    cfg = json.loads((REPO / "data" / "hf_configs" / raw["hf_config"]).read_text())
    assert load_preset(name) == from_hf_config(cfg, name)


def test_hf_config_preset_errors(tmp_path, monkeypatch):
    from memcalc.inputs import presets

    with pytest.raises(UserError, match="not in data/hf_configs"):
        presets._preset_from_hf_config({"hf_config": "nope.json"}, "x")
    with pytest.raises(UserError, match="takes only hf_config"):
        presets._preset_from_hf_config({"hf_config": "Qwen--Qwen3-8B.json", "d_model": 3}, "x")

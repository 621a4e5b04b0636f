"""Hugging Face config.json -> ModelSpec: the fixtures are the published configs of the presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memcalc.core.errors import UserError
from memcalc.inputs.hf_config import SUPPORTED_MODEL_TYPES, from_hf_config
from memcalc.engine.params import count_params
from memcalc.inputs.presets import load_preset, resolve_model

FIXTURES = Path(__file__).parent.parent / "fixtures" / "hf"
PRESET_OF_FIXTURE = ["llama-2-7b", "gpt2", "phi-1.5", "qwen2.5-7b", "mistral-7b", "llama-3.1-8b"]

# Fields that decide parameters and activations; the HF reader must agree with the preset on each.
SHAPE_FIELDS = ("n_layers", "d_model", "n_heads", "kv_heads", "dim_head", "d_ff", "vocab_size", "max_seq_len",
                "mlp", "activation", "norm", "norm_eps", "block", "positions", "rotary_pct", "qkv_bias", "o_bias",
                "mlp_bias", "has_norm_bias", "tie_embeddings", "lm_head_bias", "final_norm", "attn_dropout",
                "resid_dropout", "embd_dropout", "norm_placement")


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.parametrize("preset", PRESET_OF_FIXTURE)
def test_same_param_count_as_preset(preset):
    m = from_hf_config(load(preset), preset)
    assert count_params(m).total == count_params(load_preset(preset)).total
    assert m.name == preset


@pytest.mark.parametrize("preset", PRESET_OF_FIXTURE)
def test_same_shapes_as_preset(preset):
    m, p = from_hf_config(load(preset), preset), load_preset(preset)
    for f in SHAPE_FIELDS:
        assert getattr(m, f) == getattr(p, f), f


def test_qwen2_has_qkv_bias_without_a_key():
    cfg = load("qwen2.5-7b")
    assert "attention_bias" not in cfg
    m = from_hf_config(cfg, "q")
    assert m.qkv_bias and not m.o_bias and not m.mlp_bias


def test_llama_attention_bias_sets_qkv_and_o():
    cfg = {**load("llama-2-7b"), "attention_bias": True, "mlp_bias": True}
    m = from_hf_config(cfg, "x")
    assert m.qkv_bias and m.o_bias and m.mlp_bias


def test_gpt2_defaults_n_inner_and_tied_head():
    cfg = load("gpt2")
    assert "n_inner" not in cfg and "tie_word_embeddings" not in cfg
    m = from_hf_config(cfg, "gpt2")
    assert m.d_ff == 4 * 768 and m.tie_embeddings and m.positions == "learned" and m.max_seq_len == 1024
    m2 = from_hf_config({**cfg, "n_inner": 1000, "tie_word_embeddings": False}, "g")
    assert m2.d_ff == 1000 and not m2.tie_embeddings


def test_gpt2_xl_shapes_from_config():
    cfg = {**load("gpt2"), "n_embd": 1600, "n_head": 25, "n_layer": 48}
    assert count_params(from_hf_config(cfg, "gpt2-xl")).total == 1_557_611_200


def test_phi_partial_rotary_and_parallel_block():
    m = from_hf_config(load("phi-1.5"), "phi")
    assert m.block == "parallel" and m.rotary_pct == 0.5 and m.rotary_dim == 32 and m.lm_head_bias
    assert m.norms_per_layer == 1 and m.norm == "layernorm"


def test_explicit_head_dim_is_kept():
    cfg = {**load("mistral-7b"), "head_dim": 64}
    m = from_hf_config(cfg, "m")
    assert m.dim_head == 64 and m.q_dim == 32 * 64


def test_unknown_model_type_lists_supported():
    with pytest.raises(UserError) as e:
        from_hf_config({**load("llama-2-7b"), "model_type": "mamba"}, "x")
    msg = str(e.value)
    assert "'mamba'" in msg and all(t in msg for t in SUPPORTED_MODEL_TYPES) and "\n" not in msg


def test_missing_key_names_it():
    cfg = load("llama-2-7b")
    del cfg["hidden_size"]
    with pytest.raises(UserError, match="lacks 'hidden_size'"):
        from_hf_config(cfg, "x")


@pytest.mark.parametrize("key,value", [("hidden_size", "big"), ("num_hidden_layers", 0), ("num_hidden_layers", 2.5),
                                       ("tie_word_embeddings", "no"), ("rms_norm_eps", -1)])
def test_mistyped_key_names_key_and_value(key, value):
    with pytest.raises(UserError) as e:
        from_hf_config({**load("llama-2-7b"), key: value}, "x")
    assert key in str(e.value) and repr(value) in str(e.value)


def test_unknown_activation_lists_valid():
    with pytest.raises(UserError, match="unsupported hidden_act 'mish'.*valid: .*silu"):
        from_hf_config({**load("llama-2-7b"), "hidden_act": "mish"}, "x")


def test_impossible_shape_is_one_line():
    with pytest.raises(UserError) as e:
        from_hf_config({**load("llama-2-7b"), "num_key_value_heads": 5}, "x", where="cfg/config.json")
    assert str(e.value) == ("invalid model spec cfg/config.json: n_heads (32) must be divisible by n_kv_heads (5) "
                            "(remainder 2)")


def test_phi_qk_layernorm_rejected():
    with pytest.raises(UserError, match="qk_layernorm"):
        from_hf_config({**load("phi-1.5"), "qk_layernorm": True}, "x")


def test_resolve_model_reads_config_json(tmp_path):
    d = tmp_path / "Llama-2-7b-hf"
    d.mkdir()
    cfg = load("llama-2-7b")
    del cfg["_name_or_path"]
    (d / "config.json").write_text(json.dumps(cfg))
    m = resolve_model(str(d / "config.json"))
    assert m.name == "Llama-2-7b-hf" and count_params(m).total == 6_738_415_616
    assert resolve_model(str(d)).name == "Llama-2-7b-hf"  # a model directory works too


def test_resolve_model_uses_name_or_path(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(load("phi-1.5")))
    assert resolve_model(str(p)).name == "phi-1_5"

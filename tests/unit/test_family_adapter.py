"""A Hugging Face family is one adapter (memcalc.inputs.hf_families, one module per model_type): a
family added from an adapter alone, in the test, is read from its config.json and estimated through
the ordinary front door (built and traced by the validator from the same adapter:
``tests/trace/test_family_adapter_trace.py``); every shipped adapter names the PEFT modules of every LoRA
target its models have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memcalc.api import estimate
from memcalc.core.errors import UserError
from memcalc.inputs import hf_families
from memcalc.inputs.hf_config import from_hf_config
from memcalc.inputs.hf_families import LLAMA_LORA, Family

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "hf_configs"


def _read_renamed(r) -> dict:
    """A llama whose config names every key its own way (``width`` for hidden_size, ...)."""
    return dict(n_layers=r.int("depth"), d_model=r.int("width"), n_heads=r.int("heads"), n_kv_heads=r.int("kv_heads"),
                d_ff=r.int("ffn"), vocab_size=r.int("vocab"), max_seq_len=r.int("context"), mlp="gated",
                activation=r.activation("act"), norm="rmsnorm", norm_eps=r.float("eps"), positions="rope",
                tie_embeddings=r.bool("tied"), final_norm=True)


RENAMED = Family("renamed_llama", _read_renamed, defaults={"context": 4096, "act": "silu", "eps": 1e-6, "tied": False},
                 ignored={"comment": "a note for people"}, lora=LLAMA_LORA)

#: the same model under both families' key names (source: LlamaConfig's keys)
SHAPE = dict(width=256, depth=2, heads=4, kv_heads=2, ffn=512, vocab=1000, eps=1e-5)
LLAMA_KEYS = dict(width="hidden_size", depth="num_hidden_layers", heads="num_attention_heads",
                  kv_heads="num_key_value_heads", ffn="intermediate_size", vocab="vocab_size", eps="rms_norm_eps")


@pytest.fixture
def renamed():
    hf_families.register(RENAMED)
    yield RENAMED
    hf_families.unregister(RENAMED)


def test_a_family_from_an_adapter_alone_is_read_and_estimated(renamed, tmp_path) -> None:
    mine = tmp_path / "mine" / "config.json"
    mine.parent.mkdir()
    mine.write_text(json.dumps({"model_type": "renamed_llama", "comment": "tiny", **SHAPE}))
    llama = tmp_path / "llama" / "config.json"
    llama.parent.mkdir()
    llama.write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 4096,
                                 **{LLAMA_KEYS[k]: v for k, v in SHAPE.items()}}))
    a = from_hf_config(json.loads(mine.read_text()), "m", strict=True)
    b = from_hf_config(json.loads(llama.read_text()), "m", strict=True)
    assert a == b
    # the front door: --model PATH (memcalc.estimate is `memcalc estimate` as a function); tolerance: exact
    opts = dict(batch=2, seq=128, precision="bf16", lora=True, lora_targets="all")
    mine_est, llama_est = estimate(model=str(mine), **opts), estimate(model=str(llama), **opts)
    assert mine_est.peak_bytes == llama_est.peak_bytes > 0
    assert "renamed_llama" in hf_families.supported_model_types()


def test_a_registered_family_reports_its_unread_keys_and_defaults(renamed, capsys) -> None:
    cfg = {"model_type": "renamed_llama", **SHAPE, "mystery": 1}
    with pytest.raises(UserError, match="keys memcalc does not read: mystery"):
        from_hf_config(cfg, "m", strict=True)
    m = from_hf_config({k: v for k, v in cfg.items() if k not in ("eps", "mystery")}, "m")
    assert (m.max_seq_len, m.norm_eps, m.activation, m.tie_embeddings) == (4096, 1e-6, "silu", False)
    with pytest.raises(UserError, match="lacks 'depth'"):
        from_hf_config({"model_type": "renamed_llama"}, "m")


def test_an_unregistered_family_is_unsupported() -> None:
    with pytest.raises(UserError, match="unsupported model_type 'renamed_llama'"):
        from_hf_config({"model_type": "renamed_llama", **SHAPE}, "m")
    with pytest.raises(ValueError, match="already the family"):
        hf_families.register(Family("llama", _read_renamed))


def test_one_module_per_model_type() -> None:
    """Every builtin family lives in the module named after its model_type, with reasons for what it ignores."""
    fams = hf_families.families()
    assert len(fams) >= 26
    for t, f in fams.items():
        assert f.read.__module__ == f"memcalc.inputs.hf_families.{t}", t
        assert all(isinstance(k, str) and len(v) > 5 for k, v in f.ignored.items()), t


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_every_lora_target_has_peft_names(name: str) -> None:
    """What the validator and tests/trace/test_hf_families_exact.py ask PEFT for: each target of the model
    has module names (experts: target_parameters)."""
    raw = json.loads((FIXTURES / f"{name}.json").read_text())
    fam = hf_families.get(raw["model_type"])
    m = from_hf_config(raw, name, strict=True)
    for t in m.lora_targets:
        assert fam.lora[t] or fam.lora_params[t], (name, t)

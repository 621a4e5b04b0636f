"""Exact parameter counts of every shipped Hugging Face config fixture (data/hf_configs) against
transformers 5.23 and peft 0.21: the model built by ``AutoModelForCausalLM.from_config`` on the meta
device has exactly memcalc's ``count_params(...).total``; after ``get_peft_model`` (rank 8, the
family's attention and MLP projection names from its adapter, and ``target_parameters`` for MoE experts) the
trainable count is exactly memcalc's LoRA ``trainable``, fused projections (one adapter on c_attn,
qkv_proj, query_key_value, gate_up_proj) included.

Speed: every config is cut to a few layers on both sides (``scaled``: each layer's parameters do not
depend on the depth, so totals scale exactly); a handful of full-size builds pin the published totals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memcalc.core.spec import LoraSpec  # noqa: E402
from memcalc.engine.params import count_params  # noqa: E402
from memcalc.inputs import hf_families  # noqa: E402
from memcalc.inputs.hf_config import from_hf_config  # noqa: E402
from memcalc.validate.hf_presets import patch_peft_old_torchao  # noqa: E402

# PEFT 0.21 raises on torchao 0.14 (torchtune's pin) at every LoRA dispatch; the validator treats the old
# torchao as absent, and so must this file, which calls get_peft_model itself (it passed only after a file
# that went through the validator first: under xdist it runs alone)
patch_peft_old_torchao()

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[2] / "data" / "hf_configs"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))

RANK = 8
LAYERS = 4  # at least DeepSeek-V3's 3 dense layers + 1 MoE layer


def raw(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def scaled(cfg: dict) -> dict:
    """``cfg`` with ``LAYERS`` layers (6 for Gemma-3's 6-layer pattern); per-layer lists cut to match."""
    n = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    keep = 6 if cfg.get("model_type") == "gemma3_text" else LAYERS
    if n is None or n <= keep:
        return cfg
    out = {k: (v[:keep] if isinstance(v, list) and len(v) == n else v) for k, v in cfg.items()}
    out["n_layer" if "n_layer" in cfg else "num_hidden_layers"] = keep
    return out


def hf_model(cfg: dict):
    """AutoModelForCausalLM.from_config on the meta device (the stored quantization format and
    remote-code map dropped: training builds the plain transformers module)."""
    cfg = {k: v for k, v in cfg.items() if k not in ("quantization_config", "auto_map")}
    conf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(conf)


def peft_names(cfg: dict, spec) -> tuple[tuple[str, ...], list[str], dict]:
    """(memcalc's targets but experts, their PEFT target_modules, further LoraConfig arguments) from the
    family's adapter (source: each family's modeling_*.py module names, transformers 5.23); every
    target the model has must have its names."""
    a = hf_families.get(cfg["model_type"])
    targets = tuple(t for t in spec.lora_targets if t != "experts")
    modules = list(dict.fromkeys(n for t in targets for n in a.lora[t]))
    return targets, modules, dict(a.lora_kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_total_params_equal_transformers(name: str) -> None:
    cfg = scaled(raw(name))
    model = hf_model(cfg)
    spec = from_hf_config(cfg, name, strict=True)
    assert count_params(spec).total == sum(p.numel() for p in model.parameters())


LORA_CASES = [(n, False) for n in NAMES] + [(n, True) for n in NAMES if '"num_experts_per_tok"' in
                                             (FIXTURES / f"{n}.json").read_text()]


@pytest.mark.parametrize("name,experts", LORA_CASES, ids=[f"{n}{'-experts' if e else ''}" for n, e in LORA_CASES])
def test_lora_trainable_equals_peft(name: str, experts: bool) -> None:
    """target_modules = the family's attention and MLP names as a user writes them, from its adapter
    (PEFT 0.21 itself turns the MLP names of Mixtral / Qwen3-MoE / DeepSeek into expert adapters); with
    ``experts``, plus target_parameters on the routed experts (the adapter's ``lora_params``)."""
    cfg = scaled(raw(name))
    spec = from_hf_config(cfg, name, strict=True)
    targets, modules, kwargs = peft_names(cfg, spec)
    params = list(hf_families.get(cfg["model_type"]).lora_params["experts"]) if experts else None
    model = hf_model(cfg)
    lc = peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=modules, target_parameters=params, **kwargs)
    with torch.device("meta"):
        pm = peft.get_peft_model(model, lc)
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    lora = LoraSpec(rank=RANK, targets=targets + (("experts",) if experts else ()))
    assert count_params(spec, lora).trainable == trainable


#: (fixture, total parameters of the full-size model); source: transformers 5.23 meta build
#: (sum of numel), equal to the published sizes named in data/hf_configs/SOURCES.md.
FULL_SIZE = [
    ("meta-llama--Llama-3.3-70B-Instruct", 70_553_706_496),
    ("mistralai--Mixtral-8x7B-v0.1", None),
    ("openai--gpt-oss-20b", 20_914_757_184),
    ("Qwen--Qwen3-30B-A3B", None),
    ("google--gemma-3-1b-it", 999_885_952),
]


@pytest.mark.parametrize("name,published", FULL_SIZE)
def test_full_size_totals(name: str, published) -> None:
    cfg = raw(name)
    n = sum(p.numel() for p in hf_model(cfg).parameters())
    assert count_params(from_hf_config(cfg, name, strict=True)).total == n
    if published is not None:
        assert n == published

"""Exact parameter counts of every shipped Hugging Face config fixture (data/hf_configs) against
transformers 5.23 and peft 0.21: the model built by ``AutoModelForCausalLM.from_config`` on the meta
device has exactly memcalc's ``count_params(...).total``; after ``get_peft_model`` (rank 8, the
family's attention and MLP projection names, and ``target_parameters`` for MoE experts) the
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
from memcalc.inputs.hf_config import from_hf_config  # noqa: E402

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
NAMES = sorted(p.stem for p in FIXTURES.glob("*.json"))

#: model_type -> (PEFT target_modules of the attention and MLP projections, memcalc's canonical targets).
#: source: each family's modeling_*.py module names (transformers 5.23).
TARGETS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "llama-like": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                   ("q", "k", "v", "o", "gate", "up", "down")),
    "gpt2": (["c_attn", "c_proj", "c_fc"], ("qkv", "o", "up", "down")),  # c_proj: attention out and MLP down
    "phi": (["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"], ("q", "k", "v", "o", "up", "down")),
    "phi3": (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ("qkv", "o", "gate_up", "down")),
    "gpt_neox": (["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], ("qkv", "o", "up", "down")),
    "falcon": (["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], ("qkv", "o", "up", "down")),
    "starcoder2": (["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"], ("q", "k", "v", "o", "up", "down")),
    "glm4": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
             ("q", "k", "v", "o", "gate_up", "down")),
    "mixtral": (["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w3", "w2"],  # v4 expert names PEFT converts
                ("q", "k", "v", "o", "gate", "up", "down")),
    "mla": (["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
             "down_proj"], ("q", "q_a", "q_b", "kv_a", "kv_b", "o", "gate", "up", "down")),
}
#: PEFT target_parameters for the routed experts (3-D nn.Parameter in transformers 5)
EXPERT_PARAMS = ["experts.gate_up_proj", "experts.down_proj"]
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


def family(cfg: dict) -> str:
    t = cfg["model_type"]
    if t in ("deepseek_v2", "deepseek_v3"):
        return "mla"
    return t if t in TARGETS else "llama-like"


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
    """target_modules = the family's attention and MLP names as a user writes them (PEFT 0.21 itself turns
    the MLP names of Mixtral / Qwen3-MoE / DeepSeek into expert adapters); with ``experts``, plus
    target_parameters on the routed experts."""
    cfg = scaled(raw(name))
    spec = from_hf_config(cfg, name, strict=True)
    modules, canon = TARGETS[family(cfg)]
    targets = tuple(t for t in canon if t in spec.lora_targets)
    model = hf_model(cfg)
    lc = peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=list(modules),
                         target_parameters=EXPERT_PARAMS if experts else None)
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

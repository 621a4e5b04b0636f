"""Exact parameter counts of the shipped presets against their published totals (tolerance 0).

A mismatch means a module of the preset (or of ``params.py``) is mis-specified; fix the shape,
never the expected number.
"""

from __future__ import annotations

import pytest

from memcalc.engine.params import active_params, count_params, param_inventory
from memcalc.inputs.infer import PRESET_SIZES
from memcalc.inputs.presets import list_presets, load_preset
from memcalc.core.spec import LoraSpec

PUBLISHED_TOTALS = [
    # source: GPT2LMHeadModel.num_parameters() for openai-community/gpt2 (wte tied to lm_head)
    ("gpt2", 124_439_808),
    # source: GPT2LMHeadModel.num_parameters() for openai-community/gpt2-xl
    ("gpt2-xl", 1_557_611_200),
    # source: HF safetensors total, TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
    ("tinyllama-1.1b", 1_100_048_384),
    # source: HF safetensors total, meta-llama/Llama-2-7b-hf ("6.74B"; GGUF general.parameter_count)
    ("llama-2-7b", 6_738_415_616),
    # source: HF safetensors total, meta-llama/Llama-2-13b-hf
    ("llama-2-13b", 13_015_864_320),
    # source: HF safetensors total, meta-llama/Llama-2-70b-hf
    ("llama-2-70b", 68_976_648_192),
    # source: HF safetensors total, meta-llama/Llama-3.1-8B
    ("llama-3.1-8b", 8_030_261_248),
    # source: HF safetensors total, meta-llama/Llama-3.1-70B
    ("llama-3.1-70b", 70_553_706_496),
    # source: HF safetensors total, mistralai/Mistral-7B-v0.1
    ("mistral-7b", 7_241_732_096),
    # source: HF safetensors total, Qwen/Qwen2.5-7B (model card: 7.61B; GGUF general.parameter_count)
    ("qwen2.5-7b", 7_615_616_512),
    # source: HF safetensors_total_params, microsoft/phi-1_5
    ("phi-1.5", 1_418_270_720),
    # source: Forgather full_deepone.yaml at a0ce9176 (model summary)
    ("deep-one-1.6b", 1_631_455_744),
    # presets read from data/hf_configs (issue 12). source, every row: transformers 5.23
    # AutoModelForCausalLM.from_config(config.json) on meta, sum of numel (tests/trace/test_hf_families_exact.py);
    # the published size in the comment
    ("deepseek-v3", 671_026_404_352),  # 671B (685B with the MTP layer transformers does not build)
    ("gemma-2-9b", 9_241_705_984),  # 9.24B
    ("gemma-3-1b", 999_885_952),  # 1.0B
    ("gpt-oss-20b", 20_914_757_184),  # 20.9B
    ("llama-3.1-405b", 405_853_388_800),  # 406B
    ("granite-3.1-8b", 8_170_848_256),  # 8.17B
    ("llama-3.2-1b", 1_235_814_400),  # 1.24B
    ("llama-3.2-3b", 3_212_749_824),  # 3.21B
    ("llama-3.3-70b", 70_553_706_496),  # 70.6B
    ("mistral-7b-v0.3", 7_248_023_552),  # 7.25B
    ("mixtral-8x7b", 46_702_792_704),  # 46.7B
    ("olmo-2-7b", 7_298_617_344),  # 7.30B
    ("phi-4", 14_659_507_200),  # 14.7B
    ("qwen3-0.6b", 596_049_920),  # 0.6B
    ("qwen3-14b", 14_768_307_200),  # 14.8B
    ("qwen3-30b-a3b", 30_532_122_624),  # 30.5B
    ("qwen3-32b", 32_762_123_264),  # 32.8B
    ("qwen3-4b", 4_022_468_096),  # 4.0B
    ("qwen3-8b", 8_190_735_360),  # 8.2B
    ("smollm3-3b", 3_075_098_624),  # 3.08B
]

LORA_TRAINABLE = [
    # (preset, rank, targets, expected trainable)
    # source: r * (d_in + d_out) per adapted Linear; 32 layers x 4 x (16 * 8192)
    ("llama-2-7b", 16, ("q", "k", "v", "o"), 16_777_216),
    # source: PEFT LoraConfig(r=16, target_modules=["q_proj", "v_proj"]) on Llama-2-7b:
    # "trainable params: 8,388,608"
    ("llama-2-7b", 16, ("q", "v"), 8_388_608),
    # source: PEFT print_trainable_parameters, huggyllama/llama-7b, r=64 on q,k,v,o:
    # "trainable params: 67108864 || all params: 6738415616"
    ("llama-2-7b", 64, ("q", "k", "v", "o"), 67_108_864),
    # source: QLoRA (Guanaco) r=64 on all linear layers of LLaMA-7B: "trainable params: 159,907,840"
    ("llama-2-7b", 64, ("q", "k", "v", "o", "gate", "up", "down"), 159_907_840),
    # source: PEFT r=16 on all linear layers of Mistral-7B-v0.1:
    # "trainable params: 41,943,040 || all params: 7,283,675,136"
    ("mistral-7b", 16, ("q", "k", "v", "o", "gate", "up", "down"), 41_943_040),
    # source: r=8 on q,v of Llama 3.1 8B (GQA: v is 4096 -> 1024): 32 x 8 x (8192 + 5120)
    ("llama-3.1-8b", 8, ("q", "v"), 3_407_872),
]


@pytest.mark.parametrize("preset,expected", PUBLISHED_TOTALS)
def test_published_total(preset, expected):
    m = load_preset(preset)
    assert count_params(m).total == expected
    # --params's table of preset sizes (memcalc/inputs/infer.py PRESET_SIZES: --params names the
    # presets of the size typed without reading them) holds the same total and the active count
    row = (preset, expected, active_params(m))
    assert row in PRESET_SIZES, f"infer.py PRESET_SIZES needs the row ({preset!r}, {expected:_}, {row[2]:_})"


def test_every_preset_has_a_published_total():
    assert sorted(p for p, _ in PUBLISHED_TOTALS) == list_presets()
    assert [n for n, _, _ in PRESET_SIZES] == list_presets(), "infer.py PRESET_SIZES: one row per preset, sorted"


@pytest.mark.parametrize("preset,active", [
    ("qwen3-30b-a3b", 3_353_032_704),  # source: Qwen/Qwen3-30B-A3B's model card, "3.3B activated"
    ("deepseek-v3", 37_552_282_624),  # source: deepseek-ai/DeepSeek-V3's model card, "37B activated"
    ("mixtral-8x7b", 12_879_925_248),  # source: Mixtral of Experts (arXiv 2401.04088), "13B active parameters"
    ("llama-3.1-8b", 8_030_261_248),  # dense: every parameter
])
def test_active_params(preset, active):
    """active_params: the total less the routed experts a token skips (embeddings counted)."""
    assert active_params(load_preset(preset)) == active


@pytest.mark.parametrize("preset,rank,targets,expected", LORA_TRAINABLE)
def test_lora_trainable(preset, rank, targets, expected):
    m = load_preset(preset)
    c = count_params(m, LoraSpec(rank=rank, targets=targets))
    assert c.trainable == expected
    assert c.lora == expected
    assert c.base == count_params(m).total  # the frozen base is unchanged


def test_mistral_lora_all_params_matches_peft():
    m = load_preset("mistral-7b")
    c = count_params(m, LoraSpec(rank=16, targets=("q", "k", "v", "o", "gate", "up", "down")))
    assert c.total == 7_283_675_136  # PEFT "all params" for the same adapter


def test_phi_has_head_bias_and_one_norm_per_layer():
    inv = {p.name: p for p in param_inventory(load_preset("phi-1.5"))}
    assert inv["lm_head.bias"].shape == (51200,)
    assert "layers.0.norm1.bias" in inv and "layers.0.norm2.weight" not in inv
    assert "layers.0.attn.o_proj.bias" in inv and "layers.0.mlp.fc1.bias" in inv


def test_gpt2_has_learned_positions_and_tied_head():
    inv = {p.name: p for p in param_inventory(load_preset("gpt2"))}
    assert inv["embed_positions.weight"].shape == (1024, 768)
    assert "lm_head.weight" not in inv


def test_qwen_bias_only_on_qkv():
    inv = {p.name for p in param_inventory(load_preset("qwen2.5-7b"))}
    assert {"layers.0.attn.q_proj.bias", "layers.0.attn.k_proj.bias", "layers.0.attn.v_proj.bias"} <= inv
    assert "layers.0.attn.o_proj.bias" not in inv and "layers.0.mlp.up_proj.bias" not in inv

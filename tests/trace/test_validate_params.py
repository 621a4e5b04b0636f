"""The validator's torch model has exactly the estimator's parameter inventory, for every preset."""

from __future__ import annotations

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from memcalc.engine.params import count_params, param_inventory  # noqa: E402
from memcalc.inputs.presets import list_presets, load_preset  # noqa: E402
from memcalc.core.spec import KernelProfile, LoraSpec, TrainingSpec  # noqa: E402
from memcalc.validate.model import build_model, param_count, unbuilt_features  # noqa: E402


def _replicable(name: str) -> bool:
    """The validator's replica builds the layouts of before issue 12; the new ones join it with their
    activation rules (build_model refuses them until then). Their parameter counts are checked
    against transformers in test_hf_families_exact."""
    return not unbuilt_features(load_preset(name))


def _presets() -> list[str]:
    return [n for n in list_presets() if _replicable(n)]  # read at collection time: the folder may grow


def _small_fast(names: list[str]) -> list:
    """Presets as params; those over 3B parameters (0.1-0.2 s each to build on meta) are marked slow."""
    return [pytest.param(n, marks=[] if count_params(load_preset(n)).total <= 3e9 else [pytest.mark.slow])
            for n in names]


@pytest.mark.parametrize("name", _small_fast(_presets()))
def test_param_count_and_names_match_inventory(name):
    m = load_preset(name)
    model = build_model(m, TrainingSpec(), KernelProfile(), device="meta")
    assert param_count(model)[0] == count_params(m).total
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes == {p.name: p.shape for p in param_inventory(m)}


@pytest.mark.parametrize("name", _presets())
def test_lora_and_qlora_counts(name):
    m = load_preset(name).model_copy(update={"n_layers": 2})
    # the targets a user can give this model: a fused qkv is one target (q, k, v on it are LitGPT's
    # LoRAQKVLinear parts, which only --framework litgpt accepts: ExperimentSpec._check_lora_targets)
    qv, every = (("qkv",), ("qkv", "o", "gate", "up", "down")) if m.fused_qkv else (("q", "v"), ("q", "k", "v", "o", "gate", "up", "down"))
    for lora in (LoraSpec(targets=qv), LoraSpec(qlora=True, targets=every)):
        model = build_model(m, TrainingSpec(precision="bf16", lora=lora), KernelProfile(), device="meta")
        counts = count_params(m, lora)
        total, trainable = param_count(model)
        assert (total, trainable) == (counts.total, counts.trainable)
        inv = {p.name: p for p in param_inventory(m, lora)}
        for n, p in model.named_parameters():
            n = n.replace("_proj_lora_", "_proj.lora_")  # an expert tensor's adapter (validate/moe.py)
            assert n in inv and p.requires_grad == inv[n].trainable, n


def test_qlora_base_storage_is_packed():
    m = load_preset("llama-2-7b").model_copy(update={"n_layers": 1})
    lora = LoraSpec(qlora=True, quant_block=64, double_quant=True)
    model = build_model(m, TrainingSpec(precision="bf16", lora=lora), KernelProfile(), device="meta")
    q = model.layers[0].attn.q_proj
    n = m.d_model * m.q_dim
    assert q.weight is None and q.weight_packed.dtype == torch.uint8 and q.weight_packed.numel() == n // 2
    blocks = n // 64
    assert q.weight_absmax.numel() == blocks and q.weight_absmax.dtype == torch.uint8
    # source: bitsandbytes 0.50 functional.quantize_4bit(compress_statistics=True): the absmax quantised
    # blockwise in blocks of 256 (state2), one fp32 absmax2 per 256 blocks (validate/blocks/adapters.py NF4Weight)
    assert q.weight_absmax2.numel() == -(-blocks // 256) and q.weight_absmax2.dtype == torch.float32

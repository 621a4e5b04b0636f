"""memcalc's torch.compile saved set against PyTorch's own partitioner (dynamo on meta)."""

from __future__ import annotations

import pytest

from memcalc.compile.compiled import compiled_plan
from memcalc.inputs.configs import load_config

from conftest import preset_exp, small_config

TOL_PARTITION = 0.05  # memcalc's saved set vs PyTorch's partitioner

torch = pytest.importorskip("torch")

# Dynamo compiles every row's graph: importing it takes seconds, and each row (even a one-layer
# model) seconds more, so the whole file is slow. The quick lane checks the same partitioner with
# PyTorch's own small cases (tests/unit/test_partitioner.py) and the CPU-inductor rows of
# tests/unit/test_compile.py.
pytestmark = pytest.mark.slow


def _unfused(exp):
    """``exp`` with separate q, k, v projections (the replica's GPT-2 before issue 12's fused c_attn)."""
    return exp.model_copy(update={"model": exp.model.model_copy(update={"fused_qkv": False})})


PARTITION_ROWS = [
    # (experiment builder, description); source: torch._functorch.partitioners via dynamo on meta
    (lambda: small_config("compile", 3), "deep-one x3 fp32, budget 1.0"),
    (lambda: small_config("memory_budget_60", 3), "deep-one x3 fp32, budget 0.6"),
    (lambda: small_config("memory_budget_60", 3, memory_budget=0.3), "deep-one x3 fp32, budget 0.3"),
    (lambda: small_config("memory_budget_05", 3), "deep-one x3 fp32, budget 0.05"),
    (lambda: small_config("bf16_budget_60", 3), "deep-one x3 bf16, budget 0.6"),
    (lambda: preset_exp("tinyllama-1.1b", 2, 1.0), "tinyllama x2 (RoPE, GQA, SwiGLU)"),
    (lambda: _unfused(preset_exp("gpt2", 2, 1.0)), "gpt2 x2 (LayerNorm, GELU, dropout), budget 1.0"),
    (lambda: _unfused(preset_exp("gpt2", 2, 0.5)), "gpt2 x2, budget 0.5"),
    pytest.param(lambda: preset_exp("gpt2", 2, 1.0), "gpt2 x2 fused c_attn, budget 1.0",
                 marks=pytest.mark.xfail(strict=True, reason="torch.compile of a fused qkv projection: memcalc's "
                                         "saved set (44.1 MB) is below PyTorch's (55.5 MB); cause not located "
                                         "yet (issue 12 follow-up)")),
    (lambda: preset_exp("mistral-7b", 2, 0.5, precision="amp-bf16"), "mistral x2 amp-bf16, budget 0.5"),
    (lambda: preset_exp("qwen2.5-7b", 2, 1.0, lora=True), "qwen2.5 x2 LoRA, budget 1.0"),
]


@pytest.mark.parametrize("build,what", PARTITION_ROWS,
                         ids=[r.values[1] if hasattr(r, "values") else r[1] for r in PARTITION_ROWS])
def test_saved_set_matches_pytorch(build, what):
    from memcalc.validate.compiled import partition

    exp = build()
    mine = compiled_plan(exp).saved_bytes
    real = partition(exp).saved_bytes
    assert abs(mine - real) <= TOL_PARTITION * real, f"{what}: memcalc {mine} vs PyTorch {real}"


def test_saved_set_matches_pytorch_full_size():
    """The full 1.6B model at budget 0.6: 32 layers' knapsack at once."""
    from memcalc.validate.compiled import partition

    exp = load_config("memory_budget_60")
    mine = compiled_plan(exp).saved_bytes
    real = partition(exp).saved_bytes
    assert abs(mine - real) <= 0.01 * real

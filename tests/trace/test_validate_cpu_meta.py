"""The same tiny training step measured for real on the CPU and traced on meta agrees (same tracker).

The math attention kernel runs the same ops on both devices (the fused kernels exist only on
CUDA and meta), so these cases compare like with like.
"""

from __future__ import annotations

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from memcalc.core.spec import ExperimentSpec, KernelProfile, LoraSpec, ModelSpec, TrainingSpec  # noqa: E402
from memcalc.validate.runner import measure  # noqa: E402

TINY_LLAMA = ModelSpec(name="tiny-llama", n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, d_ff=344,
                       vocab_size=512, max_seq_len=1024)
TINY_DEEP = ModelSpec(name="tiny-deep-one", n_layers=2, d_model=128, n_heads=4, d_ff=344, vocab_size=512,
                      mlp="gated", activation="relu", norm_eps=1e-6, norm_placement="post", residual_scale=2.0,
                      positions="alibi", alibi_trainable=True)
TINY_GPT = ModelSpec(name="tiny-gpt", n_layers=2, d_model=128, n_heads=4, d_ff=512, vocab_size=512, mlp="plain",
                     activation="gelu_tanh", norm="layernorm", positions="learned", qkv_bias=True, o_bias=True,
                     mlp_bias=True, tie_embeddings=True, attn_dropout=0.1, resid_dropout=0.1, embd_dropout=0.1,
                     max_seq_len=256)
MATH = KernelProfile(attention="math")

CASES = {
    "deep-one fp32 adafactor": (TINY_DEEP, dict(optimizer="adafactor", optimizer_impl="for-loop")),
    "deep-one bf16 fused checkpoint": (TINY_DEEP, dict(optimizer="adafactor", optimizer_impl="for-loop",
                                                       precision="bf16", checkpoint="full", fused_optimizer=True)),
    "llama amp-bf16 checkpoint": (TINY_LLAMA, dict(precision="amp-bf16", checkpoint="full")),
    "llama lion sqrt": (TINY_LLAMA, dict(optimizer="lion", checkpoint="sqrt")),
    "llama fp16 master weights": (TINY_LLAMA, dict(precision="fp16", master_weights=True)),
    "llama lora": (TINY_LLAMA, dict(precision="bf16", lora=LoraSpec(rank=8))),
    "gpt2 dropout tied": (TINY_GPT, dict()),
}


# A real CPU step and a meta trace per case (a second or two each, more for the first): the
# whole file is slow. The quick lane's meta traces are in tests/trace/test_estimator_vs_trace.py and
# tests/trace/test_validate_deep_one.py.
@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_run_and_meta_trace_agree(case):
    model, training = CASES[case]
    exp = ExperimentSpec(model=model, training=TrainingSpec(batch=2, seq=64, **training), profile=MATH)
    cpu = measure(exp, "cpu")
    meta = measure(exp, "meta")
    assert cpu.status == meta.status == "ok", (cpu.reason, meta.reason)
    assert abs(cpu.measured_bytes - meta.measured_bytes) <= 0.01 * meta.measured_bytes
    assert abs(cpu.first_step_bytes - meta.first_step_bytes) <= 0.01 * meta.first_step_bytes

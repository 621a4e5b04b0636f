"""LoRA over a GPTQ / AWQ 4-bit base (--quant gptq|awq, LoraSpec.quant): read from source, since gptqmodel's
kernels need CUDA; validate refuses it in one line (torch-free)."""

from __future__ import annotations

import pytest

from conftest import cli_run, one_line_error
from memcalc.core.rules import awq_dequant_peak_bytes, packed_4bit_parts
from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, TrainingSpec
from memcalc.estimate.peak import estimate

LAYOUTS = [
    # source: gptqmodel / auto-gptq QuantLinear: qweight int32 [in*4/32, out], qzeros int32 [ceil(in/128), out*4/32],
    # scales fp16 [ceil(in/128), out], g_idx int32 [in]
    ("gptq", 4096, 11008, [4096 * 11008 // 2, 32 * 11008 // 2, 2 * 32 * 11008, 4 * 4096]),
    # source: AWQ WQLinear_GEMM / gptqmodel AwqTorchLinear: qweight int32 [in, out*4/32], qzeros int32
    # [in/128, out*4/32], scales fp16 [in/128, out], no g_idx
    ("awq", 4096, 11008, [4096 * 11008 // 2, 32 * 11008 // 2, 2 * 32 * 11008]),
    # source: a group count rounds up (math.ceil(infeatures / group_size))
    ("gptq", 200, 64, [200 * 64 // 2, 2 * 64 // 2, 2 * 2 * 64, 4 * 200]),
]


@pytest.mark.parametrize("method,k,n,parts", LAYOUTS)
def test_packed_layout(method: str, k: int, n: int, parts: list[int]) -> None:
    assert packed_4bit_parts(method, k, n) == parts


def test_awq_dequant_peak() -> None:
    # source: packing_utils.dequantize_gemm: int8 iweight + int8 izeros + fp16 scales + int8 diff + fp16 result
    assert awq_dequant_peak_bytes(128, 256, 2) == 7 * 128 * 256
    # source: the int32 shift (4) and its int8 cast (1) when the result is fp16: 5 < 7
    assert awq_dequant_peak_bytes(128, 256, 1) == 5 * 128 * 256


TINY = ModelSpec(name="tiny", n_layers=2, d_model=256, n_heads=4, d_ff=512, vocab_size=512, max_seq_len=64)
ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _forward_peak(quant: str | None) -> int:
    lora = LoraSpec(rank=8, targets=ALL, quant=quant)
    est = estimate(ExperimentSpec(model=TINY, training=TrainingSpec(batch=1, seq=64, precision="bf16", lora=lora)),
                   timeline=False)
    return est.phases["forward"]


def test_gptq_saves_each_dequantized_weight() -> None:
    # source: gptqmodel TorchQuantLinear._forward: torch.matmul(x, weights) keeps the bf16 [in, out] weight for the
    # input's gradient, so only where the input needs one: every linear of layer 1, layer 0's o and MLP (after
    # its attention's adapters), not layer 0's q, k, v (their input is the frozen embedding's output);
    # the bf16 base weights become the packed buffers (each rounded to 512 bytes)
    shapes = [(256, 256)] * 4 + [(256, 512)] * 2 + [(512, 256)]
    saved = 2 * sum(2 * k * n for k, n in shapes) - 3 * 2 * 256 * 256
    packed = 2 * sum(-(-b // 512) * 512 for k, n in shapes for b in packed_4bit_parts("gptq", k, n))
    bf16 = 2 * sum(2 * k * n for k, n in shapes)
    assert _forward_peak("gptq") - _forward_peak(None) == saved + packed - bf16


BAD = [
    (["estimate", "--model", "llama-2-7b", "--quant", "xx"], "unknown --quant 'xx'; valid: gptq, awq"),
    (["estimate", "--model", "llama-2-7b", "--quant", "gptq", "--qlora"], "not with qlora (bitsandbytes NF4)"),
    (["estimate", "--model", "llama-2-7b", "--quant", "awq", "--precision", "fp32"], "use precision bf16 or fp16"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_quant_is_one_line(args: list[str], message: str) -> None:
    one_line_error(cli_run(args), 2, message)

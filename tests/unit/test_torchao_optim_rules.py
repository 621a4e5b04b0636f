"""torchao's low-bit AdamW (adamw-4bit-torchao, adamw-8bit-torchao, adamw-fp8-torchao): the state layout and
step temporaries the estimator counts per parameter (torch-free; the trace is tests/trace/test_torchao_optim.py)."""

from __future__ import annotations

import pytest

from memcalc.core.optimizers import OPTIMIZERS
from memcalc.core.spec import TrainingSpec
from memcalc.engine.optimizers import STATE_LAYOUTS, per_param_temps
from types import SimpleNamespace

ROWS = [
    # source: torchao 0.14.1 subclass_4bit.py OptimState4bit.zeros: codes n//2 uint8, scale n//128 fp32, qmap 16 fp32
    ("adamw-4bit-torchao", 4096 * 2, "bf16", [4096, 256, 64] * 2),
    # source: adam.py _new_buffer: numel % block_size != 0 -> torch.zeros_like(p) (bf16 like the parameter)
    ("adamw-4bit-torchao", 4096 + 64, "bf16", [2 * 4160] * 2),
    # source: adam.py _new_buffer: numel < 4096 -> zeros_like(p), fp32 parameter
    ("adamw-4bit-torchao", 2048, "fp32", [4 * 2048] * 2),
    # source: subclass_8bit.py OptimState8bit.zeros: codes n uint8, scale n//256 fp32, qmap 256 fp32
    ("adamw-8bit-torchao", 8192, "bf16", [8192, 128, 1024] * 2),
    # source: subclass_fp8.py OptimStateFp8.zeros: codes n float8_e4m3fn, scale n//256 fp32, no qmap
    ("adamw-fp8-torchao", 8192, "bf16", [8192, 128] * 2),
]


@pytest.mark.parametrize("opt,numel,precision,expected", ROWS)
def test_state_layout(opt: str, numel: int, precision: str, expected: list[int]) -> None:
    tr = TrainingSpec(optimizer=opt, precision=precision)
    assert STATE_LAYOUTS[OPTIMIZERS[opt].state](numel, 1, 2, tr) == expected


TEMPS = [
    # source: single_param_adam's functional graph traced on meta (core/optimizers.py TORCHAO: 44.625 B/element + 128)
    ("adamw-4bit-torchao", 8192, "bf16", 44.625 * 8192 + 128),
    # source: as above, a parameter whose state stays zeros_like (TORCHAO_PLAIN_TEMP_PER_ELEM: bf16 20 B/element)
    ("adamw-4bit-torchao", 1000, "bf16", 20 * 1000),
    # source: as above, fp32 parameter: 24 B/element
    ("adamw-8bit-torchao", 1000, "fp32", 24 * 1000),
    # source: AdamW8bit traced: 45.0625 B/element + 2 qmaps of 256 fp32
    ("adamw-8bit-torchao", 8192, "bf16", 45.0625 * 8192 + 2048),
    # source: AdamWFp8 traced: 20.03125 B/element
    ("adamw-fp8-torchao", 8192, "bf16", 20.03125 * 8192),
]


@pytest.mark.parametrize("opt,numel,precision,expected", TEMPS)
def test_step_temporaries(opt: str, numel: int, precision: str, expected: float) -> None:
    tr = TrainingSpec(optimizer=opt, precision=precision)
    p = SimpleNamespace(numel=numel, weight=SimpleNamespace(itemsize_bits=16 if precision == "bf16" else 32))
    assert per_param_temps(p, 1, tr) == [("alloc", int(expected)), ("free", 0)]  # type: ignore[arg-type]


def test_bytes_per_param_table() -> None:
    # source: 4-bit codes (0.5 B) + an fp32 scale per 128 elements, two moments
    assert OPTIMIZERS["adamw-4bit-torchao"].state_bytes_per_param(2) == 2 * (0.5 + 4 / 128)
    assert OPTIMIZERS["adamw-8bit-torchao"].state_bytes_per_param(2) == 2 * (1 + 4 / 256)

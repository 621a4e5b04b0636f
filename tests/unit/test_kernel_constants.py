"""memcalc.core.kernels: the constants the estimator and the validator share."""

from __future__ import annotations

import pytest

from memcalc.core.kernels import (ALLOCATOR_ROUND_BYTES, choose_attention_kernel, efficient_lse_len,
                                  flash_head_dim_rounded, flash_seq_rounded, rmsnorm_for_torch)
from memcalc.core.spec import KernelProfile
from memcalc.inputs.profiles import PROFILES


@pytest.mark.parametrize("d,want", [
    (64, 64),  # source: flash_api.cpp mha_bwd head_size_rounded, round_multiple(64, 32)
    (80, 96),  # source: same, phi-2's head dim rounds up to 96
    (128, 128),  # source: same
    (192, 192),  # source: same, the last width rounded to 32
    (200, 256),  # source: same, head_size > 192 -> 256
])
def test_flash_head_dim_rounding(d: int, want: int) -> None:
    assert flash_head_dim_rounded(d) == want


def test_sequence_roundings() -> None:
    assert flash_seq_rounded(100) == 128 and flash_seq_rounded(256) == 256  # source: seqlen_q_rounded, 128
    assert efficient_lse_len(100) == 128 and efficient_lse_len(65) == 96  # source: kAlignLSE, 32


@pytest.mark.parametrize("choice,sixteen,mask,want", [
    ("auto", True, False, "flash"),  # source: sdp_utils.cpp, flash for 16-bit without a mask
    ("auto", False, False, "efficient"),  # source: fp32 has no flash kernel
    ("auto", True, True, "efficient"),  # source: an explicit mask rules flash out
    ("flash", False, False, "efficient"),  # source: a forced flash that cannot run falls back
    ("math", True, False, "math"),
])
def test_attention_kernel_choice(choice: str, sixteen: bool, mask: bool, want: str) -> None:
    assert choose_attention_kernel(choice, sixteen, mask) == want


def test_plain_torch_profiles_follow_the_rmsnorm_table() -> None:
    for p in PROFILES.values():
        if p.framework == "plain":  # hf, torchtune and litgpt bring their own RMSNorm (profiles.FRAMEWORKS)
            assert p.rmsnorm == rmsnorm_for_torch(p.torch_version), p.name


def test_spec_defaults_are_the_shared_constants() -> None:
    assert KernelProfile().allocator_round_bytes == ALLOCATOR_ROUND_BYTES == 512
    from memcalc.core.allocator import MIN_BLOCK

    assert MIN_BLOCK == ALLOCATOR_ROUND_BYTES

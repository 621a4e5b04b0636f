"""Kernel constants both sides need: the estimator (``memcalc.engine``) and the validator
(``validate/``, which imports them from here rather than writing its own).

Each constant names the PyTorch (or library) source it is read from.
"""

from __future__ import annotations

from typing import Optional

# -- the CUDA caching allocator -----------------------------------------------------------
#: c10/cuda/CUDACachingAllocator.cpp ``kMinBlockSize``: every block is a multiple of 512
#: bytes, which is also what ``torch.cuda.max_memory_allocated`` sums.
ALLOCATOR_ROUND_BYTES = 512

# -- scaled_dot_product_attention ------------------------------------------------------
#: FlashAttention-2 ``mha_bwd`` (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp):
#: ``seqlen_q_rounded = round_multiple(seqlen_q, 128)`` for ``dq_accum`` and ``softmax_d``.
FLASH_SEQ_ROUND = 128
#: Same file: ``head_size_rounded = head_size <= 192 ? round_multiple(head_size, 32) : 256``.
FLASH_HEAD_ROUND = 32
FLASH_HEAD_ROUND_LIMIT = 192
FLASH_HEAD_MAX = 256
#: aten/src/ATen/native/transformers/cuda/attention.cu ``_efficient_attention_forward``: the
#: logsumexp is (B, H, ceil(T / 32) * 32) fp32 (``kAlignLSE``).
EFFICIENT_LSE_ROUND = 32

ATTENTION_KERNELS = ("flash", "efficient", "math")


def _round(n: int, m: int) -> int:
    return -(-n // m) * m


def flash_seq_rounded(t: int) -> int:
    """Rows of FA2's backward buffers ``dq_accum`` and ``softmax_d`` for a sequence of ``t``."""
    return _round(t, FLASH_SEQ_ROUND)


def flash_head_dim_rounded(d: int) -> int:
    """Width of FA2's ``dq_accum`` for head dim ``d`` (``head_size_rounded``, see above)."""
    return _round(d, FLASH_HEAD_ROUND) if d <= FLASH_HEAD_ROUND_LIMIT else FLASH_HEAD_MAX


def efficient_lse_len(t: int) -> int:
    """Length of the memory-efficient kernel's logsumexp rows for a sequence of ``t``."""
    return _round(t, EFFICIENT_LSE_ROUND)


def choose_attention_kernel(profile_choice: str, sixteen_bit: bool, has_mask: bool, enable_gqa: bool = False) -> str:
    """The SDPA kernel CUDA runs (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp
    ``select_sdp_backend``): ``auto`` = flash for 16-bit inputs without an explicit mask;
    otherwise memory-efficient, except that a grouped-query call (``enable_gqa=True``, K/V with
    fewer heads than Q, as transformers' ``sdpa_attention_forward`` makes it when
    ``use_gqa_in_sdpa`` holds) cannot use the memory-efficient kernel (its constraints have no
    ``check_grouped_query_attention``; flash and cuDNN do) and falls to the math kernel, which
    saves the full attention matrix. A forced ``flash`` that cannot run (fp32, or a mask) falls
    back the same way, as the dispatcher would. cuDNN attention is not modelled (PyTorch 2.5.1+
    ranks it below flash and memory-efficient by default)."""
    if profile_choice == "flash" and sixteen_bit and not has_mask:
        return "flash"
    if profile_choice in ("auto", "flash"):
        if sixteen_bit and not has_mask:
            return "flash"
        return "math" if enable_gqa else "efficient"
    if profile_choice == "efficient" and enable_gqa:
        return "math"
    return profile_choice


# -- RMSNorm ---------------------------------------------------------------------------
#: What ``nn.RMSNorm`` runs on CUDA, by PyTorch version (first, last or None = open, mode):
#: aten/src/ATen/native/layer_norm.cpp ``rms_norm_symint``: composite, casting back before
#: the weight multiply (2.4-2.5); composite with the weight multiply in fp32 (2.6-2.8);
#: ``_fused_rms_norm`` (2.9+). The profiles (``memcalc.inputs.profiles``) and the validator's
#: ``RMSNorm`` (``validate/layers.py``) follow this table.
RMSNORM_BY_TORCH: tuple[tuple[tuple[int, int], Optional[tuple[int, int]], str], ...] = (
    ((2, 4), (2, 5), "composite-legacy"),
    ((2, 6), (2, 8), "composite"),
    ((2, 9), None, "fused"),
)


def rmsnorm_for_torch(version: str) -> str:
    """The ``nn.RMSNorm`` mode of PyTorch ``version`` ("major.minor"); versions before
    ``nn.RMSNorm`` (2.4) get the composite-legacy formula, as hand-written RMSNorms compute it."""
    v = tuple(int(x) for x in version.split(".")[:2])
    for first, last, mode in RMSNORM_BY_TORCH:
        if v >= first and (last is None or v <= last):
            return mode
    return "composite-legacy"


# -- dropout ---------------------------------------------------------------------------
#: ``native_dropout`` on CUDA saves a bool mask: 1 byte per element
#: (aten/src/ATen/native/cuda/Dropout.cu ``dropout_cuda``).
DROPOUT_MASK_BYTES = 1


def mla_attention_kernel(kernel: str, qk_head_dim: int, v_head_dim: int) -> str:
    """The SDPA kernel for MLA's unequal head dims: flash needs q, k and v of one head dim
    (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp ``check_head_dim_size_flash``), the
    memory-efficient kernel accepts a different value width, so the dispatcher falls to it."""
    if kernel == "flash" and qk_head_dim != v_head_dim:
        return "efficient"
    return kernel


# -- pinned host memory ----------------------------------------------------------------
def pinned_bytes(n: int) -> int:
    """A pinned host allocation of ``n`` bytes: rounded up to a power of two (CachingHostAllocator)."""
    return 1 << (n - 1).bit_length() if n > 1 else n


# -- autograd formulas with temporaries ------------------------------------------------
def pow2_backward_temps(numel: int, itemsize: int) -> list[int]:
    """The workspace of ``PowBackward0`` for ``x.pow(2)`` (tools/autograd/derivatives.yaml
    ``pow.Tensor_Scalar``: ``self: pow_backward(grad, self, exponent)``; torch/csrc/autograd/
    FunctionsManual.cpp ``pow_backward``: ``grad * (exponent * self.pow(exponent - 1)).conj()``):
    ``self.pow(1)`` and ``2 * that`` are two tensors of the input's size, alive together while the
    result (the input's gradient, counted by the node) is made. Traced on meta, torch 2.13:
    ``pow.Tensor_Scalar``, ``mul.Scalar``, ``mul.Tensor`` each of numel * itemsize, freed after the
    last (the incoming gradient, mean's ``expand / numel``, is freed with them)."""
    return [numel * itemsize, numel * itemsize]

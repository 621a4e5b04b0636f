"""Kernel dispatch for the real Hugging Face step on ``meta``: the only thing the HF validator changes.

transformers and PEFT run unmodified; :class:`HFKernels`, a ``TorchFunctionMode`` active around the
step, changes only *which kernel* runs where the meta device would pick a different one than CUDA:

- ``F.scaled_dot_product_attention`` (as transformers' ``sdpa_attention_forward`` calls it: grouped
  K/V un-expanded with ``enable_gqa=True`` when ``use_gqa_in_sdpa`` holds, else after its own
  ``repeat_kv``) goes to the kernel :func:`memcalc.core.kernels.choose_attention_kernel` names for
  (profile, dtype, mask, grouped-query): ``flash`` (:class:`~.attention.FlashAttention`: un-expanded
  K/V natively; FA2's backward adds the (B, Tk, H, D) ``dk_expanded``/``dv_expanded`` scratch),
  ``efficient`` (:class:`~.attention.EfficientAttention`), or ``math``
  (``aten._scaled_dot_product_attention_math``, the composite CUDA runs too). A bool mask is first
  made additive in the query dtype (``convert_boolean_attn_mask``, sdp_utils.h), as
  ``scaled_dot_product_attention`` (attention.cpp) does before any kernel. With dropout the math
  kernel calls ``at::dropout``, which is ``native_dropout`` (bool mask) only on CUDA, so that case is
  written out (:func:`math_attention`).
- ``F.dropout``: ``at::dropout`` uses ``native_dropout`` (a 1-byte bool mask saved) when
  ``is_fused_kernel_acceptable`` (a CUDA input, 0 < p < 1); elsewhere ``_dropout_impl`` saves a mask
  in the activation dtype. Routed to ``torch.native_dropout`` (``memcalc.core.kernels.DROPOUT_MASK_BYTES``).
- QLoRA: ``bitsandbytes::gemm_4bit`` (``MatMul4Bit.forward``) runs the allocations of its CUDA kernel's
  dequantise-then-``F.linear`` path (:func:`~.hf_qlora.gemm_4bit`); its fake kernel allocates the output only.
- AMP: ``torch.autocast`` does nothing on meta tensors, so with an :class:`~.amp.Amp` region open the
  mode applies CUDA's autocast op lists (aten/src/ATen/autocast_mode.h ``AT_FORALL_LOWER_PRECISION_FP``,
  ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``) at the Python functions that reach those ops,
  with :class:`~.amp.Amp`'s cached casts of trainable fp32 leaves. ``F.cross_entropy`` is a composite:
  under autocast its ``log_softmax`` keeps the input dtype (it passes one) and ``nll_loss`` upcasts.
  The ``promote`` list (atan2, addcmul, ...) is not applied: none of the supported families calls it.

:func:`hf_patches` also answers transformers' packed-sequence detection
(``masking_utils.find_packed_sequence_indices``, which reads ``position_ids`` with ``bool()``, impossible
on meta) the way unpacked data answers it (``None``), after running the same ops, answers
``torch.is_autocast_enabled()`` as CUDA would inside the emulated autocast region, and re-enters the
autocast region in activation-checkpoint recomputation (``torch.utils.checkpoint`` saves and restores
the autocast state; the emulated one is restored by wrapping the checkpointed function, which also
turns the routing back on: ``loss.backward()`` runs inside the mode's handler, where the mode is off).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from memcalc.core.kernels import choose_attention_kernel, mla_attention_kernel
from memcalc.core.spec import KernelProfile

from .amp import Amp
from .blocks.sdpa import EfficientAttention, FlashAttention, align_mask, bool_mask_to_additive, math_attention
from .devices import kernel_device
from .hf_qlora import gemm_4bit, is_gemm_4bit

aten = torch.ops.aten
_LOW = (torch.float16, torch.bfloat16)
Tensor = torch.Tensor


def _funcs(names: str, *owners) -> set:
    out = set()
    for owner in owners:
        for n in names.split():
            f = getattr(owner, n, None)
            if f is not None:
                out.add(f)
    return out


#: AT_FORALL_LOWER_PRECISION_FP, as the Python functions that reach those ops
LOWER_PRECISION = _funcs("linear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d prelu "
                         "bilinear", F) | _funcs("matmul __matmul__ __rmatmul__ mm bmm baddbmm addmm addbmm addmv addr "
                                                 "mv einsum chain_matmul prelu", torch, Tensor)
#: AT_FORALL_FP32
FP32 = _funcs("layer_norm group_norm nll_loss mse_loss l1_loss smooth_l1_loss huber_loss kl_div softplus "
              "binary_cross_entropy_with_logits poisson_nll_loss cosine_embedding_loss hinge_embedding_loss "
              "margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
              "pdist", F) | _funcs("acos asin cosh sinh tan exp expm1 log log10 log1p log2 rsqrt erfinv reciprocal "
                                   "pow __pow__ __rpow__ renorm logsumexp dist cdist layer_norm group_norm",
                                   torch, Tensor)
#: AT_FORALL_FP32_SET_OPT_DTYPE: run in fp32 unless the caller names an output dtype
FP32_SET_OPT_DTYPE = _funcs("softmax log_softmax", F) | _funcs("softmax log_softmax sum prod cumsum cumprod", torch, Tensor)


class HFKernels(TorchFunctionMode):
    """The kernel routing and autocast emulation of the module docstring. ``calls`` lists, per SDPA
    call, ``(kernel, dtype, grouped_query, has_mask)``."""

    def __init__(self, profile: KernelProfile, amp: Optional[Amp] = None) -> None:
        super().__init__()
        self.profile = profile
        self.amp = amp or Amp(None)
        self.calls: list[tuple[str, torch.dtype, bool, bool]] = []

    # -- dispatch -------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.sdpa(*args, **kwargs)
        if func is F.dropout:
            return self.dropout(*args, **kwargs)
        if func in _GROUPED_MM:
            return self.grouped_mm(func, *args, **kwargs)
        if is_gemm_4bit(func) and kernel_device(args[0]) == "meta":  # QLoRA's base matmul (hf_qlora.py)
            return gemm_4bit(*args, **kwargs)
        if self.amp.active:
            if func in LOWER_PRECISION:
                args, kwargs = self._cast(self.amp.lp, args, kwargs)
            elif func in FP32:
                args, kwargs = self._cast(self.amp.fp32, args, kwargs)
            elif func in FP32_SET_OPT_DTYPE:
                x = args[0] if args else None
                if kwargs.get("dtype") is None and isinstance(x, Tensor) and x.dtype in _LOW + (torch.float32,):
                    kwargs = dict(kwargs, dtype=torch.float32)
            elif func is F.cross_entropy:
                return self._cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _cast(fn, args, kwargs):
        def one(a):
            if isinstance(a, Tensor):
                return fn(a)
            if isinstance(a, (list, tuple)) and any(isinstance(x, Tensor) for x in a):
                return type(a)(fn(x) if isinstance(x, Tensor) else x for x in a)
            return a
        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    def _cross_entropy(self, input, target, *args, **kwargs):
        if input.dtype not in _LOW:
            return F.cross_entropy(input, target, *args, **kwargs)
        names = ("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
        kw = dict(zip(names, args), **kwargs)
        if kw.get("label_smoothing", 0.0) or kw.get("weight") is not None:
            return F.cross_entropy(input, target, *args, **kwargs)
        lsm = F.log_softmax(input, 1, dtype=input.dtype)
        return F.nll_loss(self.amp.fp32(lsm), target, ignore_index=kw.get("ignore_index", -100),
                          reduction=kw.get("reduction", "mean"))

    # -- kernels ----------------------------------------------------------------------------
    def dropout(self, input, p: float = 0.5, training: bool = True, inplace: bool = False):
        """``at::dropout`` as on CUDA: ``native_dropout`` for 0 < p < 1, the input itself otherwise."""
        if not training or p <= 0.0 or input.numel() == 0:
            return input
        if p >= 1.0:
            return F.dropout(input, p, training, inplace)
        out = torch.native_dropout(input, p, True)[0]
        return input.copy_(out) if inplace else out

    @staticmethod
    def grouped_mm(func, *args, **kwargs):
        """transformers' MoE experts (integrations/moe.py ``_grouped_mm``: ``grouped_mm(a, b, offs=offs)``)
        on a non-bf16 input on meta: the meta registration of ``_grouped_mm`` accepts bf16 only, CUDA
        runs its mm-loop fallback; :class:`~.moe._GroupedMMFallback` makes the same allocations (as the
        replica's :func:`~.moe.grouped_mm`). Any other call runs as it is."""
        a, offs = args[0], kwargs.get("offs")
        plain = all(v is None for k, v in kwargs.items() if k != "offs")  # no bias, no out_dtype
        if len(args) == 2 and plain and offs is not None and kernel_device(a) == "meta" and a.dtype != torch.bfloat16:
            from .blocks.moe import _GroupedMMFallback

            return _GroupedMMFallback.apply(a, args[1], offs)
        return func(*args, **kwargs)

    def sdpa(self, query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
             scale: Optional[float] = None, enable_gqa: bool = False):
        """The SDPA kernel CUDA's dispatcher picks (see the module docstring)."""
        if self.amp.active:  # scaled_dot_product_attention is on the lower-precision list
            query, key, value = self.amp.lp(query), self.amp.lp(key), self.amp.lp(value)
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = self.amp.lp(attn_mask)
        gqa = bool(enable_gqa) and key.shape[-3] != query.shape[-3]
        mask = attn_mask
        if mask is not None and mask.dtype == torch.bool:
            mask = bool_mask_to_additive(mask, query.dtype)
        kernel = choose_attention_kernel(self.profile.attention, query.dtype in _LOW, mask is not None, gqa)
        # DeepSeek MLA: q/k and v of different head dims (flash cannot run them; memcalc.engine.mla)
        kernel = mla_attention_kernel(kernel, query.shape[-1], value.shape[-1])
        self.calls.append((kernel, query.dtype, gqa, mask is not None))
        sc = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
        if kernel == "flash":
            return FlashAttention.apply(query, key, value, dropout_p, is_causal, sc)
        if kernel == "efficient":
            B, H, T, _ = query.shape
            bias = align_mask(mask, B, H, T, key.shape[-2]) if mask is not None else None
            return EfficientAttention.apply(query, key, value, bias, dropout_p, is_causal and mask is None, sc)
        return math_attention(query, key, value, mask, dropout_p, is_causal and mask is None, sc, gqa)


#: torch's grouped matmul entry points (F.grouped_mm from torch 2.9)
_GROUPED_MM = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f is not None)


# -- transformers' own code paths that cannot run on meta -----------------------------------
def _unpacked_sequences(original):
    def find_packed_sequence_indices(position_ids: torch.Tensor):
        if kernel_device(position_ids) != "meta":
            return original(position_ids)
        # the same ops as masking_utils.find_packed_sequence_indices; their answer is the one
        # unpacked data gives (every row counts 0, 1, 2, ...): no packing
        first = position_ids[:, :1] - 1
        (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        return None
    return find_packed_sequence_indices


def _autocast_enabled(original, mode: HFKernels):
    """``torch.is_autocast_enabled()`` (CUDA's, the no-argument form) answered as inside a CUDA autocast
    region while the emulated one is open: PEFT's quantized LoRA layers skip their dtype conversions
    then (peft/tuners/lora/bnb.py ``requires_conversion = not torch.is_autocast_enabled()``)."""
    def is_autocast_enabled(*args, **kwargs):
        device = args[0] if args else kwargs.get("device_type", "cuda")
        if device == "cuda" and mode.amp.active:
            return True
        return original(*args, **kwargs)
    return is_autocast_enabled


def _in_mode(fn, mode: TorchFunctionMode):
    """``fn`` run with ``mode`` active (it is not inside ``loss.backward()``, which the mode's own
    handler calls with the mode popped)."""
    def run(*a, **kw):
        if any(m is mode for m in _get_current_function_mode_stack()):
            return fn(*a, **kw)
        with mode:
            return fn(*a, **kw)
    return run


def _recompute_as_forward(func, mode: "HFKernels"):
    def checkpoint_func(function, *args, **kwargs):
        return func(_in_mode(mode.amp.wrap(function), mode), *args, **kwargs)
    return checkpoint_func


@contextlib.contextmanager
def hf_patches(model, mode: "HFKernels") -> Iterator[None]:
    """Packed-sequence detection answered on meta, and checkpoint recomputation run as its forward
    ran: with the kernel routing on and the autocast region re-entered (see the module docstring);
    undone on exit."""
    from transformers import masking_utils

    saved = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = _unpacked_sequences(saved)
    enabled = torch.is_autocast_enabled
    torch.is_autocast_enabled = _autocast_enabled(enabled, mode)
    wrapped = []
    for mod in model.modules():
        f = mod.__dict__.get("_gradient_checkpointing_func")
        if f is not None:
            mod._gradient_checkpointing_func = _recompute_as_forward(f, mode)
            wrapped.append((mod, f))
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved
        torch.is_autocast_enabled = enabled
        for mod, f in wrapped:
            mod._gradient_checkpointing_func = f

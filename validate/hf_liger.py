"""Liger-Kernel on the real Hugging Face step, traced on ``meta``: the library's Python runs
unmodified, only its Triton launches are no-ops and the device it asks about is CUDA's.

What the Trainer does (transformers 5.24 ``trainer.py`` ``Trainer.train``: ``if self.args.use_liger_kernel:
apply_liger_kernel(self.model, self.args.liger_kernel_config)``; ``integrations/liger.py``
``apply_liger_kernel``: ``_apply_liger_kernel_to_instance(model=unwrap_peft_model(model), **kernel_config)``)
is what :func:`apply_liger` does: liger_kernel 0.8.5 ``transformers/monkey_patch.py``
``_apply_liger_kernel_to_instance`` picks ``apply_liger_kernel_to_<model_type>`` and patches the instance
(``LigerRMSNorm.forward`` bound to each norm, ``LigerSwiGLUMLP`` / ``LigerGEGLUMLP`` forward to each MLP,
``lce_forward`` as the CausalLM's ``forward``) and the modeling module (``apply_rotary_pos_emb``, the norm
and MLP classes). The module-level patches are undone when the trace ends (:func:`liger_trace`), so a
later trace in the same process builds transformers' own model.

How the kernels run on ``meta`` (:func:`liger_trace`, all undone on exit):

- **Launches.** Every Triton launch is ``kernel[grid](...)``: ``triton.runtime.jit.KernelInterface.__getitem__``
  (``JITFunction`` and ``Autotuner`` inherit it) returns the launcher. It is replaced by one that returns a
  no-op, so the kernels write nothing; every buffer they write (``Y``, ``RSTD``, ``grad_input``, ...) is
  allocated by the library's Python before the launch, which is what is traced. This patches Triton,
  not liger_kernel: no line of the library's Python is changed or bypassed.
- **The device the library sees.** Liger's Python picks its buffers by device (fused_linear_cross_entropy.py
  ``_can_use_mm_out``: a preallocated ``(chunk, V)`` logits buffer and ``mm(out=)`` into ``grad_input`` on
  ``cuda``; ``addmm(out=grad_weight)`` on compute capability >= 8; rms_norm.py ``rms_norm_backward``:
  ``_dW`` of ``(sm_count, H)`` fp32 with the GPU's SM count). ``Tensor.device`` (a property of
  ``torch.Tensor``, which no function mode sees) answers ``cuda:0`` for a meta tensor when the caller is
  liger_kernel's own code (the calling frame's module); the ``device=cuda`` its factory calls then pass
  (``torch.zeros_like(_input, device=device)``, ``torch.empty(..., device=W.device)``) reaches
  :class:`MetaValues`, a ``TorchDispatchMode`` (active in backward too, unlike a function mode), as
  ``meta``, with ``torch.cuda._lazy_init`` (which such a call runs first) a no-op; ``torch.tensor``, which
  builds below the dispatch modes, gets ``meta`` for ``cuda`` from a wrapper;
  ``torch.cuda.get_device_capability`` / ``get_device_properties`` answer for the GPU of
  :data:`memcalc.core.liger.LIGER_GPU` (H100: sm90, 132 SMs) and ``torch.cuda.device`` is a no-op
  context. transformers and PEFT still see ``meta`` (their kernel choice is :mod:`.hf_kernels`').
- **Values.** ``.item()`` of a meta tensor (FLCE's ``target_mask.sum().item()``, a divisor) answers 1, and
  ``torch.equal`` (FLCE backward's ``grad_output == 1.0`` test, which only decides whether an in-place
  kernel runs) answers True: :class:`MetaValues`. Neither decides an allocation.

Which kernels apply per family is the estimator's rule too (:func:`memcalc.core.liger.liger_plan`);
:func:`check_liger` refuses a family outside it.
"""

from __future__ import annotations

import contextlib
import sys
from types import FrameType
from types import SimpleNamespace
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.errors import UserError
from memcalc.core.liger import LIGER_FAMILIES, LIGER_GPU, liger_kernel_config, liger_plan

#: the packages whose own code sees CUDA (liger_kernel: every op module and its transformers patches;
#: cut_cross_entropy: its kernels' launchers, traced the same way by validate/hf_cce.py)
_LIBRARIES = ("liger_kernel", "cut_cross_entropy")
_CUDA = torch.device("cuda", 0)


#: frames between the caller and the mode (another mode's handler re-dispatching the call)
_MODE_FRAMES = ("memcalc.validate", "validate.", "torch.overrides", "torch.utils._device")


def _from_library() -> bool:
    """The code asking is liger_kernel's (the first frame above the property and the function modes)."""
    f: Optional[FrameType] = sys._getframe(2)
    while f is not None and f.f_globals.get("__name__", "").startswith(_MODE_FRAMES):
        f = f.f_back
    return f is not None and f.f_globals.get("__name__", "").startswith(_LIBRARIES)


def _device(self) -> torch.device:
    """``Tensor.device`` while :func:`liger_trace` is active: ``cuda:0`` for a meta tensor asked by liger's code."""
    dev = _DEVICE.__get__(self)
    return _CUDA if dev.type == "meta" and _from_library() else dev


_DEVICE = torch._C.TensorBase.device


def _is_cuda(d) -> bool:
    return isinstance(d, (torch.device, str)) and torch.device(d).type == "cuda"


class MetaValues(TorchDispatchMode):
    """A factory's ``device=cuda`` (liger's code saw ``cuda:0``) is meta, and what a meta tensor's value would
    be where liger's Python reads one (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):  # a factory of liger's, given the cuda:0 it saw: meta
            kwargs = dict(kwargs, device=torch.device("meta"))
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return False if args[0].dtype == torch.bool else 1
        if func is torch.ops.aten.equal.default and args[0].device.type == "meta":
            return True
        if func is torch.ops.aten.nonzero.default and args[0].device.type == "meta":  # every element is nonzero
            return torch.empty((args[0].numel(), args[0].dim()), dtype=torch.int64, device="meta")  # (CCE's valids)
        return func(*args, **kwargs)


_TENSOR = torch.tensor


def _tensor(data, *args, **kwargs):
    """``torch.tensor`` builds its tensor below the dispatch modes: its ``device=cuda`` is made meta here."""
    if _is_cuda(kwargs.get("device")):
        kwargs = dict(kwargs, device="meta")
    return _TENSOR(data, *args, **kwargs)


def _noop_launch(self, grid):
    return lambda *args, **kwargs: None


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _modeling_modules(model_type: str) -> list:
    """The transformers modeling module ``apply_liger_kernel_to_<model_type>`` patches at module level."""
    import importlib

    return [importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")]


@contextlib.contextmanager
def liger_trace(model_type: str) -> Iterator[None]:
    """The launches no-ops, the CUDA view, the meta values; the modeling module's attributes restored on exit."""
    import triton.runtime.jit as jit  # type: ignore[import-untyped]

    mods = _modeling_modules(model_type)
    saved = [dict(m.__dict__) for m in mods]
    props = SimpleNamespace(multi_processor_count=LIGER_GPU.sm_count, major=LIGER_GPU.capability[0],
                            minor=LIGER_GPU.capability[1], name=LIGER_GPU.name)
    # torch.device("meta")'s mode knows its factories by identity (torch.utils._device._device_constructors, cached
    # at first use): fill the cache with the real torch.tensor before _tensor stands in for it
    torch.utils._device._device_constructors()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_patched(jit.KernelInterface, "__getitem__", _noop_launch))
            stack.enter_context(_patched(torch.Tensor, "device", property(_device)))
            stack.enter_context(_patched(torch.cuda, "get_device_capability", lambda *_a: LIGER_GPU.capability))
            stack.enter_context(_patched(torch.cuda, "get_device_properties", lambda *_a: props))
            stack.enter_context(_patched(torch.cuda, "device", lambda *_a: contextlib.nullcontext()))
            stack.enter_context(_patched(torch.cuda, "_lazy_init", lambda: None))
            stack.enter_context(_patched(torch, "tensor", _tensor))
            stack.enter_context(MetaValues())
            yield
    finally:
        for m, d in zip(mods, saved, strict=True):
            for k in [k for k in m.__dict__ if k not in d]:
                delattr(m, k)
            for k, v in d.items():
                if m.__dict__.get(k) is not v:
                    setattr(m, k, v)


def check_liger(exp, model_type: str) -> None:
    """A one-line UserError when Liger's kernels on this family are outside what memcalc models."""
    if model_type not in LIGER_FAMILIES:
        raise UserError(f"--kernels liger: model_type {model_type} is not modelled (liger_kernel's "
                        f"apply_liger_kernel_to_{model_type} differs); modelled: {', '.join(LIGER_FAMILIES)}")
    liger_plan(exp.model, exp.profile, exp.training)  # the estimator's rule refuses the same setups


def apply_liger(model, exp) -> None:
    """``transformers.integrations.liger.apply_liger_kernel(model, liger_kernel_config)``, as ``Trainer.train`` calls
    it, with the profile's Liger kernels as the config."""
    import logging

    from transformers.integrations.liger import apply_liger_kernel

    logging.getLogger("liger_kernel").setLevel(logging.ERROR)  # its optional-backend import notices
    apply_liger_kernel(model, liger_kernel_config(exp.model, exp.profile))

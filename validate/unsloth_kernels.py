"""Unsloth's LoRA kernels traced on meta: ``LoRA_QKV``, ``LoRA_W`` and ``LoRA_MLP`` of unsloth 2026.10.9
``unsloth/kernels/fast_lora.py``, unmodified, on one projection group of a 16-bit base; only their Triton launches
are no-ops (``triton.runtime.jit.KernelInterface.__getitem__``, as :mod:`memcalc.validate.hf_liger` does).

What cannot be traced and is not: the rest of Unsloth's step (its patched model forward, the offloading
checkpoint on CUDA streams, the torch.compile'd fused loss) and its 4-bit path (``fast_dequantize`` calls
bitsandbytes' CUDA kernels through ctypes on device-indexed global buffers). ``memcalc validate --framework
unsloth`` says so in one line (:data:`memcalc.core.unsloth.UNTRACED`).

Loading without a GPU: ``import unsloth`` takes its CPU fallback (unsloth/_cpu_init.py), whose model code is not
the CUDA path. So the packages ``unsloth``, ``unsloth.kernels`` and ``unsloth_zoo`` are entered as namespaces of
their installed directories (their ``__init__`` modules, which patch transformers and TRL, do not run) and the
kernel modules load from their own files, with three of Unsloth's own switches: ``UNSLOTH_ALLOW_CPU=1``
(unsloth/device_type.py ``get_device_type``: "Test-only CPU fallback: report 'cuda' so all cuda branches behave
identically") and ``UNSLOTH_IS_PRESENT=1`` (what ``unsloth/__init__.py`` sets before importing unsloth_zoo) and
``UNSLOTH_COMPILE_LOCATION`` (unsloth_zoo/compiler.py writes its cache there: a temporary folder, not the working
directory).

The measurement (:func:`trace_group`): X, the frozen base weights and the fp32 adapters exist before (Unsloth's
``prepare_model_for_training`` upcasts ``lora_A`` / ``lora_B`` to fp32); the Function's forward, then backward
from a gradient of each output allocated first; the live meta storages counted by
:class:`memcalc.validate.tracer.StorageTracer` (512-byte rounding, as the CUDA caching allocator).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import tempfile
import types
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

import torch

from .tracer import CUDA_ROUND_BYTES, StorageTracer, round_up

#: the groups traced: Unsloth's Function for each
GROUPS = ("qkv", "o", "mlp")


@dataclass(frozen=True)
class GroupTrace:
    """One Function's bytes above what existed before it (X, weights, adapters): ``saved_bytes`` what its
    forward leaves alive besides its outputs, ``forward_peak_bytes`` / ``backward_peak_bytes`` the highest
    live bytes in each pass (backward: above what existed when it started, the output gradients included)."""

    group: str
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int


def _namespace(name: str, path: str) -> None:
    """``name`` as a package of ``path`` whose ``__init__`` does not run."""
    if name in sys.modules:
        return
    m = types.ModuleType(name)
    m.__path__ = [path]
    m.__file__ = os.path.join(path, "__init__.py")
    m.__spec__ = importlib.util.spec_from_file_location(name, m.__file__, submodule_search_locations=[path])
    m._memcalc_namespace = True  # type: ignore[attr-defined]
    sys.modules[name] = m


def load_fast_lora() -> tuple[types.ModuleType, types.ModuleType]:
    """unsloth.kernels.fast_lora and unsloth.kernels.swiglu, loaded as the module docstring says; a one-line
    UserError when unsloth is not installed."""
    from memcalc.core.errors import UserError

    spec, zoo = importlib.util.find_spec("unsloth"), importlib.util.find_spec("unsloth_zoo")
    if spec is None or spec.origin is None or zoo is None or zoo.origin is None:
        raise UserError("tracing Unsloth's kernels needs unsloth: pip install 'memcalc[unsloth]' && pip install "
                        "--no-deps unsloth==2026.10.9 unsloth_zoo==2026.10.9")
    if "unsloth" in sys.modules and not getattr(sys.modules["unsloth"], "_memcalc_namespace", False):
        raise UserError("unsloth was imported whole (its CPU fallback): trace its kernels in a fresh process")
    os.environ.setdefault("UNSLOTH_ALLOW_CPU", "1")
    os.environ.setdefault("UNSLOTH_IS_PRESENT", "1")
    # unsloth_zoo/compiler.py writes its cache (moe_utils.py) under this folder, else ./unsloth_compiled_cache
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(tempfile.gettempdir(), "memcalc-unsloth-cache"))
    site = os.path.dirname(spec.origin)
    _namespace("unsloth", site)
    _namespace("unsloth.kernels", os.path.join(site, "kernels"))
    _namespace("unsloth_zoo", os.path.dirname(zoo.origin))
    return (importlib.import_module("unsloth.kernels.fast_lora"), importlib.import_module("unsloth.kernels.swiglu"))


@contextlib.contextmanager
def launches_off() -> Iterator[None]:
    """Every Triton launch ``kernel[grid](...)`` a no-op (the buffers are the Python's own allocations)."""
    import triton.runtime.jit as jit  # type: ignore[import-untyped]

    saved = jit.KernelInterface.__getitem__
    jit.KernelInterface.__getitem__ = lambda self, grid: (lambda *a, **k: None)
    try:
        yield
    finally:
        jit.KernelInterface.__getitem__ = saved


def _weights(shapes: list[tuple[int, int]], rank: int, dtype: torch.dtype) -> list[tuple[Any, ...]]:
    """(W, None, A, B, scale) per projection: a frozen 16-bit W (out, in), fp32 adapters A (rank, in), B (out,
    rank) that train (``get_lora_parameters`` returns ``lora_A.weight``, ``lora_B.weight``)."""
    meta = torch.device("meta")
    out = []
    for d_out, d_in in shapes:
        w = torch.empty(d_out, d_in, dtype=dtype, device=meta)
        a = torch.empty(rank, d_in, dtype=torch.float32, device=meta, requires_grad=True)
        b = torch.empty(d_out, rank, dtype=torch.float32, device=meta, requires_grad=True)
        out.append((w, None, a, b, 2.0))
    return out


def trace_group(group: str, rows: int, d_model: int, dims: tuple[int, ...], rank: int,
                dtype: torch.dtype = torch.bfloat16) -> GroupTrace:
    """Trace one of Unsloth's Functions on a (1, rows, d_model) input: ``qkv`` (dims: q, kv widths), ``o`` (dims:
    the input width), ``mlp`` (dims: d_ff)."""
    fast_lora, swiglu = load_fast_lora()
    meta = torch.device("meta")
    x = torch.empty(1, rows, dims[0] if group == "o" else d_model, dtype=dtype, device=meta, requires_grad=True)
    if group == "qkv":
        q, kv = dims
        ws = _weights([(q, d_model), (kv, d_model), (kv, d_model)], rank, dtype)

        def run() -> tuple[torch.Tensor, ...]:
            return tuple(fast_lora.LoRA_QKV.apply(x, *[v for w in ws for v in w], True))
    elif group == "o":
        ws = _weights([(d_model, dims[0])], rank, dtype)

        def run() -> tuple[torch.Tensor, ...]:
            return (fast_lora.LoRA_W.apply(x, *ws[0]),)
    elif group == "mlp":
        ff = dims[0]
        ws = _weights([(ff, d_model), (ff, d_model), (d_model, ff)], rank, dtype)

        def run() -> tuple[torch.Tensor, ...]:
            return (fast_lora.LoRA_MLP.apply(x, *[v for w in ws for v in w], swiglu.swiglu_fg_kernel,
                                              swiglu.swiglu_DWf_DW_dfg_kernel, True),)
    else:
        raise ValueError(f"unknown group {group!r}; valid: {', '.join(GROUPS)}")
    tracer = StorageTracer("meta")
    tracer.track([x, *[t for w in ws for t in w if isinstance(t, torch.Tensor)]])
    with launches_off(), tracer:
        base = tracer.current
        tracer.reset_peak()
        outs = run()
        after = tracer.current
        forward_peak = tracer.record.bytes - base
        out_bytes = sum(round_up(o.untyped_storage().nbytes(), CUDA_ROUND_BYTES) for o in outs)
        grads = [torch.empty_like(o) for o in outs]
        start = tracer.current
        tracer.reset_peak()
        torch.autograd.backward(list(outs), grads)
        backward_peak = tracer.record.bytes - start
    return GroupTrace(group, after - base - out_bytes, forward_peak, backward_peak)

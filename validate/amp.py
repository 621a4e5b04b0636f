"""Autocast, written out: ``torch.autocast`` does not act on ``meta`` tensors, so the model casts itself.

The rules follow aten/src/ATen/autocast_mode.{h,cpp} (CUDA lists):

- lower-precision ops (``linear``, ``matmul``, ``scaled_dot_product_attention``...) cast their
  floating inputs to the autocast dtype (:meth:`Amp.lp`);
- fp32 ops (``layer_norm``, ``pow``, ``rsqrt``, ``nll_loss``...) cast to fp32 (:meth:`Amp.fp32`);
- ``cached_cast``: a cast *to the autocast dtype* of an fp32 leaf that requires grad (a trainable
  parameter) is cached and reused until the outermost autocast region exits; frozen weights
  are cast afresh at every use (and then saved by the matmul that uses them);
- leaving the outermost region clears the cache (``decrement_nesting`` -> ``clear_cache``).

Activation checkpointing re-enters autocast for the recomputation
(``torch.utils.checkpoint`` saves the autocast state); :meth:`Amp.wrap` does the same.
With ``dtype=None`` every method is the identity. The casts are written out on every device,
CUDA included, so a CUDA measurement runs exactly the code that the meta trace runs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional

import torch

_LOW = (torch.float16, torch.bfloat16)


class Amp:
    """Autocast emulation for one model (see the module docstring)."""

    def __init__(self, dtype: Optional[torch.dtype] = None) -> None:
        self.dtype = dtype
        self.depth = 0
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def active(self) -> bool:
        return self.dtype is not None and self.depth > 0

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """An autocast region (``with torch.autocast(...)``); nesting as in autocast_mode.cpp."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._cache.clear()

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` re-entering the current autocast state when it runs (checkpoint recomputation)."""
        if not self.active:
            return fn

        @functools.wraps(fn)
        def run(*a, **kw):
            with self.region():
                return fn(*a, **kw)

        return run

    def lp(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``cached_cast(lower_precision_fp, t)``."""
        if t is None or not self.active or not t.is_floating_point() or t.dtype in (self.dtype, torch.float64):
            return t
        if t.dtype == torch.float32 and t.is_leaf and t.requires_grad:
            hit = self._cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            c = t.to(self.dtype)
            self._cache[id(t)] = (t, c)
            return c
        return t.to(self.dtype)

    def fp32(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``cached_cast(at::kFloat, t)`` (never cached: the cache holds lower-precision casts only)."""
        if t is None or not self.active or t.dtype not in _LOW:
            return t
        return t.to(torch.float32)

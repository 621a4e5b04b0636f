"""Whose kernels the model code takes for a tensor: ``kernel_device(t)``.

The model code picks the kernel CUDA would run when it sees a ``meta`` tensor (``attention.py``,
``layers.py``, ``moe.py``), a math fallback on ``cpu``. A sharded trace (``sharded/``) runs on
*fake* tensors on the ``cpu`` device (FSDP2 and the fake process group need a real device type,
``torch/distributed/fsdp/_fully_shard/_fsdp_init.py`` ``_get_device_from_mesh``); inside
:func:`fake_as_meta` such a tensor counts as ``meta`` here, so the same CUDA kernels are chosen
(a fake tensor runs every op through its meta kernel anyway). Outside it (the default) nothing
changes: real CPU tensors, and fake ones in the guard test that compares fake with real, take the
CPU path.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

_FAKE_AS_META = [False]


@contextlib.contextmanager
def fake_as_meta(on: bool = True) -> Iterator[None]:
    """Within this block, fake ``cpu`` tensors choose the kernels of ``meta`` ones (see the module docstring)."""
    saved = _FAKE_AS_META[0]
    _FAKE_AS_META[0] = on
    try:
        yield
    finally:
        _FAKE_AS_META[0] = saved


def _as_meta(t: torch.Tensor) -> bool:
    t = getattr(t, "_local_tensor", t)  # a DTensor (tensor parallelism): its local shard decides
    return _FAKE_AS_META[0] and t.device.type == "cpu" and isinstance(t, FakeTensor)


def kernel_device(t: torch.Tensor) -> str:
    """The device type whose kernel choice applies to ``t``."""
    return "meta" if _as_meta(t) else t.device.type


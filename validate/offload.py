"""Activation offloading on any device: torchtune's ``OffloadActivations`` as saved-tensor hooks.

The twin of :mod:`memcalc.engine.offload`, following torchtune
``torchtune/training/_activation_offloading.py`` (``OffloadActivations`` with its defaults:
``use_streams=True``, ``max_fwd_stash_size=5``, ``min_offload_size=1024``; ``NoOpManager``
around the output head, as ``get_act_offloading_ctx_manager`` does). On ``meta`` (and ``cpu``)
there is no host to copy to: packing a tensor keeps only its shape, strides and dtype (the
"host copy", counted in :attr:`host_bytes`), so the device storage is freed as soon as Python
and the forward stash let go of it; unpacking allocates a new device tensor of the same layout
(the copy brought back), held in the backward stash until the node after the next reloading
node has run, as ``unpack_tensor_with_streams`` does. On CUDA the same hooks run without the
host copy (a measured run counts the device side only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memcalc.core.kernels import pinned_bytes
from memcalc.core.rules import MAX_FWD_STASH, MIN_OFFLOAD_BYTES


class OffloadActivations:
    """Enter around the model's forward (``with offload:``); not around the head or the loss."""

    def __init__(self) -> None:
        self.tracker: dict[int, tuple[object, bool]] = {}
        self.tensor_id = 0
        self.fwd_stash: dict[int, torch.Tensor] = {}
        self.bwd_stash: dict[int, torch.Tensor] = {}
        self.curr_node = None
        self.first_backward_call = True
        self.host_bytes = 0
        self.pinned_bytes = 0
        self.tensors = 0
        self.max_host_bytes = self.max_pinned_bytes = self.max_tensors = 0
        self._hooks = None

    def __enter__(self) -> "OffloadActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self._hooks.__exit__(*exc)
        self._hooks = None
        return False

    def close(self) -> None:
        """Leave the context if inside it (the output head's pre-hook: the head and the loss keep
        their saved tensors on the device)."""
        if self._hooks is not None:
            self.__exit__(None, None, None)

    def pack(self, t: torch.Tensor) -> int:
        """``pack_tensor``: offload what is big enough and no parameter/buffer instance."""
        if not self.first_backward_call:  # a new forward after a backward
            self.first_backward_call = True
        self.tensor_id += 1
        tid = self.tensor_id
        n = t.element_size() * t.nelement()
        if n >= MIN_OFFLOAD_BYTES and not isinstance(t, (nn.Parameter, nn.Buffer)):
            for k in list(self.fwd_stash):
                if k <= tid - MAX_FWD_STASH:
                    del self.fwd_stash[k]
                else:
                    break
            self.tracker[tid] = (_layout(t), True)
            self.fwd_stash[tid] = t
            self.host_bytes += n
            self.pinned_bytes += pinned_bytes(n)
            self.tensors += 1
            self.max_host_bytes = max(self.max_host_bytes, self.host_bytes)
            self.max_pinned_bytes = max(self.max_pinned_bytes, self.pinned_bytes)
            self.max_tensors = max(self.max_tensors, self.tensors)
        else:
            self.tracker[tid] = (t, False)
        return tid

    def unpack(self, tid: int) -> torch.Tensor:
        """``unpack_tensor_with_streams``: bring it back, keep it until the next node's hook."""
        if self.first_backward_call:
            self.first_backward_call = False
            self.curr_node = None
            self.host_bytes = self.pinned_bytes = self.tensors = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        val, modified = self.tracker.pop(tid)
        if not modified:
            return val  # type: ignore[return-value]
        node = torch._C._current_autograd_node()
        prev: list[int] = []
        if self.curr_node is not node:
            self.curr_node = node
            prev = list(self.bwd_stash)
        if tid in self.fwd_stash:
            out = self.fwd_stash[tid]
        else:
            out = _reloaded(val)
            self.bwd_stash[tid] = out

        def hook(outputs, inputs):
            self.fwd_stash.clear()
            for k in prev:
                self.bwd_stash.pop(k, None)
            return None

        node.register_hook(hook)
        return out

    def _end(self) -> None:
        self.bwd_stash.clear()
        self.fwd_stash.clear()


def _layout(t: torch.Tensor) -> tuple:
    """What the "host copy" keeps: shape, strides, dtype and device; of a DTensor (tensor
    parallelism saves them), its local shard's and its mesh, placements and global shape and
    strides (torchtune's ``torch.empty_like(activation, device="cpu")`` of a DTensor is a DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = t.to_local()
        dist = (t.device_mesh, t.placements, t.shape, t.stride())
        return (local.shape, local.stride(), local.dtype, local.device, dist)
    return (t.shape, t.stride(), t.dtype, t.device, None)


def _reloaded(layout: Any) -> torch.Tensor:
    """The copy brought back (``.to("cuda")``): a new device tensor of the same layout (a DTensor
    over a new local shard where the saved tensor was one)."""
    shape, stride, dtype, device, dist = layout
    out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if dist is None:
        return out
    from torch.distributed.tensor import DTensor

    mesh, placements, gshape, gstride = dist
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=gshape, stride=gstride)

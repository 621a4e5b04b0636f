"""The allocations of one rank of a sharded step, counted as :class:`~..tracer.StorageTracer` counts one GPU.

A sharded step runs on fake tensors on the ``cpu`` device (``fake_dist.py``); this tracer
counts every storage an op returns on that device, rounded to 512 bytes like the CUDA caching
allocator (``tracer.py``), plus three things a sharded step needs beyond the plain tracer:

- **``UntypedStorage.resize_``**: FSDP2 allocates and frees its unsharded parameters by resizing
  the storage of each all-gather output (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``
  ``alloc_storage`` / ``free_storage``, called from ``FSDPParam.init_all_gather_outputs``,
  ``FSDPParam.free_unsharded_param`` and ``FSDPParamGroup._to_unsharded``); FSDP1 does the same
  with its flat parameter (``torch/distributed/fsdp/_flat_param.py`` ``_alloc_storage`` /
  ``_free_storage``). ``resize_`` is a storage method, not an op, so no dispatch mode sees it:
  while active, the tracer wraps it (chaining whatever wrapper is already installed, such as
  ``torch.distributed._tools.mem_tracker.MemTracker._track_resize``) and moves a counted
  storage's bytes to its new size.
- **DTensors count by their local shard.** A DTensor (a sharded parameter, its gradient, the
  optimizer state made by ``zeros_like`` on it) is a wrapper whose ``untyped_storage()`` reports
  the *global* size; what the rank holds is ``_local_tensor``.
- **The device is the tensor's**, not the storage's: a fake tensor's storage says ``meta``.

What is not counted, and why:

- DTensor's sharding propagation (``torch/distributed/tensor/_sharding_prop.py``
  ``_propagate_tensor_meta_non_cached``) runs each new op once on full-size fake tensors to learn
  the output's shape. It runs inside DTensor's own ``__torch_dispatch__``, below this mode, so
  none of those temporaries reach :meth:`__torch_dispatch__` (``FSDPMemTracker``, which sees them
  through its own hooks, counts them in step 1). Only the DTensor-level op output is counted, by
  its local shard.
- ``aten.lift_fresh`` outputs: ``torch.tensor(x)`` data made on the host (AdamW's ``step``
  counters when not capturable, ``torch/optim/adamw.py`` ``_init_group``); on a GPU they stay in
  host memory.

Labels: the runner sets ``phase`` (forward, backward, optimizer step) and the model sets
``label`` (``layer 3``, ``head & loss``); FSDP wraps its work in
``torch.profiler.record_function`` scopes (``FSDP::all_gather``, ``FSDP::post_backward_reduce``
... in ``_fsdp_param_group.py``), whose enter/exit are dispatcher ops
(``profiler::_record_function_enter_new`` / ``_record_function_exit``): the innermost open scope
is kept in ``scope`` and recorded with every event. ``timeline`` (a list, or None) receives
``(event, label, bytes, live_bytes, storage id, op)`` for every allocation, free and resize
(the id is the same for one storage's alloc, resizes and free within a recording).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from memcalc.core.units import round_up

from ..interrupt import check as _check_stop
from ..tracer import CUDA_ROUND_BYTES, StorageTracer, for_each_output

_ENTER = "profiler._record_function_enter_new"
_EXIT = "profiler._record_function_exit"
#: ops whose outputs live on the host on a GPU (see the module docstring)
_HOST_OPS = ("aten.lift_fresh.default", "aten.lift_fresh_copy.default")

#: FSDP's record_function names -> the event names of the timeline (``_fsdp_param_group.py``,
#: ``_fsdp_state.py``; FSDP1: ``_runtime_utils.py``)
SCOPES = (
    ("all_gather_copy_out", "all-gather copy-out"),
    ("all_gather", "all-gather"),
    ("_prefetch", "all-gather (prefetch)"),
    ("post_backward_reduce", "reduce-scatter"),
    ("post_backward_reshard", "reshard"),
    ("post_backward_accumulate", "grad accumulate"),
    ("post_backward", "post-backward"),
    ("pre_backward", "pre-backward (unshard)"),
    ("pre_forward", "pre-forward (unshard)"),
    ("post_forward", "post-forward (reshard)"),
    ("root_post_backward", "root post-backward"),
    ("root_pre_forward", "root pre-forward"),
)


def scope_event(name: str) -> str:
    """The timeline's name for an FSDP ``record_function`` scope (the raw name when unknown)."""
    for key, event in SCOPES:
        if key in name:
            return event
    return name.replace("FSDP::", "").split(" (")[0]


class RankTracer(StorageTracer):
    """Counts live storages of one rank on ``device_type`` (see the module docstring)."""

    def __init__(self, device_type: str = "cpu", round_bytes: int = CUDA_ROUND_BYTES, debug: bool = False) -> None:
        super().__init__(device_type, round_bytes, debug=debug)
        self.scopes: list[tuple[int, str]] = []  # (0, name) of each open record_function scope
        #: ``(event, label, bytes, live_bytes, storage id, op)`` while recording (see ``runner.trace_rank``)
        self.timeline: Optional[list[tuple[str, str, int, int, int, str]]] = None
        self._ids: dict[int, int] = {}
        self._next_id = 0
        self._saved_resize = None
        #: resizes of storages the tracer never saw made (diagnostic: should stay 0)
        self.unknown_resizes = 0

    # -- labels -------------------------------------------------------------------------
    @property
    def scope(self) -> str:
        return self.scopes[-1][1] if self.scopes else ""

    def where(self) -> str:
        """``phase label [fsdp scope]`` of the current moment."""
        out = f"{self.phase} {self.label}".strip()
        return f"{out} [{scope_event(self.scope)}]" if self.scopes else out

    def _event(self, kind: str, nbytes: int, key: int) -> None:
        if self.timeline is not None:
            if key not in self._ids:
                self._ids[key] = self._next_id
                self._next_id += 1
            sid = self._ids[key]
            op = {"free": "", "resize": "UntypedStorage.resize_"}.get(kind, self._op)
            self.timeline.append((kind, self.where(), nbytes, self.current, sid, op))

    # -- accounting -------------------------------------------------------------------
    def _free(self, key: int, _ref: weakref.ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
            if entry[0]:
                self._event("free", -entry[0], key)
            self._ids.pop(key, None)  # an address can be reused by a later storage: a new id then

    def _peak_check(self) -> None:
        rec = self.record
        if self.current > rec.phase_peaks.get(self.phase, -1):
            rec.phase_peaks[self.phase] = self.current
        if self.current > rec.bytes:
            rec.bytes = self.current
            rec.phase = self.phase
            rec.label = self.where()[len(self.phase):].strip()
            if self.debug:
                self.peak_live = [(e[0], self._origin.get(k, "?"), "") for k, e in self._live.items()]

    def _add(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if t.device.type != self.device_type:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        nbytes = round_up(st.nbytes(), self.round_bytes)
        self._live[key] = (nbytes, weakref.ref(st, lambda r, k=key: self._free(k, r)), None)
        self.current += nbytes
        if self.debug:
            self._origin[key] = f"{self._op} @ {self.where()}"
        if nbytes:
            self._event("alloc", nbytes, key)
        self._peak_check()

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._live.get(st._cdata)
        if entry is None:
            if st.nbytes():
                self.unknown_resizes += 1
            return
        nbytes = round_up(st.nbytes(), self.round_bytes)
        delta = nbytes - entry[0]
        if not delta:
            return
        self._live[st._cdata] = (nbytes, entry[1], entry[2])
        self.current += delta
        self._event("resize", delta, st._cdata)
        if delta > 0:
            self._peak_check()

    # -- resize_ ------------------------------------------------------------------------
    def __enter__(self):
        inner = torch.UntypedStorage.resize_
        self._saved_resize = inner
        tracer = self

        def resize_(st, size):  # chains the wrapper (or the method) that was installed before
            out = inner(st, size)
            tracer._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._saved_resize  # type: ignore[method-assign]

    # -- dispatch ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _check_stop()
        name = str(func)
        self._op = name
        out = func(*args, **(kwargs or {}))
        if name.startswith(_ENTER):
            self.scopes.append((0, str(args[0])))
            return out
        if name.startswith(_EXIT):  # the scopes are ``with`` blocks: the last one opened closes
            if self.scopes:
                self.scopes.pop()
            return out
        if name in _HOST_OPS:
            return out
        for_each_output(out, self._add)
        return out


def local_tensors(tensors) -> list[torch.Tensor]:
    """The tensors a rank holds for ``tensors``: a DTensor's local shard, others as they are."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors if isinstance(t, torch.Tensor)]

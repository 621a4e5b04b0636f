"""A lean allocation tracker: live storages on one device, rounded like the CUDA caching allocator.

What is counted: every *untyped storage* on the traced device (``meta`` or ``cpu``)
that an op returns while :class:`StorageTracer` is active, plus every tensor
registered with :meth:`StorageTracer.track` before the step (weights, optimizer
state, inputs: they exist before the step starts, as on the GPU). A storage is
counted once however many views share it, at ``nbytes`` rounded up to
``round_bytes`` (512: ``kMinBlockSize`` of c10/cuda/CUDACachingAllocator.cpp,
which is also what ``torch.cuda.max_memory_allocated`` sums); a zero-byte
storage costs nothing (CUDA allocates nothing for it). A storage stops counting
when its StorageImpl dies: PyTorch keeps one Python object per live StorageImpl,
so a weakref finalizer on it fires exactly at the free.

Only op *outputs* are seen: the dispatch mode sits below autograd, so every
tensor autograd saves, every gradient the engine allocates and every optimizer
temporary is an op output. Scratch buffers a CUDA kernel allocates and frees
inside one call (cuBLAS workspace, attention ``delta``) are invisible here; the
model code emulates the ones that matter (see ``attention.py``).

The rounded sum is the estimator's model of ``max_memory_allocated``. The allocator itself can
hand out a block up to 1 MiB larger than the request (it does not split a cached block for a
small remainder); pass ``allocator=CachingAllocatorSim()`` to replay that too (allocator.py).

Unlike ``torch.distributed._tools.mem_tracker.MemTracker`` this needs no module
or gradient hooks, so frozen parameters (LoRA) and parameters created before
tracing are fine.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.kernels import ALLOCATOR_ROUND_BYTES
from memcalc.core.units import round_up  # noqa: F401  (re-exported: the tracer's rounding)

from .interrupt import check as _check_stop

#: c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, every block is a multiple of it (one
#: constant with the estimator: memcalc.core.kernels). ``round_up`` keeps 0 at 0.
CUDA_ROUND_BYTES = ALLOCATOR_ROUND_BYTES


@dataclass
class PeakRecord:
    """The maximum seen since the last :meth:`StorageTracer.reset_peak`."""

    bytes: int = 0
    phase: str = ""
    label: str = ""
    phase_peaks: dict[str, int] = field(default_factory=dict)


class StorageTracer(TorchDispatchMode):
    """Counts live storages of ``device_type`` (see the module docstring).

    ``phase`` and ``label`` are set by the runner (``forward``, ``backward``,
    ``optimizer step``; ``layer 3``...) and recorded at the maximum.
    """

    def __init__(self, device_type: str = "meta", round_bytes: int = CUDA_ROUND_BYTES, debug: bool = False,
                 allocator: Optional[CachingAllocatorSim] = None) -> None:
        super().__init__()
        #: optional replay of the CUDA caching allocator (block sizes, segments); see allocator.py
        self.allocator = allocator
        #: debug: remember which op made each storage, and what was alive at the peak
        self.debug = debug
        self._origin: dict[int, str] = {}
        self._op = "baseline"
        self.peak_live: list[tuple[int, str, str]] = []
        self.device_type = device_type
        self.round_bytes = round_bytes
        self._live: dict[int, tuple[int, weakref.ref, object]] = {}
        #: storages marked as host memory (:meth:`mark_host`): not device bytes; their raw bytes live and at most
        self._host: dict[int, tuple[int, weakref.ref]] = {}
        self.host_current = 0
        self.host_peak = 0
        self.current = 0
        self.phase = "setup"
        self.label = ""
        self.record = PeakRecord()
        #: hears every counted allocation and free, and the phases (.snapshot_trace.TraceRecorder:
        #: ``validate --device meta --snapshot``); None: nobody listens
        self.recorder: Optional[Any] = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let ``torch.compile`` run under the tracer (a validator's per-layer compile on meta):
        dynamo otherwise skips every frame while a dispatch mode is on the stack
        (torch/_dynamo/convert_frame.py, "non-infra torch dispatch mode present"); with this the
        mode is off while dynamo and AOTAutograd compile and on while the compiled graphs run
        (torch/utils/_python_dispatch.py ``TorchDispatchMode.ignore_compile_internals``), so what
        the compiled code allocates is counted and the compiler's own fake tensors are not."""
        return True

    # -- accounting -------------------------------------------------------------------
    def _free(self, key: int, _ref: weakref.ref) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
            if self.allocator is not None:
                self.allocator.free(entry[2])
            if self.recorder is not None:
                self.recorder.on_free(key)

    def mark_host(self, t: torch.Tensor) -> None:
        """``t``'s storage is host memory (a pinned buffer where the traced device is the host too, as on
        DeepSpeed's CPU accelerator): it leaves the device count, its raw bytes count as host bytes until
        it dies, and views of it are never counted as device storages."""
        st = t.untyped_storage()
        key = st._cdata
        if key in self._host:
            return
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
            if self.recorder is not None:
                self.recorder.on_free(key)
        def dead(_ref: weakref.ref, k: int = key) -> None:
            self._free_host(k)

        self._host[key] = (st.nbytes(), weakref.ref(st, dead))
        self.host_current += st.nbytes()
        self.host_peak = max(self.host_peak, self.host_current)

    def is_host(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self._host

    def _free_host(self, key: int) -> None:
        entry = self._host.pop(key, None)
        if entry is not None:
            self.host_current -= entry[0]

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live or key in self._host:
            return
        raw = st.nbytes()
        nbytes = round_up(raw, self.round_bytes)
        block = self.allocator.malloc(raw) if self.allocator is not None else None
        self._live[key] = (nbytes, weakref.ref(st, lambda r, k=key: self._free(k, r)), block)
        self.current += nbytes
        if self.recorder is not None:
            self.recorder.on_alloc(key, raw, self._op, self.label)
        if self.debug:
            self._origin[key] = f"{self._op} @ {self.phase}/{self.label}"
        rec = self.record
        if self.current > rec.phase_peaks.get(self.phase, -1):
            rec.phase_peaks[self.phase] = self.current
        if self.current > rec.bytes:
            rec.bytes = self.current
            rec.phase = self.phase
            rec.label = self.label
            if self.debug:
                self.peak_live = [(e[0], self._origin.get(k, "?"), "") for k, e in self._live.items()]

    def track(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Count tensors that already exist (weights, optimizer state, the batch)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)

    def reset_peak(self) -> None:
        """Start a new maximum from what is alive now (``torch.cuda.reset_peak_memory_stats``)."""
        self.record = PeakRecord(self.current, self.phase, self.label, {self.phase: self.current})
        if self.allocator is not None:
            self.allocator.reset_peak()

    def set_phase(self, phase: str, label: str = "") -> None:
        if self.recorder is not None:
            self.recorder.on_phase(phase)
        self.phase = phase
        self.label = label
        if self.current > self.record.phase_peaks.get(phase, -1):
            self.record.phase_peaks[phase] = self.current

    @property
    def live_storages(self) -> int:
        return len(self._live)

    # -- dispatch ---------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _check_stop()  # a safe point for SIGINT/SIGTERM (interrupt.py): never inside a finalizer
        if self.debug or self.recorder is not None:
            self._op = str(func)
        out = func(*args, **(kwargs or {}))
        for_each_output(out, self._add)
        return out


def for_each_output(out, add) -> None:
    """Call ``add`` on every tensor an op returned: a tensor, or tensors in a (nested, two deep)
    tuple or list, as ATen ops return them."""
    if isinstance(out, torch.Tensor):
        add(out)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                add(o)
            elif isinstance(o, (tuple, list)):
                for oo in o:
                    if isinstance(oo, torch.Tensor):
                        add(oo)


def tensors_of_optimizer(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (moments, factored rows/columns, step counters)."""
    out: list[torch.Tensor] = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out

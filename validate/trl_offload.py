"""TRL's own activation offloading run unmodified on ``meta``: what has no meaning there, answered.

``SFTConfig(activation_offloading=True)`` makes ``SFTTrainer.__init__`` call
``get_act_offloading_ctx_manager(model=self.model)`` (trl 1.16.0 trl/trainer/sft_trainer.py) and
``training_step`` run ``with self.maybe_activation_offload_context:`` around the forward, the loss and
the backward. That manager (trl/models/activation_offloading.py ``OffloadActivations``, the defaults:
``use_pin_memory=True``, ``use_streams=True``, ``min_offload_size=1024``, ``max_fwd_stash_size=5``) runs
here as it is, class and function; only these are answered (:class:`MetaOffload`):

- **storage addresses**: on ``meta`` every ``untyped_storage().data_ptr()`` is 0, which would make TRL's
  storage dedup (``_get_unique_tensor_key``: ``data_ptr() + storage_offset()``, ``dtype``) see one storage
  and its parameter filter (``update_model_params``: ``param_storages`` of non-zero pointers) see none.
  :class:`StorageIds` gives each meta storage a stable id while it lives (assigned at its first query,
  dropped by a weakref finalizer when the ``StorageImpl`` dies, spaced 2**40 apart so that an element offset
  never reaches the next storage's id), as a device address is stable for the storage's life;
- **the accelerator**: a CPU build has none (``torch.accelerator.current_accelerator()`` is None): while
  the manager is built it is ``meta`` (so meta activations count as on the device: ``activation.device.type
  != self.accelerator_type`` would keep them all) and ``torch.get_device_module("meta")`` is
  :class:`_Streams`: streams whose ``wait_stream`` / ``record_event`` / ``wait_event`` / ``synchronize`` do
  nothing (the trace is synchronous: a copy is done when issued), ``stream(s)`` a null context,
  ``empty_cache`` nothing (it moves reserved memory, never allocated);
- **host copies** (:class:`HostCopies`, a dispatch mode): the pinned buffer of a pack
  (``torch.empty_like(activation, pin_memory=True, device="cpu")``, or ``torch.empty(n, pin_memory=True,
  device="cpu")`` for a broadcast's storage) is a CPU tensor of that shape over one element (no host RAM;
  pinning needs an accelerator), its raw bytes counted as pinned host memory (rounded as the caching host
  allocator does, :func:`memcalc.core.kernels.pinned_bytes`) until it dies; ``copy_`` from meta into it
  does nothing (there is no data); unpacking's ``.to("meta")`` is the ordinary ``_to_copy``: a new meta
  tensor of the host copy's (contiguous) layout, which the tracer counts; ``record_stream`` (the caching
  allocator's cross-stream bookkeeping) does nothing: its free then comes when Python lets go, as every
  free in the trace does (the meta-trace pitfalls note says the same of FSDP1's).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.kernels import pinned_bytes

#: the spacing of two storages' ids: TRL adds ``storage_offset()`` (elements) to ``data_ptr()``
ID_STRIDE = 1 << 40


class StorageIds:
    """A stable id per live meta storage (see the module docstring)."""

    def __init__(self) -> None:
        self._ids: dict[int, tuple[int, weakref.ref]] = {}
        self._next = 0

    def _forget(self, key: int) -> Callable[[weakref.ref], None]:
        def drop(_ref: weakref.ref) -> None:
            self._ids.pop(key, None)
        return drop

    def of(self, st: torch.UntypedStorage) -> int:
        key = st._cdata
        entry = self._ids.get(key)
        if entry is None:
            self._next += 1
            entry = (self._next * ID_STRIDE, weakref.ref(st, self._forget(key)))
            self._ids[key] = entry
        return entry[0]


class _Stream(torch.Stream):
    """A stream on a synchronous device: nothing to wait for, no event to record."""

    def wait_stream(self, stream) -> None:  # type: ignore[override]
        return None

    def record_event(self, event=None) -> None:  # type: ignore[override]
        return None

    def wait_event(self, event) -> None:  # type: ignore[override]
        return None

    def synchronize(self) -> None:  # type: ignore[override]
        return None


class _Streams:
    """``torch.get_device_module("meta")`` as ``OffloadActivations`` uses it (``Stream``,
    ``current_stream``, ``stream``, ``empty_cache``); one compute stream."""

    def __init__(self) -> None:
        self.compute = _Stream(device="cpu")

    def Stream(self) -> _Stream:  # torch.cuda.Stream's name
        return _Stream(device="cpu")

    def current_stream(self) -> _Stream:
        return self.compute

    def stream(self, _stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        return None

    def empty_cache(self) -> None:
        return None


class HostCopies(TorchDispatchMode):
    """The pinned host copies of the packs (see the module docstring): counted, never allocated."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        self.pinned_bytes = 0
        self.max_pinned_bytes = 0

    def _host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty((), dtype=dtype).expand(shape)
        st, n = t.untyped_storage(), pinned_bytes(t.numel() * t.element_size())
        key = st._cdata
        self._live[key] = (n, weakref.ref(st, self._release(key)))
        self.pinned_bytes += n
        self.max_pinned_bytes = max(self.max_pinned_bytes, self.pinned_bytes)
        return t

    def _release(self, key: int) -> Callable[[weakref.ref], None]:
        def free(_ref: weakref.ref) -> None:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.pinned_bytes -= entry[0]
        return free

    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage()._cdata in self._live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if kwargs.get("pin_memory") and torch.device(kwargs.get("device") or "cpu").type == "cpu":
            if func is aten.empty_like.default:
                src = args[0]
                if not src.is_contiguous():  # TRL makes every packed activation contiguous first
                    raise RuntimeError("a pinned host copy of a non-contiguous tensor is not answered on meta")
                return self._host(src.shape, kwargs.get("dtype") or src.dtype)
            if func is aten.empty.memory_format:
                return self._host(args[0], kwargs.get("dtype") or torch.get_default_dtype())
        if func is aten.copy_.default and self._is_host(args[0]) and args[1].device.type == "meta":
            return args[0]
        if func is aten.record_stream.default and args[0].device.type == "meta":
            return None
        return func(*args, **kwargs)


class MetaOffload:
    """One harness's answers for TRL's ``OffloadActivations`` on meta: :meth:`build` it, and run the step
    under :meth:`patches` (the storage ids and the host copies)."""

    def __init__(self) -> None:
        self.ids = StorageIds()
        self.host = HostCopies()
        self.streams = _Streams()

    @contextlib.contextmanager
    def storage_ids(self) -> Iterator[None]:
        """``UntypedStorage.data_ptr`` of a meta storage is its :class:`StorageIds` id; undone on exit."""
        saved = torch.UntypedStorage.data_ptr
        ids = self.ids

        def data_ptr(st: torch.UntypedStorage) -> int:
            return ids.of(st) if st.device.type == "meta" else saved(st)

        torch.UntypedStorage.data_ptr = data_ptr  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            torch.UntypedStorage.data_ptr = saved  # type: ignore[method-assign]

    def build(self, model):
        """``get_act_offloading_ctx_manager(model=model)`` as ``SFTTrainer.__init__`` calls it, with the
        accelerator ``meta`` and its device module :class:`_Streams` while it is built."""
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        current, get_module = torch.accelerator.current_accelerator, torch.get_device_module

        def device_module(device=None):
            return self.streams if str(device) == "meta" else get_module(device)

        torch.accelerator.current_accelerator = lambda *a, **kw: torch.device("meta")  # type: ignore[assignment]
        torch.get_device_module = device_module  # type: ignore[assignment]
        try:
            with self.storage_ids():
                return get_act_offloading_ctx_manager(model=model)
        finally:
            torch.accelerator.current_accelerator = current  # type: ignore[assignment]
            torch.get_device_module = get_module  # type: ignore[assignment]

    @contextlib.contextmanager
    def patches(self) -> Iterator[None]:
        """The step's answers: storage ids and the host copies (a dispatch mode)."""
        with self.storage_ids(), self.host:
            yield

"""The meta-device tracer's step as a PyTorch CUDA memory snapshot (``validate --device meta --snapshot``).

:class:`TraceRecorder` hears every storage :class:`.tracer.StorageTracer` counts (its ``recorder``):
each is replayed through the caching allocator model by a
:class:`memcalc.snapshot.builder.SnapshotBuilder` (addresses, blocks, segments, as a CUDA device would
give them) from the first tracked tensor on, and enters the trace from :meth:`TraceRecorder.start` on
(called where ``_record_memory_history`` starts on CUDA: before the first step, ``validate/step.py``
``run_on_device``), so the file is what ``torch.cuda.memory._dump_snapshot`` writes after the second
(measured) step on a GPU
(:mod:`memcalc.snapshot.format`), the bytes requested being the storages' ``nbytes``.

Each allocation's first frame is memcalc's (:func:`memcalc.snapshot.format.memcalc_frames`): its kind
decided from where it was made and how long it lived, as the step runs it (``validate/step.py``
``train_step``):

- tracked before the step: ``weights`` (parameters, buffers, a quantized base's state), the batch
  ``activations`` (memcalc counts the inputs there), fp32 master weights ``optimizer_state``;
- made in ``forward``: ``activations`` when still alive as the phase ends (what autograd saved for
  backward; the logits and the loss too, which memcalc counts as temporaries), else ``temporaries``;
- made in ``backward``: ``gradients`` when it is a trainable parameter's ``.grad`` as backward ends
  (AccumulateGrad's), else ``temporaries`` (activation gradients, a checkpoint's recompute);
- made in the ``optimizer step``: ``optimizer_state`` when it outlives the phase (the state
  ``torch.optim`` creates on the first step), else ``temporaries``.

The label is the op that made it (``aten.mm.default``) with the harness's label (``layer 3``), or the
parameter's name; the layer is the harness's ``layer <i>`` label or the name's ``layers.<i>.``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Optional

import torch

from memcalc.snapshot.builder import SnapshotBuilder
from memcalc.snapshot.format import memcalc_frames, write_snapshot

_LAYER = re.compile(r"(?:^|\.)layers?[ .](\d+)(?:\.|$)|^layer (\d+)")


def _layer_of(text: str) -> Optional[int]:
    m = _LAYER.search(text)
    return int(m.group(1) or m.group(2)) if m else None


class TraceRecorder:
    """The tracer's allocations (see the module docstring); ``trainable``: the parameters whose ``.grad``
    are the step's gradients."""

    def __init__(self, trainable: list[torch.Tensor]) -> None:
        self.build = SnapshotBuilder(recording=False)
        self.trainable = trainable
        self.serial = 0
        self.handle_of: dict[int, int] = {}  # storage key -> the allocation's handle
        #: handle -> [kind or None, phase, phase number, label, layer, freed in phase number or None]
        self.info: dict[int, list[Any]] = {}
        self.names: dict[int, str] = {}  # storage key -> a parameter's or buffer's name
        self.kinds: dict[int, str] = {}  # storage key -> a kind given before the step
        self.phase, self.number = "setup", 0
        self.done = False

    # -- what the harness says before the step ------------------------------------------------
    def name(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for n, t in named:
            self.names.setdefault(t.untyped_storage()._cdata, n)

    def kind(self, tensors: Iterable[Optional[torch.Tensor]], kind: str) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                self.kinds[key] = kind
                h = self.handle_of.get(key)
                if h is not None:
                    self.info[h][0] = kind

    # -- the tracer's hooks ----------------------------------------------------------------------
    def on_alloc(self, key: int, raw: int, op: str, label: str) -> None:
        if self.done or raw <= 0:  # a zero-byte storage allocates nothing (CUDA returns nullptr)
            return
        h = self.serial = self.serial + 1
        self.handle_of[key] = h
        name = self.names.get(key)
        text = name or (f"{op} ({label})" if label else op)
        layer = _layer_of(name) if name else _layer_of(label)
        self.info[h] = [self.kinds.get(key), self.phase, self.number, text, layer, None]
        self.build.malloc(h, raw)

    def on_free(self, key: int) -> None:
        h = self.handle_of.pop(key, None)
        if h is None or self.done:
            return
        info = self.info[h]
        info[5] = self.number
        self.build.free(h, self.phase if self.phase != info[1] else None)

    def on_phase(self, phase: str) -> None:
        if self.phase == "backward" and phase != "backward":
            self._mark_gradients()
        self.phase, self.number = phase, self.number + 1

    def _mark_gradients(self) -> None:
        for p in self.trainable:
            g = p.grad
            if isinstance(g, torch.Tensor):
                h = self.handle_of.get(g.untyped_storage()._cdata)
                if h is not None and self.info[h][1] == "backward":
                    self.info[h][0] = "gradients"

    # -- the snapshot ----------------------------------------------------------------------------
    def start(self) -> None:
        """From now on the allocations enter the trace (``_record_memory_history`` on CUDA)."""
        self.build.recording = True

    def _kind(self, info: list[Any]) -> str:
        kind, phase, number, _text, _layer, freed = info
        if kind is not None:
            return kind
        outlived = freed is None or freed > number
        if phase == "forward":
            return "activations" if outlived else "temporaries"
        if phase == "optimizer step":
            return "optimizer_state" if outlived else "temporaries"
        if phase == "backward":
            return "temporaries"
        return "weights"  # made before the step: the model's own tensors

    def _frames(self, h: int) -> list[dict[str, Any]]:
        info = self.info[h]
        return memcalc_frames(self._kind(info), info[4], info[3], info[1])

    def snapshot(self) -> dict[str, Any]:
        """The dict ``torch.cuda.memory._snapshot()`` would return now."""
        if self.phase == "backward":
            self._mark_gradients()
        return self.build.snapshot(self._frames)

    def write(self, path: str) -> None:
        """``_dump_snapshot(path)``: the snapshot now; later frees (the harness's teardown) are not heard."""
        write_snapshot(self.snapshot(), path)
        self.done = True

"""Unsloth's gradient checkpointing (``use_gradient_checkpointing="unsloth"``, the default of
``FastLanguageModel.get_peft_model``), read from unsloth_zoo 2026.10.9 ``gradient_checkpointing.py``
(rules and their lines: :mod:`memcalc.core.unsloth`).

``patch_unsloth_smart_gradient_checkpointing`` replaces ``torch.utils.checkpoint.checkpoint`` with
``unsloth_checkpoint`` = ``UnslothCheckpointFunction.apply`` around each decoder layer (a reentrant checkpoint):

- forward: the layer runs under ``no_grad``; its input hidden states (``arg`` 0, when it needs a gradient and is
  larger than ``MINIMUM_SIZE``) are copied into a pinned host buffer (``CPU_BUFFERS[CPU_INDEX]``, ``x.copy_(arg,
  non_blocking=...)``) and autograd saves ``None`` in their place, so the GPU copy dies when the decoder loop
  replaces ``hidden_states``; the last layer's input is saved on the GPU as torch's checkpoint saves it
  (:func:`memcalc.core.unsloth.gc_offloads`). The first offload creates the device's staging buffers
  (``_ensure_device_buffers``: ``GPU_BUFFERS`` and, double buffering not disabled, ``GPU_BUFFERS_B``; module
  globals, never freed) and ``resize_`` grows buffer A to one layer input; from the second step on, with more than
  ``DOUBLE_BUFFER_HEADROOM`` (512 MiB) free, ``USE_DOUBLE_BUFFER`` grows B to the same size (memcalc assumes so);
- backward: the input comes back into a staging buffer (``buffer.copy_(x)``) and the recompute runs on
  ``buffer.detach()`` (a view: no new bytes), then ``torch.autograd.backward`` on the layer's outputs. A
  reentrant recompute runs the whole layer (no early stop, unlike ``use_reentrant=False``).

Below ``max_seq_length`` 512 Unsloth uses plain reentrant checkpointing instead
(``apply_unsloth_gradient_checkpointing``); memcalc reads ``--seq`` as ``max_seq_length``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from memcalc.core.spec import TrainingSpec
from memcalc.core.unsloth import GC_MIN_SEQ, gc_buffer_bytes, gc_offloads
from memcalc.engine.checkpoint import Checkpointing, checkpoint
from memcalc.engine.sim import Node, Sim, T
from memcalc.engine.strategy import Walk


class UnslothCheckpointing(Checkpointing):
    """Every layer a reentrant checkpoint whose input lives in host memory between forward and backward."""

    def __init__(self, tr: TrainingSpec, seq_len: int, buffers: list[T]) -> None:
        super().__init__(tr)
        self.offload = seq_len >= GC_MIN_SEQ
        self.n_layers = 0
        self.buffers = buffers  # shared by the step's micro-steps (module globals in Unsloth)

    def regions(self, n_layers: int) -> Iterator[tuple[int, int]]:
        self.n_layers = n_layers
        yield from super().regions(n_layers)

    def run(self, fwd: Walk, x: T, lo: int, hi: int) -> T:
        sim = fwd.sim
        out = checkpoint(sim, fwd.ops, lambda: [x], lambda: fwd.layer(x, lo), f"layer {lo}", lo, full_recompute=True)
        node: Optional[Node] = out.producer
        if not self.offload or node is None or x not in node.saved or not gc_offloads(lo, self.n_layers, x.nbytes):
            return out
        if not self.buffers:  # _ensure_device_buffers at the first offload: buffers A and B
            n = gc_buffer_bytes(x.nbytes, x.itemsize_bits // 8)
            self.buffers += [sim.alloc(n, "temporaries", "unsloth checkpoint buffers") for _ in range(2)]
        node.saved.remove(x)  # autograd holds None; the host copy is not GPU memory
        sim.unref(x)
        recompute = node.on_backward

        def reload(s: Sim, n: Node) -> None:
            # the recompute's input is a view of a staging buffer: the freed input block comes back with no bytes
            x.nbytes, x.refs, x.alive, x.uid = 0, 1, True, 0  # (no allocator event: no block)
            n.saved.append(x)
            if recompute is not None:
                recompute(s, n)
        node.on_backward = reload
        return out

    def end_backward(self, fwd: Walk) -> None:
        """The staging buffers are module globals: they stay for the next step (allocated once)."""

"""Which phase of the step each trace entry belongs to and which of memcalc's kinds each allocation is.

A snapshot memcalc wrote (``estimate --snapshot``, the meta tracer) says both itself: the first frame
of every entry is ``{"filename": "memcalc/<kind>", "line": <layer>, "name": <label>}``
(:func:`memcalc.snapshot.format.parse_memcalc_frame`) and the next, ``{"filename": "memcalc", "name":
"<phase>: <category>"}`` (:mod:`memcalc.snapshot.export`), names the phase.

A real CUDA snapshot has the stack of each allocation instead (``_record_memory_history(context="all",
stacks="all")``, the defaults: Python frames and C++ frames, innermost first; torch 2.13
``torch/cuda/memory.py``). The rules, each from the code that runs the step:

- **phase** of an allocation (:func:`entry_phase` on its ``alloc`` entry; the first rule that
  matches; an entry with none, and every free, continues the phase before it, ``setup`` before the
  first: a free's frames can be its allocation's, CUDACachingAllocator.cpp ``free`` records
  ``context ? context : block->context_when_allocated``):
  ``optimizer step``: a frame in ``torch/optim/`` (``Optimizer.step``'s wrapper
  ``torch/optim/optimizer.py`` ``profile_hook_step``, the ``_single_tensor_*`` / ``_multi_tensor_*``
  / ``_fused_*`` kernels of ``adamw.py``, ``adam.py``, ``sgd.py``; ``zero_grad``), or a ``step`` in a
  file whose path has ``optim`` (bitsandbytes ``optim/optimizer.py``, torchao ``optim/adam.py``);
  ``backward``: the autograd engine, which runs every backward node (C++ frames
  ``torch::autograd::Engine::evaluate_function`` / ``thread_main`` of
  ``torch/csrc/autograd/engine.cpp``; the Python entry ``_engine_run_backward`` of
  ``torch/autograd/graph.py``), checkpoint recomputation included (it runs inside the engine:
  ``torch/utils/checkpoint.py`` ``unpack_hook`` / ``recompute_fn``, ``CheckpointFunction.backward``);
  with Python frames only (``stacks="python"``, what ``validate --protocol`` records) an allocation
  with no frame at all after a forward began: the engine runs a CUDA device's backward on its own
  thread (engine.cpp ``thread_main``), which holds no Python frame, while the training loop's
  thread always has one;
  ``forward``: a module's ``forward`` or ``torch/nn/modules/module.py`` ``_call_impl``.
- **kind** of an allocation (:func:`real_kind`), by where it was made and how long it lives:
  ``workspace``: made by ``getNewWorkspace`` / ``getCUDABlasLtWorkspace``
  (aten/src/ATen/cuda/CublasHandlePool.cpp: the cuBLAS / cuBLASLt workspaces, allocated through the
  caching allocator and kept for the process, :mod:`memcalc.core.gpu_side`);
  made before recording and never freed: ``weights`` (``optimizer_state`` when its frames are in
  ``torch/optim/``); made before recording and freed in an optimizer step: ``gradients``
  (``Optimizer.zero_grad`` sets ``.grad`` to None); in ``setup`` and alive at the first forward:
  ``weights``; in ``forward`` and alive when the next backward begins: ``activations`` (autograd
  keeps what a node saved for backward until the engine runs it), else ``temporaries``; in
  ``backward`` and alive when the next optimizer step begins (or at the end): ``gradients``
  (AccumulateGrad's ``.grad``), else ``temporaries`` (activation gradients, recomputed tensors); in
  an ``optimizer step`` and alive at the next forward (or the end): ``optimizer_state`` (the state
  ``torch.optim`` creates lazily on the first step), else ``temporaries``; anything else ``other``.

Known limits: what was allocated before recording has no frames, so a snapshot of a later step
alone (the optimizer state made in an earlier one) reads that state as weights (``validate
--snapshot`` records from before the first step: ``validate/step.py`` ``run_on_device``); logits and the loss,
which memcalc counts as temporaries, are saved for backward and read as activations here; a Python
custom Function's backward run by the engine has Python frames of its own (``Function.apply``) and
reads as the phase before it.
"""

from __future__ import annotations

from typing import Any, Optional

from memcalc.snapshot.format import PHASE_FILENAME, parse_memcalc_frame

BEFORE = "before recording"
SETUP = "setup"
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer step"
#: the kinds a snapshot's allocation can have beyond memcalc's KINDS
WORKSPACE, OTHER = "workspace", "other"
#: frames looked at per entry (a deep Python + C++ stack is a few hundred)
MAX_FRAMES = 1000


#: torch/utils/checkpoint.py functions that run only in backward: the non-reentrant checkpoint's
#: ``unpack_hook`` / ``recompute_fn`` (the recompute, called as a saved tensor is unpacked) and the
#: reentrant ``CheckpointFunction.backward``
_RECOMPUTE = ("unpack_hook", "recompute_fn", "backward")


def _text(frame: object, key: str) -> str:
    v = frame.get(key) if isinstance(frame, dict) else None
    return v if isinstance(v, str) else ""


def entry_phase(frames: list) -> Optional[str]:
    """The phase an entry's frames show (module docstring), or None when they show none."""
    found: set[str] = set()
    for f in frames[:MAX_FRAMES]:
        filename, name = _text(f, "filename"), _text(f, "name")
        if filename == PHASE_FILENAME and name:
            return name.split(": ", 1)[0]  # "backward: activation gradients" (memcalc.snapshot.export)
        path = filename.replace("\\", "/")
        if "torch/optim/" in path or (name == "step" and "optim" in path):
            return OPTIMIZER
        if "autograd::Engine" in name or (name == "_engine_run_backward" and path.endswith("autograd/graph.py")) \
                or (name in _RECOMPUTE and path.endswith("torch/utils/checkpoint.py")):
            found.add(BACKWARD)
        elif name in ("forward", "_call_impl") and path.endswith(".py"):
            found.add(FORWARD)
    return BACKWARD if BACKWARD in found else FORWARD if FORWARD in found else None


def _is_workspace(frames: list) -> bool:
    return any(("getNewWorkspace" in _text(f, "name") or "BlasLtWorkspace" in _text(f, "name"))
               for f in frames[:MAX_FRAMES])


def _in_optim(frames: list) -> bool:
    return any("torch/optim/" in _text(f, "filename").replace("\\", "/") for f in frames[:MAX_FRAMES])


def _next_start(starts: dict[str, list[int]], phase: str, after: int) -> Optional[int]:
    """The first entry after ``after`` where ``phase`` begins (None: it does not begin again)."""
    return next((s for s in starts.get(phase, []) if s > after), None)


def real_kind(a: Any, starts: dict[str, list[int]]) -> str:
    """The kind of an allocation of a real CUDA run (the module docstring's rules)."""
    if _is_workspace(a.frames):
        return WORKSPACE
    if a.start < 0:
        if a.end is None:
            return "optimizer_state" if _in_optim(a.frames) else "weights"
        return "gradients" if a.end_phase == OPTIMIZER else OTHER
    keeps_until = {SETUP: FORWARD, FORWARD: BACKWARD, BACKWARD: OPTIMIZER, OPTIMIZER: FORWARD}.get(a.phase)
    if keeps_until is None:
        return OTHER
    nxt = _next_start(starts, keeps_until, a.start)
    # kept until the phase that uses it begins; with no such phase recorded after it, to the end
    survives = a.end is None or (nxt is not None and a.end > nxt)
    kept = {SETUP: "weights", FORWARD: "activations", BACKWARD: "gradients", OPTIMIZER: "optimizer_state"}[a.phase]
    return kept if survives else "temporaries"


def phase_starts(phases: list[str]) -> dict[str, list[int]]:
    """Where each phase begins, entry indices in order."""
    out: dict[str, list[int]] = {}
    prev = None
    for i, ph in enumerate(phases):
        if ph != prev:
            out.setdefault(ph, []).append(i)
            prev = ph
    return out


def attribute(rep: Any) -> None:
    """Set each allocation's kind and label: memcalc's frame where it has one, else
    :func:`real_kind`; ``rep.memcalc_frames`` says whether any allocation had memcalc's frame."""
    starts = phase_starts(rep.phases)
    for a in rep.allocations:
        mine = parse_memcalc_frame(a.frames[0]) if a.frames else None
        if mine is None and a.free_frames:
            mine = parse_memcalc_frame(a.free_frames[0])
        if mine is not None:
            a.kind, a.layer, a.label = mine
            rep.memcalc_frames = True
        else:
            a.kind = real_kind(a, starts)
            a.label = next((f"{_text(f, 'filename')}:{_text(f, 'name')}" for f in a.frames[:1]), "")


__all__ = ["BACKWARD", "BEFORE", "FORWARD", "OPTIMIZER", "OTHER", "SETUP", "WORKSPACE", "attribute", "entry_phase",
           "phase_starts", "real_kind"]

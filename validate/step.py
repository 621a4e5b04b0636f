"""The training step every harness runs, and what it records: one loop for all of them.

A harness (``runner.py``: memcalc's replica on cuda / meta / cpu; ``hf_runner.py``: transformers +
PEFT; ``sharded/runner.py``: one FSDP rank; ``sharded/tp.py``: one tensor-parallel rank;
``deepspeed_trace.py``: one DeepSpeed rank) builds its model, inputs, optimizer and tracer, then
says what one micro-step calls in a :class:`Step` (its build-model hook is whatever it did to get
there). :func:`train_step` runs the step the same way for all of them:

- ``min(grad_accum, 2)`` micro-steps (from the second on every micro-step starts with all
  gradients alive, so later ones repeat the second exactly): phase ``forward``, the loss (divided
  by ``grad_accum`` when accumulating, unless the harness's engine scales it), phase
  ``backward``, ``backward``;
- then phase ``optimizer step``: ``optimizer.step(); optimizer.zero_grad(set_to_none=True)``
  (Forgather's trainer, src/forgather/ml/trainer.py at a0ce9176), once after the last micro-step;
  DeepSpeed's ``engine.step()`` after every micro-step (it steps only at the accumulation
  boundary); none with a fused optimizer (it steps inside backward: :func:`register_fused_step`).

:func:`two_steps` runs it twice: the first step creates the optimizer state (its peak is the
first step's), then the tracer's peak is reset (``reset_peak_memory_stats`` on CUDA) and the
second, measured, step runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from memcalc.core.allocator import CachingAllocatorSim

from .interrupt import check as check_stop
from .optim import MasterWeights, allow_fused_on, build_optimizer
from .tracer import StorageTracer

PHASES = ("forward", "backward", "optimizer step")


@dataclass
class Measurement:
    """One measured (or traced) step. Bytes are ints; ``None`` when not measured."""

    device: str
    measured_bytes: Optional[int] = None
    first_step_bytes: Optional[int] = None
    peak_phase: Optional[str] = None
    reserved_bytes: Optional[int] = None
    status: str = "ok"  # ok | skipped | oom | error (the reason: exception type and message)
    reason: str = ""
    torch_version: str = torch.__version__
    #: ``plain`` (memcalc's replica, runner.py) or ``hf`` (transformers + PEFT, hf_runner.py), with
    #: the library versions the trace ran (None when not used)
    framework: str = "plain"
    transformers_version: Optional[str] = None
    peft_version: Optional[str] = None
    #: the trainer's libraries and their versions (validate/trainers/: e.g. litgpt, lightning)
    library_versions: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    peak_label: str = ""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    layers: Optional[int] = None
    params: Optional[int] = None
    #: meta/cpu with ``allocator_sim``: the CUDA caching allocator replayed (memcalc.core.allocator)
    sim_allocated_bytes: Optional[int] = None
    sim_reserved_bytes: Optional[int] = None
    #: torch.compile skipped off CUDA: what PyTorch's partitioner saves for backward (on meta), for
    #: the model as measured (the record puts memcalc's prediction beside it: record.make_record)
    partition_saved_bytes: Optional[int] = None
    #: activation offloading: pinned host bytes its hooks offloaded in one forward (validate/offload.py)
    host_activation_bytes: Optional[int] = None
    #: DeepSpeed offload_param: the pinned host bytes of its 16-bit partitions (validate/deepspeed_trace.py)
    host_param_bytes: Optional[int] = None
    #: pipeline parallelism: every rank's traced stage and peak (validate/sharded/pipeline.py); the worst is measured
    pipeline_stages: list = field(default_factory=list)
    peak_live: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


def error_reason(e: BaseException, limit: int = 300) -> str:
    """One line: the exception's type and the first line of its message, cut to ``limit``."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    line = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Probe:
    """Phase bookkeeping: the tracer on meta/cpu, ``max_memory_allocated`` per phase on cuda."""

    def __init__(self, device: str, tracer: Optional[StorageTracer]) -> None:
        self.device, self.tracer = device, tracer
        self.phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        self.reserved = 0

    def label(self, text: str) -> None:
        check_stop()  # a safe point for SIGINT/SIGTERM on every device (interrupt.py)
        if self.tracer is not None:
            self.tracer.label = text

    def set_phase(self, phase: str) -> None:
        check_stop()
        if self.tracer is not None:
            self.tracer.set_phase(phase)
        else:
            self._close_cuda_phase()
            torch.cuda.reset_peak_memory_stats()
        self.phase = phase

    def _close_cuda_phase(self) -> None:
        peak = torch.cuda.max_memory_allocated()
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), peak)
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())

    def reset(self) -> None:
        if self.tracer is not None:
            self.tracer.reset_peak()
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.phase_peaks = {}
            self.reserved = 0

    def result(self) -> tuple[int, str, str, dict[str, int]]:
        if self.tracer is not None:
            r = self.tracer.record
            return r.bytes, r.phase, r.label, dict(r.phase_peaks)
        torch.cuda.synchronize()
        self._close_cuda_phase()
        peaks = {k: v for k, v in self.phase_peaks.items() if k != "setup"}
        top = max(peaks, key=lambda k: peaks[k]) if peaks else self.phase
        return max(peaks.values()) if peaks else torch.cuda.max_memory_allocated(), top, "", peaks


@dataclass
class Step:
    """What one harness's training step calls (see the module docstring).

    ``forward``: one micro-step's loss (the model on the harness's inputs, under its contexts);
    ``optimizer_step``: the optimizer's step and ``zero_grad(set_to_none=True)`` (None: a fused
    optimizer, stepped inside backward); ``backward``: ``loss.backward()`` unless the harness's
    engine runs it; ``scale``: divide the loss by ``grad_accum`` when accumulating (DeepSpeed's
    engine scales it itself); ``step_each_micro``: the optimizer step after every micro-step
    (DeepSpeed's ``engine.step``); ``release_loss``: drop the loss after each backward (torchtitan's
    and DeepSpeed's loops) rather than keeping it to the next micro-step's and the optimizer's
    (Forgather's); ``around``: a context over the micro-steps (torchtitan's ``loss_parallel``);
    ``before``: called as the step starts.
    """

    forward: Callable[[], torch.Tensor]
    grad_accum: int
    optimizer_step: Optional[Callable[[], None]]
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    scale: bool = True
    step_each_micro: bool = False
    release_loss: bool = False
    around: Callable[[], AbstractContextManager] = contextlib.nullcontext
    before: Callable[[], None] = lambda: None


def optimizer_step(opt) -> Callable[[], None]:
    """``opt.step(); opt.zero_grad(set_to_none=True)``: the step after backward."""
    def run() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def train_step(s: Step, set_phase: Callable[[str], None]) -> None:
    """One training step (see the module docstring); ``set_phase`` marks its phases."""
    s.before()
    loss = None
    with s.around():
        for _ in range(min(s.grad_accum, 2)):
            set_phase("forward")
            loss = s.forward()
            if s.scale and s.grad_accum > 1:
                loss = loss / s.grad_accum
            set_phase("backward")
            s.backward(loss)
            if s.release_loss:
                loss = None
            if s.step_each_micro and s.optimizer_step is not None:
                set_phase("optimizer step")
                s.optimizer_step()
    if s.optimizer_step is not None and not s.step_each_micro:
        set_phase("optimizer step")
        s.optimizer_step()
    del loss


def two_steps(probe: Probe, step: Callable[[], None], say: Callable[[str], None],
              before_measured: Callable[[], None] = lambda: None) -> tuple[int, tuple]:
    """Run the first step (it creates the optimizer state), then ``before_measured()``, the peak
    reset and the measured step; returns the first step's peak and the measured step's
    ``probe.result()``."""
    say("first step (creates optimizer state)")
    probe.reset()
    step()
    first = probe.result()[0]
    say("measured step")
    before_measured()
    probe.reset()
    step()
    return first, probe.result()


def traced_snapshot(tracer: Optional[StorageTracer], snapshot: Optional[str], model, trainable, batch, opt):
    """Off CUDA with a ``snapshot`` path: a :class:`.snapshot_trace.TraceRecorder` listening to the tracer
    (before anything is tracked), told the parameters' and buffers' names and which tensors are the batch
    and the fp32 master weights; else None."""
    if tracer is None or not snapshot:
        return None
    from .snapshot_trace import TraceRecorder

    rec = TraceRecorder(trainable)
    rec.name(model.named_parameters())
    rec.name(model.named_buffers())
    rec.kind(batch, "activations")
    if isinstance(opt, MasterWeights):
        rec.kind(opt.masters.values(), "optimizer_state")
    tracer.recorder = rec
    return rec


def fill_measurement(meas: Measurement, result: tuple, probe: Probe, dev_type: str,
                     sim: Optional[CachingAllocatorSim], tracer: Optional[StorageTracer], debug: bool) -> None:
    """Record the measured step's ``probe.result()`` (peak, phase, label, per-phase peaks) in ``meas``,
    with the CUDA reserved peak, the allocator replay's peaks and (``debug``) what was alive at the peak."""
    peak, phase, label, peaks = result
    meas.measured_bytes = peak
    meas.peak_phase = phase
    meas.peak_label = label
    meas.phase_peaks = {k: v for k, v in peaks.items() if k in PHASES}
    if dev_type == "cuda":
        meas.reserved_bytes = probe.reserved
    if sim is not None and tracer is not None:
        meas.sim_allocated_bytes = sim.peak_allocated
        meas.sim_reserved_bytes = sim.peak_reserved
    if tracer is not None and debug:
        meas.peak_live = sorted(tracer.peak_live, reverse=True)


def register_fused_step(opt, trainable) -> None:
    """Optimizer-in-backward: a ``register_post_accumulate_grad_hook`` on every trainable parameter
    that steps the optimizer and drops the gradient (Forgather's ``optimzer_hook``; for
    :class:`MasterWeights`, that parameter's own step)."""
    if isinstance(opt, MasterWeights):
        def hook(p):
            opt.step_param(p)
            p.grad = None
    else:
        def hook(p):  # Forgather optimzer_hook
            opt.step()
            opt.zero_grad()
    for p in trainable:
        p.register_post_accumulate_grad_hook(hook)


def track_inputs(tracer, model, ids, labels, opt, local=lambda ts: ts) -> None:
    """Count what exists before the step: parameters, buffers, the batch, fp32 master weights
    (``local``: a DTensor's local shard)."""
    tracer.track(local(model.parameters()))
    tracer.track(local(model.buffers()))
    tracer.track([ids, labels])
    if isinstance(opt, MasterWeights):
        tracer.track(local(opt.masters.values()))


def _batch(B: int, T: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, T) batch of token ids and labels: empty on meta, random ids elsewhere."""
    if torch.device(device).type == "meta":
        return (torch.empty((B, T), dtype=torch.int64, device=device),
                torch.empty((B, T), dtype=torch.int64, device=device))
    ids = torch.randint(0, vocab, (B, T), device=device)
    return ids, ids.clone()


def run_on_device(exp, m, device: str, model, meas: Measurement, say: Callable[[str], None], debug: bool,
                  sim: Optional[CachingAllocatorSim], forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  attach: Callable[[Probe], None], contexts: tuple = (), snapshot: Optional[str] = None,
                  backward: Callable[[torch.Tensor], None] = torch.Tensor.backward, extra: tuple = ()) -> None:
    """The two steps of a model built on one device (cuda, meta, cpu) by a harness (its build-model hook:
    ``runner.py``'s replica, ``hf_runner.py``'s transformers model): the optimizer over its trainable
    parameters, the batch, the tracer (off CUDA), the probe (``attach`` gives it to the model's phase
    labels), a fused optimizer's hooks, then :func:`two_steps` of :func:`train_step` under
    ``contexts``; the result goes to ``meas``. ``snapshot``: a ``_dump_snapshot`` (CUDA; off it the
    tracer's, :mod:`.snapshot_trace`) of both steps, recorded from before the first; ``backward``:
    :attr:`Step.backward` (a harness whose context spans forward and backward closes it there)."""
    tr = exp.training
    dev_type = torch.device(device).type
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    opt = build_optimizer(trainable, tr, [n for n, _ in named])
    ids, labels = _batch(tr.batch, tr.seq, m.vocab_size, device)
    # TrainingSpec.first_seq: the run's first micro-batch is first_seq tokens (memcalc.engine.timeline), used once
    firsts = [] if tr.first_seq is None else [_batch(tr.batch, tr.first_seq, m.vocab_size, device)]

    def micro_forward() -> torch.Tensor:
        if firsts:
            return forward(*firsts.pop())
        return forward(ids, labels)
    tracer = None
    if dev_type != "cuda":
        tracer = StorageTracer(dev_type, exp.profile.allocator_round_bytes, debug=debug, allocator=sim)
    probe = Probe(device, tracer)
    attach(probe)
    if tr.fused_optimizer:
        register_fused_step(opt, trainable)
    parts = Step(forward=micro_forward, grad_accum=tr.grad_accum,
                 optimizer_step=None if tr.fused_optimizer else optimizer_step(opt), backward=backward)
    record = bool(snapshot) and dev_type == "cuda"
    recorder = traced_snapshot(tracer, snapshot, model, trainable, [ids, labels], opt)

    def start_recording() -> None:
        # both steps, as docs/compare.md records them: the first creates the optimizer state (compare
        # reads it as state, not weights) and holds what only a first step allocates (a compiled
        # step's autotuning at first launch); compare takes the last step as the steady state
        if recorder is not None:
            recorder.start()
        if record:
            # Python frames only: C++ frames are symbolized when the snapshot is dumped, which can take
            # minutes on a long trace (torch/csrc/profiler/combined_traceback.cpp symbolize)
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")

    if tracer is not None:
        track_inputs(tracer, model, ids, labels, opt)
        tracer.track(extra)
        for first in firsts:
            tracer.track(first)
    with allow_fused_on(dev_type), contextlib.ExitStack() as stack:
        for c in (*contexts, tracer if tracer is not None else contextlib.nullcontext()):
            stack.enter_context(c)
        start_recording()
        meas.first_step_bytes, result = two_steps(probe, lambda: train_step(parts, probe.set_phase), say)
        if record:
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        if recorder is not None and snapshot:
            recorder.write(snapshot)
    fill_measurement(meas, result, probe, dev_type, sim, tracer, debug)
    if firsts_used(tr, meas):  # first_seq: the run's peak is its first step's where that is the higher
        meas.measured_bytes, meas.peak_phase, meas.peak_label = meas.first_step_bytes, "first step", "first step"


def firsts_used(tr, meas: Measurement) -> bool:
    """With ``first_seq`` (a first micro-batch of its own length), whether the first step's peak is the run's:
    the estimator's peak is the higher of its first and steady steps then (memcalc.estimate.peak)."""
    return (tr.first_seq is not None and meas.first_step_bytes is not None and meas.measured_bytes is not None
            and meas.first_step_bytes > meas.measured_bytes)

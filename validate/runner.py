"""Run one training step of an experiment and measure its peak memory.

``measure(exp, device)``:

- ``cuda``: the real step; ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats`` (and ``max_memory_reserved``), per phase; ``snapshot`` writes a
  ``torch.cuda.memory._dump_snapshot`` of the measured step (open it in memory_viz).
- ``meta``: the same step on the meta device (no data, no GPU), counted by
  :class:`~.tracer.StorageTracer` with 512-byte rounding: what CUDA would allocate, given the
  kernels the model code names (see ``attention.py``).
- ``cpu``: the real step at small scale, counted by the same tracer (real tensors).

The step follows Forgather's trainer (src/forgather/ml/trainer.py at a0ce9176): weights
exist before the step; ``loss = model(batch)``; ``loss.backward()``; ``optimizer.step()``;
``optimizer.zero_grad()`` (grads set to None). A fused optimizer registers
``register_post_accumulate_grad_hook`` on every trainable parameter that runs
``optimizer.step(); optimizer.zero_grad()`` (only the parameter whose gradient just arrived has
one). Gradient accumulation runs ``min(grad_accum, 2)`` micro-steps: from the second on every
micro-step starts with all gradients alive, so later ones repeat the second exactly.

Two steps run: the first creates the optimizer state (its peak is ``first_step_bytes``),
the second is the measured steady state. ``torch.compile`` needs CUDA; elsewhere the record
is ``skipped`` with the reason.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from memcalc.core.spec import ExperimentSpec

from .model import build_model, param_count
from .optim import MasterWeights, allow_fused_on, build_optimizer
from memcalc.engine.allocator import CachingAllocatorSim
from .interrupt import check as check_stop
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
    #: ``plain`` (memcalc's replica, this module) or ``hf`` (transformers + PEFT, hf_runner.py), with
    #: the library versions the trace ran (None when not used)
    framework: str = "plain"
    transformers_version: Optional[str] = None
    peft_version: Optional[str] = None
    seconds: float = 0.0
    peak_label: str = ""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    layers: Optional[int] = None
    params: Optional[int] = None
    #: meta/cpu with ``allocator_sim``: the CUDA caching allocator replayed (allocator.py)
    sim_allocated_bytes: Optional[int] = None
    sim_reserved_bytes: Optional[int] = None
    #: torch.compile skipped off CUDA: what PyTorch's partitioner saves for backward (on meta),
    #: and what memcalc's own partitioner saves, for the model as measured
    partition_saved_bytes: Optional[int] = None
    predicted_saved_bytes: Optional[int] = None
    #: activation offloading: pinned host bytes its hooks offloaded in one forward (validate/offload.py)
    host_activation_bytes: Optional[int] = None
    peak_live: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return asdict(self)


def two_steps(meas: "Measurement", probe: "_Probe", step: Callable[[], None], say: Callable[[str], None],
              before_measured: Callable[[], None] = lambda: None) -> tuple:
    """Run the first step (it creates the optimizer state; its peak goes to
    ``meas.first_step_bytes``), then ``before_measured()`` and the measured step; returns the
    measured step's ``probe.result()``."""
    say("first step (creates optimizer state)")
    probe.reset()
    step()
    meas.first_step_bytes = probe.result()[0]
    say("measured step")
    before_measured()
    probe.reset()
    step()
    return probe.result()


def fill_measurement(meas: "Measurement", result: tuple, probe: "_Probe", dev_type: str,
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


def unsupported(exp: ExperimentSpec, device: str) -> Optional[str]:
    """Why this experiment cannot be run on this device (None when it can)."""
    tr = exp.training
    if tr.compile and device != "cuda":
        return f"torch.compile needs CUDA (inductor generates GPU kernels); cannot run on {device}"
    if tr.zero and tr.gpus > 1:
        return f"ZeRO-{tr.zero} across {tr.gpus} GPUs needs {tr.gpus} processes; the validator runs one"
    if tr.offload_optimizer:
        return "optimizer offload (state and step on the CPU) is not measured by the validator"
    if tr.fused_optimizer and tr.grad_accum > 1:
        return f"a fused optimizer steps inside backward, so it cannot accumulate gradients (grad_accum {tr.grad_accum})"
    if device == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    return None


class _Probe:
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
        top = max(peaks, key=peaks.get) if peaks else self.phase
        return max(peaks.values()) if peaks else torch.cuda.max_memory_allocated(), top, "", peaks


def measure(exp: ExperimentSpec, device: str, scale_layers: Optional[int] = None, snapshot: Optional[str] = None,
            progress: Optional[Callable[[str], None]] = None, debug: bool = False,
            allocator_sim: bool = False, capacity: Optional[int] = None) -> Measurement:
    """Measure (cuda, cpu) or trace (meta) the steady-state training step of ``exp``.

    ``scale_layers`` rebuilds the model with that many layers (quick runs). ``debug`` (meta/cpu)
    keeps the list of storages alive at the peak, with the op that made each, in
    ``Measurement.peak_live`` (slower). ``allocator_sim`` (meta/cpu) also replays the CUDA
    caching allocator (``capacity``: the GPU's usable bytes) and reports its allocated and
    reserved peaks in ``sim_allocated_bytes`` / ``sim_reserved_bytes``.
    """
    if exp.training.tp > 1:  # tensor parallelism: one rank on the fake process group (sharded/tp.py)
        from .sharded.tp import measure_tp

        return measure_tp(exp, scale_layers, progress, debug, device=device)
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    meas = Measurement(device=device)
    why = unsupported(exp, device)
    if why:
        meas.status, meas.reason = "skipped", why
        if exp.training.compile_partitions:
            _check_partition(exp, scale_layers, meas, say)
        meas.seconds = round(time.perf_counter() - t0, 3)
        return meas
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    try:
        _run(exp, m, device, snapshot, say, meas, debug, CachingAllocatorSim(capacity) if allocator_sim else None)
    except torch.cuda.OutOfMemoryError as e:  # type: ignore[attr-defined]
        meas.status = "oom"
        meas.reason = str(e).strip().splitlines()[0] if str(e).strip() else "CUDA out of memory"
        meas.measured_bytes = None
    except Exception as e:  # noqa: BLE001 - any failure of this config is its record; the run goes on
        meas.status, meas.reason, meas.measured_bytes = "error", error_reason(e), None
    finally:
        gc.collect()
        if device == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def error_reason(e: BaseException, limit: int = 300) -> str:
    """One line: the exception's type and the first line of its message, cut to ``limit``."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    line = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _run(exp: ExperimentSpec, m, device: str, snapshot: Optional[str], say, meas: Measurement, debug: bool,
         sim: Optional[CachingAllocatorSim]) -> None:
    tr = exp.training
    dev_type = torch.device(device).type
    if dev_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    say(f"building {m.name} ({m.n_layers} layers) on {device}")
    model = build_model(m, tr, exp.profile, device=device)
    meas.params = param_count(model)[0]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(trainable, tr)
    B, T = tr.batch, tr.seq
    if dev_type == "meta":
        ids = torch.empty((B, T), dtype=torch.int64, device=device)
        labels = torch.empty((B, T), dtype=torch.int64, device=device)
    else:
        ids = torch.randint(0, m.vocab_size, (B, T), device=device)
        labels = ids.clone()
    if tr.compile:
        import torch._functorch.config as fconfig
        from torch._dynamo import reset as dynamo_reset

        # a fresh compile per config (dynamo's cache would otherwise keep an earlier config's
        # graphs, or hit its recompile limit and fall back to eager), at this config's budget
        dynamo_reset()
        fconfig.activation_memory_budget = tr.memory_budget if tr.memory_budget is not None else 1.0
        model.compile(backend="inductor", mode="default", dynamic=False)

    tracer = StorageTracer(dev_type, exp.profile.allocator_round_bytes, debug=debug, allocator=sim) if dev_type != "cuda" else None
    probe = _Probe(device, tracer)
    # phase labels are Python callbacks inside forward: under torch.compile they would break the
    # graph into pieces (and change what it saves), so a compiled step reports no phase
    model.on_label = None if tr.compile else probe.label
    if tr.fused_optimizer:
        register_fused_step(opt, trainable)

    def step() -> None:
        loss = None
        for _ in range(min(tr.grad_accum, 2)):
            probe.set_phase("forward")
            loss = model(ids, labels)
            if tr.grad_accum > 1:
                loss = loss / tr.grad_accum
            probe.set_phase("backward")
            loss.backward()
        if not tr.fused_optimizer:
            probe.set_phase("optimizer step")
            opt.step()
            opt.zero_grad(set_to_none=True)
        del loss

    ctx = tracer if tracer is not None else _nullcontext()
    if tracer is not None:
        tracer.track(model.parameters())
        tracer.track(model.buffers())
        tracer.track([ids, labels])
        if isinstance(opt, MasterWeights):
            tracer.track(opt.masters.values())
    with allow_fused_on(dev_type), ctx:
        say("first step (creates optimizer state)")
        probe.reset()
        step()
        meas.first_step_bytes = probe.result()[0]
        say("measured step")
        probe.reset()
        if snapshot and dev_type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=200000)
        step()
        peak, phase, label, peaks = probe.result()
        if snapshot and dev_type == "cuda":
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
    fill_measurement(meas, (peak, phase, label, peaks), probe, dev_type, sim, tracer, debug)
    if model.offload is not None:
        meas.host_activation_bytes = model.offload.max_pinned_bytes
    model.on_label = None
    del model, opt, ids, labels


def _check_partition(exp: ExperimentSpec, scale_layers: Optional[int], meas: Measurement, say) -> None:
    """The part of a compiled step that needs no GPU: PyTorch's partition of the joint graph."""
    from memcalc.compile.compiled import compiled_plan
    from memcalc.core.units import fmt_bytes

    from .compiled import partition

    say("partitioning the compiled graph (PyTorch, on meta)")
    target = exp if scale_layers is None else exp.model_copy(
        update={"model": exp.model.model_copy(update={"n_layers": scale_layers})})
    real = partition(target).saved_bytes
    mine = compiled_plan(target).saved_bytes
    meas.partition_saved_bytes, meas.predicted_saved_bytes = real, mine
    gap = f"{100 * (mine - real) / real:+.2f}%" if real else "both nothing" if not mine else "PyTorch saves nothing"
    meas.reason += (f"; its saved set was checked instead: PyTorch's partitioner saves {fmt_bytes(real)} "
                    f"for backward, memcalc {fmt_bytes(mine)} ({gap})")


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

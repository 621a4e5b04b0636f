"""Run one training step of an experiment and measure its peak memory.

``measure(exp, device)``:

- ``cuda``: the real step; ``torch.cuda.max_memory_allocated`` after
  ``reset_peak_memory_stats`` (and ``max_memory_reserved``), per phase; ``snapshot`` writes a
  ``torch.cuda.memory._dump_snapshot`` of both steps, the measured one last (open it in memory_viz).
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
from typing import Callable, Optional

import torch

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.spec import ExperimentSpec

from .model import build_model, param_count
from .step import Measurement, error_reason, run_on_device


def unsupported(exp: ExperimentSpec, device: str) -> Optional[str]:
    """Why this experiment cannot be run on this device (None when it can)."""
    tr = exp.training
    if tr.compile and device != "cuda" and not (device == "meta" and tr.compile_scope == "layer"):
        return f"torch.compile needs CUDA (inductor generates GPU kernels); cannot run on {device}"
    if tr.zero and tr.gpus > 1:
        return f"ZeRO-{tr.zero} across {tr.gpus} GPUs needs {tr.gpus} processes; the validator runs one"
    if tr.lora is not None and tr.lora.modules_to_save and exp.profile.framework != "hf":
        return ("modules_to_save: PEFT's ModulesToSaveWrapper is traced through PEFT itself (--framework hf); "
                "memcalc's replica does not build it")
    if tr.offload_optimizer:
        return "optimizer offload (state and step on the CPU) is not measured by the validator"
    if tr.fused_optimizer and tr.grad_accum > 1:
        return f"a fused optimizer steps inside backward, so it cannot accumulate gradients (grad_accum {tr.grad_accum})"
    if device == "cuda" and not torch.cuda.is_available():
        return "CUDA is not available"
    return None


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
    if exp.training.pp > 1:  # pipeline parallelism: every rank in turn on the fake process group (sharded/pipeline.py)
        from .sharded.pipeline import measure_pp
        from .sharded.pipeline_fsdp import trace_pp_fsdp_rank

        fsdp = exp.training.gpus * exp.training.cp > 1 and exp.training.zero > 0  # pp x FSDP2 (pipeline_fsdp.py)
        return measure_pp(exp, scale_layers, progress, debug, device=device, trace=trace_pp_fsdp_rank if fsdp else None)
    if exp.training.cp > 1:  # context parallelism: one rank on the fake process group (sharded/context_parallel.py)
        from .sharded.context_parallel import measure_cp

        return measure_cp(exp, scale_layers, progress, debug, device=device)
    if exp.training.tp > 1:  # tensor parallelism: one rank on the fake process group (sharded/tp.py)
        from .sharded.tp import measure_tp

        return measure_tp(exp, scale_layers, progress, debug, device=device)
    if exp.training.ep > 1:  # expert parallelism: one rank on the fake process group (sharded/expert_parallel.py)
        from .sharded.expert_parallel import measure_ep

        return measure_ep(exp, scale_layers, progress, debug, device=device)
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
    if tr.compile and dev_type == "meta":  # compile_scope layer (unsupported() refuses the rest)
        from .compiled import compile_layers

        compile_layers(model, tr.memory_budget)
    elif tr.compile:
        import torch._functorch.config as fconfig
        from torch._dynamo import reset as dynamo_reset

        # a fresh compile per config (dynamo's cache would otherwise keep an earlier config's
        # graphs, or hit its recompile limit and fall back to eager), at this config's budget
        dynamo_reset()
        fconfig.activation_memory_budget = tr.memory_budget if tr.memory_budget is not None else 1.0
        if tr.compile_scope == "layer":  # torchtune's training.compile_model: each layer apart
            for layer in model.layers:
                layer.compile(backend="inductor", mode="default", dynamic=False)
        elif tr.compile_scope == "logits":  # a module returning logits compiled; Decoder.forward's loss eager
            model.logits = torch.compile(  # type: ignore[method-assign]
                model.logits, backend="inductor", mode="default", dynamic=False)
        else:
            model.compile(backend="inductor", mode="default", dynamic=False)

    def attach(probe) -> None:
        # phase labels are Python callbacks inside forward: under torch.compile they would break the
        # graph into pieces (and change what it saves), so a compiled step reports no phase
        model.on_label = None if tr.compile else probe.label

    run_on_device(exp, m, device, model, meas, say, debug, sim, model, attach, snapshot=snapshot)
    if model.offload is not None:
        meas.host_activation_bytes = model.offload.max_pinned_bytes
    model.on_label = None


def _check_partition(exp: ExperimentSpec, scale_layers: Optional[int], meas: Measurement, say) -> None:
    """The part of a compiled step that needs no GPU: PyTorch's partition of the joint graph (the
    record puts memcalc's saved set beside it: record.make_record)."""
    from memcalc.core.units import fmt_bytes

    from .compiled import partition

    say("partitioning the compiled graph (PyTorch, on meta)")
    target = exp if scale_layers is None else exp.model_copy(
        update={"model": exp.model.model_copy(update={"n_layers": scale_layers})})
    meas.partition_saved_bytes = real = partition(target).saved_bytes
    meas.reason += f"; its saved set was checked instead: PyTorch's partitioner saves {fmt_bytes(real)} for backward"

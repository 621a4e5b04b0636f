"""One rank of a sharded training step, traced in one process: :func:`trace_rank`.

The recipe (``/work/shared/notes/meta-trace-pitfalls.md``, "Tracing one rank of a sharded step"):

1. ``fake_dist.fake_world``: rank ``r`` of ``N`` on PyTorch's fake process group, a ``cpu`` mesh;
2. memcalc's replica of the model (``validate/model.py``) built under ``FakeTensorMode`` on
   ``meta`` (no memory), wrapped by FSDP2 (``fsdp2.py``) or FSDP1 (``fsdp1.py``), then
   ``to_empty(device="cpu")``: FSDP2 refuses parameters left on ``meta``
   (``_fsdp_param_group.py`` ``FSDPParamGroup._validate_no_meta_params``), and moving plain fake
   parameters fails, DTensor ones work;
3. the step runs under ``devices.fake_as_meta`` so the model code picks the kernels CUDA would
   (flash / memory-efficient attention, fused norms), as it does on ``meta``;
4. AdamW ``foreach=True`` (CUDA's default; CPU's is the for-loop) over the sharded parameters;
   two steps, ``zero_grad(set_to_none=True)`` after each, the peak reset before the second,
   which is the one measured (``rank_tracer.RankTracer``).

``real=True`` runs the same on real CPU tensors (no fake mode; kernels as on ``cpu``): the guard
that fake tensors allocate what real ones do (``tests/trace/test_sharded_trace.py``).

``fsdp_tracker=True`` also runs ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``
(FSDP2 only) around both steps: its peak cannot be reset between steps, it counts DTensor's
sharding-propagation temporaries of step 1 and rounds only CUDA storages, so it is a cross-check,
not the measurement.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Callable, Optional

import torch

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec

from ..devices import fake_as_meta
from ..model import build_model, param_count
from ..optim import allow_fused_on, build_optimizer
from ..step import PHASES, Probe, Step, optimizer_step, track_inputs, train_step, two_steps
from .fake_dist import DEVICE, fake_world
from .fsdp1 import STRATEGIES, apply_fsdp1
from .fsdp2 import RESHARD_AFTER_FORWARD, apply_fsdp2, precision_plan
from .rank_tracer import RankTracer, local_tensors

#: ``--sharding`` values this tracer runs (deepspeed has its own path)
TRACED = ("fsdp2", "fsdp1")


def check_sharded(exp: ExperimentSpec, sharding: Optional[str] = None) -> str:
    """Why this experiment cannot be traced as a sharded step (a UserError), else its sharding."""
    tr = exp.training
    sharding = sharding or tr.sharding
    if tr.first_seq is not None:
        raise UserError("first_seq (a longer first micro-batch) is traced by the single-process harnesses "
                        "(validate/step.py run_on_device: the replica, hf, trl, litgpt), not sharded")
    if sharding not in TRACED:
        hint = " (DeepSpeed ZeRO is traced by its own path: --sharding deepspeed with --deepspeed CONFIG)" \
            if sharding == "deepspeed" else ""
        raise UserError(f"--sharding {sharding}: the sharded tracer runs {', '.join(TRACED)}{hint}")
    if tr.zero not in RESHARD_AFTER_FORWARD:
        raise UserError(f"--zero {tr.zero} with --sharding {sharding}: FSDP shards parameters (--zero 3) or "
                        "keeps them unsharded after forward (--zero 2); valid: 2, 3")
    if tr.compile:
        raise UserError("--compile: the sharded trace runs eager (inductor needs a GPU)")
    if tr.fused_optimizer:
        raise UserError("--fused-optimizer: FSDP reduce-scatters gradients after each layer's backward; "
                        "optimizer-in-backward is not traced under FSDP")
    if tr.offload_optimizer:
        raise UserError("--offload-optimizer: CPU offload of FSDP is not traced yet")
    if tr.tp > 1:
        raise UserError(f"--tp {tr.tp}: tensor parallelism is traced by the tp path, not the FSDP tracer")
    return sharding


def trace_rank(exp: ExperimentSpec, rank: int = 0, scale_layers: Optional[int] = None, timeline: bool = False, *,
               sharding: Optional[str] = None, framework: str = "plain", real: bool = False, cuda_kernels: bool = True,
               fsdp_tracker: bool = False,
               debug: bool = False, progress: Optional[Callable[[str], None]] = None) -> dict:
    """Trace rank ``rank`` of ``exp.training.gpus`` for one steady-state step of ``exp``.

    ``exp.training``: ``gpus`` (world size), ``zero`` (3: reshard after forward, 2: not),
    ``sharding`` (fsdp2 | fsdp1; ``sharding`` overrides it), precision (see ``fsdp2.py``).
    ``scale_layers``: build that many layers. Returns a dict of JSON types, bytes as ints:

    - ``peak_bytes``: the measured (second) step's peak on this rank; ``phase`` (forward,
      backward, optimizer step) and ``label`` (layer and FSDP scope) where it happened;
      ``phase_peaks``; ``first_step_bytes`` (step 1, which creates the optimizer state);
    - ``baseline_bytes``: what is alive when the measured step starts (shards, optimizer state,
      the batch); ``sharding``, ``gpus``, ``zero``, ``rank``, ``mixed_precision`` (what ran),
      ``reshard_after_forward`` (FSDP2) or ``strategy`` (FSDP1), ``layers``, ``params`` (whole model);
    - ``fsdp_tracker_bytes``: FSDPMemTracker's peak over both steps (``fsdp_tracker=True``, FSDP2);
    - ``timeline`` (``timeline=True``): ``[event, label, bytes, live_bytes]`` for every
      allocation (``alloc``), free (``free``, negative bytes) and ``resize`` of the measured step;
      ``label`` is ``phase label [fsdp scope]``, e.g. ``backward layer 2 [reduce-scatter]``;
      beside it, ``timeline_ids`` (one storage's alloc, resizes and free share an id: lifetimes) and
      ``timeline_ops`` (the op that made it; ``UntypedStorage.resize_`` for a resize, ``""`` for a free);
    - ``peak_live`` (``debug=True``): the storages alive at the peak, ``[bytes, "op @ where"]``.

    ``framework``: ``plain`` (memcalc's replica, ``validate/model.py``) or ``hf`` (transformers + PEFT,
    FSDP2 only: ``hf.py``). ``real``: real CPU tensors instead of fake ones (small models only: it allocates). ``cuda_kernels``
    (fake tensors only): pick the kernels CUDA runs, as on ``meta``; False takes the CPU path, as
    real tensors do (the guard test compares the two).
    """
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    tr = exp.training
    sharding = check_sharded(exp, sharding)
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    plan = precision_plan(tr, sharding)
    if framework not in ("plain", "hf"):
        raise UserError(f"unknown framework {framework!r}; valid: plain, hf")
    if framework == "hf" and real:
        raise UserError("framework hf is traced on fake tensors only")
    out: dict = {"sharding": sharding, "gpus": tr.gpus, "zero": tr.zero, "rank": rank, "framework": framework,
                 "mixed_precision": plan.name, "layers": m.n_layers, "real_tensors": real,
                 "kernels": "cuda (as on meta)" if cuda_kernels and not real else "cpu",
                 "torch_version": torch.__version__}
    if sharding == "fsdp2":
        out["reshard_after_forward"] = RESHARD_AFTER_FORWARD[tr.zero]
    else:
        out["strategy"] = STRATEGIES[tr.zero]
    fake = None
    if not real:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake = FakeTensorMode()
    in_fake = fake if fake is not None else contextlib.nullcontext()
    with fake_world(tr.gpus, rank) as mesh:
        say(f"building {m.name} ({m.n_layers} layers), rank {rank} of {tr.gpus}, {sharding} zero {tr.zero}")
        torch.manual_seed(0)
        # FSDP2: on meta, then to_empty (below); FSDP1 flattens plain tensors, so its fake model is
        # built on cpu directly (to_empty cannot swap plain fake parameters)
        if framework == "hf":
            from .hf import build_hf_sharded

            model, layers, out["params"] = build_hf_sharded(exp, m, plan, fake, mesh, tr.zero, sharding)
            inner = None
        else:
            with in_fake:
                model = build_model(m, plan.build, exp.profile,
                                    device="meta" if fake is not None and sharding == "fsdp2" else DEVICE)
            out["params"] = param_count(model)[0]
            inner, layers = model, None
        if framework == "hf":
            pass  # wrapped and moved by build_hf_sharded
        elif sharding == "fsdp2":
            apply_fsdp2(model, mesh, tr.zero, plan)
            if fake is not None:
                with fake:
                    model.to_empty(device=DEVICE)
        else:
            with in_fake:
                model = apply_fsdp1(model, mesh, tr.zero, plan)
        try:
            _steps(exp, model, inner, layers, plan, fake, in_fake, out, timeline,
                   fsdp_tracker and sharding == "fsdp2", debug, say, cuda_kernels)
        finally:
            if inner is not None:
                inner.on_label = None
            del model, inner, layers
            gc.collect()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _steps(exp: ExperimentSpec, model, inner, layers, plan, fake, in_fake, out: dict, timeline: bool,
           fsdp_tracker: bool, debug: bool, say, cuda_kernels: bool) -> None:
    tr = exp.training
    B, T = tr.batch, tr.seq
    with in_fake, fake_as_meta(fake is not None and cuda_kernels), allow_fused_on("meta" if fake is not None else DEVICE):
        ids = torch.randint(0, exp.model.vocab_size, (B, T), device=DEVICE) if fake is None else \
            torch.zeros((B, T), dtype=torch.int64, device=DEVICE)
        labels = ids.clone()
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = build_optimizer(trainable, plan.build)
        tracer = RankTracer(DEVICE, exp.profile.allocator_round_bytes, debug=debug)
        track_inputs(tracer, model, ids, labels, None, local_tensors)
        if inner is None and tr.lora is not None and tr.lora.qlora:  # the HF 4-bit base's quantisation states
            from ..hf_qlora import quant_state_tensors

            tracer.track(quant_state_tensors(model))
        set_label = lambda text: setattr(tracer, "label", text)  # noqa: E731
        hooks: list = []
        extra = contextlib.nullcontext()
        if inner is not None:  # the replica labels its own layers
            inner.on_label = set_label

            def forward(i, y):
                return model(i, y)
        else:
            from .hf import hf_step_parts

            forward, extra, hooks = hf_step_parts(exp, model, layers, set_label)

        parts = Step(forward=lambda: forward(ids, labels), grad_accum=tr.grad_accum, optimizer_step=optimizer_step(opt))
        # the phase's label: the layer's as backward starts (where the forward ended), else none
        set_phase = lambda phase: tracer.set_phase(phase, tracer.label if phase == "backward" else "")  # noqa: E731
        mt = contextlib.nullcontext()
        if fsdp_tracker:
            from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

            mt = FSDPMemTracker(model, opt)

        def before_measured() -> None:
            gc.collect()
            tracer.set_phase("setup", "")
            if fsdp_tracker:  # it refuses a second iteration otherwise; its peak is not reset
                mt.reset_mod_stats()
            out["baseline_bytes"] = tracer.current
            if timeline:
                tracer.timeline = []

        with mt, extra, tracer:
            out["first_step_bytes"], _ = two_steps(Probe(DEVICE, tracer), lambda: train_step(parts, set_phase), say,
                                                   before_measured)
            tracer.timeline, events = None, tracer.timeline
        rec = tracer.record
        out["peak_bytes"] = rec.bytes
        out["phase"] = rec.phase
        out["label"] = rec.label
        out["phase_peaks"] = {k: v for k, v in rec.phase_peaks.items() if k in PHASES}
        out["unknown_resizes"] = tracer.unknown_resizes
        if fsdp_tracker:
            out["fsdp_tracker_bytes"] = _tracker_peak(mt)
            out["fsdp_tracker_note"] = ("FSDPMemTracker's peak over both steps (it cannot be reset between steps); "
                                        "it counts DTensor's sharding-propagation temporaries of step 1 and does "
                                        "not round to 512-byte blocks off CUDA")
        if events is not None:
            out["timeline"] = [list(e[:4]) for e in events]
            out["timeline_ids"] = [e[4] for e in events]
            out["timeline_ops"] = [e[5] for e in events]
        if debug:
            out["peak_live"] = sorted(([b, w] for b, w, _ in tracer.peak_live), reverse=True)
        for h in hooks:
            h.remove()
        del opt, ids, labels, trainable


def _tracker_peak(mt) -> Optional[int]:
    """FSDPMemTracker's peak total, summed over the devices it saw (a fake storage reports ``meta``)."""
    snap = mt.get_tracker_snapshot("peak")
    total = 0
    for dev, stats in snap.items():
        if isinstance(stats, dict) and "Total" in stats:
            total += int(stats["Total"])
    return total or None

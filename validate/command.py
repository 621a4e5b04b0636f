"""``memcalc validate``: predictions beside measurements, one record per experiment.

Each record (a dict of JSON types, bytes as ints) has the keys ``config, device,
predicted_bytes, measured_bytes, published_bytes, error_pct, published_error_pct,
peak_phase, measured_phase, first_step_bytes, status, reason, torch_version, framework,
transformers_version, peft_version, seconds``,
plus ``measured_label`` (the layer at the measured peak, meta/cpu), ``reserved_bytes``
(cuda), ``allocator_sim_bytes`` / ``allocator_sim_reserved_bytes`` (meta/cpu: the CUDA caching
allocator replayed over the traced allocations, see ``allocator.py``; the allocated figure
counts whole blocks, so it sits at or above ``measured_bytes``) and ``scale_layers``.

``framework``: ``plain`` traces memcalc's own PyTorch replica of the model (``runner.py``); ``hf``
traces the real Hugging Face step, transformers + PEFT, unmodified but for kernel dispatch
(``hf_runner.py``), and compares it with the estimate of :func:`~.record.hf_estimator_spec`.
``transformers_version`` / ``peft_version`` are the libraries the trace ran (None when not used).

- ``error_pct`` = (predicted - measured) / measured * 100;
- ``published_error_pct`` = (measured - published) / published * 100 (how far the
  measurement sits from the published figure; None when ``--scale-layers`` changes the model);
- ``status``: ``ok``, ``skipped`` (the reason says why this device cannot run it), ``oom``, or
  ``error``: building or tracing the step raised (an op with no meta kernel such as
  ``_fused_sgd_``, a partitioner that refuses a budget, the host out of memory); ``reason`` is
  the exception's type and first line, and the run goes on to the next config;
- ``run_id``: ``host:pid:random``, the same for every record of one run;
- ``--output FILE`` holds a JSON *list* of the records so far, rewritten (atomically) after
  every record, so an interrupted run keeps what finished; runs writing one file at the same
  time keep each other's records (``output.py``: a lock, read, merge by ``run_id``, replace).

``--gpus N --zero {2,3} --sharding {fsdp2,fsdp1} [--rank R]`` (an experiment with ``gpus`` > 1)
traces one rank of the sharded step on PyTorch's fake process group (``sharded/``); its records
add ``sharding, gpus, zero, rank, mixed_precision, reshard_after_forward | strategy,
baseline_bytes, fsdp_tracker_bytes, fsdp_tracker_note, kernels`` (``sharded/command.py``).

Progress goes to stderr; stdout gets the table, or with ``--json`` only the JSON list.
SIGINT / SIGTERM stop the run promptly (see ``interrupt.py``): the records that finished are
printed (valid JSON with ``--json``; ``--output`` already holds them) and the exit status is
130 / 143.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import torch
from rich import box
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec
from memcalc.core.units import gib

from .interrupt import StopRequested, check as check_stop, stoppable, stopped
from .output import RecordFile, new_run_id
from .predict import predict
from .record import make_record, target_spec
from .runner import measure
from .step import Measurement, error_reason
from .trainers import TRAINERS, load as load_trainer


#: ``--framework``: memcalc's replica of the model, the real transformers + PEFT step, or a trainer's
#: own code (``trainers/``: one module each)
FRAMEWORKS = ("plain", "hf", *TRAINERS)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "meta"


def _record(name: str, exp: Optional[ExperimentSpec], meas: Measurement, scale_layers: Optional[int]) -> dict:
    """The record of ``meas`` beside memcalc's prediction for the model as measured (``exp`` None: a
    config that could not be read, nothing predicted)."""
    prediction = None if exp is None else predict(target_spec(exp, scale_layers, meas.framework))
    return make_record(name, exp, meas, scale_layers, prediction)


def _gap_style(pct: Optional[float]) -> str:
    if pct is None:
        return "dim"
    a = abs(pct)
    return "green" if a < 3 else "yellow" if a < 10 else "red"


def _fmt_gib(b: Optional[int]) -> str:
    return "-" if b is None else f"{gib(b):.3f}"


def _fmt_pct(p: Optional[float]) -> str:
    return "-" if p is None else f"{p:+.2f}%"


def render_table(records: list[dict], console: Optional[Console] = None) -> None:
    """The summary table (GiB = 2**30); reasons for skipped/oom rows are listed under it."""
    console = console or Console()
    # meta/cpu rows are traced (the step's allocations counted by the tracer), not measured on a GPU
    traced = all(r["device"] != "cuda" for r in records)
    scaled = sorted({r["scale_layers"] for r in records if r.get("scale_layers")})
    what = "traced" if traced else "measured"
    title = f"memcalc validate: peak allocated memory, predicted vs {what}"
    if scaled:
        title += f" (models cut to {', '.join(map(str, scaled))} layer{'s' if scaled != [1] else ''})"
    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    for col, just in (("config", "left"), ("device", "left"), ("pred GiB", "right"),
                      ("traced GiB" if traced else "meas GiB", "right"),
                      ("pub GiB", "right"), ("gap", "right"), ("vs pub", "right"), ("phase", "left")):
        t.add_column(col, justify=just, no_wrap=col not in ("config", "phase"), min_width=min(len(col), 8))
    notes = []
    for r in records:
        gap = r["error_pct"]
        phase = r["measured_phase"] or "-" if r["status"] == "ok" else r["status"]
        if r["peak_phase"] and r["measured_phase"] and r["peak_phase"] != r["measured_phase"]:
            phase = f"{r['measured_phase']} (pred. {r['peak_phase']})"
        if r["reason"]:
            notes.append(f"{r['config']}: {r['reason']}")
        if r.get("sharding"):  # a sharded record: which rank of what ran (sharded/command.py)
            tracker = r.get("fsdp_tracker_bytes")
            notes.append(f"{r['config']}: rank {r['rank']} of {r['gpus']} GPUs, {r['sharding']} --zero {r['zero']}, "
                         f"{r.get('mixed_precision') or '-'}"
                         + (f"; FSDPMemTracker {_fmt_gib(tracker)} GiB (counts DTensor propagation temporaries)"
                            if tracker else ""))
        t.add_row(r["config"], r["device"], _fmt_gib(r["predicted_bytes"]), _fmt_gib(r["measured_bytes"]),
                  _fmt_gib(r["published_bytes"]), f"[{_gap_style(gap)}]{_fmt_pct(gap)}[/]",
                  _fmt_pct(r["published_error_pct"]), phase)
    console.print(t)
    console.print(f"gap = (predicted - {what}) / {what}; vs pub = ({what} - published) / published", style="dim")
    for n in notes:
        console.print(f"  {n}", style="dim")


def _deepspeed(exp: ExperimentSpec) -> bool:
    """DeepSpeed ZeRO-2/3, on any number of GPUs (as memcalc.engine.sharding.uses_deepspeed, which the
    validator does not import): DeepSpeed's engine traced as rank 0 (deepspeed_trace.py)."""
    return exp.training.sharding == "deepspeed" and exp.training.zero >= 2


def sharded_items(items: list) -> bool:
    """Whether these experiments are sharded over several GPUs (traced one rank at a time), or run
    DeepSpeed ZeRO-2/3 (its engine traced as rank 0, of one rank too: memcalc.engine.sharding.uses_deepspeed)."""
    # with --tp the tensor-parallel trace runs them, 2-D FSDP2 x TP included (sharded/tp.py)
    # with --ep the expert-parallel trace runs them (sharded/expert_parallel.py), with --cp the context-parallel
    # one, FSDP2 over dp x cp included (sharded/context_parallel.py), with --pp the pipeline one, FSDP2 over dp x pp
    # included (sharded/pipeline_fsdp.py)
    return any(isinstance(e, ExperimentSpec) and e.training.tp == 1 and e.training.ep == 1 and e.training.cp == 1
               and e.training.pp == 1
               and (e.training.gpus > 1 or _deepspeed(e))
               for _n, e in items)


def _refuse_quant_base(items: list) -> None:
    """A GPTQ / AWQ base (LoraSpec.quant) runs gptqmodel's kernels, which need CUDA: one line, before any trace."""
    for _name, e in items:
        lo = e.training.lora if isinstance(e, ExperimentSpec) else None
        if lo is not None and lo.quant is not None:
            raise UserError(f"--quant {lo.quant}: a {lo.quant.upper()} base cannot be traced without CUDA (gptqmodel's "
                            "kernels); the estimate reads it from source (docs/techniques.md)")


def _check_snapshot(snapshot: Optional[str], items: list, framework: str, sharded: bool) -> None:
    """``--snapshot`` is written by the one-GPU steps of memcalc's replica and ``--framework hf``
    (:func:`.step.run_on_device`); elsewhere one line says so rather than no file."""
    from memcalc.core.errors import UserError

    if not snapshot:
        return
    which = (f"--framework {framework}" if framework in TRAINERS else "a sharded step" if sharded
             else "a DeepSpeed step" if any(isinstance(e, ExperimentSpec) and _deepspeed(e) for _n, e in items)
             else None)
    if which is not None:
        raise UserError(f"--snapshot: {which} does not write one yet; it is written for memcalc's replica and "
                        "--framework hf on one GPU (drop --snapshot, or validate that setup)")


#: the harnesses whose checkpointing runs torch's reentrant kind when the spec asks (checkpoint_reentrant)
REENTRANT_TRACED = ("hf", "trl")


def _check_reentrant(items: list, framework: str, sharded: bool) -> None:
    """Reentrant checkpointing is traced on one GPU by :data:`REENTRANT_TRACED` only (UserError otherwise)."""
    specs = [e for _, e in items if isinstance(e, ExperimentSpec) and e.training.checkpoint_reentrant]
    if specs and (framework not in REENTRANT_TRACED or sharded or any(_deepspeed(e) for e in specs)):
        where = "a sharded step's" if sharded or framework in REENTRANT_TRACED else f"{framework}'s"
        raise UserError(f"reentrant checkpointing (--reentrant; hf --qlora's default without --checkpoint) is traced "
                        f"by --framework {' or '.join(REENTRANT_TRACED)} on one GPU; {where} checkpointing is "
                        "non-reentrant: pass --checkpoint full for that kind")


def run_validate(items: list[tuple[str, ExperimentSpec]], device: Optional[str], as_json: bool,
                 output: Optional[str], scale_layers: Optional[int], snapshot: Optional[str] = None,
                 framework: str = "plain", rank: int = 0) -> list[dict]:
    """Measure every experiment on ``device`` (default cuda if available, else meta) beside its
    prediction; returns the records (see the module docstring). ``framework`` ``hf`` runs the
    transformers + PEFT step (a spec's ``checkpoint_reentrant``: its checkpointing with ``use_reentrant=True``).
    Experiments with ``gpus`` > 1 trace rank ``rank`` of the sharded step (default device meta)."""
    if framework not in FRAMEWORKS:
        raise UserError(f"unknown --framework {framework!r}; valid: {', '.join(FRAMEWORKS)}")
    _refuse_quant_base(items)
    sharded = sharded_items(items)
    _check_snapshot(snapshot, items, framework, sharded)
    if sharded:
        from .sharded.command import check_sharded_run

        check_sharded_run(items, device, framework, rank)
        device = device or "meta"
    if framework == "hf":
        try:
            from .hf_runner import check_hf
        except ImportError as e:
            raise UserError(f"--framework hf needs transformers and peft: pip install 'memcalc[validate]' ({e})") from None
        for _name, e in items:  # a model or LoRA setup HF cannot express: one line, before any trace
            if isinstance(e, ExperimentSpec):
                check_hf(e)
    elif framework in TRAINERS:
        trainer = load_trainer(framework)
        for _name, spec in items:
            if isinstance(spec, ExperimentSpec):
                trainer.check(spec)
    _check_reentrant(items, framework, sharded)
    if device == "cuda" and not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
        raise UserError(f"--device cuda: no CUDA device is available (torch {torch.__version__}, built with {built}); "
                        "use --device meta to trace the step instead")
    err = Console(stderr=True)
    dev = device or default_device()
    if sharded:
        what = "transformers' model" if framework == "hf" else "memcalc's PyTorch replica of the model"
        err.print(f"memcalc validate: tracing rank {rank} of a sharded step in one process (fake process group, "
                  f"fake tensors on cpu; {what})")
    elif device is None:
        err.print(f"memcalc validate: running on {dev}" + ("" if dev == "cuda" else " (no CUDA device: tracing on the meta device)"))
    records: list[dict] = []
    stop: Optional[StopRequested] = None
    with stoppable():
        try:
            _run_all(items, dev, RecordFile(output) if output else None, scale_layers, snapshot, records, err,
                     framework, rank if sharded else None)
        except StopRequested as e:
            stopped(e)
            stop = e
    if stop is not None:
        err.print(f"memcalc validate: stopped by {stop} after {len(records)} of {len(items)} configs"
                  + (f"; {output} holds them" if output and records else ""))
        _finish(records, as_json)
        sys.stdout.flush()
        raise SystemExit(stop.exit_code)
    _finish(records, as_json)
    return records


def _run_all(items: list[tuple[str, ExperimentSpec]], dev: str, output: Optional[RecordFile],
             scale_layers: Optional[int], snapshot: Optional[str], records: list[dict], err: Console,
             framework: str = "plain", rank: Optional[int] = None) -> None:
    """Measure each item in turn (``framework`` hf: the transformers + PEFT step; ``rank`` given: rank
    ``rank`` of a sharded step), appending its record to ``records`` (and to ``output``)."""
    if framework == "hf":
        from .hf_runner import measure_hf
    if rank is not None:
        from .sharded.command import measure_sharded
    run_id = output.run_id if output is not None else new_run_id()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as prog:
        task = prog.add_task("validate", total=len(items))
        for k, (name, exp) in enumerate(items):
            head = f"[{k + 1}/{len(items)}] {name}"
            prog.update(task, description=f"{head}: starting")

            def say(msg: str, head: str = head) -> None:
                prog.update(task, description=f"{head}: {msg}")

            snap = snapshot
            if snapshot and len(items) > 1:
                root, ext = os.path.splitext(snapshot)
                snap = f"{root}-{name}{ext or '.pickle'}"
            try:
                if isinstance(exp, Exception):  # a config that could not be read (one of several named)
                    raise exp
                extra: dict = {}
                if _deepspeed(exp):
                    from .deepspeed_trace import trace_deepspeed  # one rank on the fake process group

                    meas = trace_deepspeed(exp, scale_layers=scale_layers, progress=say)
                elif rank is not None:
                    meas, extra = measure_sharded(exp, dev, rank, scale_layers, progress=say, framework=framework)
                elif framework in TRAINERS:
                    meas = load_trainer(framework).measure(exp, dev, scale_layers=scale_layers, progress=say,
                                                           allocator_sim=dev != "cuda")
                elif framework == "hf":
                    meas = measure_hf(exp, dev, scale_layers=scale_layers, progress=say,
                                      allocator_sim=dev != "cuda", snapshot=snap)
                else:
                    meas = measure(exp, dev, scale_layers=scale_layers, snapshot=snap, progress=say,
                                   allocator_sim=dev != "cuda")
                rec = _record(name, exp, meas, scale_layers)
                rec.update(extra)
            except Exception as e:  # noqa: BLE001 - a config that fails is a record; the run goes on
                meas = Measurement(device=dev, status="error", reason=error_reason(e), framework=framework)
                rec = _record(name, None if isinstance(exp, Exception) else exp, meas, scale_layers)
            rec["run_id"] = run_id
            records.append(rec)
            if output is not None:
                output.write(records)
            prog.advance(task)
            check_stop()


def _finish(records: list[dict], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(records, indent=2) + "\n")
    else:
        render_table(records)

"""``memcalc validate --protocol``: one command that runs, on one GPU within 10 minutes, what only a GPU
can tell (issue 30), and writes every case as it finishes in the measured format
(:mod:`memcalc.inputs.measured`; ``data/reference/measured/README.md``).

The list (:data:`CASES`), in this order (the cheap ones, then the 11 reference configs' eager steps,
the Hugging Face steps, the Trainer callback, then the compiled configs, whose inductor compile is the
slowest part):

- ``cuda-context``: the device's used memory (NVML / nvidia-smi) after the CUDA context is made;
- ``allocator-pattern``: a fixed request pattern through PyTorch's caching allocator and memcalc's replay;
- ``cublas-workspace``: what a linear's forward + backward leaves allocated (cuBLAS / cuBLASLt);
- ``config-NAME``: each reference config (``data/configs/``), memcalc's replica of Forgather's step
  (``runner.measure``); the compiled ones (torch.compile, with and without a memory budget) cut to
  :data:`COMPILE_LAYERS` layers on CUDA, so that inductor's compile fits the budget;
- ``hf-lora``, ``hf-qlora`` (bitsandbytes 4-bit), ``chunked-loss``: the real transformers + PEFT step
  (``hf_runner.measure_hf``) and the replica with torchtune's chunked cross-entropy;
- ``callback-trainer``: a 3-step Hugging Face ``Trainer`` run with ``MemcalcCallback``.

Every step case states memcalc's three peaks (allocated, reserved, device total, on this card:
memcalc.core.gpu_side) beside ``max_memory_allocated``, ``max_memory_reserved`` and the device's used
memory read when the step ends (:func:`_reading`), and dumps a memory snapshot
(``torch.cuda.memory._dump_snapshot``; on meta the tracer's, of the same format: validate/snapshot_trace.py)
beside the records. ``--device meta`` runs the same list traced,
each model cut to :data:`META_LAYERS` layer (the Trainer callback on the CPU with a tiny model): the
step cases compare the traced step (and its allocator replay) with the estimate's step figures; the
GPU-only probes are ``skipped`` with the reason, their prediction stated. A case that fails is an
``error`` record and the run goes on; a case that would end past :data:`BUDGET_S` seconds (its
:attr:`Case.cost_s` guessed from its kind) and every later one are
``skipped`` ("time budget"), so the summary is always printed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch

from memcalc.core.errors import UserError
from memcalc.core.gpu_side import biased_linears, device_memory
from memcalc.core.units import fmt_auto
from memcalc.inputs.measured import MEASURED_FORMAT, MeasuredRecord, comparison

from . import protocol_child as child
from . import protocol_probes as probes
from .interrupt import StopRequested, check as check_stop, stoppable, stopped
from .output import RecordFile, new_run_id
from .record import Prediction, make_record, target_spec
from .step import error_reason

#: layers of each model on meta (the trace's cost is per op, not per byte: one layer has every mechanism)
META_LAYERS = 1
#: layers of the compiled reference configs on CUDA (inductor compiles the whole unrolled graph)
COMPILE_LAYERS = 8
#: the protocol's wall-clock budget on CUDA, seconds: the remaining cases are skipped after it (10 minutes
#: for the whole command, less the interpreter's start, torch's import and the summary)
BUDGET_S = 480.0


@dataclass(frozen=True)
class Case:
    """One case: ``kind`` (measured-format kind), memcalc ``options`` (or a reference ``config``) for a step."""

    name: str
    kind: str
    what: str
    config: Optional[str] = None
    options: dict = field(default_factory=dict)
    cuda_layers: Optional[int] = None  # None: the whole model on CUDA
    cost_s: float = 20.0  # about how long it takes on an H100 (inductor's compile of 8 layers: ~60 s)


_EAGER = ("control", "fused", "checkpoint", "fused_checkpoint", "bfloat16", "bf16_fused_chkpt")
_COMPILED = ("compile", "memory_budget_05", "bf16_budget_60", "memory_budget_60", "fused_memory_budget_05")
_LLAMA = dict(model="llama-3.2-1b", batch=4, seq=1024)

CASES: tuple[Case, ...] = (
    Case("cuda-context", "context", "CUDA context: device used after creation - before"),
    Case("allocator-pattern", "allocator", "caching allocator on a fixed request pattern"),
    Case("cublas-workspace", "workspace", "cuBLAS / cuBLASLt workspaces of a linear's step"),
    *(Case(f"config-{n}", "step", f"reference config {n} (memcalc's replica, Forgather's step)", config=n)
      for n in _EAGER),
    Case("hf-lora", "step", "transformers + PEFT LoRA, bf16",
         options=dict(_LLAMA, framework="hf", precision="bf16", lora=True)),
    Case("hf-qlora", "step", "transformers + PEFT QLoRA (bitsandbytes nf4), checkpointing",
         options=dict(_LLAMA, framework="hf", qlora=True, checkpoint="full")),
    Case("chunked-loss", "step", "torchtune's chunked cross-entropy, 8 chunks, bf16",
         options=dict(_LLAMA, framework="plain", precision="bf16", loss="chunked", loss_chunks=8)),
    Case("callback-trainer", "callback", "MemcalcCallback on a 3-step Hugging Face Trainer run (gpt2)"),
    *(Case(f"config-{n}", "step", f"reference config {n}: torch.compile (inductor)", config=n,
           cuda_layers=COMPILE_LAYERS, cost_s=60.0) for n in _COMPILED),
)


def select(names: Sequence[str]) -> tuple[Case, ...]:
    """The cases named (``--case``; all when none), in the protocol's order; an unknown name is one
    UserError listing the valid ones."""
    names = list(names)
    known = {c.name for c in CASES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"unknown --case {', '.join(map(repr, unknown))}; valid: {', '.join(c.name for c in CASES)}")
    return tuple(c for c in CASES if not names or c.name in names)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "gpu"


def records_path(folder: str, device: str, gpu_name: Optional[str]) -> str:
    """``FOLDER/protocol-<device>-<gpu>-<UTC time>.json`` (the snapshots in the folder of the same stem); the
    GPU's name as NVML gives it, before the context probe (``gpu`` when unknown)."""
    gpu = _slug(gpu_name or "gpu") if device == "cuda" else "traced"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.join(folder, f"protocol-{device}-{gpu}-{stamp}.json")


#: where a GPU run's records land by default (the clone's folder, from the repository's root)
MEASURED_DIR = os.path.join("data", "reference", "measured")


def resolve_device(device: Optional[str]) -> str:
    """cuda or meta (default: cuda when available); --device cuda without CUDA is a UserError."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--protocol --device cuda: no CUDA device is available (torch {torch.__version__}); "
                        "use --device meta to run the protocol traced")
    device = device or ("cuda" if torch.cuda.is_available() else "meta")
    if device not in ("cuda", "meta"):
        raise UserError(f"--protocol runs on cuda or meta, not {device}")
    return device


def default_output(device: Optional[str]) -> Optional[str]:
    """``--output`` when not given: on CUDA the clone's ``data/reference/measured/`` (UserError outside a
    clone); traced on meta, nothing is written."""
    if resolve_device(device) != "cuda":
        return None
    if not os.path.isdir(MEASURED_DIR):
        raise UserError(f"--protocol on CUDA writes its records to {MEASURED_DIR}/ of a memcalc clone, and "
                        f"{os.getcwd()} has none: run it from the clone's root, or give --output FOLDER")
    return MEASURED_DIR


def command_of(case: Case, device: str, layers: Optional[int]) -> Optional[str]:
    """The ``memcalc validate`` command that reruns a step case alone."""
    if case.kind != "step":
        return None
    args = ["memcalc", "validate"] + (["--config", case.config] if case.config else [])
    for k, v in case.options.items():
        flag = "--" + k.replace("_", "-")
        args += [flag] if v is True else [flag, str(v)]
    args += ["--device", device] + (["--scale-layers", str(layers)] if layers else [])
    return " ".join(args)


@contextlib.contextmanager
def _reading(used: Optional[probes.DeviceUsed], out: dict) -> Iterator[None]:
    """The device's used memory when the step ends: the harnesses call ``torch.cuda.empty_cache()`` once
    the step's tensors are freed, when the caching allocator still holds every segment the step reserved
    (segments are returned only by ``empty_cache``); it is read there, then the cache is emptied. The
    reading kept is the one taken with the most reserved: model loading may empty the cache before the
    step too (transformers + bitsandbytes did, so the first GPU run read hf-qlora's device total before
    its step: 4.41 GiB against 9.34 GiB reserved)."""
    real = torch.cuda.empty_cache

    def reading_then_empty() -> None:
        reserved_now = int(torch.cuda.memory_reserved())
        if used is not None and reserved_now >= out.get("reserved_now", -1):
            out["used"] = used.since_start()
            out["reserved_now"] = reserved_now
        real()

    torch.cuda.empty_cache = reading_then_empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.empty_cache = real  # type: ignore[assignment]


def _comparisons(device: str, est: Any, exp: Any, measured: tuple, used: Optional[int]) -> list:
    """The step's comparisons: on CUDA the three peaks on this card, on meta the step's own figures."""
    alloc, reserved = measured
    if est is None:
        return [comparison("allocated" if device == "cuda" else "step_allocated", None, alloc, "no estimate")]
    if device != "cuda":
        return [comparison("step_allocated", est.peak_bytes, alloc, "estimate peak_bytes vs the traced step's tensors"),
                comparison("step_reserved", est.step_reserved_bytes, reserved,
                           "estimate step_reserved_bytes vs the caching-allocator replay over the traced step")]
    side = probes.card_side(device, biased_linears(exp), exp.training.compile)
    dev = device_memory(est.step_allocated_bytes, est.step_reserved_bytes, side)
    return [comparison("allocated", dev.allocated_peak_bytes, alloc,
                       "estimate allocated_peak_bytes (with the cuBLAS workspaces) vs max_memory_allocated"),
            comparison("reserved", dev.reserved_peak_bytes, reserved,
                       "estimate reserved_peak_bytes vs max_memory_reserved"),
            comparison("device_total", dev.device_total_bytes, used,
                       "estimate device_total_bytes (reserved + CUDA context + what the step loads) vs the device's "
                       "used memory at the step's end less before this process")]


def _step(case: Case, device: str, used: Optional[probes.DeviceUsed], snap: Optional[str],
          say: Callable[[str], None]) -> dict:
    """A step case: the experiment resolved as ``memcalc validate`` resolves it, measured (or traced)."""
    import memcalc.api

    from .predict import estimate

    layers = case.cuda_layers if device == "cuda" else META_LAYERS
    opts = dict(case.options)
    framework = opts.pop("framework", None)
    name, exp = memcalc.api.experiments([case.config] if case.config else [], framework=framework, **opts)[0]
    if isinstance(exp, Exception):
        raise exp
    reading: dict = {}
    with _reading(used if device == "cuda" else None, reading):
        if exp.profile.framework == "hf":
            from .hf_runner import measure_hf

            meas = measure_hf(exp, device, scale_layers=layers, progress=say, allocator_sim=device != "cuda",
                              snapshot=snap)
        else:
            from .runner import measure

            meas = measure(exp, device, scale_layers=layers, snapshot=snap, progress=say,
                           allocator_sim=device != "cuda")
    say("estimating")
    try:
        est = estimate(target_spec(exp, layers, meas.framework))
        pred = Prediction.of(est)
    except Exception as e:  # an unsupported combination is reported beside the measurement
        est, pred = None, Prediction.failed(e)
    vrec = make_record(name, exp, meas, layers, pred)
    reserved = meas.reserved_bytes if device == "cuda" else meas.sim_reserved_bytes
    comps = _comparisons(device, est, exp, (meas.measured_bytes, reserved), reading.get("used"))
    if vrec["partition_saved_bytes"] is not None:  # a compiled step off CUDA: its partition was checked
        comps.append(comparison("saved_for_backward", vrec["predicted_saved_bytes"], vrec["partition_saved_bytes"],
                                "memcalc's compiled saved set vs PyTorch's partitioner on meta "
                                "(runner._check_partition)"))
    return dict(status=meas.status, reason=vrec["reason"], validate_record=vrec,
                setup={"config": case.config, **case.options, "scale_layers": layers, "profile": exp.profile.name,
                       "experiment": exp.model_dump(mode="json")},
                comparisons=comps,
                details={k: v for k, v in reading.items() if k != "used"})


def _callback(device: str, used: Optional[probes.DeviceUsed], snap: Optional[str],
              say: Callable[[str], None]) -> dict:
    """A tiny Hugging Face Trainer run (3 steps, random tokens, the model from its preset's config with
    random weights) with ``MemcalcCallback``; on meta the Trainer runs on the CPU with gpt2 cut to one
    narrow layer (the callback's record then holds the estimate, nothing measured). The device total is
    read as training ends, the Trainer still holding the model, its optimizer and the cache."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from memcalc.inputs.presets import load_preset
    from memcalc.integrations.transformers import MemcalcCallback

    from .hf_model import build_hf_model
    from .hf_runner import quiet_transformers

    cuda = device == "cuda"
    m = load_preset("gpt2")
    if not cuda:
        m = m.model_copy(update=dict(n_layers=1, d_model=64, n_heads=2, d_ff=256, vocab_size=512, max_seq_len=128))
    batch, seq, steps = 4, (512 if cuda else 64), 3
    say(f"building {m.name} ({m.n_layers} layers); Trainer, {steps} steps of {batch} x {seq}")
    torch.manual_seed(0)
    with quiet_transformers(), tempfile.TemporaryDirectory() as tmp:
        model, _family = build_hf_model(m, None, torch.float32, "cpu")
        ids = torch.randint(0, m.vocab_size, (batch * steps, seq))
        data = [{"input_ids": r, "labels": r} for r in ids]
        args = TrainingArguments(output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch, report_to=[],
                                 save_strategy="no", logging_strategy="no", use_cpu=not cuda, bf16=cuda,
                                 disable_tqdm=True, dataloader_num_workers=0)
        cb = MemcalcCallback(quiet=True, name="callback-trainer")
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
        recording = bool(snap) and probes.snapshot_start(device)
        try:
            trainer.train()
        finally:
            if recording and snap:
                probes.snapshot_stop(snap)
        dev_used = used.since_start() if used is not None and cuda else None
        del trainer, model
    rec = cb.recorder.record if cb.recorder is not None else None
    if rec is None:
        raise RuntimeError("MemcalcCallback made no record")
    est = cb.recorder.estimate.estimate if cb.recorder.estimate is not None else None
    exp = est.experiment if est is not None else None
    alloc, reserved = rec["measured_bytes"], rec["reserved_bytes"]
    comps = _comparisons(device, est, exp, (alloc, reserved), dev_used)
    if not cuda:  # nothing measured off CUDA: the estimate's step figures stated alone
        comps = [c.model_copy(update={"how": "no measurement off CUDA (MemcalcCallback: " + c.how + ")"})
                 for c in comps]
    return dict(status=rec["status"], reason=rec["reason"], validate_record=rec, comparisons=comps,
                setup={"model": m.model_dump(mode="json"), "batch": batch, "seq": seq, "steps": steps,
                       "bf16": cuda, "estimate_options": {k: v for k, v in cb.options.items() if k != "model"}},
                details={"notes": rec.get("notes", []), "step_peak_bytes": rec.get("step_peak_bytes", [])})


def _run_case(case: Case, device: str, used: Optional[probes.DeviceUsed], snap: Optional[str],
              say: Callable[[str], None]) -> dict:
    if device == "cuda" and case.kind in ("step", "callback"):
        probes.clear_workspaces()  # each case's first step allocates its own, as in a fresh process
    if case.kind == "step":
        return _step(case, device, used, snap, say)
    if case.kind == "callback":
        return _callback(device, used, snap, say)
    recording = bool(snap) and probes.snapshot_start(device)
    try:
        if case.kind == "context":
            status, reason, comps, details = probes.context_probe(device, used)
        elif case.kind == "allocator":
            status, reason, comps, details = probes.allocator_probe(device)
        else:
            status, reason, comps, details = probes.workspace_probe(device)
    finally:
        if recording and snap:
            probes.snapshot_stop(snap)
    return dict(status=status, reason=reason, comparisons=comps, details=details, setup={})


#: why a case has no snapshot off CUDA, by kind (a traced step's is the tracer's, validate/snapshot_trace.py)
META_SNAPSHOT = {
    "step": "the step was not traced (see the reason), so the tracer wrote no snapshot",
    "callback": "the Trainer ran on the CPU: there is no CUDA allocator history to dump",
}
NOTHING_TRACED = "nothing is traced off CUDA for this probe: no allocator history to dump"


def _one(case: Case, device: str, used: Optional[probes.DeviceUsed], env: dict, snapdir: Optional[str],
         say: Callable[[str], None], over_budget: str, isolate: bool = False) -> dict:
    """The measured-format record of one case (an exception in it is an ``error`` record); ``isolate``: the
    case's own process's record (protocol_child.run_case), or an ``error`` record where it gave none."""
    t0 = time.perf_counter()
    layers = case.cuda_layers if device == "cuda" else META_LAYERS
    snap = os.path.join(snapdir, f"{case.name}.pickle") if snapdir else None
    if over_budget:
        out: dict = dict(status="skipped", reason=over_budget, comparisons=[], setup={})
    elif isolate:
        try:
            return child.run_case(case.name, device, snapdir, child.child_timeout(case.cost_s))
        except RuntimeError as e:  # killed, crashed: no record came back
            out = dict(status="error", reason=str(e), comparisons=[], setup={})
    else:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout is the table or --json's list alone
                out = _run_case(case, device, used, snap, say)
        except torch.cuda.OutOfMemoryError as e:  # type: ignore[attr-defined]
            out = dict(status="oom", reason=error_reason(e), comparisons=[], setup={})
        except Exception as e:  # a case that fails is a record; the run goes on
            out = dict(status="error", reason=error_reason(e), comparisons=[], setup={})
    written = snap is not None and os.path.exists(snap)
    if written:
        snapshot_reason = ""
    elif not snapdir:
        snapshot_reason = "no --output folder: the snapshots are written beside the records"
    elif device == "cuda":
        snapshot_reason = f"the case ended {out['status']}"
    else:
        snapshot_reason = META_SNAPSHOT.get(case.kind, NOTHING_TRACED)
    rec = dict(format=MEASURED_FORMAT, case=case.name, kind=case.kind, environment=env,
               command=command_of(case, device, layers), seconds=round(time.perf_counter() - t0, 3),
               snapshot=os.path.join(os.path.basename(snapdir), os.path.basename(snap)) if written else None,  # type: ignore[arg-type,type-var]
               snapshot_reason=snapshot_reason, **out)
    rec["setup"] = {"what": case.what, **rec["setup"]}
    rec["comparisons"] = [c.model_dump() if hasattr(c, "model_dump") else c for c in rec["comparisons"]]
    return MeasuredRecord.model_validate(rec).model_dump(mode="json")


def run_protocol(device: Optional[str], output: Optional[str], as_json: bool, budget_s: float = BUDGET_S,
                 cases: tuple[Case, ...] = CASES, isolate: Optional[bool] = None) -> list[dict]:
    """Run :data:`CASES` on ``device`` (cuda when available, else meta), writing each record to a new
    file in the folder ``output`` as it finishes; prints progress and the summary (or ``--json``).
    ``isolate`` (default: on CUDA) runs each case in a process of its own (validate/protocol_child.py)."""
    device = resolve_device(device)
    if isolate is None:
        isolate = device == "cuda" and not child.in_child()
    used = probes.DeviceUsed() if device == "cuda" else None  # before this process's CUDA context
    records: list[dict] = []
    env: Optional[dict] = None if device == "cuda" else probes.environment(device, None)
    path, rf, snapdir = _run_files(output, device, used)
    if not child.in_child():  # a case's own process: the parent said it
        probes.warn(f"{len(cases)} cases on {device}"
                    + (f"; records: {path}" if path else "; no --output: nothing written")
                    + ("" if device == "cuda" else f" (traced, models cut to {META_LAYERS} layer)"))
    t_start = time.perf_counter()
    out_of_time = False
    stop: Optional[StopRequested] = None
    with stoppable():
        try:
            for k, case in enumerate(cases):
                head = f"[{k + 1}/{len(cases)}] {case.name}"

                def say(msg: str, head: str = head) -> None:
                    probes.warn(f"{head}: {msg}")

                say(case.what)
                over = _over(time.perf_counter() - t_start + (child.CHILD_START_S if isolate else 0), case,
                             budget_s, out_of_time)
                # CUDA: the GPU's name and memory are read once the first case (the context probe) made it
                rec = _one(case, device, used, env or probes.environment(device, used, gpu=False), snapdir,
                           say, over, isolate)
                out_of_time = out_of_time or rec["reason"].startswith("time budget")
                if env is None:  # isolated: the GPU's, as the case's process read it
                    env = rec["environment"] if isolate else probes.environment(device, used)
                    rec["environment"] = env
                rec["run_id"] = rf.run_id if rf else None
                records.append(rec)
                if rf is not None:
                    rf.write(records)
                say(_line(rec))
                check_stop()
        except StopRequested as e:
            stopped(e)
            stop = e
    if stop is not None:
        probes.warn(f"stopped by {stop} after {len(records)} of {len(cases)} cases"
                    + (f"; {path} holds them" if path else ""))
    if snapdir and os.path.isdir(snapdir) and not os.listdir(snapdir):
        os.rmdir(snapdir)  # no case wrote one (meta, until its tracer writes snapshots)
    _finish(records, as_json)
    if stop is not None:
        sys.stdout.flush()
        raise SystemExit(stop.exit_code)
    return records


def _run_files(output: Optional[str], device: str, used: Any) -> tuple[Optional[str], Optional[RecordFile], Any]:
    """(records file, its writer, the snapshot folder beside it) in the folder ``output``; None without one."""
    if not output:
        return None, None, None
    path = records_path(output, device, used.name if used is not None else None)
    os.makedirs(snapdir := path[:-5] + "-snapshots", exist_ok=True)  # (and ``output`` with it)
    return path, RecordFile(path, new_run_id()), snapdir


def _over(elapsed: float, case: Case, budget_s: float, already: bool) -> str:
    """Why ``case`` is skipped for time ("" when it runs): once one is, every later one is too."""
    if not already and elapsed + case.cost_s <= budget_s:
        return ""
    return (f"time budget: {elapsed:.0f} s of the protocol's {budget_s:.0f} s spent, and this case takes about "
            f"{case.cost_s:.0f} s" if not already else "time budget: an earlier case was skipped for time")


def _line(rec: dict) -> str:
    c = rec["comparisons"][0] if rec["comparisons"] else None
    if rec["status"] != "ok" or c is None:
        return f"{rec['status']} ({rec['reason'] or '-'}) in {rec['seconds']:.1f} s"
    return (f"ok in {rec['seconds']:.1f} s: {c['metric']} predicted {_b(c['predicted_bytes'])}, measured "
            f"{_b(c['measured_bytes'])}, error {_p(c['error_pct'])}")


def _b(n: Optional[int]) -> str:
    return "-" if n is None else fmt_auto(n)


def _p(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.2f}%"


def _finish(records: list[dict], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(records, indent=2) + "\n")
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    traced = all(r["environment"]["device"] != "cuda" for r in records)
    t = Table(title=f"memcalc validate --protocol: predicted vs {'traced' if traced else 'measured'}",
              box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("case", "status", "metric", "predicted", "traced" if traced else "measured", "error"):
        t.add_column(col, justify="right" if col in ("predicted", "measured", "traced", "error") else "left")
    for r in records:
        rows = r["comparisons"] or [None]
        for i, c in enumerate(rows):
            t.add_row(r["case"] if i == 0 else "", r["status"] if i == 0 else "", c["metric"] if c else "-",
                      _b(c["predicted_bytes"]) if c else "-", _b(c["measured_bytes"]) if c else "-",
                      _p(c["error_pct"]) if c else "-")
    console = Console(stderr=False)
    console.width = max(console.width, 110)  # the case names whole, piped too
    console.print(t)
    console.print("error = (predicted - measured) / measured; reasons:", style="dim")
    for r in records:
        if r["reason"]:
            console.print(f"  {r['case']}: {r['reason']}", style="dim")

"""``memcalc.measure()`` and the Hugging Face callback's shared part: a real training run's peak memory
beside memcalc's estimate of the same setup, written as a ``memcalc validate`` record.

:class:`Recorder` does the work: :meth:`~Recorder.start` resets CUDA's peak statistics;
:meth:`~Recorder.step` (after every optimizer step) records ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` since the last step and resets the peak again; :meth:`~Recorder.finish`
prints predicted vs measured and the gap, and writes the record (:func:`.record.make_record`,
filled by :func:`.runner.fill_measurement`; the file as ``validate --output`` writes it,
:class:`.output.RecordFile`).

What is measured: the largest per-step ``max_memory_allocated`` over the run (the first step, which
creates the optimizer state, included), as memcalc's ``peak_bytes`` is the higher of the first and
the steady-state step. Memory allocated before :meth:`~Recorder.start` (the model's weights) is in
every reading: resetting the peak sets it to what is allocated now. The record adds to
``validate``'s keys: ``source`` (``measure`` or ``callback``), ``gpu_name``, ``cuda_version``,
``steps``, ``step_peak_bytes`` / ``step_reserved_bytes`` (one per step) and ``notes`` (how the setup
was read). Without CUDA nothing is measured: one warning line, and the record holds the estimate
with ``measured_bytes`` null and status ``skipped``.

:class:`Measure` is the context manager ``memcalc.measure()`` returns.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any, Optional

import torch

from memcalc.core.errors import UserError
from memcalc.core.units import fmt_bytes

from .output import RecordFile
from .record import Prediction, make_record, target_spec
from .step import Measurement, error_reason, fill_measurement

NO_CUDA = "CUDA is not available: nothing was measured"


def check_output(path: Optional[str]) -> None:
    """An output file that cannot or should not be written is a one-line error before training starts: the
    rules of ``--output`` (:func:`memcalc.core.files.check_output_path`: a FIFO, a device, a path under /dev,
    an existing file that is not a JSON list of records are refused)."""
    from memcalc.core.files import check_output_path

    if path is not None and not isinstance(path, str):
        raise UserError(f"output= must be a string or None, not {type(path).__name__}")
    check_output_path(path, "output=")


def _versions() -> dict[str, Optional[str]]:
    """The library versions of the run: transformers and peft when the process has imported them."""
    out: dict[str, Optional[str]] = {}
    for name in ("transformers", "peft"):
        mod = sys.modules.get(name)
        out[name] = getattr(mod, "__version__", None) if mod is not None else None
    return out


class Recorder:
    """Per-step CUDA peaks of a real run, and the record that compares them with ``estimate``.

    ``estimate``: a :class:`memcalc.api.EstimateResult`; None: memcalc could not estimate the setup
    (``why`` says why; the record has ``predicted_bytes`` null). ``notes``: how the setup was read
    (put in the record and printed). ``predict``: :func:`memcalc.api.estimate`, for the one case where
    the record compares with another spec than the estimate's (:func:`.record.target_spec`: the HF
    rules over a profile whose framework is hf but whose rules were changed, ``loss="chunked"``);
    passed in, as the API imports this module.
    """

    def __init__(self, estimate: Optional[Any], name: str, output: Optional[str] = None,
                 source: str = "measure", notes: Optional[list[str]] = None, quiet: bool = False,
                 why: str = "", predict: Optional[Callable[[Any], Any]] = None) -> None:
        check_output(output)
        self.estimate, self.name, self.output, self.source = estimate, name, output, source
        self.notes, self.quiet, self.why, self.predict = list(notes or []), quiet, why, predict
        self.cuda = torch.cuda.is_available()
        self.step_peaks: list[int] = []
        self.step_reserved: list[int] = []
        self.record: Optional[dict[str, Any]] = None
        self._t0 = time.perf_counter()

    def say(self, line: str) -> None:
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)

    def start(self) -> None:
        """Reset CUDA's peak statistics (or warn, once, that nothing will be measured)."""
        self._t0 = time.perf_counter()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.say(f"memcalc: warning: {NO_CUDA}; the record will hold the estimate only (measured_bytes null)")

    def step(self) -> None:
        """After an optimizer step: this step's allocated and reserved peaks; the peak is reset."""
        if not self.cuda:
            return
        self.step_peaks.append(int(torch.cuda.max_memory_allocated()))
        self.step_reserved.append(int(torch.cuda.max_memory_reserved()))
        torch.cuda.reset_peak_memory_stats()

    def finish(self, status: str = "ok", reason: str = "") -> dict[str, Any]:
        """The record (printed as one summary line, written to ``output``)."""
        if self.cuda and not self.step_peaks:  # step() never called: the whole block is one step
            self.step()
        exp = self.estimate.spec if self.estimate is not None else None
        meas = Measurement(device="cuda")
        meas.framework = exp.profile.framework if exp is not None else "plain"
        v = _versions()
        meas.transformers_version, meas.peft_version = v["transformers"], v["peft"]
        if status != "ok":
            meas.status, meas.reason = status, reason
        elif not self.cuda:
            meas.status, meas.reason = "skipped", NO_CUDA
        else:
            fill_measurement(meas, (max(self.step_peaks), None, "", {}),
                             SimpleNamespace(reserved=max(self.step_reserved)), "cuda", None, None, False)
            meas.first_step_bytes = self.step_peaks[0]
        meas.seconds = round(time.perf_counter() - self._t0, 3)
        rec = make_record(self.name, exp, meas, None, self._prediction(meas.framework))
        if self.why:
            rec["reason"] = "; ".join(r for r in (rec["reason"], f"no estimate: {self.why}") if r)
        rec.update(
            source=self.source,
            gpu_name=torch.cuda.get_device_name() if self.cuda else None,
            cuda_version=torch.version.cuda,
            steps=len(self.step_peaks),
            step_peak_bytes=list(self.step_peaks),
            step_reserved_bytes=list(self.step_reserved),
            notes=list(self.notes),
        )
        self.record = rec
        self.say(summary(rec))
        for n in self.notes:
            self.say(f"memcalc: note: {n}")
        if self.output is not None:
            RecordFile(self.output).write([rec])
            self.say(f"memcalc: record written to {self.output}")
        return rec


    def _prediction(self, framework: str) -> Optional[Prediction]:
        """What the record compares with: the estimate given, or ``predict``'s of the record's spec
        where that differs from the estimate's."""
        if self.estimate is None:
            return None
        exp = self.estimate.spec
        target = target_spec(exp, None, framework)
        if target == exp or self.predict is None:
            return Prediction.of(self.estimate.estimate)
        try:
            return Prediction.of(self.predict(target).estimate)
        except Exception as e:  # an unsupported combination is reported beside the measurement
            return Prediction.failed(e)


def summary(rec: dict[str, Any]) -> str:
    """One line: predicted vs measured and the gap (GiB = 2**30)."""
    pred, meas = rec["predicted_bytes"], rec["measured_bytes"]
    p = "no prediction" if pred is None else f"predicted {fmt_bytes(pred)} (peak in {rec['peak_phase']})"
    if meas is None:
        why = rec["reason"] or rec["status"]
        return f"memcalc: {rec['config']}: {p}; not measured ({why})"
    n = rec["steps"]
    m = (f"measured {fmt_bytes(meas)} (max_memory_allocated, highest of {n} step{'s' if n != 1 else ''}; "
         f"reserved {fmt_bytes(rec['reserved_bytes'])})")
    gap = "" if rec["error_pct"] is None else f", gap {rec['error_pct']:+.2f}%"
    return f"memcalc: {rec['config']}: {p}, {m}{gap}"


class Measure:
    """``memcalc.measure(...)``: a context manager around any training loop (see :func:`memcalc.api.measure`).

    ``memcalc.measure`` builds the estimate before it, so bad inputs fail before training starts. Call
    :meth:`step` after every optimizer step; on exit the record is made (``record``), printed, and
    written to ``output``. An exception in the block is recorded (``oom`` or ``error``) and re-raised.
    """

    def __init__(self, estimate: Any, *, output: Optional[str] = None, name: Optional[str] = None,
                 quiet: bool = False, predict: Optional[Callable[[Any], Any]] = None) -> None:
        # a memcalc.api.EstimateResult, and memcalc.api.estimate (the API passes both: no import back)
        self.estimate = estimate
        self.recorder = Recorder(self.estimate, name or self.estimate.spec.name, output, "measure", quiet=quiet,
                                 predict=predict)

    @property
    def record(self) -> Optional[dict[str, Any]]:
        """The ``memcalc validate`` record, once the block has ended."""
        return self.recorder.record

    @property
    def step_peaks(self) -> list[int]:
        """``max_memory_allocated`` of each step so far (empty without CUDA)."""
        return list(self.recorder.step_peaks)

    def step(self) -> None:
        """Call after every optimizer step."""
        self.recorder.step()

    def __enter__(self) -> "Measure":
        self.recorder.start()
        return self

    def __exit__(self, et, ev, tb) -> bool:
        if et is None:
            self.recorder.finish()
        elif issubclass(et, torch.cuda.OutOfMemoryError):  # type: ignore[attr-defined]
            self.recorder.finish("oom", str(ev).strip().splitlines()[0] if str(ev).strip() else "CUDA out of memory")
        elif issubclass(et, Exception):
            self.recorder.finish("error", error_reason(ev))
        return False

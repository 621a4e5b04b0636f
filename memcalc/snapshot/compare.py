"""``memcalc compare``: a PyTorch memory snapshot held against the estimate of the same step.

The snapshot's trace is replayed (:mod:`memcalc.snapshot.replay`), each allocation attributed to one
of memcalc's kinds (:mod:`memcalc.snapshot.attribute`), and the measured step set beside the
predicted one (:class:`memcalc.engine.result.Estimate`):

- the **peak**: the most bytes the step's allocations hold at once, each rounded as the caching
  allocator rounds it, against ``Estimate.peak_bytes`` (the same count: memcalc's model of
  ``torch.cuda.max_memory_allocated``). The cuBLAS workspaces are not the step's tensors
  (``Estimate.device_parts["workspace_bytes"]``): they are left out of the measured peak and shown
  on their own row when the snapshot has them;
- what is alive **at the peak**, by kind, against ``Estimate.components_by_kind``;
- each **phase**'s highest point against ``Estimate.phases``, and the first phase, in the order
  the trace runs them, where the two part by more than :data:`PART_FRACTION` of the predicted
  peak, with the kind that differs most there (the predicted side: the phase's highest
  ``Estimate.timeline`` point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memcalc.core.units import fmt_auto
from memcalc.engine.result import KINDS, KIND_NAMES, Estimate
from memcalc.snapshot.attribute import FORWARD, WORKSPACE, phase_starts
from memcalc.snapshot.replay import Replay

#: the measured and predicted steps "part" at the first phase whose highest point differs by more
#: than this fraction of the predicted peak (a stated threshold, not a tolerance of the estimate)
PART_FRACTION = 0.01
#: the verdict says "within" when the measured peak is within this fraction of the predicted one
#: (issue 30: "every kind within 1%" of the meta tracer's snapshot of the same step)
AGREE_FRACTION = 0.01


@dataclass(frozen=True)
class Row:
    """One line of the comparison: predicted and measured bytes (None: that side has no such row)."""

    name: str
    predicted_bytes: Optional[int]
    measured_bytes: Optional[int]

    @property
    def difference_bytes(self) -> Optional[int]:
        if self.predicted_bytes is None or self.measured_bytes is None:
            return None
        return self.measured_bytes - self.predicted_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "predicted_bytes": self.predicted_bytes, "measured_bytes": self.measured_bytes,
                "difference_bytes": self.difference_bytes}


@dataclass(frozen=True)
class Comparison:
    """A snapshot against an estimate (module docstring); every number in integer bytes."""

    snapshot: str
    device: int
    source: str  # "memcalc" (memcalc's frames), "stacks" (a real run's frames) or "no stacks"
    predicted_peak_bytes: int
    predicted_phase: str
    predicted_label: str
    measured_peak_bytes: int
    measured_phase: str
    measured_label: str
    kinds: tuple[Row, ...]  # alive at the peak
    phases: tuple[Row, ...]  # each phase's highest point
    parts_at: Optional[dict[str, Any]]  # the first phase where they part, or None
    snapshot_layers: Optional[int] = None  # decoder layers memcalc's frames name (None: no such frames)
    setup_layers: Optional[int] = None  # the estimated model's decoder layers
    steps: int = 1  # the steps recorded (forward phases); the last is compared, the steady state
    first_step: Optional[tuple[int, int]] = None  # (predicted, measured) peak of the first, when several

    @property
    def difference_fraction(self) -> float:
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / max(self.predicted_peak_bytes, 1)

    def document(self) -> dict[str, Any]:
        """``--json``: the comparison, bytes as integers."""
        return {
            "snapshot": self.snapshot, "device": self.device, "attributed_from": self.source,
            "agree_fraction": AGREE_FRACTION, "part_fraction": PART_FRACTION,
            "peak": {"predicted_bytes": self.predicted_peak_bytes, "measured_bytes": self.measured_peak_bytes,
                     "difference_bytes": self.measured_peak_bytes - self.predicted_peak_bytes,
                     "predicted_phase": self.predicted_phase, "predicted_at": self.predicted_label,
                     "measured_phase": self.measured_phase, "measured_at": self.measured_label},
            "kinds_at_peak": [r.to_dict() for r in self.kinds],
            "phases": [r.to_dict() for r in self.phases],
            "parts_at": self.parts_at, "snapshot_layers": self.snapshot_layers, "setup_layers": self.setup_layers,
            "steps": self.steps,
            "first_step": None if self.first_step is None else {
                "predicted_bytes": self.first_step[0], "measured_bytes": self.first_step[1],
                "difference_bytes": self.first_step[1] - self.first_step[0]},
        }


def _series(rep: Replay, leave_out: frozenset[str]) -> list[int]:
    """Live bytes after each entry, without the allocations of the kinds ``leave_out``."""
    n = len(rep.live)
    delta = [0] * (n + 1)
    base = 0
    for a in rep.allocations:
        if a.kind in leave_out:
            continue
        if a.start < 0:
            base += a.bytes
        else:
            delta[a.start] += a.bytes
        if a.end is not None:
            delta[a.end] -= a.bytes
    out, total = [], base
    for i in range(n):
        total += delta[i]
        out.append(total)
    return out


def _kinds_at(rep: Replay, i: int, leave_out: frozenset[str]) -> dict[str, int]:
    return {k: v for k, v in rep.by_kind_at(i).items() if k not in leave_out}


def _predicted_kinds_in(est: Estimate, phase: str) -> dict[str, int]:
    points = [p for p in est.timeline if p.phase == phase]
    if phase == est.peak_phase or not points:
        return dict(est.components_by_kind)
    return dict(max(points, key=lambda p: p.total_bytes).by_kind)


def _kind_rows(predicted: dict[str, int], measured: dict[str, int]) -> tuple[Row, ...]:
    names = list(KINDS) + sorted(k for k in measured if k not in KINDS)
    return tuple(Row(k, predicted.get(k, 0), measured.get(k, 0)) for k in names)


def compare(rep: Replay, est: Estimate, snapshot: str) -> Comparison:
    """The snapshot replayed in ``rep`` against the estimate ``est`` (module docstring)."""
    leave_out = frozenset({WORKSPACE})
    step = _series(rep, leave_out)
    forwards = phase_starts(rep.phases).get(FORWARD, [])
    # several steps recorded: the last is the steady state the estimate predicts, the first is reported
    # beside the estimate's first step (its optimizer state made in its optimizer step)
    steady = forwards[-1] if len(forwards) > 1 else 0
    first_step = None
    if len(forwards) > 1:
        first_step = max([_series_before(rep, leave_out), *step[:forwards[1]]])
    peak, at = (_series_before(rep, leave_out), -1) if steady == 0 else (-1, steady)
    for i in range(steady, len(step)):
        if step[i] > peak:
            peak, at = step[i], i
    kinds = _kind_rows(dict(est.components_by_kind), _kinds_at(rep, at, leave_out))
    workspace = max(_series(rep, frozenset(k for k in _all_kinds(rep) if k != WORKSPACE)), default=0)
    if workspace:
        kinds += (Row(WORKSPACE, est.device_parts.get("workspace_bytes", 0), workspace),)
    measured_phases: dict[str, tuple[int, int]] = {}
    for i in range(steady, len(step)):
        v, ph = step[i], rep.phases[i]
        if ph not in measured_phases or v > measured_phases[ph][0]:
            measured_phases[ph] = (v, i)
    phase_names = list(measured_phases) + [p for p in est.phases if p not in measured_phases]
    phases = tuple(Row(p, est.phases.get(p), measured_phases[p][0] if p in measured_phases else None)
                   for p in phase_names)
    parts_at = None
    for r in phases:
        d = r.difference_bytes
        if d is not None and abs(d) > PART_FRACTION * est.peak_bytes:
            i = measured_phases[r.name][1]
            pk, mk = _predicted_kinds_in(est, r.name), _kinds_at(rep, i, leave_out)
            worst = max(set(pk) | set(mk), key=lambda k: abs(mk.get(k, 0) - pk.get(k, 0)))
            parts_at = {"phase": r.name, "predicted_bytes": r.predicted_bytes, "measured_bytes": r.measured_bytes,
                        "difference_bytes": d, "kind": worst, "kind_predicted_bytes": pk.get(worst, 0),
                        "kind_measured_bytes": mk.get(worst, 0), "entry": i}
            break
    source = "memcalc" if rep.memcalc_frames else "stacks" if rep.has_frames else "no stacks"
    label = _label_at(rep, at)
    layers = [a.layer for a in rep.allocations if a.layer is not None]
    model = getattr(getattr(est, "experiment", None), "model", None)
    return Comparison(snapshot, rep.device, source, est.peak_bytes, est.peak_phase, est.peak_label, peak,
                      rep.phase_at(at), label, kinds, phases, parts_at, max(layers) + 1 if layers else None,
                      getattr(model, "n_layers", None), len(forwards),
                      None if first_step is None else (est.first_step_peak_bytes, first_step))


def _series_before(rep: Replay, leave_out: frozenset[str]) -> int:
    return sum(a.bytes for a in rep.allocations if a.start < 0 and a.kind not in leave_out)


def _all_kinds(rep: Replay) -> set[str]:
    return {a.kind for a in rep.allocations}


def _label_at(rep: Replay, i: int) -> str:
    """The label of the allocation made at entry ``i`` (the one that set the peak)."""
    return next((a.label for a in rep.allocations if a.start == i and i >= 0), "")


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:+.1f}%" if whole else "n/a"


def _fmt(n: Optional[int]) -> str:
    return "-" if n is None else fmt_auto(n)


def comparison_lines(c: Comparison) -> list[str]:
    """The answer first (the peak's verdict), then the table by kind at the peak, the phases, and
    where the two part."""
    within = abs(c.difference_fraction) <= AGREE_FRACTION
    verdict = (f"within {AGREE_FRACTION:.0%} of" if within else
               "above" if c.measured_peak_bytes > c.predicted_peak_bytes else "below")
    out = [f"Measured peak {fmt_auto(c.measured_peak_bytes)} in {c.measured_phase}: "
           f"{_pct(c.measured_peak_bytes - c.predicted_peak_bytes, c.predicted_peak_bytes)}, {verdict} the predicted "
           f"{fmt_auto(c.predicted_peak_bytes)} in {c.predicted_phase}"]
    if c.parts_at is None:
        out.append(f"The timelines stay within {PART_FRACTION:.0%} of the predicted peak in every phase")
    else:
        p = c.parts_at
        out.append(f"They part in {p['phase']}: measured {fmt_auto(p['measured_bytes'])} vs predicted "
                   f"{fmt_auto(p['predicted_bytes'])} ({_pct(p['difference_bytes'], p['predicted_bytes'])}), most in "
                   f"{KIND_NAMES.get(p['kind'], p['kind'])} ({fmt_auto(p['kind_measured_bytes'])} vs "
                   f"{fmt_auto(p['kind_predicted_bytes'])})")
    if c.first_step is not None:
        p1, m1 = c.first_step
        out.append(f"{c.steps} steps recorded: the last is compared (the steady state); the first peaks at "
                   f"{fmt_auto(m1)}, {_pct(m1 - p1, p1)} against the estimate's first step ({fmt_auto(p1)})")
    if c.snapshot_layers is not None and c.setup_layers is not None and c.snapshot_layers < c.setup_layers:
        out.append(f"Note: the snapshot's frames name {c.snapshot_layers} decoder layers, the setup has "
                   f"{c.setup_layers}: is it another model (validate --scale-layers cuts it)?")
    head = f" {'':<18}{'predicted':>12}{'measured':>12}{'difference':>13}"
    out += ["", "At the peak" + (f" (measured at {c.measured_label})" if c.measured_label else ""), head]
    for r in c.kinds:
        d = r.difference_bytes
        out.append(f" {KIND_NAMES.get(r.name, r.name):<18}{_fmt(r.predicted_bytes):>12}{_fmt(r.measured_bytes):>12}"
                   f"{'' if d is None else _pct(d, r.predicted_bytes or 0) if r.predicted_bytes else _fmt(d):>13}")
    out.append(f" {'peak':<18}{_fmt(c.predicted_peak_bytes):>12}{_fmt(c.measured_peak_bytes):>12}"
               f"{_pct(c.measured_peak_bytes - c.predicted_peak_bytes, c.predicted_peak_bytes):>13}")
    out += ["", "Highest point of each phase", head]
    for r in c.phases:
        d = r.difference_bytes
        out.append(f" {r.name:<18}{_fmt(r.predicted_bytes):>12}{_fmt(r.measured_bytes):>12}"
                   f"{'' if d is None else _pct(d, r.predicted_bytes or 0):>13}")
    out.append("")
    out.append({"memcalc": "Kinds from memcalc's frames in the snapshot.",
                "stacks": "Kinds from the allocations' stacks and lifetimes (see `memcalc compare --help`).",
                "no stacks": "The snapshot has no stacks: record with torch.cuda.memory._record_memory_history() "
                             "(context and stacks 'all') to split it by kind."}[c.source])
    return out


__all__ = ["AGREE_FRACTION", "PART_FRACTION", "Comparison", "Row", "compare", "comparison_lines"]

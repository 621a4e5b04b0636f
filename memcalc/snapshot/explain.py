"""``memcalc explain``: which part of the step crossed the card, whether fragmentation did it, and the
smallest change that fits (the estimate's "To make it fit", :mod:`memcalc.plan.remedies`, computed by
:func:`memcalc.api.estimate` for the card the message names).

The card is the message's capacity (:meth:`memcalc.snapshot.oom.OomMessage.capacity_bytes`). What the
step's tensors may use on it is that capacity less the parts of the device total that are not the
step's tensors (:attr:`memcalc.engine.result.Estimate.device_parts`: the CUDA context, the cuBLAS
workspaces, NCCL); the first point of the predicted timeline (:attr:`Estimate.timeline`, then the peak
itself) whose allocated bytes pass it is where the step crosses the card. When no point does but the
device total does, the caching allocator's reserved overhead at the peak
(``allocator_overhead_bytes``, the replay's reserved less allocated) is what crosses.

Fragmentation failed the request when the message's "reserved by PyTorch but unallocated" is at least
the request: PyTorch held that much and could not hand it out as one block. It is *the* issue when the
predicted step fits the card; then the remedy is the message's own:
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (c10/cuda/CUDACachingAllocator.cpp, the OOM
message; PyTorch's CUDA notes, :data:`memcalc.snapshot.oom.EXPANDABLE_SEGMENTS_DOC`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memcalc.core.units import fmt_auto
from memcalc.engine.result import KIND_NAMES
from memcalc.snapshot.oom import EXPANDABLE_SEGMENTS_DOC, OomMessage

#: the parts of the device total that are not the step's tensors (Estimate.device_parts keys)
FIXED_PARTS = ("cuda_context_bytes", "step_loaded_bytes", "workspace_bytes", "nccl_bytes")


@dataclass(frozen=True)
class Explanation:
    """The message against the estimate (module docstring); bytes as integers."""

    message: OomMessage
    capacity_bytes: int
    device_total_bytes: int  # what memcalc predicts the step needs on the card
    tensor_budget_bytes: int  # the capacity less FIXED_PARTS
    crosses: Optional[dict[str, Any]]  # where the predicted step passes the budget (None: it fits)
    fragmentation: bool
    failed_at: Optional[dict[str, Any]]  # where the predicted step first holds allocated + requested
    remedies: list[Any]  # memcalc.plan.remedies.Remedy, smallest first
    outside_bytes: int = 0  # predicted outside the caching allocator: the CUDA context and NCCL

    def document(self) -> dict[str, Any]:
        return {"message": self.message.to_dict(), "capacity_bytes": self.capacity_bytes,
                "device_total_bytes": self.device_total_bytes, "tensor_budget_bytes": self.tensor_budget_bytes,
                "crosses": self.crosses, "fragmentation": self.fragmentation,
                "fragmentation_is_the_issue": self.fragmentation and self.crosses is None,
                "expandable_segments_doc": EXPANDABLE_SEGMENTS_DOC if self.fragmentation else None,
                "failed_at": self.failed_at, "predicted_outside_allocator_bytes": self.outside_bytes,
                "to_make_it_fit": [r.as_json() for r in self.remedies]}


def _point(label: str, phase: str, total: int, by_kind: dict[str, int]) -> dict[str, Any]:
    kind = max(by_kind, key=lambda k: by_kind[k]) if by_kind else ""
    return {"label": label, "phase": phase, "allocated_bytes": total, "kind": kind,
            "kind_bytes": by_kind.get(kind, 0), "by_kind": dict(by_kind)}


def _first_at_least(est: Any, level: int) -> Optional[dict[str, Any]]:
    """The first point of the predicted step (the timeline, then the peak) holding ``level`` bytes or more."""
    for p in est.timeline:
        if p.total_bytes >= level:
            return _point(p.label, p.phase, p.total_bytes, p.by_kind)
    if est.peak_bytes >= level:
        return _point(est.peak_label, est.peak_phase, est.peak_bytes, est.components_by_kind)
    return None


def explain(est: Any, message: OomMessage, remedies: list[Any]) -> Explanation:
    """``message`` held against the estimate ``est`` of the step on the card it names."""
    capacity = message.capacity_bytes
    budget = capacity - sum(est.device_parts.get(k, 0) for k in FIXED_PARTS)
    crosses = _first_at_least(est, budget + 1)
    if crosses is None and est.device_total_bytes > capacity:
        crosses = _point(est.peak_label, est.peak_phase, est.peak_bytes, est.components_by_kind)
        crosses["allocator_overhead_bytes"] = est.device_parts.get("allocator_overhead_bytes", 0)
    fragmentation = message.reserved_unallocated_bytes >= message.requested_bytes
    failed_at = _first_at_least(est, message.allocated_bytes + message.requested_bytes)
    outside = sum(est.device_parts.get(k, 0) for k in ("cuda_context_bytes", "step_loaded_bytes", "nccl_bytes"))
    return Explanation(message, capacity, est.device_total_bytes, budget, crosses, fragmentation, failed_at,
                       list(remedies), outside)


def explanation_lines(x: Explanation) -> list[str]:
    """The answer first (where the step crosses the card), then fragmentation, where the run failed,
    the changes that fit, and the message's numbers."""
    m, card = x.message, fmt_auto(x.capacity_bytes)
    c = x.crosses
    outside = max(m.total_bytes - m.free_bytes - m.allocated_bytes - m.reserved_unallocated_bytes, 0)
    if c is None:
        out = [f"memcalc predicts this step fits the {card} card (needs {fmt_auto(x.device_total_bytes)}): the "
               "run that failed differs from the setup given, or something else holds the card "
               f"({fmt_auto(outside)} of it is outside PyTorch's allocator, against {fmt_auto(x.outside_bytes)} "
               "predicted: the CUDA context, what the step loads into it, and NCCL)"]
    elif "allocator_overhead_bytes" in c:
        out = [f"The step crosses the {card} card at its peak ({c['phase']}, at {c['label']}) through the caching "
               f"allocator's reserved overhead ({fmt_auto(c['allocator_overhead_bytes'])}): the tensors "
               f"({fmt_auto(c['allocated_bytes'])}) fit, the device total ({fmt_auto(x.device_total_bytes)}) "
               "does not"]
    else:
        out = [f"The step crosses the {card} card in {c['phase']}, at {c['label']}: "
               f"{fmt_auto(c['allocated_bytes'])} allocated there, {KIND_NAMES.get(c['kind'], c['kind'])} the "
               f"largest ({fmt_auto(c['kind_bytes'])}); the tensors have {fmt_auto(x.tensor_budget_bytes)} of the "
               f"card beside the CUDA context and workspaces; the step needs {fmt_auto(x.device_total_bytes)} in all"]
    held = fmt_auto(m.reserved_unallocated_bytes)
    asked = fmt_auto(m.requested_bytes)
    if x.fragmentation and c is None:
        out.append(f"Fragmentation is the issue: PyTorch held {held} reserved but unallocated, at least the {asked} "
                   "asked for, and had no block that large; run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                   f"(the message's own advice; {EXPANDABLE_SEGMENTS_DOC})")
    elif x.fragmentation:
        out.append(f"Fragmentation failed this request ({held} reserved but unallocated, at least the {asked} asked "
                   "for), but PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True alone will not make the step fit: "
                   "it needs more than the card (above)")
    else:
        out.append(f"Fragmentation is not the issue: {held} reserved but unallocated is less than the {asked} "
                   "asked for")
    level = fmt_auto(m.allocated_bytes + m.requested_bytes)
    f = x.failed_at
    out.append(f"The run failed asking for {level} in all (allocated + requested); the predicted step first "
               f"holds that much in {f['phase']}, at {f['label']}" if f is not None else
               f"The run failed asking for {level} in all (allocated + requested), more than the predicted step "
               "ever holds: the run's setup is larger than the one given")
    if x.remedies:
        out.append(f"To make it fit {card} (the smallest change; `memcalc plan` lists others):")
        for r in x.remedies:
            out.append(f"  {r.flags}: {fmt_auto(r.headroom_bytes)} to spare (peak {fmt_auto(r.peak_bytes)})")
            if r.command:
                out.append(f"    {r.command}")
    elif c is not None:
        out.append(f"To make it fit {card}: no single change memcalc tries is enough; `memcalc plan --gpu "
                   f"{card.replace(' ', '')}` searches every combination")
    out += ["", "The message's numbers:", f"  GPU {m.device}: {fmt_auto(m.total_bytes)} total, "
            f"{fmt_auto(m.free_bytes)} free" + (f", {fmt_auto(m.allowed_bytes)} allowed" if m.allowed_bytes else ""),
            f"  allocated by PyTorch {fmt_auto(m.allocated_bytes)}, reserved but unallocated {held}, "
            f"requested {fmt_auto(m.requested_bytes)}",
            f"  outside PyTorch's allocator (total - free - allocated - reserved): {fmt_auto(outside)}; memcalc "
            f"predicts {fmt_auto(x.outside_bytes)} (the CUDA context and NCCL)"]
    if m.process_bytes is not None:
        out.append(f"  this process {fmt_auto(m.process_bytes)} in all (the CUDA context and other non-PyTorch "
                   f"memory: {fmt_auto(max(m.process_bytes - m.allocated_bytes - m.reserved_unallocated_bytes, 0))})")
    if m.other_processes_bytes is not None:
        out.append(f"  processes on the GPU: {fmt_auto(m.other_processes_bytes)} in use")
    return out


__all__ = ["FIXED_PARTS", "Explanation", "explain", "explanation_lines"]

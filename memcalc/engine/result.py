"""The estimate's result: the peak, the phase that sets it, what is alive there, and the timeline.

Plain dataclasses of integer bytes; reports, JSON and the HTML page read these
and do no arithmetic of their own beyond unit conversion.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memcalc.core.spec import ExperimentSpec

#: The kinds memory is stacked by, in display order.
KINDS = ("weights", "optimizer_state", "gradients", "activations", "temporaries")


@dataclass(frozen=True)
class TimelinePoint:
    """Memory alive at one instant of the step (after an event), split by kind."""

    index: int
    label: str  # e.g. "fwd layer 3", "bwd layer 10 (recompute)", "optimizer step"
    phase: str  # one of Estimate.phases' keys
    by_kind: dict[str, int]  # kind -> bytes; keys are KINDS

    @property
    def total_bytes(self) -> int:
        return sum(self.by_kind.values())


@dataclass(frozen=True)
class Estimate:
    """A predicted training step.

    ``components`` is what is alive at the peak, by name, and sums exactly to
    ``peak_bytes``; ``phases`` is the highest point of each phase of the
    steady-state step. ``required_bytes`` adds the stated overheads.
    """

    experiment: ExperimentSpec
    params: int
    trainable_params: int
    peak_bytes: int
    peak_phase: str
    peak_label: str
    components: dict[str, int]
    components_by_kind: dict[str, int]
    phases: dict[str, int]
    first_step_peak_bytes: int
    first_step_peak_phase: str
    timeline: list[TimelinePoint]
    bytes_per_param: dict[str, float]
    cuda_context_bytes: int
    allocator_slack_bytes: int
    required_bytes: int
    assumptions: list[str] = field(default_factory=list)
    inferred: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # options that have no effect in this setup
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert sum(self.components.values()) == self.peak_bytes, "components must add up to the peak"
        assert sum(self.components_by_kind.values()) == self.peak_bytes, "kinds must add up to the peak"
        assert self.required_bytes == self.peak_bytes + self.cuda_context_bytes + self.allocator_slack_bytes

"""The estimate's result: the peak, the phase that sets it, what is alive there, and the timeline.

Plain dataclasses of integer bytes; reports, JSON and the HTML page read these
and do no arithmetic of their own beyond unit conversion. :class:`SimResult` is what one
simulated step gives (:func:`memcalc.engine.timeline.simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from memcalc.core.spec import ExperimentSpec

#: The kinds memory is stacked by, in display order: the one vocabulary of the tables, the chart, the
#: HTML report and the API (``EstimateResult.breakdown``'s keys, ``--json``'s ``components_by_kind``).
KINDS = ("weights", "optimizer_state", "gradients", "activations", "temporaries")
#: Each kind's name for people (the key, spaced) and what it holds: every component of the peak
#: (a category the engine allocates under, such as "frozen base weights (NF4)" or "logits & loss")
#: is shown under its kind, with these names wherever memory is split by kind.
KIND_NAMES = {k: k.replace("_", " ") for k in KINDS}
KIND_MEANING = {
    "weights": "the model's parameters (trainable and frozen, quantized bases, gathered shards)",
    "optimizer_state": "the optimizer's state (moments, fp32 master weights)",
    "gradients": "the parameters' gradients",
    "activations": "tensors the forward pass saves for backward (and the inputs)",
    "temporaries": "tensors that live within a phase: activation gradients, logits and loss, workspaces",
}


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
    steady-state step. The GPU side (:mod:`memcalc.core.gpu_side`): ``step_allocated_bytes`` /
    ``step_reserved_bytes`` are the caching-allocator replay's peaks of the step's own allocations
    (``step_reserved_bytes`` None without a replay); ``allocated_peak_bytes``, ``reserved_peak_bytes``
    and ``device_total_bytes`` (= ``required_bytes``, what "fits" compares) add the workspaces, the
    CUDA context and NCCL on ``device``, with ``device_parts`` summing to the device total.
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
    step_allocated_bytes: int
    step_reserved_bytes: Optional[int]
    allocated_peak_bytes: int
    reserved_peak_bytes: int
    device_total_bytes: int
    device_parts: dict[str, int]
    device: str
    #: the allocator replays' inputs, (events, step start, warm) of the steady and the first step
    #: (``memcalc.estimate.peak.runs_within``); empty without a replay
    replays: tuple = field(default=(), repr=False, compare=False)
    assumptions: list[str] = field(default_factory=list)
    inferred: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # options that have no effect in this setup
    extra: dict[str, Any] = field(default_factory=dict)
    #: what is alive at the peak, by kind (KINDS) and, within it, by component: ``components`` split by kind
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert sum(self.components.values()) == self.peak_bytes, "components must add up to the peak"
        assert sum(self.components_by_kind.values()) == self.peak_bytes, "kinds must add up to the peak"
        assert sum(self.device_parts.values()) == self.device_total_bytes, "parts must add up to the device total"

    @property
    def required_bytes(self) -> int:
        """What a GPU must have: the device total (what nvidia-smi shows at the peak)."""
        return self.device_total_bytes


@dataclass
class SimResult:
    """What one simulated step produced (bytes are ints)."""

    peak_bytes: int
    peak_phase: str
    peak_label: str
    peak_categories: dict[str, int]
    peak_kinds: dict[str, int]
    phases: dict[str, int]
    timeline: list[TimelinePoint]
    max_activation_bytes: int
    alloc_trace: Optional[list[tuple[int, str, str, int]]] = None  # (total, phase, label, requested) per allocation
    events: Optional[list[tuple[int, int]]] = None  # allocation events (observers.AllocEvents)
    step_start: int = 0  # index of the step's first event (before it: weights, state)
    #: activation offloading: (raw bytes, pinned host bytes, tensors) offloaded in one forward
    host_offload: Optional[tuple[int, int, int]] = None
    #: bitsandbytes paged optimizer state (CUDA unified memory, not in the peak); None when not paged
    paged_state_bytes: Optional[int] = None
    #: with ``events``: (index into events, phase) where each phase begins
    event_phases: Optional[list[tuple[int, str]]] = None
    #: a steady-state step with ``events`` outside DeepSpeed: the uids of the optimizer state allocated
    #: in setup, and (index into events, [(uid, bytes)]) where a first step would create each
    #: parameter's state instead (:func:`first_step_of`)
    state_moves: Optional[tuple[frozenset[int], list[tuple[int, list[tuple[int, int]]]]]] = None
    #: blocks an earlier step left that this steady step makes at its start and frees in it (TRL's offloading:
    #: memcalc.engine.offload_trl); a first step has none (:func:`first_step_of` drops their events)
    prior_step: frozenset[int] = frozenset()
    #: an unfused step simulated with ``fused_twin``: where each gradient became ready
    #: (:class:`GradReady`), from which :func:`fused_twin_of` derives the same step with the
    #: optimizer fused into backward
    grads_ready: Optional[list[GradReady]] = None
    #: what is alive at the peak by kind, then category (:meth:`PeakBreakdown.peak_by_kind`); empty for a
    #: step derived from another's records (memcalc.engine.twins)
    peak_by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    #: pipeline parallelism: every rank's stage and peak (:mod:`memcalc.engine.pipeline`); the result is the worst's
    stages: Optional[list[dict]] = None


@dataclass(frozen=True)
class GradReady:
    """An unfused step's gradient becoming ready (AccumulateGrad, :meth:`Sim._run_node`): where a
    fused step would run that parameter's optimizer step (:meth:`OptimizerSim.step_param`) and
    free its gradient."""

    trace_at: int  # allocations traced before it (-1: no trace recorded)
    total: int  # bytes alive then (the new gradient included)
    label: str
    phase: str
    temps: list[tuple[str, int]]  # the parameter's step temporaries (per_param_temps)
    grad_bytes: int  # the gradient's block
    # a step recording its allocation events (:func:`memcalc.engine.twins.fused_events_of`): the events and
    # phase marks before it, the gradient's block id, and the parameter's optimizer state (block id, bytes)
    event_at: int = -1
    phase_at: int = 0
    grad_uid: int = 0
    state: tuple[tuple[int, int], ...] = ()

"""ZeRO sharding: what each GPU holds of weights, gradients and optimizer state.

Stages follow Rajbhandari et al. 2020 ("ZeRO", Table 1): stage 1 shards the
optimizer state (including fp32 master weights), stage 2 also the gradients,
stage 3 also the weights, each over ``gpus`` data-parallel ranks
(:func:`model_state_bytes`). Who runs the stage is ``TrainingSpec.sharding``:
FSDP2 (the default) is simulated op by op in :mod:`memcalc.engine.fsdp` (every
parameter sharded, root included; per-unit all-gather, copy-out and
reduce-scatter buffers), FSDP1 in :mod:`memcalc.engine.fsdp1` (flat parameters);
:func:`memcalc.engine.fsdp.sharding_mechanics` names which in the inputs table. Elsewhere
(``deepspeed`` until its own mechanics are modelled, and stage 1) the generic
model applies: a gradient
is produced whole, reduce-scattered, and only its shard kept; under stage 3 a
layer's weights are all-gathered whole for its forward and again for its
backward, with the next layer prefetched (:class:`LayerGather`), while the
embedding, final norm and head stay whole. CPU offload keeps optimizer state,
and the step, on the CPU. DeepSpeed's reduce/all-gather buckets and DDP's
gradient buckets are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from memcalc.core.spec import ExperimentSpec


class Share(int):
    """``ceil(whole / parts)`` bytes, a rank's share of ``whole``: an int that remembers what it
    is a share of, so that the plan's depth extrapolation (:mod:`memcalc.plan.depth`) can
    extrapolate the whole (a sum over the layers, affine in the depth) and divide at the real
    depth, where the share itself is not affine."""

    whole: int
    parts: int

    def __new__(cls, whole: int, parts: int) -> "Share":
        self = super().__new__(cls, -(-whole // parts))
        self.whole, self.parts = whole, parts
        return self

    def __getnewargs__(self) -> tuple[int, int]:  # pickling (the plan's worker processes)
        return self.whole, self.parts


def shard(n_bytes: int, gpus: int) -> int:
    """This rank's share of ``n_bytes`` (ceil division: the last rank pads); a :class:`Share`
    when ``gpus`` > 1."""
    return Share(n_bytes, gpus) if gpus > 1 else -(-n_bytes // gpus)


@dataclass(frozen=True)
class ModelStates:
    """Per-GPU model-state bytes (no activations, no temporaries)."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes


def model_state_bytes(n_params: int, zero: int, gpus: int, weight_bytes: int = 2, grad_bytes: int = 2,
                      optimizer_bytes_per_param: int = 12) -> ModelStates:
    """ZeRO paper's model-state arithmetic: (2 + 2 + K) * Psi bytes unsharded, with K = 12 for
    mixed-precision Adam (fp32 master, momentum, variance); stage s divides the first s
    terms (state, then gradients, then weights) by the data-parallel degree N_d."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0-3, got {zero}")
    w = n_params * weight_bytes
    g = n_params * grad_bytes
    k = n_params * optimizer_bytes_per_param
    return ModelStates(
        weights_bytes=shard(w, gpus) if zero >= 3 else w,
        gradients_bytes=shard(g, gpus) if zero >= 2 else g,
        optimizer_bytes=shard(k, gpus) if zero >= 1 else k,
    )


class GatherHooks:
    """The hooks the decoder walk and the timeline call on whatever gathers sharded weights
    (:class:`LayerGather`, FSDP's runtimes, DeepSpeed's gathers); each does nothing unless the
    runtime needs it."""

    def layer_enter(self, i: int) -> None:
        """A layer's forward starts (the region hook gathers)."""

    def layer_exit(self, i: int) -> None:
        """A layer's forward ends."""

    def before_forward(self) -> None:
        """The model's forward starts."""

    def after_forward(self) -> None:
        """The model's forward (and loss) returned."""

    def backward_start(self) -> None:
        """Backward starts at the loss."""

    def end_backward(self) -> None:
        """Backward has reached the embedding."""

    def forward_enter(self, i: int) -> None:
        """A region of layers starting at layer ``i`` begins its forward."""

    def backward_enter(self, i: Optional[int]) -> None:
        """Backward reaches layer ``i`` (``None``: outside the layers)."""

    def release(self) -> None:
        """The layers' forward (or the micro-step) is over: what stays gathered goes."""


class LayerGather(GatherHooks):
    """The generic ZeRO-3 all-gathers (the ZeRO paper's stage 3, used where no framework's own
    mechanics are modelled: ``--sharding deepspeed`` for now; ``fsdp2`` and ``fsdp1`` are
    :mod:`memcalc.engine.fsdp` and :mod:`memcalc.engine.fsdp1`): a layer's weights are gathered whole (``layer_bytes``,
    the weight dtype) for its forward and again for its backward, with the next layer in that
    direction prefetched, and freed once the walk has moved past them. The decoder walk calls
    :meth:`forward_enter` per region and :meth:`layer_enter` / :meth:`layer_exit` per layer; the
    timeline calls :meth:`backward_enter` when backward reaches a layer (``None``: outside the
    layers) and the other hooks (no-ops here) around the step."""

    def __init__(self, sim, layer_bytes: int, n_layers: int) -> None:
        self.sim = sim
        self.layer_bytes = layer_bytes
        self.n_layers = n_layers
        self.buffers: dict = {}  # layer index -> gathered buffer

    def keep(self, layers: list[int]) -> None:
        """Exactly these layers' weights stay gathered."""
        for j in [j for j in self.buffers if j not in layers]:
            self.sim.unref(self.buffers.pop(j))
        for j in layers:
            if j not in self.buffers:
                self.buffers[j] = self.sim.alloc(self.layer_bytes, "weights", "all-gathered layer weights (ZeRO-3)")

    def forward_enter(self, i: int) -> None:
        self.keep([i, i + 1] if i + 1 < self.n_layers else [i])

    def backward_enter(self, i: Optional[int]) -> None:
        if i is not None:
            self.keep([i, i - 1] if i > 0 else [i])

    def release(self) -> None:
        self.keep([])


def uses_deepspeed(exp: ExperimentSpec) -> bool:
    """This step runs DeepSpeed ZeRO-2/3 (the mechanics of :mod:`memcalc.engine.deepspeed` apply; that
    module is imported only then), on one rank too: DeepSpeed's engine builds the same flat fp32
    partition, reduce buckets and gradient partition with world size 1 (stage_1_and_2.py
    ``DeepSpeedZeroOptimizer.__init__`` takes ``dp_process_group`` of any size, partitions of ``flat / 1``;
    stage3.py likewise), as validate/deepspeed_trace.py traces it."""
    tr = exp.training
    return tr.sharding == "deepspeed" and tr.zero >= 2


def offload_param(exp: ExperimentSpec) -> bool:
    """DeepSpeed ZeRO-3's ``offload_param`` is on: each parameter's 16-bit partition (``ds_tensor``) lives
    in pinned host memory (deepspeed 0.19.8 runtime/zero/partition_parameters.py ``Init._partition_param``:
    ``device = self.remote_device`` = ``offload_param.device``, ``get_accelerator().pin_memory``; stage3.py
    ``_create_fp16_partitions_with_defragmentation``: the trainable partitions moved into one pinned flat
    host buffer per parameter group instead of the GPU's ``lp_param_buffer``); DeepSpeed reads it at
    stage 3 only (offload_config.py: "Valid only with stage 3")."""
    tr = exp.training
    return uses_deepspeed(exp) and tr.zero >= 3 and tr.deepspeed is not None and tr.deepspeed.offload_param

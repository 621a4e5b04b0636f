"""ZeRO / FSDP sharding: what each GPU holds of weights, gradients and optimizer state.

Stages follow Rajbhandari et al. 2020 ("ZeRO", Table 1): stage 1 shards the
optimizer state (including fp32 master weights), stage 2 also the gradients,
stage 3 also the weights, each over ``gpus`` data-parallel ranks. The timeline
uses PyTorch FSDP's mechanics (no large fixed buckets): a gradient is produced
whole, reduce-scattered, and only its shard kept; under stage 3 a layer's
weights are all-gathered (whole, in the weight dtype) for its forward and again
for its backward, with the next layer prefetched. Embedding, final norm and
head stay whole (FSDP's root unit). CPU offload keeps optimizer state, and the
step, on the CPU. DeepSpeed's reduce/all-gather buckets (``reduce_bucket_size``)
and DDP's gradient buckets are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass


def shard(n_bytes: int, gpus: int) -> int:
    """This rank's share of ``n_bytes`` (ceil division: the last rank pads)."""
    return -(-n_bytes // gpus)


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

"""Expert-parallel layouts for ``memcalc plan --model M`` of a mixture-of-experts model (issue 31): per GPU,
the fewest GPUs of the full fine-tune with the routed experts sharded over ``ep`` ranks and that count's
per-rank peak.

The layout (torchtitan's MoE parallelism, :mod:`memcalc.engine.expert_parallel` and
:mod:`memcalc.engine.expert_fsdp`): FSDP2 ZeRO-3 over ``N`` data-parallel GPUs, the routed experts of every
MoE layer split over ``ep`` of them (:data:`EP`: one node's GPUs, where the dispatch and combine all-to-alls
stay on NVLink) and sharded by FSDP2 over the other ``N / ep``, the rest (attention, routers, shared
experts, dense layers, embedding, head) over all ``N``; bf16 with fp32 master weights and AdamW (the
full fine-tune of ``plan --model``), batch 1 x seq per GPU, full activation checkpointing, the stated
capacity factor (``TrainingSpec.ep_capacity_factor``'s default). Without expert parallelism FSDP2
all-gathers a whole MoE layer, every expert, on every GPU (DeepSeek-V3: 256 experts of 3 x 7168 x 2048),
a floor no count of GPUs divides; with it a rank gathers only its ``n_experts / ep``.

The counts tried are :data:`COUNTS` (whole nodes, powers of two: what clusters are rented and torchtitan's
meshes split), each estimated once whatever the card; each card bisects them (the per-GPU requirement falls
with ``N``: every sharded state is ``1 / N`` of it). The peak and the device total are
:func:`memcalc.plan.simulations.estimated_peak`'s (the estimate's own, steady and first step).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from memcalc.core.errors import UserError
from memcalc.core.expert_parallel import check_ep
from memcalc.core.spec import ExperimentSpec
from memcalc.estimate.peak import card_side, required_bytes, step_side
from memcalc.core.units import gib
from memcalc.plan.simulations import estimated_peak, smallest_fitting, with_training

#: the expert-parallel degree: the GPUs of one node
EP = 8
#: the GPU counts tried: whole nodes of 8, powers of two, up to plan's GPU_CAP
COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class ExpertLayout:
    """One count's estimate: ``gpus`` data-parallel ranks, ``ep`` of them sharing the experts."""

    gpus: int
    ep: int
    peak_bytes: int
    required_bytes: int


@dataclass
class ExpertRow:
    """One card's fewest-GPU expert-parallel layout (None: none of :data:`COUNTS` fits)."""

    gpu: Any
    layout: Optional[ExpertLayout]
    command: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        d: dict[str, Any] = {"name": self.gpu.name, "gpus": None if lay is None else lay.gpus}
        if lay is not None:
            d.update(ep=lay.ep, dp=lay.gpus, peak_bytes=lay.peak_bytes, required_bytes=lay.required_bytes,
                     command=self.command)
        return d


def expert_setup(full: ExperimentSpec, gpus: int) -> ExperimentSpec:
    """The plan's full fine-tune (``full``: plan.cluster's, ZeRO-3 by FSDP2) over ``gpus`` GPUs with the experts
    over :data:`EP` of them, checkpointing full."""
    return with_training(full, gpus=gpus, ep=EP, checkpoint="full")


def expert_refusal(full: ExperimentSpec) -> Optional[str]:
    """None when the model's experts can be sharded over :data:`EP` ranks; else why not (one line; a dense
    model: the empty string, nothing to say)."""
    if full.model.moe is None:
        return ""
    try:
        check_ep(expert_setup(full, COUNTS[0]))
    except UserError as e:
        return str(e)
    return None


def _layout(full: ExperimentSpec, gpus: int) -> ExpertLayout:
    exp = expert_setup(full, gpus)
    peak = estimated_peak(exp)
    return ExpertLayout(gpus, EP, peak, int(required_bytes(peak, step_side(exp))))


def search_experts(full: ExperimentSpec, cards: Sequence[Any]) -> tuple[list, Optional[str]]:
    """Each card's :class:`ExpertRow` (commands filled in by :func:`memcalc.plan.rows.cluster_commands`) and,
    for a mixture-of-experts model whose experts cannot be sharded, why (rows empty then). A dense model:
    no rows, no reason."""
    why = expert_refusal(full)
    if why is not None:
        return [], why or None
    cache: dict[int, ExpertLayout] = {}

    def at(i: int) -> ExpertLayout:
        if COUNTS[i] not in cache:
            cache[COUNTS[i]] = _layout(full, COUNTS[i])
        return cache[COUNTS[i]]

    def on(i: int, g: Any) -> ExpertLayout:  # count i on card g: the device total on the card's own GPU side
        lay = at(i)
        side = card_side(expert_setup(full, lay.gpus), g)
        return replace(lay, required_bytes=int(required_bytes(lay.peak_bytes, side)))

    fits = smallest_fitting(cards, len(COUNTS), lambda i, g: on(i, g).required_bytes)
    rows = [ExpertRow(g, None if i is None else on(i, g)) for g, i in zip(cards, fits, strict=True)]
    if rows and all(r.layout is None for r in rows):
        most = on(len(COUNTS) - 1, max(cards, key=lambda g: g.capacity_bytes))
        return [], f"no card fits: {most.gpus} GPUs, ep {most.ep}, need {gib(most.required_bytes):.1f} GiB a GPU"
    return rows, None


def expert_command(seq: int, lay: ExpertLayout, gpu: str, sharding: str, source: Sequence[str]) -> str:
    """The ``memcalc estimate`` command of a layout (its peak is the layout's)."""
    from memcalc.inputs.trainer_defaults import SHARDED_FULL_PRECISION

    precision, master = SHARDED_FULL_PRECISION
    args = ["memcalc", "estimate", *source, "--batch", "1", "--seq", str(seq), "--precision", precision]
    args += (["--master-weights"] if master else []) + ["--optimizer", "adamw", "--checkpoint", "full", "--zero", "3",
                                                        "--gpus", str(lay.gpus), "--sharding", sharding,
                                                        "--ep", str(lay.ep)]
    return shlex.join([*args, "--gpu", gpu])

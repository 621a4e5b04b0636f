"""Pipeline x tensor-parallel layouts for ``memcalc plan --model M`` (issue 31): per GPU, the fewest GPUs of
a ``pp x tp`` full fine-tune (``pp x ep`` for a mixture-of-experts model), its worst rank and that rank's peak.

The layout is the one a user of a cluster of 8-GPU nodes runs (torchtitan's recipes for Llama 3.1 405B:
tensor parallelism within a node, pipeline stages across nodes): ``tp`` the largest of :data:`TP_DEGREES`
the model allows (:func:`memcalc.core.rules.check_tp`, with sequence parallelism), ``pp`` a divisor of the
layer count or a power of two up to the layers + 2, each split as torchtitan always splits
(:func:`memcalc.core.pipeline.stage_layers`: the embedding and the head weigh one layer each by default, so
32 layers over 4 stages are 8, 9, 8, 7, and DeepSeek-V3's 61 layers go over 8 or 16 stages),
:data:`SCHEDULE` with ``M = pp``
micro-batches of one sequence each (the batch of one pipeline step is ``pp`` sequences), full activation
checkpointing, bf16 with fp32 master weights and AdamW (the full fine-tune of ``plan --model``), no ZeRO:
each rank holds ``1 / (pp x tp)`` of the model states. Data-parallel replicas multiply the GPUs without
changing a rank's memory, so the fewest GPUs is ``pp x tp``.

A mixture-of-experts model's stages put expert parallelism within the node instead (torchtitan's MoE layout,
:mod:`memcalc.engine.expert_parallel`, on its sparse mesh ``(pp, dp, efsdp, ep)``): ``ep`` the largest of
:data:`EP_DEGREES` dividing the routed experts, ``tp`` 1, each stage's experts split over its ``ep`` ranks and the
rest of the stage replicated over them (no ZeRO), so the fewest GPUs is ``pp x ep``.

A layout's peak does not depend on the card, so each ``pp`` tried is estimated once
(:func:`stage_peaks`), and each card takes the smallest ``pp`` whose device total fits it, by bisection
over those (a rank's state shrinks as ``1 / pp`` while the 1F1B activations in flight stay
``n_layers`` checkpointed layer inputs: the requirement falls with ``pp``). Of the ranks, the first
(embedding, ``pp`` micro-batches in flight), the second (the most in flight of the middle ranks, which
hold the same layers and buffers: 1F1B's warm-up is ``pp - rank``) and the last (head, logits and loss)
are simulated (:func:`memcalc.core.pipeline.simulated_ranks`, as the estimate does);
``tests/unit/test_plan_pipelines.py`` checks that no other rank peaks higher.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from collections.abc import Sequence
from typing import Any, Optional

from memcalc.core.errors import UserError
from memcalc.core.pipeline import TORCH_SCHEDULES, check_pp
from memcalc.core.rules import check_tp
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.timeline import first_step_within_steady
from memcalc.estimate.peak import card_side, required_bytes, step_side
from memcalc.core.units import gib
from memcalc.plan.simulations import smallest_fitting, with_training

#: tensor-parallel degrees, largest first: within one 8-GPU node (NVLink)
TP_DEGREES = (8, 4, 2)
#: expert-parallel degrees of a mixture-of-experts model's stages, largest first: within one 8-GPU node, where the
#: dispatch and combine all-to-alls stay on NVLink (as plan/experts.py's EP)
EP_DEGREES = (8, 4, 2)
#: the pipeline schedule the plan's layouts run (torchtitan's default)
SCHEDULE = "1f1b"
#: the most GPUs a pipeline layout may use (as plan's other searches: plan.cluster.GPU_CAP)
MAX_GPUS = 1024


@dataclass(frozen=True)
class StagePeak:
    """One ``pp x tp`` layout's estimate: the worst simulated rank, its layers and peaks."""

    pp: int
    tp: int
    rank: int
    layers: tuple[int, int]
    peak_bytes: int
    required_bytes: int
    #: expert-parallel ranks of each stage (a mixture-of-experts model's; 1: dense)
    ep: int = 1

    @property
    def gpus(self) -> int:
        """The layout's GPUs: ``pp x tp x ep``."""
        return self.pp * self.tp * self.ep


def pipeline_setup(full: ExperimentSpec, pp: int, tp: int, ep: int = 1) -> ExperimentSpec:
    """The plan's full fine-tune (``full``: plan.cluster's, one GPU, ZeRO-3 by FSDP2) as a ``pp x tp`` pipeline,
    or ``pp x ep`` with ``ep > 1`` (``--gpus ep``: the stage's expert-parallel ranks; see the module docstring)."""
    return with_training(full, pp=pp, tp=tp, sequence_parallel=tp > 1, microbatches=pp, pp_schedule=SCHEDULE,
                         batch=pp, zero=0, gpus=ep, ep=ep, checkpoint="full")


def pipeline_ep(full: ExperimentSpec) -> int:
    """A mixture-of-experts model's ``ep`` (the largest of :data:`EP_DEGREES` dividing its routed experts); 1 for a
    dense model or when none divides."""
    moe = full.model.moe
    if moe is None:
        return 1
    return next((e for e in EP_DEGREES if moe.n_experts % e == 0), 1)


def pipeline_degrees(full: ExperimentSpec) -> tuple[Optional[int], list[int], Optional[str]]:
    """``(tp, the pp tried in increasing order, why none)``: ``tp`` the largest allowed (1 for a mixture-of-experts
    model, whose stages take :func:`pipeline_ep` instead), the divisors ``pp >= 2`` of the layers and the powers of
    two up to the layers + 2 (module docstring) with ``pp x tp x ep <= MAX_GPUS``; none (with the one-line reason)
    when the model cannot be pipelined."""
    n, ep = full.model.n_layers, pipeline_ep(full)
    tp = 1 if ep > 1 else next((t for t in TP_DEGREES if _allows_tp(full, t)), 1)
    twos = {1 << k for k in range(1, (n + 2).bit_length()) if 1 << k <= n + 2}
    pps = sorted(p for p in {p for p in range(2, n + 1) if n % p == 0} | twos if p * tp * ep <= MAX_GPUS)
    if not pps:
        return None, [], f"{n} layers cannot be split into pipeline stages"
    try:
        check_pp(pipeline_setup(full, pps[0], tp, ep))
    except UserError as e:
        return None, [], str(e)
    return tp, pps, None


def _allows_tp(full: ExperimentSpec, tp: int) -> bool:
    if full.training.seq % tp:  # sequence parallelism shards the sequence (engine.tensor_parallel.TensorParallel.of)
        return False
    try:
        check_tp(with_training(full, tp=tp, sequence_parallel=True))
    except UserError:
        return False
    return True


def stage_peaks(exp: ExperimentSpec) -> StagePeak:
    """The worst simulated rank's (:func:`memcalc.core.pipeline.simulated_ranks`) steady-state and (where it can be
    higher) first steps: the estimate's peak."""
    from memcalc.engine.pipeline import simulate_pp
    from memcalc.estimate.step import strategy_for

    tr = exp.training
    firsts = (False,) if first_step_within_steady(exp) else (False, True)
    best = None
    for first in firsts:
        res = simulate_pp(exp, strategy_for(exp), first_step=first, record_timeline=False)  # simulated_ranks
        for s in res.stages or []:
            if best is None or s["peak_bytes"] > best["peak_bytes"]:
                best = s
    assert best is not None
    peak = int(best["peak_bytes"])
    return StagePeak(tr.pp, tr.tp, best["rank"], tuple(best["layers"]), peak,  # type: ignore[arg-type]
                     int(required_bytes(peak, step_side(exp))), tr.ep)


@dataclass
class PipelineRow:
    """One card's fewest-GPU pipeline layout (None: none of ``pp x tp <= MAX_GPUS`` fits)."""

    gpu: Any
    layout: Optional[StagePeak]
    command: Optional[str] = None

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        d: dict[str, Any] = {"name": self.gpu.name, "gpus": None if lay is None else lay.gpus}
        if lay is not None:
            d.update(pp=lay.pp, tp=lay.tp, ep=lay.ep, microbatches=lay.pp, schedule=SCHEDULE,
                     torch_schedule=TORCH_SCHEDULES[SCHEDULE], worst_rank=lay.rank, worst_rank_layers=list(lay.layers),
                     peak_bytes=lay.peak_bytes, required_bytes=lay.required_bytes, command=self.command)
        return d


def search_pipelines(full: ExperimentSpec, cards: Sequence[Any]) -> tuple[list, Optional[str]]:
    """Each card's :class:`PipelineRow` (its command filled in by :func:`memcalc.plan.rows.cluster_commands`)
    and, when the model cannot be pipelined, why (rows empty then)."""
    tp, pps, why = pipeline_degrees(full)
    if tp is None:
        return [], why
    ep = pipeline_ep(full)
    cache: dict[int, StagePeak] = {}

    def at(i: int) -> StagePeak:
        pp = pps[i]
        if pp not in cache:
            cache[pp] = stage_peaks(pipeline_setup(full, pp, tp, ep))
        return cache[pp]

    def on(i: int, g: Any) -> StagePeak:  # layout i on card g: the device total on the card's own GPU side
        lay, side = at(i), card_side(pipeline_setup(full, pps[i], tp, ep), g)
        return replace(lay, required_bytes=int(required_bytes(lay.peak_bytes, side)))

    fits = smallest_fitting(cards, len(pps), lambda i, g: on(i, g).required_bytes)
    rows = [PipelineRow(g, None if i is None else on(i, g)) for g, i in zip(cards, fits, strict=True)]
    if rows and all(r.layout is None for r in rows):
        most = on(len(pps) - 1, max(cards, key=lambda g: g.capacity_bytes))
        width = f"ep {most.ep}" if most.ep > 1 else f"tp {most.tp}"
        return [], (f"no card fits: pp {most.pp} x {width}, the most stages, needs "
                    f"{gib(most.required_bytes):.1f} GiB a rank (rank {most.rank})")
    return rows, None


def pipeline_command(seq: int, lay: StagePeak, gpu: str, source: Sequence[str]) -> str:
    """The ``memcalc estimate`` command of a layout (its peak is the layout's, every rank simulated)."""
    from memcalc.inputs.trainer_defaults import SHARDED_FULL_PRECISION

    precision, master = SHARDED_FULL_PRECISION
    args = ["memcalc", "estimate", *source, "--batch", str(lay.pp), "--seq", str(seq),
            "--precision", precision] + (["--master-weights"] if master else [])
    args += ["--optimizer", "adamw", "--checkpoint", "full", "--pp", str(lay.pp), "--pp-schedule", SCHEDULE,
             "--microbatches", str(lay.pp)]
    if lay.tp > 1:
        args += ["--tp", str(lay.tp), "--sequence-parallel"]
    if lay.ep > 1:
        args += ["--ep", str(lay.ep), "--gpus", str(lay.ep)]
    return shlex.join([*args, "--gpu", gpu])

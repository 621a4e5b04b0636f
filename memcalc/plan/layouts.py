"""Data-parallel x tensor-parallel layouts for ``memcalc plan --model M``'s fewest-GPU answers.

A full fine-tune on ``dp x tp`` GPUs runs FSDP2 (ZeRO-3) over ``dp`` data-parallel ranks and
Megatron-style tensor parallelism with sequence parallelism over ``tp`` (torchtitan's 2-D layout:
``apply_tp`` then ``apply_fsdp``; :mod:`memcalc.engine.tensor_parallel`), batch 1 per data-parallel
rank. Each rank holds ``1/(dp x tp)`` of the sharded model states either way, but TP with SP also
divides the activations by ``tp``, so when activations are what does not fit, a TP layout needs
fewer GPUs than ZeRO-3 alone.

:func:`search_layouts` tries ``tp`` in :data:`TP_DEGREES` (the degrees that fit in one 8-GPU
node, where TP's per-layer collectives stay on NVLink) that the model allows
(:func:`memcalc.engine.tensor_parallel.check`), fits each one's per-GPU requirement in ``dp``
(:func:`memcalc.plan.fits.fit_gpus`, the depth-extrapolated simulations of ``plan/depth.py``), and
keeps the layout with the fewest GPUs in all (the smaller ``tp`` on a tie: less communication),
confirmed with direct estimates. LoRA runs are not searched: the tensor-parallel
model covers full fine-tuning only.

For long sequences (``seq >= CP_MIN_SEQ``) the search also tries context parallelism: ``dp x cp``
GPUs, ring attention over ``cp`` ranks (:mod:`memcalc.engine.context_parallel`) and ZeRO-3 over all
``dp x cp`` of them (torchtitan's ``dp_shard_cp`` mesh dimension), each ``cp`` in :data:`CP_DEGREES`
that :func:`memcalc.core.rules.check_cp` allows; the layout is ``{"dp", "tp": 1, "cp"}``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from memcalc.core.errors import UserError
from memcalc.core.rules import check_cp
from memcalc.core.rules import check_tp as check
from memcalc.core.spec import ExperimentSpec
from memcalc.estimate.peak import card_side, required_bytes
from memcalc.plan.fits import GpusFit, fit_gpus
from memcalc.plan.limits import fit_probe, need, smallest_by_value
from memcalc.plan.simulations import estimated_peak, with_training

#: tensor-parallel degrees searched: within one 8-GPU node (NVLink), as torchtitan's recipes use
TP_DEGREES = (2, 4, 8)


#: context-parallel degrees searched (ring attention over up to 4 nodes of 8), for sequences of at least
#: :data:`CP_MIN_SEQ` tokens (where activations, not model states, set the GPU count)
CP_DEGREES = (2, 4, 8, 16, 32)
CP_MIN_SEQ = 16384


def cp_degrees(exp: ExperimentSpec) -> list[int]:
    """The degrees of :data:`CP_DEGREES` the model and setup allow (none below :data:`CP_MIN_SEQ`)."""
    if exp.training.seq < CP_MIN_SEQ:
        return []
    out = []
    for cp in CP_DEGREES:
        try:
            check_cp(with_training(exp, cp=cp))
        except UserError:
            continue
        out.append(cp)
    return out


def parallel(exp: ExperimentSpec, tp: int, cp: int = 1, **kw: Any) -> ExperimentSpec:
    """``exp`` at tensor-parallel degree ``tp`` (with sequence parallelism) or context-parallel degree ``cp``."""
    if cp > 1:
        return with_training(exp, cp=cp, **kw)
    return with_training(exp, tp=tp, sequence_parallel=True, **kw)


def degrees(exp: ExperimentSpec) -> list[tuple[int, int]]:
    """The ``(tp, cp)`` pairs the search tries: tensor parallelism within a node, or context parallelism."""
    return [(tp, 1) for tp in tp_degrees(exp)] + [(1, cp) for cp in cp_degrees(exp)]


def tp_degrees(exp: ExperimentSpec) -> list[int]:
    """The degrees of :data:`TP_DEGREES` the model and setup allow."""
    out = []
    for tp in TP_DEGREES:
        if exp.training.seq % tp:  # sequence parallelism shards the sequence (engine.tensor_parallel.TensorParallel.of)
            continue
        try:
            check(with_training(exp, tp=tp, sequence_parallel=True))
        except UserError:
            continue
        out.append(tp)
    return out


def layout_of(dp: Optional[int], tp: int, cp: int = 1) -> Optional[dict[str, int]]:
    """The layout as ``--json`` shows it: ``{"dp": ..., "tp": ...}`` (and ``"cp"`` with context
    parallelism; None when nothing fits)."""
    return None if dp is None else {"dp": dp, "tp": tp} | ({"cp": cp} if cp > 1 else {})


def layout_setups(base: ExperimentSpec) -> list[ExperimentSpec]:
    """The full fine-tune at each tensor-parallel degree the search tries (``gpus`` as in ``base``):
    what :func:`search_layouts` fits in the data-parallel degree."""
    return [parallel(base, tp, cp) for tp, cp in degrees(base)]


def _fewest_dp(exp: ExperimentSpec, gpu: Any, n_max: int, n_fit: int, fit: Optional[GpusFit] = None) -> Optional[int]:
    """The fewest data-parallel ranks (1..n_max) at which ``exp`` fits card ``gpu``: one checked directly
    (weights and state alone usually rule it out at once), 2..n_max from the fit in ``dp``."""
    cap = int(gpu.capacity_bytes)
    if need(with_training(exp, gpus=1), cap, gpu=gpu)[0]:  # one tensor-parallel group, no ZeRO
        return 1
    if n_max < 2:
        return None
    req = (fit or fit_gpus(exp, n_fit)).required(np.arange(1, n_max + 1))  # NaN at 1 (the fit is over 2..n_fit)
    ok = np.nonzero(req[1:] <= cap)[0]
    return int(ok[0]) + 2 if len(ok) else None


def layout_probes(full: dict[str, ExperimentSpec], caps: dict[int, Optional[int]], n_max: int,
                  fits: dict[ExperimentSpec, GpusFit]) -> set[tuple[ExperimentSpec, bool]]:
    """The steps :func:`search_layouts` is likely to ask about, for simulating ahead in parallel
    (``(experiment, whether its first step too)``, as ``plan_cluster``'s other probes): per card
    capacity (mapped to the fitted fewest GPUs without tensor parallelism, None: none fit), the
    layout the search confirms first: the tensor-parallel degree whose fitted fewest data-parallel
    ranks ``dp`` give the fewest GPUs, fewer than ZeRO-3 alone; then ``dp``, ``dp - 1`` (what
    confirms it) and checkpointing none at ``dp``; and every degree's single group (``dp`` 1, which
    the search checks first). A guess: the search itself decides, simulating
    what is missing."""
    out: set[tuple[ExperimentSpec, bool]] = set()
    base = full["full"]
    best: dict[int, tuple[int, int, int, int]] = {}  # cap -> (dp x tp x cp, tp, cp, dp): the first confirmed
    for tp, cp in degrees(base):
        e = parallel(base, tp, cp)
        out.add((with_training(e, gpus=1), False))  # one tensor-parallel group, checked first (_fewest_dp)
        fit = fits.get(e)
        hi = n_max // (tp * cp)
        if fit is None or hi < 2:
            continue
        req = fit.required(np.arange(2, hi + 1))
        for cap, n in caps.items():
            ok = np.nonzero(req <= cap)[0]
            if len(ok) and (n is None or (int(ok[0]) + 2) * tp * cp < n):  # fewer GPUs than ZeRO-3 alone
                dp = int(ok[0]) + 2
                cand = (dp * tp * cp, tp, cp, dp)
                best[cap] = min(best.get(cap, cand), cand)
    for _, tp, cp, dp in best.values():
        e = parallel(base, tp, cp)
        out.add((with_training(e, gpus=dp), True))
        if dp > 2:
            out.add((with_training(e, gpus=dp - 1), False))
        out.add((parallel(full["none"], tp, cp, gpus=dp), True))
    return out


def _confirmed(exp: ExperimentSpec, gpu: Any, n: int, n_max: int) -> Optional[int]:
    """The fitted count ``n`` made exact with direct estimates: the fewest data-parallel ranks in
    2..n_max that fit (:func:`memcalc.plan.limits.smallest_by_value`, from ``n``), or None."""
    if n_max < 2:
        return None
    cap = int(gpu.capacity_bytes)
    return smallest_by_value(fit_probe(lambda k: with_training(exp, gpus=int(k)), cap, gpu=gpu), 2, n_max, cap, n)


def search_layouts(rows: list[Any], full: dict[str, ExperimentSpec], n_max: int,
                   fits: Optional[dict[ExperimentSpec, GpusFit]] = None) -> None:
    """For each :class:`memcalc.plan.cluster.ClusterRow`, replace the full fine-tune's fewest-GPU
    answer with the best ``dp x tp`` layout when one needs fewer GPUs in all, and record the
    layout (``row.layout[setup]``, ``tp`` 1 for ZeRO-3 alone). ``full`` maps checkpointing
    ``none``/``full`` to the full fine-tune's setup. The layouts are compared by their fitted
    counts; only the winner is confirmed with direct estimates. ``fits``: the fits in
    ``dp`` of :func:`layout_setups` already made (fitted here otherwise)."""
    base = full["full"]
    pairs = degrees(base)
    for row in rows:
        n = row.min_gpus.get("full")
        row.layout["full"] = layout_of(n, 1)
        for s in row.min_gpus.keys() - {"full"}:  # LoRA and QLoRA: ZeRO-3 alone
            row.layout[s] = layout_of(row.min_gpus[s], 1)
        cap = int(row.gpu.capacity_bytes)
        cands = []  # (total, tp, cp, dp)
        for tp, cp in pairs:
            w = tp * cp
            bound = n_max // w if n is None else min(n_max // w, (n - 1) // w)
            if bound < 1:
                continue
            e = parallel(base, tp, cp)
            dp = _fewest_dp(e, row.gpu, bound, n_max, (fits or {}).get(e))
            if dp is not None:
                cands.append((dp * w, tp, cp, dp))
        for total, tp, cp, dp in sorted(cands):
            exp = parallel(base, tp, cp)
            if dp > 1:
                dp = _confirmed(exp, row.gpu, dp, n_max // (tp * cp))
                if dp is None or (n is not None and dp * tp * cp >= n):
                    continue
            exps = {ck: parallel(e, tp, cp, gpus=dp) for ck, e in full.items()}
            ck = "none" if need(exps["none"], cap, gpu=row.gpu)[0] else "full"
            row.min_gpus["full"] = dp * tp * cp
            row.checkpoint["full"] = ck
            row.peak_bytes["full"] = estimated_peak(exps[ck])
            row.required_bytes["full"] = required_bytes(row.peak_bytes["full"], card_side(exps[ck], row.gpu))
            row.layout["full"] = layout_of(dp, tp, cp)
            break

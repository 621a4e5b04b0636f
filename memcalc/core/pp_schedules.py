"""The per-rank action order of torch.distributed.pipelining's schedules, ported to pure Python (no torch at
estimate time).

Each function returns one rank's compute actions ``(kind, stage_index, micro-batch)`` in the order the
schedule runs them on that rank, ``kind`` one of ``F`` (forward), ``B`` (full backward), ``I`` (backward for
the stage's input only) and ``W`` (backward for the weights, after its ``I``). The sources (torch 2.13
torch/distributed/pipelining/schedules.py):

- ``ScheduleGPipe._step_microbatches``, ``Schedule1F1B._step_microbatches``: one stage per rank (its index
  is the rank);
- ``ScheduleZBVZeroBubble._calculate_single_rank_operations``: :func:`zbv`, two stages per rank in a V;
- ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` and ``ScheduleInterleavedZeroBubble``'s:
  ``_get_warmup_ops`` + ``_get_1f1b_rank_ops``, stages looped over the ranks (rank ``r`` holds stages
  ``r, r + pp, ...``, ``_utils.generate_stage_to_rank_mapping(style="loop")``). The ``None`` slots of
  ``pipeline_order`` (bubbles, and ``ScheduleInterleavedZeroBubble._add_bubbles_to_actions``') only delay an
  action; ``_add_send_recv`` and ``_add_reduce_grad`` put communication and gradient reduction between them and
  keep each rank's compute order, so the order here is the order ``_PipelineScheduleRuntime`` runs.

``tests/trace/test_pp_schedules.py`` checks every function against torch's own ``pipeline_order`` on a grid of
``(pp, stages per rank, micro-batches)``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

Action = tuple[str, int, int]


def single_stage(schedule: str, pp: int, M: int, rank: int) -> list[Action]:
    """GPipe (every forward, then every backward) and 1F1B (``min(M, pp - rank)`` warm-up forwards, then a
    backward and a forward in turn, backward first, then the cool-down backwards)."""
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(M)] + [("B", rank, i) for i in range(M)]
    warmup = min(M, pp - rank)
    out = [("F", rank, i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        out.append(("B", rank, b))
        b += 1
        if f == M:
            break
        out.append(("F", rank, f))
        f += 1
    return out + [("B", rank, i) for i in range(b, M)]


def rounds(pp: int, M: int) -> tuple[int, int]:
    """(``number_of_rounds``, ``microbatches_per_round``) of the interleaved schedules' ``__init__``:
    ``max(1, M // pp)`` rounds of ``M // rounds`` micro-batches (``M`` must divide by the rounds)."""
    n = max(1, M // pp)
    return n, M // n


def _warmup_ops(rank: int, V: int, per_round: int, pp: int, M: int, factor: int) -> int:
    """``_get_warmup_ops``: ``(V - 1) * per_round`` on the last rank, ``factor`` more per hop from it, at most
    ``M * V``."""
    return min((V - 1) * per_round + factor * (pp - 1 - rank), M * V)


def interleaved(pp: int, V: int, M: int, rank: int, zero_bubble: bool = False) -> list[Action]:
    """``ScheduleInterleaved1F1B`` (``zero_bubble`` False) or ``ScheduleInterleavedZeroBubble`` (True): rank
    ``rank``'s actions over its ``V`` stages."""
    per_round = rounds(pp, M)[1]
    warmup = _warmup_ops(rank, V, per_round, pp, M, 1 if zero_bubble else 2)
    total = V * M  # forwards; fwd_bwd = total - warmup, cooldown = warmup

    def fwd_stage(step: int) -> int:
        return (step // per_round) % V * pp + rank

    def bwd_stage(step: int) -> int:
        return (V - 1 - ((step - warmup) // per_round) % V) * pp + rank

    return _one_f_one_b(total, warmup, fwd_stage, bwd_stage, rank if zero_bubble else None)


def _one_f_one_b(total: int, warmup: int, fwd_stage: Callable[[int], int], bwd_stage: Callable[[int], int],
                 n_1f1b: int | None) -> list[Action]:
    """``_get_1f1b_rank_ops`` (compute actions only): warm-up forwards, then a forward and a backward per step,
    then the cool-down backwards; with zero bubble (``n_1f1b`` = ``num_1f1b_microbatches``, the rank) each
    backward is an ``I``, and from step ``warmup + n_1f1b`` on each step also runs the oldest pending ``W``, the
    rest at the end."""
    fwd_mb: dict[int, int] = defaultdict(int)
    bwd_mb: dict[int, int] = defaultdict(int)
    w_mb: dict[int, int] = defaultdict(int)
    out: list[Action] = []
    backward_ops: list[int] = []
    weights_done = 0
    kind = "B" if n_1f1b is None else "I"

    def take(counter: dict[int, int], stage: int) -> int:
        i = counter[stage]
        counter[stage] = i + 1
        return i

    def weight() -> None:
        nonlocal weights_done
        s = bwd_stage(backward_ops[weights_done])
        out.append(("W", s, take(w_mb, s)))
        weights_done += 1

    for op in range(total + warmup):  # warmup + (total - warmup) F/B steps + warmup cool-down steps
        if op < total:
            s = fwd_stage(op)
            out.append(("F", s, take(fwd_mb, s)))
        if op >= warmup:
            s = bwd_stage(op)
            out.append((kind, s, take(bwd_mb, s)))
            backward_ops.append(op)
            if n_1f1b is not None and op - warmup >= n_1f1b:
                weight()
    while n_1f1b is not None and weights_done < len(backward_ops):
        weight()
    return out


def zbv(pp: int, M: int, rank: int) -> list[Action]:
    """``ScheduleZBVZeroBubble._calculate_single_rank_operations``: two stages per rank in a V (rank ``rank`` holds
    stages ``rank`` and ``2 pp - 1 - rank``, chunks 0 and 1), planned for ``max(2 pp - 1, M)`` micro-batches and
    the actions of micro-batches past ``M`` dropped: ``2 (pp - rank) - 1`` chunk-0 forwards, ``rank`` pairs of a
    chunk-1 and a chunk-0 forward, ``pp - rank`` chunk-1 ``F I W``; then, while forwards remain, a chunk-0 ``F``
    (while any is left) ``I W`` and a chunk-1 ``F I W``; then ``rank`` pairs of chunk-0 and chunk-1 ``I``,
    ``pp - rank`` chunk-0 ``I W``, and the chunk-1 then the chunk-0 ``W`` s left."""
    n_micro = max(2 * pp - 1, M)
    c0, c1 = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    out += [("F", c0, i) for i in range(2 * (pp - rank) - 1)]
    f0 = 2 * (pp - rank) - 1
    for _ in range(rank):
        out += [("F", c1, f1), ("F", c0, f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(pp - rank):
        out += [("F", c1, f1), ("I", c1, b1), ("W", c1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            out.append(("F", c0, f0))
            f0 += 1
        out += [("I", c0, b0), ("W", c0, b0), ("F", c1, f1), ("I", c1, b1), ("W", c1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [("I", c0, b0), ("I", c1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - rank):
        out += [("I", c0, b0), ("W", c0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [("W", c1, i) for i in range(w1, b1)] + [("W", c0, i) for i in range(w0, b0)]
    return [a for a in out if a[2] < M]


def rank_actions(schedule: str, pp: int, V: int, M: int, rank: int) -> list[Action]:
    """Rank ``rank``'s actions under ``--pp-schedule schedule`` with ``V`` stages per rank."""
    if schedule in ("gpipe", "1f1b"):
        return single_stage(schedule, pp, M, rank)
    if schedule == "zbv-zero-bubble":
        return zbv(pp, M, rank)
    return interleaved(pp, V, M, rank, zero_bubble=schedule == "zero-bubble")


def rank_stages(pp: int, V: int, rank: int, style: str = "loop") -> list[int]:
    """The global stage indices rank ``rank`` holds, in ascending order: looped
    (``generate_stage_to_rank_mapping(style='loop')``: ``rank, rank + pp, ...``) or in a V (``style='v'``, ZBV's:
    ``rank`` and ``2 pp - 1 - rank``, torchtitan 0.3.0 distributed/pipeline_parallel.py
    ``_get_pp_rank_to_stage_indices_mapping``)."""
    if style == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(V)]

"""The FSDP actions torch's multi-stage runtime adds to a rank's compute actions, ported to pure Python.

``_PipelineScheduleRuntime._prepare_schedule_with_comms`` (torch 2.13 torch/distributed/pipelining/schedules.py)
lowers every multi-stage schedule's ``pipeline_order`` (``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``) with two passes before the send / receive pass, on every rank alike:

- ``_add_unshard_reshard(actions, max_active_stages=3)``: before each compute action it looks at the next three
  distinct stages the rank computes (``next_stage_indices``), RESHARDs every active stage not among them (in the
  order its set ``active_stages`` iterates in) and UNSHARDs
  every one of them not yet active, in the order they come; after the last action every stage still active is
  RESHARDed. With ``V <= 3`` stages per rank every stage is UNSHARDed before the first action and none is
  RESHARDed before the end.
- ``_add_reduce_grad(actions, M)``: a REDUCE_GRAD of a stage right after its ``M``-th ``B`` or ``W``
  (``_requires_reduce_grad``): the stage's gradients are reduce-scattered as soon as its last backward is done,
  not at the end of the step.

The runtime runs them (``_step_microbatches``' ``_perform_action``) only for a stage whose module is an
``FSDPModule``: UNSHARD -> ``unshard(async_op=True)`` of every FSDP module of the stage, the handles kept in
``unshard_ops``; the stage's next compute action waits on them (``_assert_unsharded``); RESHARD ->
``reshard()``; REDUCE_GRAD -> ``stage.perform_reduce_grad``. ``tests/trace/test_pp_lowering.py`` checks these
against torch's own passes.
"""

from __future__ import annotations

from memcalc.core.pp_schedules import Action

#: the FSDP actions' kinds (torch's ``_ComputationType`` names)
UNSHARD, RESHARD, REDUCE_GRAD = "UNSHARD", "RESHARD", "REDUCE_GRAD"
#: ``_add_unshard_reshard``'s default ``max_active_stages``, which ``_prepare_schedule_with_comms`` keeps
MAX_ACTIVE_STAGES = 3
#: the micro-batch index of an FSDP action (torch's ``None``)
NO_MB = -1


def add_unshard_reshard(actions: list[Action], max_active: int = MAX_ACTIVE_STAGES) -> list[Action]:
    """``_add_unshard_reshard`` (module docstring) over one rank's compute actions ``(kind, stage, mb)``."""
    active: set[int] = set()  # (a set, as torch's: the evictions come in the order it iterates in)
    out: list[Action] = []
    limit = min(max_active, len({a[1] for a in actions}))  # (the scan stops once it has them all)
    for i, action in enumerate(actions):
        next_n: list[int] = []
        for j in range(i, len(actions)):  # next_stage_indices
            s = actions[j][1]
            if s not in next_n:
                next_n.append(s)
                if len(next_n) == limit:
                    break
        fetch = [s for s in next_n if s not in active]
        evict = [s for s in active if s not in next_n]
        for s in evict:
            active.remove(s)
            out.append((RESHARD, s, NO_MB))
        for s in fetch:
            active.add(s)
            out.append((UNSHARD, s, NO_MB))
        out.append(action)
    out.extend((RESHARD, s, NO_MB) for s in list(active))
    return out


def add_reduce_grad(actions: list[Action], M: int) -> list[Action]:
    """``_add_reduce_grad``: a REDUCE_GRAD right after each stage's ``M``-th ``B`` or ``W``."""
    count: dict[int, int] = {}
    out: list[Action] = []
    for action in actions:
        out.append(action)
        kind, s, _ = action
        if kind in ("B", "W"):
            count[s] = count.get(s, 0) + 1
            if count[s] == M:
                out.append((REDUCE_GRAD, s, NO_MB))
    return out


def lowered(actions: list[Action], M: int) -> list[Action]:
    """The rank's actions with the runtime's FSDP actions (``_prepare_schedule_with_comms``' two passes)."""
    return add_reduce_grad(add_unshard_reshard(actions), M)

"""The runtime's FSDP actions (memcalc.core.pp_lowering) against torch's own lowering passes.

torch 2.13 torch/distributed/pipelining/schedules.py ``_add_unshard_reshard`` and ``_add_reduce_grad``, run on
the compute actions of :func:`memcalc.core.pp_schedules.rank_actions` (which ``tests/trace/test_pp_schedules.py``
checks against torch's ``pipeline_order``), must give the same actions as the port.
"""

from __future__ import annotations

import pytest

from memcalc.core.pp_lowering import MAX_ACTIVE_STAGES, NO_MB, lowered
from memcalc.core.pp_schedules import rank_actions

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

# (schedule, pp, stages per rank, micro-batches): source: torch's passes; V 2-3 (every stage active from the
# start) and V 4-5 (stages evicted and fetched again mid-step, max_active_stages 3)
CELLS = [(sched, pp, V, M) for sched in ("interleaved-1f1b", "zero-bubble") for pp in (2, 3, 4) for V in (2, 3, 4, 5)
         for M in (pp, 2 * pp)]


@pytest.mark.parametrize("schedule,pp,V,M", CELLS)
def test_lowering_is_torchs(schedule, pp, V, M):
    from torch.distributed.pipelining import schedules as s

    kinds = {"F": s._ComputationType.FORWARD, "B": s._ComputationType.FULL_BACKWARD,
             "I": s._ComputationType.BACKWARD_INPUT, "W": s._ComputationType.BACKWARD_WEIGHT}
    for rank in range(pp):
        compute = rank_actions(schedule, pp, V, M, rank)
        theirs = s._add_reduce_grad(s._add_unshard_reshard([s._Action(st, kinds[k], i) for k, st, i in compute],
                                                           MAX_ACTIVE_STAGES), M)
        names = {v: k for k, v in kinds.items()}
        want = [(names.get(a.computation_type, a.computation_type.value), a.stage_index,
                 NO_MB if a.microbatch_index is None else a.microbatch_index) for a in theirs]
        assert lowered(compute, M) == want, (schedule, pp, V, M, rank)

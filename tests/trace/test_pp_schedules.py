"""The estimator's pure-Python schedule orders (:mod:`memcalc.core.pp_schedules`) against torch's own.

torch.distributed.pipelining's multi-stage schedules compute every rank's action list in ``__init__``
(``pipeline_order``: ``_calculate_single_rank_operations`` per rank, plus ``None`` bubbles;
``ScheduleZBVZeroBubble`` over its V of stages); each rank's compute actions, bubbles dropped, must equal
:func:`memcalc.core.pp_schedules.rank_actions` on a grid of (pp, stages per rank, micro-batches). The schedules are
built over stand-in stages (the attributes their ``__init__`` reads: group size and rank, stage count and index,
``submod``), which is all the order depends on; a combination torch refuses must be one ``check_pp`` refuses too.
"""

from __future__ import annotations

import itertools
import types

import pytest

from memcalc.core.errors import UserError
from memcalc.core.pipeline import MULTI_STAGE, TORCH_SCHEDULES, V_SHAPED, check_pp
from memcalc.core.pp_schedules import rank_actions, rank_stages
from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

#: the multi-stage schedules (memcalc.core.pipeline.MULTI_STAGE) and their torch classes
CLASSES = {s: TORCH_SCHEDULES[s] for s in MULTI_STAGE}
#: source: the grid: 2-4 ranks, 2-3 stages per rank, micro-batches below, at and above pp (1 to 3 rounds, and
#: counts that are not a multiple of the rounds: 5 over 2 ranks, 9 over 4)
GRID = list(itertools.product((2, 3, 4), (2, 3), (1, 2, 3, 4, 5, 6, 8, 9, 12)))


def _torch_order(cls, pp: int, V: int, M: int, v_shaped: bool = False) -> dict:
    # rank 0's stages (every rank's order is computed); a V of other than 2 stages: V of them, which ZBV refuses
    mine = rank_stages(pp, V, 0, "v" if v_shaped and V == 2 else "loop")
    stages = [types.SimpleNamespace(group_size=pp, group_rank=0, num_stages=pp * V, stage_index=s,
                                    is_first=s == 0, is_last=s == pp * V - 1, submod=None) for s in mine]
    return cls(stages, M, loss_fn=None).pipeline_order


@pytest.mark.parametrize("schedule", list(CLASSES))
def test_orders_equal_torchs_pipeline_order(schedule: str) -> None:
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, CLASSES[schedule])
    compared = refused = 0
    for pp, V, M in GRID:
        layers = pp * V
        exp = ExperimentSpec(model=ModelSpec(name="t", n_layers=layers, d_model=64, n_heads=4, d_ff=128,
                                             vocab_size=64, max_seq_len=64),
                             training=TrainingSpec(batch=M, seq=16, pp=pp, microbatches=M, pp_schedule=schedule,
                                                   pp_stages_per_rank=V))
        try:
            order = _torch_order(cls, pp, V, M, schedule in V_SHAPED)
        except ValueError as e:  # torch refuses: so must memcalc (the rounds rule; ZBV's two stages per rank)
            assert "multiple of the number of rounds" in str(e) or "ZBV requires exactly 2 stages per rank" in str(e)
            with pytest.raises(UserError, match=r"multiple of its rounds|exactly 2 stages per rank"):
                check_pp(exp)
            refused += 1
            continue
        check_pp(exp)  # accepted by both
        for rank in range(pp):
            theirs = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in order[rank]
                      if a is not None]
            assert rank_actions(schedule, pp, V, M, rank) == theirs, (pp, V, M, rank)
            compared += 1
    assert compared > 100 * (schedule not in V_SHAPED) + 40 and refused > 0

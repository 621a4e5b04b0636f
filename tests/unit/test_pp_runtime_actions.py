"""The multi-stage runtime's FSDP actions (memcalc.core.pp_lowering), hand-checked on three small cells
(tests/trace/test_pp_lowering.py checks every cell of a grid against torch's own passes)."""

from __future__ import annotations

import pytest

from memcalc.core.pp_lowering import lowered
from memcalc.core.pp_schedules import rank_actions


def _text(schedule: str, pp: int, V: int, M: int, rank: int) -> str:
    return " ".join(f"{k}{s}" + ("" if i < 0 else f".{i}")
                    for k, s, i in lowered(rank_actions(schedule, pp, V, M, rank), M))


@pytest.mark.parametrize("schedule,pp,V,M,rank,want", [
    # source: torch 2.13 schedules.py _add_unshard_reshard (max_active_stages 3: both stages UNSHARDed before the
    # first action) and _add_reduce_grad (REDUCE_GRAD after a stage's M-th B: stage 2's gradients reduce-scattered
    # before stage 0's backwards run); the final RESHARDs
    ("interleaved-1f1b", 2, 2, 2, 0, "UNSHARD0 UNSHARD2 F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 REDUCE_GRAD2 RESHARD2 B0.0 "
                                     "B0.1 REDUCE_GRAD0 RESHARD0"),
    # source: the same passes over zero bubble: REDUCE_GRAD after a stage's M-th W
    ("zero-bubble", 2, 2, 2, 1, "UNSHARD1 UNSHARD3 F1.0 F1.1 F3.0 I3.0 F3.1 I3.1 W3.0 I1.0 W3.1 REDUCE_GRAD3 "
                                "RESHARD3 I1.1 W1.0 W1.1 REDUCE_GRAD1 RESHARD1"),
    # source: the same, 4 stages per rank: three active at most, stage 0 evicted after its forwards and
    # UNSHARDed again for its backwards
    ("interleaved-1f1b", 2, 4, 2, 0, "UNSHARD0 UNSHARD2 UNSHARD4 F0.0 F0.1 RESHARD0 UNSHARD6 F2.0 F2.1 F4.0 F4.1 "
                                     "F6.0 F6.1 B6.0 B6.1 REDUCE_GRAD6 RESHARD6 UNSHARD0 B4.0 B4.1 REDUCE_GRAD4 "
                                     "RESHARD4 B2.0 B2.1 REDUCE_GRAD2 RESHARD2 B0.0 B0.1 REDUCE_GRAD0 RESHARD0"),
])
def test_the_runtime_lowering(schedule, pp, V, M, rank, want):
    assert _text(schedule, pp, V, M, rank) == want

"""The compiled reference configs against the first CUDA record (issue 28): an H200 with PyTorch 2.11
(data/reference/measured/protocol-cuda-nvidia-h200-20261128-070544.json, each config cut to 8 layers).

The estimate is the record's own setup (its resolved experiment at the record's ``scale_layers``) with
the one profile field a PyTorch version decides for a compiled graph, ``inductor_reuse``, as the
record's PyTorch has it (memcalc.inputs.profiles.profile_for: peak-aware from 2.9). Its allocated peak
(the step's allocator replay plus the cuBLAS workspaces on a Hopper card, memcalc.core.gpu_side, as
``validate --protocol`` predicts it) is held against ``max_memory_allocated`` of the measured step.

Mechanisms this pins (read from the record's memory snapshots, the ``.tgz`` beside it):
- the loss is inside the compiled graph (validate/model.py ``Decoder.forward`` under ``model.compile()``):
  the forward keeps the logits and two 12 KiB row statistics, no shifted copy and no log-probabilities,
  and the logits' gradient is freed after the head's backward (memcalc.engine.blocks.compiled_loss);
- PyTorch >= 2.9's inductor keeps a dead buffer for a later allocation of its size only where that does
  not raise the graph's peak (torch/_inductor/codegen/wrapper.py ``AllocateLine.should_reuse_buffer``):
  config-compile's backward allocates its MLP-width buffers anew in layers 7 and 6 and reuses them
  below; the budget-0.05 configs allocate them anew in every layer (memcalc.compile.backward
  ``CompiledLayers.kept_pools``).
Before these two (commit af3be71's estimate, the record's ``predicted``): +4.2%, +10.6%, +6.0%, +8.6%,
+10.6%.

Reserved: memcalc's caching-allocator model replays each measured step exactly from the state it began
in (test_allocator_replays_the_measured_step_exactly), so a reserved gap is in the requests memcalc
replays; the chunked-loss case's was the foreach AdamW step's temporaries as one group-sized request
(memcalc.engine.optimizers.foreach_temp_sizes). The compiled configs' reserved is set in the first step,
where inductor autotunes (docs/compile-scope.md), and is not pinned.

Torch-free, but compiled estimates (graph, partition and a probed step each) and snapshot replays: slow
lane (about 4 s).
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from memcalc.core.gpu_side import device_memory, gpu_side
from memcalc.core.spec import ExperimentSpec
from memcalc.estimate.peak import estimate
from memcalc.inputs.profiles import profile_for

RECORD = Path(__file__).parents[2] / "data/reference/measured/protocol-cuda-nvidia-h200-20261128-070544.json"
SNAPSHOTS = RECORD.with_name(RECORD.stem + "-snapshots.tgz")
#: predicted allocated vs measured max_memory_allocated, compiled steps (named tolerance; eager steps are
#: pinned at 0.1% by the CUDA-record test of the eager rows)
TOL_COMPILED_ALLOCATED = 0.02
#: predicted reserved vs max_memory_reserved where the request stream is the step's own (eager)
TOL_RESERVED = 0.02

_LOGITS_RECOMPUTED = (
    "at budget 0.05 with the loss in the graph the partitioner recomputes the logits in backward: measured "
    "168 MiB alive when backward starts, the 144 MiB memcalc saves plus the final hidden state (24 MiB) and no "
    "logits (93.75 MiB); memcalc's partition graph ends at the logits (memcalc.compile.graph records the forward "
    "to the loss, exclusive), so it keeps them: +3.4%")

ROWS = [
    pytest.param("config-compile", id="config-compile"),  # source: the H200 record, -0.2%
    pytest.param("config-bf16_budget_60", id="config-bf16_budget_60"),  # source: the H200 record, +0.9%
    pytest.param("config-memory_budget_60", id="config-memory_budget_60"),  # source: the H200 record, +1.7%
    pytest.param("config-memory_budget_05", id="config-memory_budget_05",  # source: the H200 record, +3.4%
                 marks=pytest.mark.xfail(strict=True, reason=_LOGITS_RECOMPUTED)),
    pytest.param("config-fused_memory_budget_05", id="config-fused_memory_budget_05",  # source: as above, +3.4%
                 marks=pytest.mark.xfail(strict=True, reason=_LOGITS_RECOMPUTED)),
]


def _case(name: str) -> dict:
    return next(r for r in json.loads(RECORD.read_text()) if r["case"] == name)


def _spec(rec: dict) -> ExperimentSpec:
    """The record's experiment at its scale, with the record's PyTorch's inductor reuse rule."""
    data = dict(rec["setup"]["experiment"])
    data["model"] = {**data["model"], "n_layers": rec["setup"]["scale_layers"]}
    exp = ExperimentSpec.model_validate(data)
    torch = ".".join(rec["environment"]["torch_version"].split(".")[:2])
    reuse = profile_for(exp.profile.framework, torch).inductor_reuse
    return exp.model_copy(update={"profile": exp.profile.model_copy(update={"inductor_reuse": reuse})})


@pytest.mark.slow
@pytest.mark.parametrize("case", ROWS)
def test_compiled_allocated_matches_the_h200_record(case: str) -> None:
    rec = _case(case)
    exp = _spec(rec)
    assert exp.profile.inductor_reuse == "peak-aware"  # PyTorch 2.11
    est = estimate(exp)
    side = gpu_side("nvidia", "Hopper", rec["environment"]["gpu_name"])
    predicted = device_memory(est.step_allocated_bytes, est.step_reserved_bytes, side).allocated_peak_bytes
    measured = next(c["measured_bytes"] for c in rec["comparisons"] if c["metric"] == "allocated")
    assert abs(predicted - measured) <= TOL_COMPILED_ALLOCATED * measured, (
        f"{case}: predicted {predicted:,} B, measured {measured:,} B ({100 * (predicted - measured) / measured:+.2f}%)")


@pytest.mark.slow
def test_peak_aware_reuse_never_raises_the_peak() -> None:
    """source: AllocateLine.should_reuse_buffer keeps a buffer for reuse only within the graph's peak, so
    the peak-aware step peaks as the step that keeps no pool does, and keeps some (config-compile: layers
    6 to 1 keep theirs, as the snapshot's backward reuses its MLP-width buffers from layer 5 down); 'always'
    keeps every pool (layer 7's three MLP-width buffers through its attention backward raise the peak)."""
    from memcalc.engine.timeline import simulate
    from memcalc.estimate.step import strategy_for

    exp = _spec(_case("config-compile"))
    made: list = []
    simulate(exp, record_timeline=False, strategy=strategy_for(exp, made=made))
    assert made[-1].kept_pools() == frozenset(range(1, 7))
    aware = estimate(exp, timeline=False, replay=False).peak_bytes
    none = simulate(exp, record_timeline=False, strategy=strategy_for(exp, keep_pools=frozenset())).peak_bytes
    always = estimate(exp.model_copy(update={"profile": exp.profile.model_copy(update={"inductor_reuse": "always"})}),
                      timeline=False, replay=False).peak_bytes
    assert aware == none < always


def _snapshot(case: str) -> dict:
    """A case's measured snapshot, read from the .tgz in memory (as data only: memcalc.snapshot.reader)."""
    from memcalc.snapshot.reader import unpickle_data

    with tarfile.open(SNAPSHOTS) as tgz:
        member = next(m for m in tgz.getmembers() if m.name.endswith(f"/{case}.pickle"))
        f = tgz.extractfile(member)
        assert f is not None
        return unpickle_data(f.read())


def _start_state(snap: dict) -> tuple[list[dict], dict[int, int]]:
    """The segments that existed when the recorded step began and the blocks then allocated
    (address -> size): the dumped state with the trace walked backwards (an alloc had not happened
    yet, a free_completed had not)."""
    trace = snap["device_traces"][0]
    made = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    active: dict[int, int] = {}
    for seg in snap["segments"]:
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                active[addr] = b["size"]
            addr += b["size"]
    for e in reversed(trace):
        if e["action"] == "alloc":
            active.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            active[e["addr"]] = e["size"]
    return [s for s in snap["segments"] if s["address"] not in made], active


def _replay_from(segments: list[dict], active: dict[int, int], trace: list[dict]):
    """memcalc's CachingAllocatorSim seeded with ``segments`` and ``active`` at their addresses, then
    the recorded step's allocs and frees."""
    from memcalc.core.allocator import CachingAllocatorSim, _Block

    cas = CachingAllocatorSim()
    blocks = {}
    for seg in sorted(segments, key=lambda s: s["address"]):
        sid, base, total = cas._next_seg, seg["address"], seg["total_size"]
        cas._next_seg += 1
        cas._seg_size[sid] = total
        cas.reserved += total
        pieces, cur = [], base
        for a in sorted(x for x in active if base <= x < base + total):
            if a > cur:
                pieces.append((cur, a - cur, True))
            pieces.append((a, active[a], False))
            cur = a + active[a]
        if cur < base + total:
            pieces.append((cur, base + total - cur, True))
        prev = None
        for a, size, free in pieces:
            b = _Block(sid, a, size, seg["segment_type"] == "small")
            b.free, b.prev = free, prev
            if prev is None:
                cas._segments[sid] = b
            else:
                prev.next = b
            prev = b
            if free:
                cas._insert(b)
            else:
                blocks[a] = b
                cas.allocated += size
    cas.reset_peak()
    made = 0
    for e in trace:
        if e["action"] == "alloc":
            before = cas.reserved
            blocks[e["addr"]] = cas.malloc(e["size"])
            made += cas.reserved > before
        elif e["action"] == "free_completed":
            cas.free(blocks.pop(e["addr"]))
    return cas, made


@pytest.mark.slow
@pytest.mark.parametrize("case", ["chunked-loss", "config-control", "config-compile"])
def test_allocator_replays_the_measured_step_exactly(case: str) -> None:
    """source: the H200 snapshots. From the exact state the measured (second) step began in, memcalc's
    caching-allocator model (memcalc.core.allocator) makes the segments the GPU made (chunked-loss: 26,
    4,896 MiB) and ends at the measured max_memory_reserved: where memcalc's reserved differs, the request
    stream it replays does, not the allocator's rules."""
    snap = _snapshot(case)
    trace = snap["device_traces"][0]
    segments, active = _start_state(snap)
    cas, made = _replay_from(segments, active, trace)
    assert made == sum(e["action"] == "segment_alloc" for e in trace)
    measured = next(c["measured_bytes"] for c in _case(case)["comparisons"] if c["metric"] == "reserved")
    assert cas.peak_reserved == sum(s["total_size"] for s in snap["segments"]) == measured


@pytest.mark.slow
def test_chunked_loss_reserved_matches_the_h200_record() -> None:
    """source: the H200 record's chunked-loss case (llama-3.2-1b, bf16, foreach AdamW, 8 loss chunks):
    reserved predicted 22.63 GB against 20.38 measured (+11.0%) while _foreach_sqrt's temporaries were one
    group-sized request (a 2,358 MiB segment the GPU never made); one request per tensor: -1.1%."""
    from memcalc.validate.record import target_spec

    rec = _case("chunked-loss")
    exp = target_spec(ExperimentSpec.model_validate(rec["setup"]["experiment"]), None,
                      rec["validate_record"]["framework"])
    est = estimate(exp)
    side = gpu_side("nvidia", "Hopper", rec["environment"]["gpu_name"])
    predicted = device_memory(est.step_allocated_bytes, est.step_reserved_bytes, side).reserved_peak_bytes
    measured = next(c["measured_bytes"] for c in rec["comparisons"] if c["metric"] == "reserved")
    assert abs(predicted - measured) <= TOL_RESERVED * measured, (predicted, measured)

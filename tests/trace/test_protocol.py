"""``memcalc validate --protocol``: the whole list traced on meta (what CI runs), and on a GPU the real
thing (skipped without CUDA). The format: memcalc.inputs.measured (tests/unit/test_measured_format.py)."""

from __future__ import annotations

import json
import os

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from memcalc.inputs.measured import load_measured, parse_records  # noqa: E402
from memcalc.validate.protocol import CASES, run_protocol  # noqa: E402

#: issue 10's bound on the estimate vs the meta trace of the same step (every traced grid holds it)
STEP_TOLERANCE_PCT = 1.0
GPU_ONLY = {"cuda-context", "allocator-pattern", "cublas-workspace"}


@pytest.fixture(scope="module")
def meta_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("measured")
    records = run_protocol("meta", str(out), as_json=True)
    return records, out


def test_meta_protocol_writes_every_case_in_the_measured_format(meta_run):
    records, out = meta_run
    files = sorted(out.glob("protocol-meta-*.json"))
    assert len(files) == 1
    snaps = [r["snapshot"] for r in records if r["snapshot"]]
    assert bool(list(out.glob("*-snapshots"))) == bool(snaps)  # the folder only when a case wrote one
    assert all((out / s).stat().st_size > 0 for s in snaps)
    parsed = load_measured(str(files[0]))
    assert [r.case for r in parsed] == [c.name for c in CASES] == [r["case"] for r in records]
    assert parse_records(json.loads(json.dumps(records)), "stdout")
    for r in parsed:
        assert r.environment.device == "meta" and r.environment.gpu_name is None
        assert (r.snapshot is None) == bool(r.snapshot_reason)  # none is said, never silent
        assert r.comparisons and all(c.predicted_bytes for c in r.comparisons), r.case  # every case predicts
        assert r.status in ("ok", "skipped"), (r.case, r.reason)
        if r.status == "skipped":
            assert r.reason, r.case


def test_meta_protocol_gpu_only_cases_say_why(meta_run):
    records, _ = meta_run
    by = {r["case"]: r for r in records}
    for name in GPU_ONLY:
        assert by[name]["status"] == "skipped" and "needs a CUDA device" in by[name]["reason"]
        assert all(c["measured_bytes"] is None for c in by[name]["comparisons"])
    cb = by["callback-trainer"]
    assert cb["status"] == "skipped" and "CUDA is not available" in cb["reason"]
    assert cb["validate_record"]["source"] == "callback" and cb["validate_record"]["predicted_bytes"]


def test_meta_protocol_snapshots_hold_the_traced_peak(meta_run):
    """Each traced step's snapshot (validate/snapshot_trace.py) peaks where the trace does."""
    from memcalc.snapshot.format import load_snapshot, trace_peak

    records, out = meta_run
    ok = [r for r in records if r["kind"] == "step" and r["status"] == "ok"]
    assert ok and all(r["snapshot"] for r in ok)
    for r in ok:
        traced = next(c for c in r["comparisons"] if c["metric"] == "step_allocated")["measured_bytes"]
        assert trace_peak(load_snapshot(out / r["snapshot"])).peak_bytes == traced, r["case"]


def test_meta_protocol_steps_match_the_estimate(meta_run):
    """Every traced step beside its estimate; a compiled config (inductor needs CUDA) compares
    PyTorch's partition with memcalc's saved set instead."""
    records, _ = meta_run
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 14
    for r in steps:
        comps = {c["metric"]: c for c in r["comparisons"]}
        if r["setup"]["experiment"]["training"]["compile"]:
            assert r["status"] == "skipped" and "torch.compile needs CUDA" in r["reason"]
            c = comps["saved_for_backward"]
        else:
            assert r["status"] == "ok", (r["case"], r["reason"])
            c = comps["step_allocated"]
            assert comps["step_reserved"]["measured_bytes"] >= c["measured_bytes"]
            assert r["command"].startswith("memcalc validate ") and "--device meta --scale-layers 1" in r["command"]
        assert abs(c["error_pct"]) <= STEP_TOLERANCE_PCT, (r["case"], c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_protocol(tmp_path):
    """On a GPU: every case runs (or the time budget skips it), each step with its three peaks measured
    and a snapshot; the records file is in the measured format."""
    records = run_protocol("cuda", str(tmp_path), as_json=True)
    (path,) = tmp_path.glob("protocol-cuda-*.json")
    assert len(load_measured(str(path))) == len(CASES)
    for r in records:
        assert r["status"] == "ok" or r["reason"].startswith("time budget"), (r["case"], r["reason"])
        if r["status"] != "ok":
            continue
        assert all(c["measured_bytes"] is not None for c in r["comparisons"]
                   if c["metric"] not in ("device_total", "context")), r["case"]
        assert r["snapshot"] and os.path.getsize(tmp_path / r["snapshot"]) > 0, r["case"]
        assert r["environment"]["gpu_name"] and r["environment"]["torch_version"] == torch.__version__


def test_cuda_comparisons_on_the_reference_card(monkeypatch):
    """The CUDA records' predicted peaks are the estimate's own on the card the protocol finds: on an H100
    (the estimate's reference card) exactly its allocated_peak_bytes, reserved_peak_bytes and
    device_total_bytes."""
    import memcalc.api
    from memcalc.core.gpu_side import reference_side
    from memcalc.validate import protocol, protocol_probes

    monkeypatch.setattr(protocol_probes, "card_side",
                        lambda _device, biased=0, compiled=False: reference_side(1, biased, compiled))
    for opts in (dict(model="gpt2", batch=2, seq=256, precision="bf16"),  # source: biased linears (cuBLASLt)
                 dict(model="gpt2", batch=2, seq=256, checkpoint="full"),  # source: recomputed biased forward
                 dict(config="control"), dict(config="compile")):  # source: no biases; torch.compile's loads
        est = memcalc.api.estimate(**opts).estimate
        comps = {c.metric: c for c in protocol._comparisons("cuda", est, est.experiment, (100, 200), 300)}
        assert comps["allocated"].predicted_bytes == est.allocated_peak_bytes
        assert comps["reserved"].predicted_bytes == est.reserved_peak_bytes
        assert comps["device_total"].predicted_bytes == est.device_total_bytes
        assert [comps[m].measured_bytes for m in ("allocated", "reserved", "device_total")] == [100, 200, 300]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_protocol_on_cuda_without_cuda_is_one_line(tmp_path, monkeypatch):
    """Checked before the output folder's default (a clone's data/reference/measured/)."""
    from conftest import one_line_error
    from typer.testing import CliRunner

    from memcalc.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["validate", "--protocol", "--device", "cuda"])
    one_line_error(r, 2, "--protocol --device cuda: no CUDA device is available")


def test_case_selection_keeps_the_protocols_order():
    from memcalc.core.errors import UserError
    from memcalc.validate.protocol import select

    assert [c.name for c in select(["hf-lora", "cuda-context"])] == ["cuda-context", "hf-lora"]
    assert select([]) == CASES
    with pytest.raises(UserError, match=r"unknown --case 'hf-lorra'; valid: cuda-context, allocator-pattern"):
        select(["hf-lorra"])


def test_time_budget_skips_the_case_that_would_end_past_it_and_every_later_one():
    from memcalc.validate.protocol import _over

    cheap, compiled = CASES[3], CASES[-1]  # source: Case.cost_s 20 s, a compiled config's 60 s
    assert _over(430.0, cheap, 480.0, False) == ""
    assert _over(430.0, compiled, 480.0, False).startswith("time budget: 430 s of the protocol's 480 s spent")
    assert _over(0.0, cheap, 480.0, True) == "time budget: an earlier case was skipped for time"


def test_each_case_in_its_own_process_keeps_records_and_snapshots(tmp_path, meta_run):
    """On CUDA every case runs in a fresh interpreter (validate/protocol_child.py): a second case measured
    in the first one's process counted what the first left behind (the first H200 run). The plumbing is
    the same on meta: the child's record comes back whole, its snapshot moves beside the parent's records,
    and it equals the in-process record of the same case."""
    from memcalc.validate.protocol import select

    records = run_protocol("meta", str(tmp_path), as_json=True, cases=select(["cuda-context", "config-control"]),
                           isolate=True)
    assert [r["case"] for r in records] == ["cuda-context", "config-control"]
    step = records[1]
    (path,) = tmp_path.glob("protocol-meta-*.json")
    assert step["snapshot"] and (tmp_path / step["snapshot"]).is_file()
    assert step["snapshot"].startswith(path.stem + "-snapshots/")
    in_process = {r["case"]: r for r in meta_run[0]}["config-control"]
    assert step["comparisons"] == in_process["comparisons"]
    assert len({r["run_id"] for r in records}) == 1


def test_a_case_process_that_gives_no_record_is_an_error_record(monkeypatch):
    from memcalc.validate import protocol_child
    from memcalc.validate.protocol import select

    def dies(*_a, **_k):
        raise RuntimeError("the case's own process exited -9 without its record (no output)")

    monkeypatch.setattr(protocol_child, "run_case", dies)
    (rec,) = run_protocol("meta", None, as_json=True, cases=select(["config-control"]), isolate=True)
    assert rec["status"] == "error" and "exited -9" in rec["reason"]
    assert rec["command"] == "memcalc validate --config control --device meta --scale-layers 1"

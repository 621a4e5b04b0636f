"""run_validate: records beside predictions, JSON output file, table or JSON on stdout."""

from __future__ import annotations

import json

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.core.spec import ExperimentSpec, KernelProfile, TrainingSpec  # noqa: E402
from memcalc.validate.command import run_validate  # noqa: E402

KEYS = {"config", "device", "predicted_bytes", "measured_bytes", "published_bytes", "error_pct",
        "published_error_pct", "peak_phase", "measured_phase", "first_step_bytes", "status", "reason",
        "torch_version", "seconds"}


def exp(**tr) -> ExperimentSpec:
    base = dict(batch=2, seq=128, optimizer="adafactor", optimizer_impl="for-loop")
    base.update(tr)
    return ExperimentSpec(name="t", model=load_preset("deep-one-1.6b"), training=TrainingSpec(**base),
                          profile=KernelProfile(), published_peak_bytes=10**9)


@pytest.mark.slow  # partitions the compiled graph with dynamo
def test_json_records_and_output_file(tmp_path, capsys):
    out = tmp_path / "results.json"
    items = [("eager", exp()), ("compiled", exp(compile=True))]
    recs = run_validate(items, None if not torch.cuda.is_available() else "meta", True, str(out), scale_layers=1)
    captured = capsys.readouterr()
    assert json.loads(captured.out) == recs  # stdout is the JSON list only
    assert json.loads(out.read_text()) == recs
    ok, skipped = recs
    assert KEYS <= set(ok)
    assert ok["status"] == "ok" and ok["device"] == "meta" and isinstance(ok["measured_bytes"], int)
    assert ok["published_bytes"] is None  # --scale-layers changes the model: no published figure
    if ok["predicted_bytes"] is not None:
        want = (ok["predicted_bytes"] - ok["measured_bytes"]) / ok["measured_bytes"] * 100
        assert ok["error_pct"] == pytest.approx(want, abs=1e-3)
    assert skipped["status"] == "skipped" and "CUDA" in skipped["reason"] and skipped["measured_bytes"] is None
    # what needs no GPU is still checked: PyTorch's partition of the compiled graph
    assert "partitioner saves" in skipped["reason"]
    real, mine = skipped["partition_saved_bytes"], skipped["predicted_saved_bytes"]
    assert isinstance(real, int) and abs(mine - real) <= 0.05 * real


@pytest.mark.slow  # a meta trace; the quick lane traces in tests/trace/test_estimator_vs_trace.py
def test_table_on_stdout(capsys):
    run_validate([("eager", exp())], "meta", False, None, scale_layers=1)
    out = capsys.readouterr().out
    assert "eager" in out and "traced GiB" in out and "predicted vs traced" in out and "[" not in out.split("\n")[0]

"""The measured format (memcalc.inputs.measured: what ``validate --protocol`` writes) and the
``--protocol`` flag's refusals, torch-free (the protocol itself: tests/trace/test_protocol.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.errors import UserError
from memcalc.inputs.measured import MEASURED_FORMAT, MeasuredRecord, json_schema, load_measured, pct
from conftest import one_line_error

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "data" / "reference" / "measured"


def record(**over) -> dict:
    """A minimal step record as the protocol writes it on CUDA."""
    rec = {
        "format": MEASURED_FORMAT, "case": "config-control", "kind": "step", "status": "ok", "reason": "",
        "setup": {"config": "control", "scale_layers": None}, "command": "memcalc validate --config control",
        "environment": {"device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_capability": "9.0",
                        "gpu_total_bytes": 85_520_809_984, "driver_version": "580.159.04", "cuda_version": "13.0",
                        "torch_version": "2.11.0+cu130", "python_version": "3.12.3",
                        "libraries": {"memcalc": "0.1.0", "transformers": "5.17.0", "peft": None, "bitsandbytes": None},
                        "device_used_source": "nvml", "device_used_before_bytes": 0},
        "comparisons": [{"metric": "allocated", "predicted_bytes": 110, "measured_bytes": 100, "error_pct": 10.0,
                         "how": "estimate allocated_peak_bytes vs max_memory_allocated"}],
        "snapshot": "protocol-cuda-x-snapshots/config-control.pickle", "snapshot_reason": "",
        "details": {}, "validate_record": {"config": "control"}, "seconds": 4.2, "run_id": "host:1:abc",
    }
    rec.update(over)
    return rec


def test_schema_file_is_the_models_schema():
    """data/reference/measured/schema.json is regenerated with ``python -m memcalc.inputs.measured``."""
    assert json.loads((MEASURED / "schema.json").read_text()) == json_schema()


def test_readme_names_every_field():
    text = (MEASURED / "README.md").read_text()
    missing = [f for f in MeasuredRecord.model_fields if f"`{f}`" not in text]
    assert not missing, missing


def test_a_record_loads(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps([record(), record(case="cuda-context", kind="context", command=None)]))
    recs = load_measured(str(p))
    assert [r.case for r in recs] == ["config-control", "cuda-context"]
    assert recs[0].comparisons[0].error_pct == pct(110, 100) == 10.0


@pytest.mark.parametrize("data,message", [
    ({"format": MEASURED_FORMAT}, "a JSON list"),  # source: RecordFile writes a list
    ([record(format="memcalc-measured/0")], "format"),  # source: only this version is read
    ([record(kind="gpu")], "kind"),  # source: CASE_KINDS
    ([record(extra_key=1)], "extra_key"),  # source: Spec extra="forbid"
    ([record(comparisons=[{"metric": "peak", "predicted_bytes": 1, "measured_bytes": 1, "error_pct": 0.0,
                           "how": ""}])], "metric"),  # source: METRICS
])
def test_bad_records_are_one_line(tmp_path, data, message):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(data))
    with pytest.raises(UserError) as e:
        load_measured(str(p))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_shipped_records_load():
    """Every records file under data/reference/measured/ (a GPU run's) is in the format."""
    for f in sorted(MEASURED.glob("protocol-*.json")):
        assert load_measured(str(f)), f


@pytest.mark.parametrize("args,code,message", [
    # source: validate_cmd._protocol, checked before torch is imported
    (["--model", "gpt2", "--config", "control"], 2,
     "--protocol runs its own fixed list of cases (docs/protocol.md): drop --model, --config"),
    (["--device", "cpu"], 2, "--protocol --device cpu: the protocol runs on cuda, or traced on meta"),
    (["--output", "README.md"], 2, "it is a file; --protocol writes a folder of records"),  # source: _check_folder
])
def test_protocol_flag_refusals(args, code, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(app, ["validate", "--protocol", *args])
    one_line_error(r, code, message)


def test_case_needs_protocol():
    r = CliRunner().invoke(app, ["validate", "--config", "control", "--case", "hf-lora"])
    one_line_error(r, 2, "--case selects the cases of --protocol: add --protocol")

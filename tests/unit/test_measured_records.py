"""Every step measured on a real GPU, re-estimated from its record (issue 28: "the model's constants are
checked against them first").

For each CUDA records file in ``data/reference/measured/`` (``memcalc validate --protocol``), each ``ok``
step case is estimated again, torch-free, as the protocol predicted it (validate/protocol.py ``_step``
and ``_comparisons``): the record's resolved experiment (``setup.experiment``) cut to the layers measured
(``setup.scale_layers``), under the HF rules when the step ran transformers + PEFT (validate/record.py
``target_spec``), through :func:`memcalc.api.estimate`; then the three peaks on the card's own GPU side
(:func:`memcalc.core.gpu_side.gpu_side` for the record's compute capability). Each is compared with the
bytes measured (``max_memory_allocated``, ``max_memory_reserved``, NVML's used memory at the step's end).
A new records file adds its rows here by itself; a gap it shows fails until it is explained.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # 14 estimates of 1B-parameter steps (about 1 s), torch-free

MEASURED = Path(__file__).resolve().parents[2] / "data" / "reference" / "measured"
RECORDS = sorted(MEASURED.glob("protocol-cuda-*.json"))

#: allocated: the eager steps agree within 0.03% (the allocator replay's whole blocks + the workspaces)
ALLOCATED_TOLERANCE_PCT = 0.05
#: reserved and the device total: the allocator replay's segments; the rows outside it are xfails below
RESERVED_TOLERANCE_PCT = 0.5
DEVICE_TOTAL_TOLERANCE_PCT = 0.5
#: the device total less reserved (the CUDA context + what the step loads): NVML reads bytes; nvidia-smi MiB
OUTSIDE_TOLERANCE_BYTES = 1 << 20

H200 = "protocol-cuda-nvidia-h200-20261128-070544.json"
_COMPILED = ("the compiled step: allocated 2-8% high and reserved -12%..+2% (the record's own profile, PyTorch 2.8 "
             "rules): the partitioner's saved set and inductor's buffer reuse by PyTorch version "
             "(tests/unit/test_compiled_cuda_record.py pins them with the record's PyTorch), and reserved set in the "
             "first step, where inductor autotunes (docs/compile-scope.md), suspected")
_REPLAY_LOW = ("reserved low: the allocator model replays a measured step's own requests exactly "
               "(test_compiled_cuda_record), so the gap is in the requests the timeline replays; config-control's and "
               "config-fused's measured segments (snapshots in the .tgz beside the records) hold more 64 MiB and fewer "
               "24 MiB segments than the replay's. Suspected: the cache the first step (optimizer state created) "
               "leaves for the measured second step, and the free order inside an op")
#: (records file, case, metric) -> why it fails; every row names its source: the records file and the case
KNOWN_GAPS: dict[tuple[str, str, str], str] = {
    # source: H200 records, config-control / fused / checkpoint / bfloat16: reserved -1.6%, -2.4%, -0.7%, -1.3%
    **{(H200, f"config-{c}", m): _REPLAY_LOW for c in ("control", "fused", "checkpoint", "bfloat16")
       for m in ("reserved", "device_total")},
    # source: H200 records, hf-qlora: reserved -0.79% (and its device total read before the step: skipped below)
    (H200, "hf-qlora", "reserved"): _REPLAY_LOW + "; bitsandbytes' 4-bit load leaves its own segments cached",
    # source: H200 records, chunked-loss: reserved -1.1% (+11.0% before the foreach AdamW temporaries were one
    # request, memcalc.engine.optimizers.foreach_temp_sizes)
    **{(H200, "chunked-loss", m): _REPLAY_LOW for m in ("reserved", "device_total")},
    # source: H200 records, the 5 compiled configs (8 layers)
    **{(H200, f"config-{c}", m): _COMPILED
       for c in ("compile", "memory_budget_05", "bf16_budget_60", "memory_budget_60", "fused_memory_budget_05")
       for m in ("allocated", "reserved", "device_total")},
}
#: (records file, case, metric) -> why the row says nothing (a harness fault, the record kept as measured)
EXCLUDED: dict[tuple[str, str, str], str] = {
    # source: data/reference/measured/README.md, known faults: hf-qlora's device used was read while transformers
    # loaded the model, before the step (4.41 GiB against 9.34 GiB reserved); the harness now keeps the reading
    # taken with the most reserved (fixed on main after this run)
    **{(H200, "hf-qlora", m): "device total read before the step (harness fault, README known faults)"
       for m in ("device_total", "outside")},
}


@cache
def _records(name: str) -> list[dict[str, Any]]:
    return json.loads((MEASURED / name).read_text())


def _steps() -> list[tuple[str, str]]:
    return [(p.name, r["case"]) for p in RECORDS for r in _records(p.name)
            if r["kind"] == "step" and r["status"] == "ok"]


def _record(name: str, case: str) -> dict[str, Any]:
    return next(r for r in _records(name) if r["case"] == case)


@cache
def predicted(name: str, case: str) -> dict[str, int]:
    """The protocol's prediction of the case, made again: allocated, reserved, device_total and outside
    (the device total less reserved)."""
    import memcalc.api
    from memcalc.core.gpu_side import architecture_of, biased_linears, device_memory, gpu_side
    from memcalc.core.spec import ExperimentSpec
    from memcalc.inputs.profiles import compose

    rec = _record(name, case)
    exp = ExperimentSpec.model_validate(rec["setup"]["experiment"])
    layers = rec["setup"]["scale_layers"]
    if layers is not None:
        exp = exp.model_copy(update={"model": exp.model.model_copy(update={"n_layers": layers})})
    framework = rec["validate_record"]["framework"]
    assert framework in ("plain", "hf"), f"{case}: a {framework} step (validate/record.py trainer_estimator_spec)"
    if framework == "hf" and exp.profile.framework != "hf":  # validate/record.py hf_estimator_spec
        exp = exp.model_copy(update={"profile": compose(exp.profile, "hf", None)})
    est = memcalc.api.estimate(exp).estimate
    env = rec["environment"]
    major, minor = (int(x) for x in env["gpu_capability"].split("."))
    side = gpu_side("nvidia", architecture_of((major, minor)), env["gpu_name"], 1, biased_linears(exp),
                    exp.training.compile)
    dev = device_memory(est.step_allocated_bytes, est.step_reserved_bytes, side)
    return {"allocated": dev.allocated_peak_bytes, "reserved": dev.reserved_peak_bytes,
            "device_total": dev.device_total_bytes, "outside": dev.device_total_bytes - dev.reserved_peak_bytes}


def measured(name: str, case: str) -> dict[str, int]:
    got = {c["metric"]: c["measured_bytes"] for c in _record(name, case)["comparisons"]}
    got["outside"] = got["device_total"] - got["reserved"]
    return got


def _rows(metrics: tuple[str, ...]) -> list[Any]:
    out = []
    for name, case in _steps():
        for m in metrics:
            key = (name, case, m)
            marks = ([pytest.mark.skip(reason=EXCLUDED[key])] if key in EXCLUDED else
                     [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[key])] if key in KNOWN_GAPS else [])
            out.append(pytest.param(name, case, m, marks=marks, id=f"{name[:-5]}:{case}:{m}"))
    return out


TOLERANCE_PCT = {"allocated": ALLOCATED_TOLERANCE_PCT, "reserved": RESERVED_TOLERANCE_PCT,
                 "device_total": DEVICE_TOTAL_TOLERANCE_PCT}


def test_there_is_a_cuda_record():
    # source: data/reference/measured/README.md, "Runs recorded here": the H200 run
    assert H200 in [p.name for p in RECORDS] and len(_steps()) >= 14


@pytest.mark.parametrize("name,case,metric", _rows(("allocated", "reserved", "device_total")))
def test_peak_matches_the_measured_step(name, case, metric):
    # source: the records file `name`, case `case` (max_memory_allocated / max_memory_reserved / NVML used)
    got, want = predicted(name, case)[metric], measured(name, case)[metric]
    err = 100 * (got - want) / want
    assert abs(err) <= TOLERANCE_PCT[metric], f"{case} {metric}: predicted {got:,} B, measured {want:,} B ({err:+.3f}%)"


@pytest.mark.parametrize("name,case,metric", _rows(("outside",)))
def test_device_total_less_reserved_is_the_context_and_the_step_s_loads(name, case, metric):
    # source: the records file `name`, case `case`: NVML used at the step's end less max_memory_reserved, against
    # memcalc.core.gpu_side's CUDA context + what the step loads (+ NCCL: none on one GPU)
    got, want = predicted(name, case)[metric], measured(name, case)[metric]
    assert abs(got - want) <= OUTSIDE_TOLERANCE_BYTES, f"{case}: predicted {got:,} B past reserved, measured {want:,} B"


def test_the_protocol_s_own_predictions_are_reproduced():
    """The rows above estimate what the protocol estimated: the record's allocated and reserved predictions (the
    GPU side's workspaces unchanged since) to the byte; its device total then added the 426 MiB context alone."""
    from memcalc.core.units import MiB

    # source: H200 records, config-control: predicted allocated 22,774,754,816 B, reserved 23,188,209,664 B,
    # device total 23,634,903,040 B (= reserved + 426 MiB)
    rec = {c["metric"]: c["predicted_bytes"] for c in _record(H200, "config-control")["comparisons"]}
    now = predicted(H200, "config-control")
    assert (now["allocated"], now["reserved"]) == (rec["allocated"], rec["reserved"])
    assert rec["device_total"] - rec["reserved"] == 426 * MiB
    # source: H200 records, cuda-context 548,995,072 B + every eager step's 224 MiB beyond it
    assert now["outside"] == 548_995_072 + 224 * MiB

"""The "measured" format: what ``memcalc validate --protocol`` writes, one record per case, and its loader.

A records file (``data/reference/measured/<run>.json``) is a JSON list of :class:`MeasuredRecord`
(``format`` ``memcalc-measured/1``), written after every case (``memcalc.validate.output.RecordFile``:
an interrupted run keeps what it measured). Each record states the machine (:class:`Environment`: GPU,
driver, CUDA, torch, transformers / peft / bitsandbytes), the exact setup, and memcalc's prediction
beside the measurement as :class:`Comparison` rows, one per metric:

- ``allocated``: ``torch.cuda.max_memory_allocated`` of the measured step, beside the estimate's
  ``allocated_peak_bytes`` (the allocator replay's blocks + the cuBLAS workspaces, memcalc.core.gpu_side);
- ``reserved``: ``max_memory_reserved`` beside ``reserved_peak_bytes``;
- ``device_total``: the device's used memory (NVML or nvidia-smi) at the end of the step, less what was
  used before this process touched the GPU, beside ``device_total_bytes`` (reserved + CUDA context);
- ``step_allocated`` / ``step_reserved`` (the meta device): the traced step's own tensors and the
  caching-allocator replay over them, beside the estimate's ``peak_bytes`` / ``step_reserved_bytes``;
- ``saved_for_backward`` (a compiled step on meta, which inductor cannot run): what PyTorch's partitioner
  saves for backward beside memcalc's compiled saved set;
- ``context``, ``workspace``, ``allocator_allocated`` / ``allocator_reserved``: the probes' own figures.

``error_pct`` = (predicted - measured) / measured * 100. ``data/reference/measured/README.md`` documents
the format and ``schema.json`` beside it is :func:`json_schema` (a test keeps them equal). Torch-free.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import Field, ValidationError

from memcalc.core.errors import UserError
from memcalc.core.files import MAX_RECORDS_BYTES, read_bounded
from memcalc.core.spec_base import Spec

MEASURED_FORMAT = "memcalc-measured/1"
CASE_KINDS = ("context", "workspace", "allocator", "step", "callback")
STATUSES = ("ok", "skipped", "oom", "error")
METRICS = ("allocated", "reserved", "device_total", "step_allocated", "step_reserved", "saved_for_backward",
           "context", "workspace", "allocator_allocated", "allocator_reserved")


class Environment(Spec):
    """The machine and libraries a case ran on (None: not known there, or not installed)."""

    device: Literal["cuda", "meta"] = Field(description="cuda: measured on a GPU; meta: traced, nothing measured.")
    gpu_name: Optional[str] = Field(None, description="torch.cuda.get_device_name() (None on meta).")
    gpu_capability: Optional[str] = Field(None, description="Compute capability, major.minor (9.0: Hopper).")
    gpu_total_bytes: Optional[int] = Field(None, description="The card's memory, torch.cuda.mem_get_info()[1].")
    driver_version: Optional[str] = Field(None, description="NVIDIA driver version (NVML or nvidia-smi).")
    cuda_version: Optional[str] = Field(None, description="CUDA torch was built with (torch.version.cuda).")
    torch_version: str = Field(description="torch.__version__.")
    libraries: dict[str, Optional[str]] = Field(
        description="Versions of memcalc, transformers, peft and bitsandbytes (None: not installed).")
    python_version: str = Field(description="platform.python_version().")
    device_used_source: Optional[Literal["nvml", "nvidia-smi"]] = Field(
        None, description="Where the device's used memory was read (None: neither available; no device totals).")
    device_used_before_bytes: Optional[int] = Field(
        None, description="The device's used memory before this process created its CUDA context.")


class Comparison(Spec):
    """One metric, predicted beside measured (bytes; None where one side has no figure)."""

    metric: Literal[METRICS] = Field(description="What is compared (see the module docstring).")  # type: ignore[valid-type]
    predicted_bytes: Optional[int] = Field(description="memcalc's figure.")
    measured_bytes: Optional[int] = Field(description="The run's (or the trace's, on meta) figure.")
    error_pct: Optional[float] = Field(description="(predicted - measured) / measured * 100, 3 decimals.")
    how: str = Field(description="Where each side comes from.")


class MeasuredRecord(Spec):
    """One case of the protocol (see the module docstring)."""

    format: Literal["memcalc-measured/1"] = Field(description="The format and its version.")
    case: str = Field(description="The case's name in the protocol's list.")
    kind: Literal[CASE_KINDS] = Field(description="Which part of the GPU the case probes.")  # type: ignore[valid-type]
    status: Literal[STATUSES] = Field(  # type: ignore[valid-type]
        description="ok, skipped (reason: why this device cannot run it), oom, or error (reason: the exception).")
    reason: str = Field("", description="Why the case was skipped or failed; notes on an ok case.")
    setup: dict[str, Any] = Field(description="The exact setup: memcalc options, framework, sizes, scale_layers.")
    command: Optional[str] = Field(None, description="The memcalc command that reruns this step alone.")
    environment: Environment = Field(description="The machine and libraries.")
    comparisons: list[Comparison] = Field(description="Predicted vs measured, one row per metric.")
    snapshot: Optional[str] = Field(
        None, description="The case's memory snapshot (torch.cuda.memory._dump_snapshot format), relative to "
                          "the records file's folder.")
    snapshot_reason: str = Field("", description="Why there is no snapshot.")
    details: dict[str, Any] = Field(default_factory=dict, description="The probe's own figures (bytes as ints).")
    validate_record: Optional[dict[str, Any]] = Field(
        None, description="The step's `memcalc validate` record, as validate --json prints it.")
    seconds: float = Field(description="Wall-clock seconds the case took.")
    run_id: Optional[str] = Field(None, description="host:pid:random, the same for every record of one run.")


def pct(predicted: Optional[int], measured: Optional[int]) -> Optional[float]:
    """(predicted - measured) / measured in percent, 3 decimals (None without both, or measured 0)."""
    if predicted is None or measured is None or measured == 0:
        return None
    return round((predicted - measured) / measured * 100, 3)


def comparison(metric: str, predicted: Optional[int], measured: Optional[int], how: str) -> Comparison:
    return Comparison(metric=metric, predicted_bytes=predicted, measured_bytes=measured,
                      error_pct=pct(predicted, measured), how=how)


def parse_records(data: Any, where: str) -> list[MeasuredRecord]:
    """The records of a parsed records file (UserError, one line, when it is not one)."""
    from memcalc.inputs.pydantic_errors import pydantic_error_line

    if not isinstance(data, list):
        raise UserError(f"{where}: a measured records file is a JSON list, got {type(data).__name__}")
    out = []
    for i, r in enumerate(data):
        try:
            out.append(MeasuredRecord.model_validate(r))
        except ValidationError as e:
            raise UserError(pydantic_error_line(e, f"{where} record {i}")) from None
    return out


#: the largest records file read (bytes; memcalc.core.files.MAX_RECORDS_BYTES, 256 MiB): a protocol run's is
#: about 100 KiB (data/reference/measured/)


def load_measured(path: str) -> list[MeasuredRecord]:
    """Read a records file ``validate --protocol`` wrote (UserError, one line, when it cannot)."""
    raw = read_bounded(path, "measured records file", MAX_RECORDS_BYTES, "a protocol run's records are about 100 KiB")
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # (UnicodeDecodeError is a ValueError)
        raise UserError(f"{path}: not JSON ({str(e)[:80]})") from None
    except RecursionError:
        raise UserError(f"{path}: nests too deep for a records file") from None
    return parse_records(data, path)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a records file (``data/reference/measured/schema.json``)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "memcalc measured records",
            "type": "array", "items": MeasuredRecord.model_json_schema()}


if __name__ == "__main__":  # python -m memcalc.inputs.measured > data/reference/measured/schema.json
    print(json.dumps(json_schema(), indent=2))

"""Published GPU runs as test rows: the data file, the estimate each row maps to, the pass lines.

``data/reference/published.yaml`` (installed as ``memcalc.data``, ``reference/published.yaml``) holds
each row as its source published it (value, unit, metric) with the ``memcalc estimate`` arguments a
careful user would type for it. Torch-free: the estimate runs through the CLI (``--json``), exactly
as a user runs it. Used by ``tests/unit/test_published.py`` and ``tests/published_report.py``.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from memcalc.inputs.data_files import data_root, parse_text

GiB = 2**30
GB = 10**9
UNIT_BYTES = {"GiB": GiB, "GB": GB}

TOLERANCE_PCT = 5.0  # issue 27: a published run is within 5% where every input is known
MAX_LOW_PCT = 10.0  # issue 28: no row with every input known is more than 10% low
QLORA_TOLERANCE_PCT = 5.0  # issue 28: QLoRA rows within 5%

# the published metric -> the estimate's --json key that measures the same thing
METRIC_KEY = {
    "allocated": "allocated_peak_bytes",  # torch.cuda.max_memory_allocated: whole blocks + cuBLAS workspaces
    "allocated_run": "run_peak_bytes",  # max_memory_allocated never reset: the higher of the load phase and that
    "active": "allocated_peak_bytes",  # active_bytes.all.peak: allocated + blocks whose free waits on a stream
    "reserved": "reserved_peak_bytes",  # torch.cuda.max_memory_reserved
    "device_total": "device_total_bytes",  # what nvidia-smi shows: reserved + CUDA context + workspaces
}
METRICS = (*METRIC_KEY, "unstated")
REQUIRED = ("id", "trainer", "issue", "qlora", "repo", "commit", "path", "source", "quote", "value", "unit",
            "metric", "metric_as_published", "gpu", "args", "inputs", "assumptions")


@lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    """The parsed data file (notes and rows)."""
    entry = data_root() / "reference" / "published.yaml"
    return parse_text(entry.read_text(encoding="utf-8"), "reference/published.yaml")


def rows() -> list[dict[str, Any]]:
    return list(load()["rows"])


def known(row: dict[str, Any]) -> bool:
    """Every input known and the metric one memcalc can name: the row counts for pass/fail."""
    return not row.get("unknown") and bool(row["args"]) and row["metric"] in METRIC_KEY


def published_bytes(row: dict[str, Any]) -> int:
    return round(float(row["value"]) * UNIT_BYTES[row["unit"]])


def argv(row: dict[str, Any]) -> list[str]:
    """The row's ``memcalc estimate`` arguments; ``hf_configs/NAME.json`` and ``reference/models/NAME.json``
    are shipped data files."""
    out = []
    for a in shlex.split(row["args"]):
        if a.startswith(("hf_configs/", "reference/models/")):
            a = str(data_root() / a)
        out.append(a)
    return out


@dataclass(frozen=True)
class Result:
    row: dict[str, Any]
    estimate_bytes: int | None  # the estimate's figure for the row's metric; None if it has none
    error: str | None  # the CLI's one-line error (a refused setup) or the missing --json key
    doc: dict[str, Any] | None

    @property
    def published_bytes(self) -> int:
        return published_bytes(self.row)

    @property
    def error_pct(self) -> float | None:
        if self.estimate_bytes is None:
            return None
        return 100.0 * (self.estimate_bytes - self.published_bytes) / self.published_bytes


def pass_line(row: dict[str, Any], err_pct: float) -> tuple[bool, str]:
    """Whether an error passes the row's issue, and the line it was held to."""
    if row["qlora"]:
        return abs(err_pct) <= QLORA_TOLERANCE_PCT, f"|error| <= {QLORA_TOLERANCE_PCT}% (QLoRA)"
    if row["issue"] == 27:
        return abs(err_pct) <= TOLERANCE_PCT, f"|error| <= {TOLERANCE_PCT}%"
    return err_pct >= -MAX_LOW_PCT, f"error >= -{MAX_LOW_PCT}%"


@cache
def _estimate_json(args: tuple[str, ...]) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from memcalc.cli import app

    r = CliRunner().invoke(app, ["estimate", *args, "--json"])
    return r.exit_code, r.stdout, r.stderr


def run(row: dict[str, Any]) -> Result:
    """Run the row's estimate (cached per argument list)."""
    if not row["args"]:
        return Result(row, None, "not expressible (no arguments)", None)
    code, out, err = _estimate_json(tuple(argv(row)))
    if code != 0:
        text = (err or out).strip()
        return Result(row, None, text.splitlines()[-1] if text else f"exit {code}", None)
    doc = json.loads(out)
    key = METRIC_KEY.get(row["metric"], "peak_bytes")
    if key not in doc:
        return Result(row, None, f"the estimate reports no {key}", doc)
    return Result(row, int(doc[key]), None, doc)

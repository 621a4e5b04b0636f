"""What the two recorders (``record.py``, ``field_contract_record.py``) share: a recording is one
JSON document, ``{"about": ..., "rows": [...]}``, rewritten whole after each row (through a temporary
file and an atomic rename), so an interrupted run loses nothing already traced."""

from __future__ import annotations

import json
import os
from typing import Any


def write_rows(path: str, about: str, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` with their ``about`` line to ``path``, atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"about": about, "rows": rows}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)

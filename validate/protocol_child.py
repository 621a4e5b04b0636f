"""Each case of ``memcalc validate --protocol`` on CUDA runs in a process of its own (issue 30).

A case measured after another in the same process is not what a user's run sees: the first GPU run of the
protocol (H200, stop 29) measured ``config-control`` and ``config-fused`` exactly (+0.00%), and every case
after them about one model's weights high (``config-checkpoint`` 18.66 GiB against 12.58 predicted and
12.53 published), since what an earlier case left allocated counts in ``max_memory_allocated``, and its
cached segments, CUDA context and cuBLAS handles in the device's used memory. A fresh interpreter per case
(``python -m memcalc.cli validate --protocol --case NAME --json --output TMP``, with :data:`CHILD_ENV` set
so that it runs the case itself) starts each from what a user's ``memcalc validate`` starts from; the
parent never makes a CUDA context (it reads the card's name through NVML) and collects the records and
snapshots.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional

#: set in a case's own process: it runs the case in-process (and never spawns)
CHILD_ENV = "MEMCALC_PROTOCOL_CHILD"
#: about how long a fresh interpreter takes to import torch and memcalc before its case starts, seconds
CHILD_START_S = 10.0


def in_child() -> bool:
    """True inside a case's own process."""
    return os.environ.get(CHILD_ENV) == "1"


def child_timeout(cost_s: float) -> float:
    """How long a case's process may run before it is killed (a hung case must not hang the protocol):
    four times its guessed cost and its start, at least two minutes."""
    return max(4 * (cost_s + CHILD_START_S), 120.0)


def run_case(name: str, device: str, snapdir: Optional[str], timeout_s: float) -> dict[str, Any]:
    """Run case ``name`` in a fresh interpreter and return its measured-format record; its snapshot, if it
    wrote one, is moved into ``snapdir``. Its progress lines pass through on stderr. A process that
    prints no record (killed, crashed) raises RuntimeError with the end of what it said."""
    with tempfile.TemporaryDirectory(prefix="memcalc-case-") as tmp:
        cmd = [sys.executable, "-m", "memcalc.cli", "validate", "--protocol", "--device", device,
               "--case", name, "--json", "--output", tmp]
        env = dict(os.environ, **{CHILD_ENV: "1"})
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"the case's own process ran past {timeout_s:.0f} s and was killed") from e
        records = _parse(proc.stdout)
        if len(records) != 1:
            tail = proc.stdout.strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the case's own process exited {proc.returncode} without its record ({tail[0][:200]})")
        rec = records[0]
        if rec.get("snapshot") and snapdir:
            src = os.path.join(tmp, rec["snapshot"])
            dst = os.path.join(snapdir, os.path.basename(src))
            shutil.move(src, dst)
            rec["snapshot"] = os.path.join(os.path.basename(snapdir), os.path.basename(dst))
        elif rec.get("snapshot"):
            rec["snapshot"] = None
            rec["snapshot_reason"] = "no --output folder: the snapshots are written beside the records"
        return rec


def _parse(stdout: str) -> list:
    try:
        out = json.loads(stdout)
    except ValueError:
        return []
    return out if isinstance(out, list) else []


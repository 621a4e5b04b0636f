"""An unsharded estimate, from its inputs to its tables, leaves unloaded what only other setups use
(the estimate's start-up time): DeepSpeed's and FSDP1's runtimes (``memcalc.engine.timeline``
imports them where a step runs them), ``importlib.resources`` and its readers
(``memcalc.inputs.data_files.data_root`` finds the data folder itself) and ``difflib`` (imported
for a misspelt name's suggestion). The CLI's own rows are in ``tests/unit/test_lazy_imports.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

UNUSED = ("memcalc.engine.deepspeed", "memcalc.engine.fsdp1", "importlib.resources", "importlib.readers",
          "zipfile", "difflib")

PROBE = """
import json, os, sys, types
# pydantic's plugin lookup stubbed out: its loader imports importlib.metadata, and with it zipfile;
# this probe watches what memcalc itself imports
os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
sys.modules["pydantic.plugin._loader"] = types.SimpleNamespace(get_plugins=lambda: ())
from memcalc.inputs.resolve import resolve, Options
from memcalc.estimate.peak import estimate
from memcalc.inputs.gpus import list_gpus
from memcalc.render.report import to_json
res = resolve(Options(params="125M", seq=64, bf16=True, lora=True))
est = estimate(res.exp)
doc = to_json(est, res, list_gpus())
print(json.dumps({{"peak": doc["peak_bytes"], "loaded": [m for m in {unused!r} if m in sys.modules]}}))
res = resolve(Options(params="125M", seq=64, bf16=True, zero=3, gpus=2, sharding="deepspeed"))
estimate(res.exp)
print(json.dumps({{"loaded": [m for m in {unused!r} if m in sys.modules]}}))
"""


def test_an_unsharded_estimate_loads_no_sharded_runtime_nor_resource_readers():
    out = subprocess.run([sys.executable, "-c", PROBE.format(unused=UNUSED)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    unsharded, deepspeed = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert unsharded["peak"] > 0 and unsharded["loaded"] == []
    # the probe can tell: a DeepSpeed estimate does load its runtime
    assert "memcalc.engine.deepspeed" in deepspeed["loaded"]


def test_data_root_is_what_importlib_resources_gives():
    # data_root() skips importlib.resources for a package loaded from a folder; it must name the
    # same root (the same type and path), listing the same files
    from importlib import resources

    from memcalc.inputs.data_files import data_root

    want = resources.files("memcalc.data")
    got = data_root()
    assert type(got) is type(want) and str(got) == str(want)
    assert sorted(e.name for e in got.iterdir()) == sorted(e.name for e in want.iterdir())

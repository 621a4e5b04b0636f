"""The CLI loads only what a command prints (issue 15: the estimate's start-up time).

Each row runs the ``memcalc`` entry point in a fresh interpreter (a small model: well under a
second each) and lists the heavy modules it left in ``sys.modules``. A module-level import of
rich in ``render/report.py``, of yaml in ``inputs/data_files.py``, of the spec models in the CLI,
or of the Hugging Face hub client in ``inputs/presets.py`` makes a row fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the modules watched: each is what a command may leave unloaded
WATCHED = ("pydantic", "memcalc.core.spec", "rich", "yaml", "numpy", "memcalc.inputs.hf_hub", "http.client",
           "memcalc.inputs.presets", "memcalc.inputs.configs", "memcalc.plan.search", "memcalc.compile.graph",
           "memcalc.estimate.peak", "memcalc.render.report", "importlib.metadata", "memcalc.plan.limits")

PROBE = """
import contextlib, io, json, sys
import memcalc.cli
from memcalc.cli import main
WATCHED = {watched!r}
for argv in {stages!r}:  # one interpreter, the stages in order: each sees what the earlier ones loaded
    sys.argv = ["memcalc", *argv]
    code = 0
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            main()
    except SystemExit as e:
        code = e.code
    print(json.dumps({{"code": code, "loaded": [m for m in WATCHED if m in sys.modules]}}))
"""

# (the arguments, what must still be unloaded after them, what must be loaded), lightest first:
# each stage runs after the ones above it in the same interpreter
STAGES = [
    # source: issue 15 ("lazy imports so that `estimate` loads only what it renders"); --help lists
    # the commands from typer alone
    (["--help"], WATCHED, ()),
    # a command's options without the spec models (the choices come from memcalc.core); typer
    # coerces option values through pydantic, which loads with them
    (["estimate", "--help"], tuple(m for m in WATCHED if m not in ("pydantic", "importlib.metadata")), ()),
    # --json: no rich; --params: no presets, no hub client (YAML: the GPU catalog, parsed when
    # read); an eager estimate: no numpy, no plan, no compile graph
    (["estimate", "--params", "125M", "--seq", "64", "--json"],
     ("rich", "numpy", "memcalc.inputs.hf_hub", "http.client", "memcalc.inputs.presets",
      "memcalc.inputs.configs", "memcalc.plan.search", "memcalc.compile.graph"),
     ("pydantic", "memcalc.core.spec", "memcalc.estimate.peak", "yaml")),
    # a preset by name: no hub client
    (["estimate", "--model", "gpt2", "--seq", "64", "--json"],
     ("rich", "numpy", "memcalc.inputs.hf_hub", "http.client", "memcalc.plan.search"),
     ("memcalc.inputs.presets",)),
    # a setup that does not fit the card asked: "to make it fit" estimates each change, no numpy, no plan search
    # (source: issue 29's "to make it fit" within estimate's 0.5 s; memcalc/plan/remedies.py)
    (["estimate", "--model", "gpt2", "--seq", "1024", "--batch", "64", "--gpu", "8GB", "--json"],
     ("numpy", "memcalc.inputs.hf_hub", "http.client", "memcalc.plan.search", "memcalc.plan.limits"), ()),
    # the tables, to a pipe: rich, and nothing more of the pipeline than --json
    (["estimate", "--params", "125M", "--seq", "64"],
     ("numpy", "memcalc.inputs.hf_hub", "memcalc.plan.search"), ("memcalc.render.report", "rich")),
]


@pytest.fixture(scope="module")
def loaded() -> list[dict]:
    """What each stage left loaded (one fresh interpreter for all of them: about a second)."""
    src = PROBE.format(watched=WATCHED, stages=[argv for argv, _, _ in STAGES])
    out = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(STAGES):]]


@pytest.mark.parametrize("i", range(len(STAGES)), ids=[" ".join(argv) for argv, _, _ in STAGES])
def test_a_command_loads_only_what_it_prints(loaded, i):
    argv, absent, present = STAGES[i]
    doc = loaded[i]
    assert doc["code"] == 0
    got = set(doc["loaded"])
    assert sorted(got & set(absent)) == [], f"memcalc {' '.join(argv)} loaded these"
    assert sorted(set(present) - got) == [], "the probe lost track of what runs (these should load)"


def test_importing_the_cli_loads_no_pipeline():
    out = subprocess.run([sys.executable, "-c", f"import sys, memcalc.cli; print([m for m in {WATCHED!r} if m in sys.modules])"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"

"""What import-linter cannot see: `memcalc.validate` (the torch side) lives in the top-level
`validate/` folder and is installed under `memcalc` by pyproject's `package-dir`, so grimp never
finds it. Here every module of `memcalc/` is parsed with `ast`: only the entry points (the CLI,
the Python API's `measure`, the HF Trainer callback) import `memcalc.validate`, and only inside a
function (lazily); no module imports torch (or
transformers, peft) anywhere, top level or nested. The contracts import-linter does check are in
`.importlinter` (run by `.ci/run`)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "memcalc"
TORCH_SIDE = ("torch", "transformers", "peft")  # source: .importlinter, contract no-torch
VALIDATE = "memcalc.validate"
CLI = PACKAGE / "cli" / "validate_cmd.py"  # the validate command, the CLI's only user of memcalc.validate
#: the entry points that may import memcalc.validate, lazily (source: .importlinter's header)
VALIDATE_ENTRY_POINTS = (CLI, PACKAGE / "api.py", PACKAGE / "integrations" / "transformers.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports(source: str, module: str = "memcalc.x", package: bool = False) -> list[tuple[str, bool]]:
    """Every module ``source`` imports, as (absolute dotted name, inside a function?).

    ``from a import b`` counts as importing both ``a`` and ``a.b`` (``b`` may be a submodule);
    relative imports are resolved against ``module``; ``importlib.import_module("x")`` and
    ``__import__("x")`` with a literal name count too."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend((a.name, in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, in_function))
            found.extend((f"{name}.{a.name}", in_function) for a in node.names if a.name != "*")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            if (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or \
                    (isinstance(f, ast.Attribute) and f.attr == "import_module"):
                found.append((node.args[0].value, in_function))
        nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, nested)

    visit(ast.parse(source), False)
    return found


def _is(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


MODULES = sorted(PACKAGE.rglob("*.py"))


@lru_cache(maxsize=1)
def _package_imports() -> dict[str, list[tuple[str, bool]]]:
    """Every module's imports, parsed once per session (the tests below only read them)."""
    return {str(p.relative_to(ROOT)): imports(p.read_text(encoding="utf-8"), _module_name(p), _is_package(p))
            for p in MODULES}


def test_the_scanner_sees_every_kind_of_import():
    # the checks below can fail: each form of import is found, and whether it is lazy
    src = ("import torch.nn as nn\nfrom memcalc import validate\n"
           "def f():\n    from memcalc.validate.command import run\n    import importlib\n"
           "    importlib.import_module('peft')\n"
           "class C:\n    def g(self):\n        from ..validate import runner\n")
    got = imports(src, "memcalc.plan.search")
    assert ("torch.nn", False) in got
    assert ("memcalc.validate", False) in got  # from memcalc import validate
    assert ("memcalc.validate.command", True) in got
    assert ("peft", True) in got
    assert ("memcalc.validate.runner", True) in got  # relative, inside a method


def test_every_stage_is_scanned():
    names = {_module_name(p) for p in MODULES}
    assert len(MODULES) > 40 and "memcalc.cli" in names
    for stage in ("core", "inputs", "engine", "compile", "estimate", "plan", "render"):
        assert f"memcalc.{stage}" in names


@pytest.mark.slow  # a subprocess; lint-imports (.ci/run) checks the same contract statically
def test_no_module_imports_torch():
    bad = [(path, name) for path, found in _package_imports().items()
           for name, _ in found if any(_is(name, t) for t in TORCH_SIDE)]
    assert bad == [], f"memcalc/ must not import the torch side: {bad}"


@pytest.mark.slow  # the quick lane stays under 30 s; CI runs it
def test_only_the_entry_points_import_validate_and_only_lazily():
    found = _package_imports()
    entry = [str(p.relative_to(ROOT)) for p in VALIDATE_ENTRY_POINTS]
    others = [(path, name) for path, imps in found.items() if path not in entry
              for name, _ in imps if _is(name, VALIDATE)]
    assert others == [], f"only {', '.join(entry)} may import {VALIDATE}: {others}"
    for path in entry:
        uses = [(name, lazy) for name, lazy in found[path] if _is(name, VALIDATE)]
        assert uses, f"{path} imports memcalc.validate (the scan lost it)"
        eager = [name for name, lazy in uses if not lazy]
        assert eager == [], f"{path} imports {eager} at module level; import it inside the function"


PROBE = """
import json, sys

def loaded():
    roots = {"torch", "transformers", "peft"}
    return sorted({m.split(".")[0] if m.split(".")[0] in roots else "memcalc.validate" for m in sys.modules
                   if m.split(".")[0] in roots or m == "memcalc.validate" or m.startswith("memcalc.validate.")})

import memcalc.cli
after_import = loaded()
from typer.testing import CliRunner
r = CliRunner().invoke(memcalc.cli.app, ["estimate", "--model", "gpt2", "--batch", "1", "--seq", "64", "--json"])
print(json.dumps({"code": r.exit_code, "after_import": after_import, "after_run": loaded()}))
"""


@pytest.mark.slow  # a subprocess; lint-imports (.ci/run) checks the same contract statically
def test_importing_and_running_the_cli_loads_no_torch():
    # a fresh interpreter: import the CLI, then run an estimate through it; neither loads torch
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["code"] == 0
    assert doc["after_import"] == [], f"`import memcalc.cli` loaded {doc['after_import']}"
    assert doc["after_run"] == [], f"`memcalc estimate` loaded {doc['after_run']}"


def test_import_contracts_hold_with_no_exception():
    """No `.importlinter` contract lists `ignore_imports`: the validator reaches the estimate through
    memcalc.api (validate/predict.py), and builds its records without predicting (validate/record.py),
    so no import of the estimator's insides needs an exception."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    contracts = [s for s in cfg.sections() if s.startswith("importlinter:contract:")]
    assert contracts, "no contract read from .importlinter"
    excepted = {s: cfg[s]["ignore_imports"].split() for s in contracts if "ignore_imports" in cfg[s]}
    assert not excepted, f"contracts with ignore_imports: {excepted}; import through memcalc.api instead"

"""The shape issue 26 asks for, checked over `memcalc/`, `validate/` (installed as
`memcalc.validate`) and `data/` (`memcalc.data`) with `ast` alone (no torch, no extra package):

- no import cycle, counting every import: top level, inside a function (lazy), under
  ``if TYPE_CHECKING:``, in a ``try``. A package's ``__init__`` that imports its own submodules
  while one of them imports the package is a cycle too;
- no module over ``MAX_LINES`` lines;
- no function or method with a cyclomatic complexity over ``MAX_COMPLEXITY``, counted as radon's
  ``cc`` counts it (see ``complexity``).

Each check has a KNOWN list of today's violations. It may only shrink: a new violation fails, and
so does a KNOWN entry that no longer violates ("remove it from KNOWN"), so that the list always
says what is left to do.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: folder -> the package it installs as (pyproject's [tool.setuptools.package-dir])
PACKAGES = {"memcalc": "memcalc", "validate": "memcalc.validate", "data": "memcalc.data"}
MAX_LINES = 500
MAX_COMPLEXITY = 30

#: import cycles today, each by its sorted member set (a strongly connected component)
KNOWN_CYCLES: list[frozenset[str]] = []

#: modules over MAX_LINES lines today, by path
KNOWN_LONG_MODULES: set[str] = set()

#: functions over MAX_COMPLEXITY today, as path:qualname (radon's count in the comment)
KNOWN_COMPLEX: set[str] = set()


@cache
def modules() -> dict[str, Path]:
    """Every module of the three folders, by its installed dotted name."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- import cycles --------------------------------------------------------------------------


def imported(module: str, source: ast.Module, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its ``source``.
    ``from P import x`` counts as importing ``P.x`` when that is a module, else ``P``; a name that
    is not a module is cut back to its longest module prefix. (Importing ``a.b.c`` also runs
    ``a/__init__`` and ``a/b/__init__``; those implicit edges are not counted.)"""
    package = module if is_package else module.rpartition(".")[0]
    targets = []
    for node in ast.walk(source):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                full = f"{origin}.{alias.name}"
                targets.append(full if full in known else origin)
    edges = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != module:
            edges.add(target)
    return edges


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's algorithm, iterative; only the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def import_cycles() -> list[frozenset[str]]:
    known = modules()
    graph = {
        name: imported(name, tree(path), path.name == "__init__.py", known) for name, path in known.items()
    }
    return strongly_connected(graph)


def test_cycle_finder_sees_type_only_lazy_and_package_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert strongly_connected(graph) == [frozenset("abc")]
    known = {"memcalc.p": ROOT / "p" / "__init__.py", "memcalc.p.m": ROOT / "p" / "m.py"}
    type_only = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import m\n")
    assert imported("memcalc.p", type_only, True, known) == {"memcalc.p.m"}
    lazy = ast.parse("def f():\n    from memcalc.p import thing\n")
    assert imported("memcalc.p.m", lazy, False, known) == {"memcalc.p"}
    relative = ast.parse("from .m import thing\nfrom .. import p\n")
    assert imported("memcalc.p", relative, True, known) == {"memcalc.p.m"}


def test_no_new_import_cycle():
    found = import_cycles()
    new = [sorted(cycle) for cycle in found if not any(cycle <= old for old in KNOWN_CYCLES)]
    assert not new, f"new import cycle(s), type-only and lazy imports included: {new}"
    gone = [sorted(old) for old in KNOWN_CYCLES if old not in found]
    assert not gone, (
        f"KNOWN_CYCLES entries no longer cycles as listed: {gone}; remove them from KNOWN_CYCLES "
        f"(and add what is left of them, if anything): today's cycles are {[sorted(c) for c in found]}"
    )


# --- module length --------------------------------------------------------------------------


def long_modules() -> dict[str, int]:
    lengths = {_rel(path): len(path.read_text().splitlines()) for path in modules().values()}
    return {path: n for path, n in lengths.items() if n > MAX_LINES}


def test_no_new_long_module():
    found = long_modules()
    new = {path: n for path, n in found.items() if path not in KNOWN_LONG_MODULES}
    assert not new, f"module(s) over {MAX_LINES} lines: {new}"
    gone = sorted(KNOWN_LONG_MODULES - set(found))
    assert not gone, f"{gone} are no longer over {MAX_LINES} lines: remove them from KNOWN_LONG_MODULES"


# --- cyclomatic complexity ------------------------------------------------------------------


def complexity(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Cyclomatic complexity as radon's ``cc`` counts it: 1, plus one for each ``if``/``elif``,
    conditional expression, ``for``/``async for``/``while`` (and one more for its ``else``),
    ``except`` handler (and one for a ``try``'s ``else``), ``assert`` (not looking inside it), each extra operand of
    ``and``/``or``, each ``for`` of a comprehension and each of its ``if``s, and each ``case`` of
    a ``match`` except a bare ``case _``. Decorators, default values and nested functions and
    classes are not counted (a nested function is a function of its own). Ruff's C901 (the mccabe
    package) counts the same branches but not boolean operators or comprehensions, so it reads
    lower on most functions."""
    count = 1
    todo: list[ast.AST] = list(function.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Assert):
            count += 1
            continue  # radon does not look inside an assert
        if isinstance(node, (ast.If, ast.IfExp)):
            count += 1
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            count += 1 + bool(node.orelse)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            count += len(node.handlers) + bool(node.orelse)  # type: ignore[attr-defined]
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += 1 + len(node.ifs)
        elif isinstance(node, ast.Match):
            wildcard = any(getattr(case.pattern, "pattern", False) is None for case in node.cases)
            count += max(0, len(node.cases) - wildcard)
        todo.extend(ast.iter_child_nodes(node))
    return count


def functions(body: list[ast.stmt], prefix: str = ""):
    """(qualname, function) for every function and method, nested ones included."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node.body, f"{prefix}{node.name}.")
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                nested = getattr(node, field, None)
                if isinstance(nested, list):
                    yield from functions([n for n in nested if isinstance(n, ast.AST)], prefix)


def complex_functions() -> dict[str, int]:
    found = {}
    for path in modules().values():
        for qualname, function in functions(tree(path).body):
            score = complexity(function)
            if score > MAX_COMPLEXITY:
                found[f"{_rel(path)}:{qualname}"] = score
    return found


def test_complexity_counts_like_radon():
    source = (
        "def f(a, b):\n"
        "    if a and b or a:\n"  # 1 + 2
        "        return [x for x in a if x]\n"  # 2
        "    elif b:\n"  # 1
        "        pass\n"
        "    for x in a:\n"  # 1
        "        pass\n"
        "    else:\n"  # 1
        "        pass\n"
        "    try:\n"
        "        pass\n"
        "    except ValueError:\n"  # 1
        "        pass\n"
        "    except KeyError:\n"  # 1
        "        pass\n"
        "    assert a and b\n"  # 1
        "    def g():\n"  # not counted
        "        if a: pass\n"
        "    match a:\n"
        "        case 1: pass\n"  # 1
        "        case _: pass\n"
        "    return 1 if a else 2\n"  # 1
    )
    (function,) = [node for node in ast.parse(source).body]
    assert isinstance(function, ast.FunctionDef)
    assert complexity(function) == 1 + 3 + 2 + 1 + 2 + 2 + 1 + 1 + 1


def test_no_new_complex_function():
    found = complex_functions()
    new = {name: n for name, n in found.items() if name not in KNOWN_COMPLEX}
    assert not new, f"function(s) with cyclomatic complexity over {MAX_COMPLEXITY} (radon cc): {new}"
    gone = sorted(KNOWN_COMPLEX - set(found))
    assert not gone, f"{gone} are no longer over {MAX_COMPLEXITY}: remove them from KNOWN_COMPLEX"

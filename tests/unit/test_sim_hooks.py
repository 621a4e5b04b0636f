"""Nothing outside the simulator assigns a field of a :class:`memcalc.engine.sim.Sim`: what other
modules switch (observers, the op recorder, the gradient and layer hooks, offloading, where the
forward code is, a checkpointed region's no-grad forward and recompute) goes through
:class:`memcalc.engine.sim_hooks.SimHooks`'s methods (issue 26: the engine core is small, optional
behaviours are registered). Checked with ``ast`` over every module, the tests included: an
assignment (plain, augmented, annotated, in a tuple, ``setattr``) whose target is an attribute of
``sim``, ``s`` or ``<anything>.sim``, or of a name annotated ``Sim``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from memcalc.engine.checkpoint import Ghosts
from memcalc.engine.sim import Sim

ROOT = Path(__file__).resolve().parents[2]
#: the simulator and its base classes, which set their own fields (as ``self.<field>``)
OWNERS = {"memcalc/engine/sim.py", "memcalc/engine/sim_hooks.py", "memcalc/engine/breakdown.py"}
#: modules allowed to assign a Sim's field anyway, with why (none today)
ALLOWED: dict[str, str] = {}


def _sim_names(tree: ast.AST) -> set[str]:
    """The names a module binds to a Sim: ``sim``, ``s``, and any argument annotated ``Sim``."""
    names = {"sim", "s"}
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            ann = ast.unparse(node.annotation).strip("'\"")
            if ann == "Sim" or ann.endswith(".Sim"):
                names.add(node.arg)
    return names


def _is_sim(node: ast.expr, names: set[str]) -> bool:
    return (isinstance(node, ast.Name) and node.id in names) or (isinstance(node, ast.Attribute) and node.attr == "sim")


def _leaves(target: ast.expr):
    if isinstance(target, (ast.Tuple, ast.List)):
        for e in target.elts:
            yield from _leaves(e)
    elif isinstance(target, ast.Starred):
        yield from _leaves(target.value)
    else:
        yield target


def sim_assignments(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = _sim_names(tree)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("setattr", "delattr") and node.args and _is_sim(node.args[0], names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        for target in targets:
            for leaf in _leaves(target):
                if isinstance(leaf, ast.Attribute) and _is_sim(leaf.value, names):
                    found.append(f"{node.lineno}: {ast.unparse(leaf)}")
    return found


def _modules() -> list[Path]:
    paths = []
    for folder in ("memcalc", "validate", "tests", "benchmarks", "data"):
        paths += sorted((ROOT / folder).rglob("*.py"))
    return paths


def test_no_module_outside_the_simulator_assigns_a_sim_field():
    bad = {}
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel in OWNERS or rel in ALLOWED:
            continue
        found = sim_assignments(path)
        if found:
            bad[rel] = found
    assert not bad, f"assign a Sim's fields through memcalc.engine.sim_hooks.SimHooks's methods: {bad}"


def test_the_scan_finds_each_form(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(sim, q: 'Sim', fwd):\n    sim.a = 1\n    q.b += 1\n    x, fwd.sim.c = 1, 2\n"
                   "    setattr(sim, 'd', 1)\n    fwd.other = 1\n    sim.e.f = 1\n")
    found = [line.split(": ")[1] for line in sim_assignments(src)]
    assert found == ["sim.a", "q.b", "fwd.sim.c", "setattr(sim, 'd', 1)"]


def test_the_switches_restore_what_was_there():
    sim = Sim(512)
    heard = []
    with sim.recording(lambda *a: heard.append(a[0])) as prev:
        assert prev is None
        sim.note_op("cast", [], [], [])
    assert sim.recorder is None and heard == ["cast"]
    with sim.no_grad(), pytest.raises(RuntimeError):
        assert not sim.grad_enabled
        raise RuntimeError
    assert sim.grad_enabled and sim.count_saves is None
    outer = sim.nodes
    with sim.apart(Ghosts(0)) as nodes:
        assert sim.nodes is nodes is not outer and sim.alloc(100, "activations", "a").nbytes == 0
    assert sim.nodes is outer and sim.ghosts is None
    where = sim.where(3, "layer")
    assert (sim.layer, sim.role) == (3, "layer") and sim.set_role("mlp") == "layer"
    sim.where(*where)
    assert (sim.layer, sim.role) == where
    with sim.recomputing(2, "bwd layer 2 (recompute)"):
        assert (sim.phase, sim.layer, sim.label) == ("backward", 2, "bwd layer 2 (recompute)")
    assert (sim.phase, sim.layer) == ("setup", where[0])

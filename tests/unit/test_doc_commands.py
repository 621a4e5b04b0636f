"""Every ``memcalc`` command in README.md and ``docs/*.md`` runs as printed, from a clone (issue 29).

The commands are read from the pages' fenced ``bash`` blocks (and unlabelled ones; ``text`` blocks are
output, except a transcript's ``$ memcalc ...`` line), so a new example is run without a new row
here. A line continued with ``\\`` is one command.
Each runs in-process from a temporary folder holding what a clone has (``examples/`` and
``tests/fixtures/``); files an example writes land there. The expected exit code is 0 unless the
line's comment says ``# exit N``. A command that cannot run here says why in its comment,
``# needs: cuda (...)`` or ``# needs: network (...)``, and is listed as skipped with that reason.
The set-up commands (``python3 -m venv ...``) are not ``memcalc`` lines: CI runs the second one
verbatim (``.ci/run``); a ``memcalc`` command joined to one with ``&&`` runs here. A ``memcalc WORD`` line
whose WORD is no command fails (issue 32: every example runs); a ``python -m MODULE`` line names a module
of the repository.

``python`` fences: one written as a doctest (``>>>``) runs as one, from the same folder; any other says
why it cannot run here with a ``# needs: ...`` comment (a fragment of a training loop, a CUDA recording).
"""

from __future__ import annotations

import doctest
import re
import shlex
from pathlib import Path

import pytest
from conftest import cli_run

ROOT = Path(__file__).parent.parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: README.md is the front door: what it is, set-up, three answers, links (issue 29); the depth is in docs/
README_MAX_BYTES = 12 * 1024
#: fence languages whose lines are commands (``text`` / ``console`` blocks hold output)
COMMAND_FENCES = ("bash", "sh", "")
SUBCOMMANDS = ("estimate", "plan", "validate", "models", "configs", "gpus", "profiles", "compare", "explain")
#: a ``memcalc`` line that is no command: ``memcalc --version`` / ``--help`` only
TOP_LEVEL_FLAGS = ("--version", "--help")
NEEDS = re.compile(r"#.*\bneeds:\s*(.+)$")
EXIT = re.compile(r"#.*\bexit (\d+)\b")


def _fences(page: Path):
    """(language, the block's lines with continuations joined, the first line's number) of each fence."""
    text = page.read_text()
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        yield m.group(1), m.group(2), text[: m.start()].count("\n") + 2


def _memcalc_lines(page: Path):
    """(``memcalc ...`` text with its comment, where, its words) for each memcalc command in ``page``'s command
    fences, a transcript's ``$ memcalc ...`` line in any fence, and each ``&&``-joined part of a line."""
    for lang, body, start in _fences(page):
        commands = lang in COMMAND_FENCES
        for k, line in enumerate(body.replace("\\\n", " ").splitlines()):
            prompted = line.startswith("$ ")  # a transcript's command, in any fence
            if not (commands or prompted):
                continue
            line = line[2:] if prompted else line
            for part in line.split("&&") if "&&" in line.split("#")[0] else [line]:
                words = part.split()
                if len(words) > 1 and words[0] == "memcalc":
                    yield part.strip(), f"{page.relative_to(ROOT)}:{start + k}", words


def doc_commands(page: Path) -> list[tuple[str, str]]:
    """(``memcalc ...`` line with its comment, where) for every command in ``page``'s command fences."""
    return [(line, where) for line, where, words in _memcalc_lines(page) if words[1] in SUBCOMMANDS]


COMMANDS = [c for page in PAGES for c in doc_commands(page)]
#: each distinct command (its words, the comment aside) runs once, named by where it first appears
RUNS: list[tuple[str, str]] = []
for _line, _where in COMMANDS:
    if all(shlex.split(_line, comments=True) != shlex.split(seen, comments=True) for seen, _ in RUNS):
        RUNS.append((_line, _where))


def test_readme_is_a_front_door():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move depth to docs/"


def test_the_docs_have_commands_and_each_runs_or_says_why_not():
    assert len(COMMANDS) >= 20, COMMANDS
    for line, where in COMMANDS:
        words = shlex.split(line, comments=True)
        assert "..." not in words, f"{where}: a placeholder is not a command a reader can run: {line}"
        assert "|" not in words, f"{where}: a pipe is not run by the test; use --json alone: {line}"


@pytest.mark.slow  # estimates, plans and scaled-down meta traces: seconds each
@pytest.mark.parametrize("line,where", RUNS, ids=[w for _, w in RUNS])
def test_doc_command_runs(tmp_path, monkeypatch, line, where):
    needs = NEEDS.search(line)
    if needs:
        pytest.skip(f"{where} needs {needs.group(1)}")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures")
    monkeypatch.chdir(tmp_path)
    expected = EXIT.search(line)
    r = cli_run(shlex.split(line, comments=True)[1:])
    assert r.exit_code == (int(expected.group(1)) if expected else 0), f"{where}: {line}\n{r.output[-2000:]}"


def test_every_memcalc_line_is_a_command():
    """A ``memcalc WORD`` line in a command fence runs a command that exists (the test runs those; a line
    naming no command, ``memcalc report``, would be skipped silently)."""
    import typer

    from memcalc.cli import app

    commands = set(typer.main.get_command(app).commands)
    assert set(SUBCOMMANDS) == commands, "SUBCOMMANDS is the CLI's command list"
    bad = [(where, line) for page in PAGES for line, where, words in _memcalc_lines(page)
           if words[1] not in commands and words[1] not in TOP_LEVEL_FLAGS and not words[1].startswith("#")]
    assert not bad, bad


def _python_blocks() -> list[tuple[str, str, str]]:
    """(where, the block, its page's path) of every ``python`` fence."""
    return [(f"{page.relative_to(ROOT)}:{start}", body, str(page)) for page in PAGES
            for lang, body, start in _fences(page) if lang in ("python", "py", "pycon")]


def test_python_examples_run_or_say_why_not():
    blocks = _python_blocks()
    assert blocks
    for where, body, _ in blocks:
        assert ">>>" in body or NEEDS.search(body.splitlines()[0]), \
            f"{where}: a python example is a doctest (>>>) or says '# needs: ...' on its first line"


def test_python_module_lines_name_modules():
    """``python -m MODULE`` in a command fence: the module is a file of the repository (memcalc.validate.X is
    validate/X.py: pyproject's package-dir)."""
    for page in PAGES:
        for lang, body, start in _fences(page):
            for m in re.finditer(r"python3? -m (memcalc[\w.]*)", body if lang in COMMAND_FENCES else ""):
                parts = m.group(1).split(".")
                rel = Path("validate", *parts[2:]) if parts[:2] == ["memcalc", "validate"] else Path(*parts)
                assert (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__main__.py").is_file(), \
                    f"{page.relative_to(ROOT)}:{start}: python -m {m.group(1)}: no such module"


DOCTESTS = [(where, body, page) for where, body, page in _python_blocks() if ">>>" in body]


@pytest.mark.slow  # the usage page's: an 8B QLoRA estimate and an 8B plan for one card, seconds
@pytest.mark.parametrize("where,body,page", DOCTESTS, ids=[w for w, _, _ in DOCTESTS])
def test_python_doctest_runs(tmp_path, monkeypatch, where, body, page):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "fixtures").symlink_to(ROOT / "tests" / "fixtures")
    monkeypatch.chdir(tmp_path)
    test = doctest.DocTestParser().get_doctest(body, {}, where, page, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out: list[str] = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)[-3000:]

"""Every ``memcalc`` command in README.md and ``docs/*.md`` runs as printed, from a clone (issue 29).

The commands are read from the pages' fenced ``bash`` blocks (and unlabelled ones; ``text`` blocks are
output, except a transcript's ``$ memcalc ...`` line), so a new example is run without a new row
here. A line continued with ``\\`` is one command.
Each runs in-process from a temporary folder holding what a clone has (``examples/`` and
``tests/fixtures/``); files an example writes land there. The expected exit code is 0 unless the
line's comment says ``# exit N``. A command that cannot run here says why in its comment,
``# needs: cuda (...)`` or ``# needs: network (...)``, and is listed as skipped with that reason.
The set-up commands (``python3 -m venv ...``) are not ``memcalc`` lines: CI runs the second one
verbatim (``.ci/run``).
"""

from __future__ import annotations

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
NEEDS = re.compile(r"#.*\bneeds:\s*(.+)$")
EXIT = re.compile(r"#.*\bexit (\d+)\b")


def doc_commands(page: Path) -> list[tuple[str, str]]:
    """(``memcalc ...`` line with its comment, where) for every command in ``page``'s command fences."""
    out: list[tuple[str, str]] = []
    text = page.read_text()
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        commands = m.group(1) in COMMAND_FENCES
        lines = m.group(2).replace("\\\n", " ").splitlines()
        start = text[: m.start()].count("\n") + 2
        for k, line in enumerate(lines):
            prompted = line.startswith("$ ")  # a transcript's command, in any fence
            if not (commands or prompted):
                continue
            line = line[2:] if prompted else line
            words = line.split()
            if len(words) > 1 and words[0] == "memcalc" and words[1] in SUBCOMMANDS:
                out.append((line.strip(), f"{page.relative_to(ROOT)}:{start + k}"))
    return out


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

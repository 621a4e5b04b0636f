"""Every example in ``memcalc COMMAND --help`` runs as printed, from a clone (issue 32: two of
``validate --help``'s examples were refused; issue 29: examples named files a clone does not have).

The examples are read from the help text itself, so a new one is run without a new row here. Each runs
in-process from a temporary folder holding the repository's ``examples/`` (what a clone has); files
an example writes land there. Exit code 0 is the check; the traces and plans behind them are checked
by their own tests.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import cli_run

ROOT = Path(__file__).parent.parent.parent


def _commands() -> tuple[str, ...]:
    """Every command of the CLI (a new one's examples run without a new row here)."""
    import typer

    from memcalc.cli import app

    return tuple(typer.main.get_command(app).commands)


COMMANDS = _commands()


def help_examples(command: str) -> list[str]:
    """The ``memcalc ...`` lines under ``Examples:`` in ``memcalc COMMAND --help``."""
    text = cli_run([command, "--help"]).stdout
    if "Examples:" not in text:
        return []
    block = text.split("Examples:", 1)[1]
    return [line.strip() for line in block.splitlines() if re.match(r"^\s*memcalc ", line)]


EXAMPLES = [(c, e) for c in COMMANDS for e in help_examples(c)]


def test_the_commands_have_examples():
    assert {c for c, _ in EXAMPLES} >= {"estimate", "plan", "validate"}
    assert "memcalc " not in cli_run(["--help"]).stdout.split("Commands:")[0].replace("Usage: memcalc ", ""), \
        "the top-level --help has no examples to run (add them under a command's Examples:)"


@pytest.mark.slow  # estimates, plans and (scaled-down) traces: seconds each
@pytest.mark.parametrize("command,example", EXAMPLES, ids=[e[8:60] for _, e in EXAMPLES])
def test_help_example_runs(tmp_path, monkeypatch, command, example):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    r = cli_run(shlex.split(example)[1:])
    assert r.exit_code == 0, f"{example}\n{r.output[-2000:]}"

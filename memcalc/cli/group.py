"""The typer application: the group that turns every error into one line and an exit code.

Imports only typer and memcalc's pydantic-free core modules: the spec models, rich, yaml and the
pipeline load inside the commands that need them. Help and errors are click's plain layout
(``rich_markup_mode=None``): each example in a command's docstring stays one line (``\\b``).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from typer._click.exceptions import NoArgsIsHelpError  # (typer 0.2x carries its own click)
from typer.core import TyperGroup

from memcalc.core.errors import UserError


class _Group(TyperGroup):
    """Runs commands without click's standalone error printing; errors become one line + exit 2.
    (typer lists the commands in the order they were added.)"""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        try:
            rv = super().main(args=args, prog_name=prog_name or "memcalc", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except UserError as e:
            _err(str(e))
            sys.exit(2)
        except NoArgsIsHelpError as e:  # a bare `memcalc`: the help screen as is (stderr, exit 2)
            sys.stderr.write(e.format_message().rstrip("\n") + "\n")
            sys.exit(2)
        except typer.Abort:
            _err("aborted")
            sys.exit(130)
        except typer.TyperException as e:  # click's usage errors: no such option, bad choice, bad number
            _err(" ".join(e.format_message().split()))
            sys.exit(2)
        except Exception as e:  # a pydantic ValidationError: one line too
            from memcalc.api import error_line

            line = error_line(e)
            if line is None:
                raise
            _err(line)
            sys.exit(2)
        # (typer returns an Exit's code, --version's or --help's, as the command's value)
        sys.exit(rv if isinstance(rv, int) else 0)


def _err(msg: str) -> None:
    sys.stderr.write(f"memcalc: error: {msg}\n")


app = typer.Typer(
    cls=_Group,
    name="memcalc",
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from memcalc import __version__

        typer.echo(f"memcalc {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """memcalc: how much GPU memory a training step takes, from its timeline, and proof by measuring."""

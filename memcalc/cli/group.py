"""The typer application: the group that turns every error into one line and an exit code.

Imports only typer and memcalc's pydantic-free core modules: pydantic (and the spec models),
rich, yaml and the pipeline load inside the commands that need them, so that ``memcalc --help``
and each command's ``--help`` start fast.
"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from memcalc.core.errors import UserError


def _validation_error(e: BaseException) -> bool:
    """``e`` is a pydantic ValidationError (pydantic_core's class, which pydantic re-exports);
    checked without importing pydantic: none can be raised before pydantic is imported."""
    core = sys.modules.get("pydantic_core")
    return core is not None and isinstance(e, core.ValidationError)


class _Group(TyperGroup):
    """Runs commands without click's standalone error printing; errors become one line + exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        try:
            rv = super().main(args=args, prog_name=prog_name or "memcalc", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except UserError as e:
            _err(str(e))
            sys.exit(2)
        except Exception as e:  # click's (or typer's vendored click's) Exit / Abort / usage errors
            if _validation_error(e):
                from memcalc.inputs.pydantic_errors import pydantic_error_line

                _err(pydantic_error_line(e, "input"))  # type: ignore[arg-type]
                sys.exit(2)
            name = type(e).__name__
            if name == "NoArgsIsHelpError":  # a bare `memcalc`: the help screen as is (click >= 8.2: stderr, exit 2)
                sys.stderr.write(e.format_message().rstrip("\n") + "\n")  # type: ignore[attr-defined]
                sys.exit(2)
            if name == "Exit":
                sys.exit(getattr(e, "exit_code", 0))
            if name == "Abort":
                _err("aborted")
                sys.exit(130)
            if hasattr(e, "format_message"):  # ClickException: no such option, bad choice, bad number
                _err(" ".join(e.format_message().split()))
                sys.exit(2)
            raise
        if isinstance(rv, int) and rv:
            sys.exit(rv)
        sys.exit(0)

    def get_help_option(self, ctx):  # type: ignore[no-untyped-def]
        """The group's ``--help``, defaulting to False instead of None: typer coerces an option's
        non-boolean value through a pydantic TypeAdapter, so a None here imported pydantic (a
        tenth of a second) for ``memcalc estimate --help``; the help callback reads both as "not
        asked"."""
        opt = super().get_help_option(ctx)
        if opt is not None and opt.default is None:
            opt.default = False
        return opt


def _err(msg: str) -> None:
    sys.stderr.write(f"memcalc: error: {msg}\n")


app = typer.Typer(
    cls=_Group,
    help="memcalc: how much GPU memory a training step takes, from its timeline, and proof by measuring.",
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
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """memcalc: how much GPU memory a training step takes, from its timeline, and proof by measuring."""

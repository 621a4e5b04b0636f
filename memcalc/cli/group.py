"""The click application: the group that turns every error into one line and an exit code.

Imports only click and memcalc's pydantic-free core modules: pydantic (and the spec models),
rich, yaml and the pipeline load inside the commands that need them, so that ``memcalc --help``
and each command's ``--help`` start fast. (Plain click, not typer: typer 0.2x coerces every
option's value, given or not, through a pydantic TypeAdapter built for it on each run, about
0.03 s of each command's start; ``benchmarks/bench_estimate.py``.)
"""

from __future__ import annotations

import sys

import click

from memcalc.core.errors import UserError


def _validation_error(e: BaseException) -> bool:
    """``e`` is a pydantic ValidationError (pydantic_core's class, which pydantic re-exports);
    checked without importing pydantic: none can be raised before pydantic is imported."""
    core = sys.modules.get("pydantic_core")
    return core is not None and isinstance(e, core.ValidationError)


class _Group(click.Group):
    """Runs commands without click's standalone error printing; errors become one line + exit 2.
    Lists its commands in the order they were added (click's own sorts them by name)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        try:
            rv = super().main(args=args, prog_name=prog_name or "memcalc", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except UserError as e:
            _err(str(e))
            sys.exit(2)
        except click.exceptions.NoArgsIsHelpError as e:  # a bare `memcalc`: the help screen as is (stderr, exit 2)
            sys.stderr.write(e.format_message().rstrip("\n") + "\n")
            sys.exit(2)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            _err("aborted")
            sys.exit(130)
        except click.ClickException as e:  # no such option, bad choice, bad number
            _err(" ".join(e.format_message().split()))
            sys.exit(2)
        except Exception as e:
            if _validation_error(e):
                from memcalc.inputs.pydantic_errors import pydantic_error_line

                _err(pydantic_error_line(e, "input"))  # type: ignore[arg-type]
                sys.exit(2)
            raise
        if isinstance(rv, int) and rv:
            sys.exit(rv)
        sys.exit(0)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


def _err(msg: str) -> None:
    sys.stderr.write(f"memcalc: error: {msg}\n")


def _version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        from memcalc import __version__

        click.echo(f"memcalc {__version__}")
        ctx.exit()


app = _Group(
    name="memcalc",
    help="memcalc: how much GPU memory a training step takes, from its timeline, and proof by measuring.",
    no_args_is_help=True,
    params=[click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True, callback=_version,
                         help="Print the version and exit.")],
)

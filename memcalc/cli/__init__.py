"""The ``memcalc`` command line.

Every bad input ends as one line on stderr and exit code 2: usage errors (typer's, on click),
:class:`~memcalc.core.errors.UserError`, and pydantic validation errors.

One module per command (``estimate_cmd``, ``plan_cmd``, ``listing``: models, configs, gpus,
profiles; ``validate_cmd``), the options they share in ``options``, the application and its
error handling in ``group``. A command resolves nothing and runs no stage itself: it calls
:mod:`memcalc.api` (``estimate``, ``plan``, ``experiments``, the listings) and renders the result
with :mod:`memcalc.render` (the ``cli-through-api`` contract in ``.importlinter``). Importing this
package loads typer and memcalc's pydantic-free core only; the API loads a command's pipeline when
it runs (``tests/unit/test_lazy_imports.py``).
"""

from __future__ import annotations

import sys

from memcalc.cli.group import app

# the commands register on `app` as they are imported, in the order `memcalc --help` lists them
from memcalc.cli import estimate_cmd, plan_cmd, listing, validate_cmd, compare_cmd  # noqa: F401  isort: skip
from memcalc.cli.estimate_cmd import _check_fits, estimate  # noqa: F401  (tests use _check_fits)
from memcalc.cli.listing import configs, gpus, models, profiles
from memcalc.cli.plan_cmd import plan
from memcalc.cli.validate_cmd import validate

__all__ = ["app", "main", "estimate", "plan", "models", "configs", "gpus", "profiles", "validate"]


def main() -> None:
    """Console-script entry point: runs the command line; the group always ends with ``sys.exit``
    (its status: 0, 2 for bad input, 3 for ``estimate --check`` on a card too small)."""
    import typer

    typer.main.get_command(app).main(args=sys.argv[1:], prog_name="memcalc")

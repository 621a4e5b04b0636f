"""The ``memcalc`` command line.

Every bad input ends as one line on stderr and exit code 2: click usage errors,
:class:`~memcalc.core.errors.UserError`, and pydantic validation errors.

One module per command (``estimate_cmd``, ``plan_cmd``, ``listing``: models, configs, gpus,
profiles; ``validate_cmd``), the options they share in ``options``, the application and its
error handling in ``group``. Importing this package loads click and memcalc's pydantic-free core
only; each command imports the pipeline it runs when it runs (``tests/test_lazy_imports.py``).
"""

from __future__ import annotations

import os
import sys
import types

# pydantic looks up its plugins (the ``pydantic`` entry points of every installed distribution) the
# first time it builds a validator, about 20-30 ms of every command here; the command line has no
# use for them. A user's setting wins.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
if os.environ["PYDANTIC_DISABLE_PLUGINS"] in ("__all__", "1", "true") and "pydantic.plugin._loader" not in sys.modules:
    # with every plugin off, pydantic's loader returns no plugins without looking; but importing it
    # imports importlib.metadata (about 18 ms). Its one function, as it answers then:
    _loader = types.ModuleType("pydantic.plugin._loader")
    _loader.get_plugins = lambda: ()  # type: ignore[attr-defined]
    sys.modules["pydantic.plugin._loader"] = _loader

from memcalc.cli.group import app  # noqa: E402

# the commands register on `app` as they are imported, in the order `memcalc --help` lists them
from memcalc.cli import estimate_cmd, plan_cmd, listing, validate_cmd  # noqa: E402,F401  isort: skip
from memcalc.cli.estimate_cmd import _check_fits, estimate  # noqa: E402,F401  (tests use _check_fits)
from memcalc.cli.listing import configs, gpus, models, profiles  # noqa: E402
from memcalc.cli.plan_cmd import plan  # noqa: E402
from memcalc.cli.validate_cmd import validate  # noqa: E402

__all__ = ["app", "main", "estimate", "plan", "models", "configs", "gpus", "profiles", "validate"]


def main() -> None:
    """Console-script entry point: runs the command line, then leaves (:func:`_leave`)."""
    try:
        app.main(args=sys.argv[1:], prog_name="memcalc")
    except SystemExit as e:  # (the group always leaves this way: memcalc.cli.group._Group.main)
        code = e.code
    else:
        code = 0
    _leave(code)


def _leave(code: object) -> None:
    """Exit with ``code`` as ``sys.exit`` does, without the interpreter's teardown where nothing
    needs it: the atexit handlers run and stdout and stderr are flushed, then the process ends
    (``os._exit``) instead of freeing every object one by one, which takes 30-55 ms after a plan
    (its caches of simulated steps are large) and a tenth of an estimate. Every file memcalc
    writes is closed by then (``with`` blocks). The ordinary exit where torch is loaded
    (``validate``: its own exit-time work) or a tracer or profiler is attached (coverage,
    cProfile write their results after the program)."""
    if "torch" in sys.modules or sys.gettrace() is not None or sys.getprofile() is not None:
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        sys.stderr.write(f"{code}\n")
        status = 1
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (memcalc ... | head), a closed stream
            pass
    os._exit(status)

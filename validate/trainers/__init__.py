"""The trainers ``memcalc validate --framework NAME`` runs as their own code (issue 27).

Each trainer is one module here with a fixed contract, imported only when its framework is asked
for (its library is an extra of its own, see pyproject.toml):

- ``EXTRA``: the pip extra that installs it (named in the error when the import fails);
- ``check(exp) -> None``: raise :class:`memcalc.core.errors.UserError` (one line) for a setup the
  trainer cannot express, before anything is traced;
- ``measure(exp, device, scale_layers=None, progress=None, allocator_sim=False) -> Measurement``:
  build the trainer's own model and step (its builders, layers and loss, unmodified; only kernel
  dispatch patched), trace it on meta (or run it on cpu / cuda) and return the measurement, with
  ``framework`` set to the trainer's name and the library's version in ``library_versions``.

``TRAINERS`` maps the framework name to its module; ``plain`` (memcalc's replica, ``runner.py``)
and ``hf`` (transformers + PEFT, ``hf_runner.py``) predate it and stay where they are.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: ``--framework`` name -> the module under ``memcalc.validate.trainers`` that runs it
TRAINERS: dict[str, str] = {"torchtune": "torchtune", "trl": "trl", "litgpt": "litgpt"}


def load(framework: str) -> ModuleType:
    """The trainer module of ``framework``; a one-line UserError naming the extra when its library
    does not import."""
    from memcalc.core.errors import UserError

    name = TRAINERS[framework]
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ImportError as e:
        raise UserError(f"--framework {framework} needs its library: pip install 'memcalc[{framework}]' "
                        f"({e})") from None

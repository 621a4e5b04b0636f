"""The family registry: every module of this package that defines ``FAMILY`` (a
:class:`~.base.Family`) is one Hugging Face ``model_type``. :func:`get` imports the module named
after the model_type it is asked for (reading one config loads one family); listing them, or a
name no module has (an alias), scans the package once. :func:`register` adds a family from
elsewhere (a test, a plugin). Nothing here imports :mod:`memcalc.inputs.hf_config` (which reads
configs through this registry).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from typing import Optional

from memcalc.inputs.hf_families.base import Family
from memcalc.inputs.hf_families.ignored import COMMON

_PACKAGE = __name__.rpartition(".")[0]
#: model_type (and each alias) -> its family
_BY_TYPE: dict[str, Family] = {}
_scanned = False


def _load(module: str) -> None:
    family = getattr(importlib.import_module(f"{_PACKAGE}.{module}"), "FAMILY", None)
    if isinstance(family, Family):
        register(family)


def _scan() -> None:
    global _scanned
    if _scanned:
        return
    _scanned = True
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if not info.name.startswith("_"):
            _load(info.name)


def register(family: Family) -> Family:
    """Add ``family`` under its model_type and aliases; a name already taken is an error."""
    for t in family.model_types:
        if t in _BY_TYPE and _BY_TYPE[t] is not family:
            raise ValueError(f"model_type {t!r} is already the family {_BY_TYPE[t].model_type!r}")
    for t in family.model_types:
        _BY_TYPE[t] = family
    return family


def unregister(family: Family) -> None:
    """Remove ``family`` (its model_type and aliases)."""
    for t in family.model_types:
        if _BY_TYPE.get(t) is family:
            del _BY_TYPE[t]


def get(model_type: object) -> Optional[Family]:
    """The family that reads configs of ``model_type`` (a refused one included), else None."""
    if not isinstance(model_type, str):
        return None
    if model_type not in _BY_TYPE and not _scanned:
        if model_type.isidentifier() and not model_type.startswith("_") and os.path.isfile(
                os.path.join(os.path.dirname(__file__), f"{model_type}.py")):
            _load(model_type)  # the module named after it
        if model_type not in _BY_TYPE:
            _scan()
    return _BY_TYPE.get(model_type)


def families() -> dict[str, Family]:
    """Every family by its own model_type (aliases not repeated), in name order."""
    _scan()
    return {f.model_type: f for f in sorted(set(_BY_TYPE.values()), key=lambda f: f.model_type)}


def supported_model_types() -> tuple[str, ...]:
    """The model_types read (aliases included; refused ones not), sorted."""
    _scan()
    return tuple(sorted(t for t, f in _BY_TYPE.items() if not f.refused))


def ignored(model_type: str) -> dict[str, str]:
    """Keys deliberately not read for ``model_type``, with their reasons."""
    family = get(model_type)
    return {**COMMON, **(family.ignored if family is not None else {})}

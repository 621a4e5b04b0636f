"""memcalc: predict the peak GPU memory of a training step from its timeline.

The package never imports torch; the torch-backed validator lives in
``memcalc.validate`` (installed from the repository's ``validate/`` folder).

The Python API (:mod:`memcalc.api`) is reachable from here and imported on first use, so that
``import memcalc`` stays cheap (no typer, rich, numpy or torch):

>>> import memcalc
>>> memcalc.estimate(model="llama-3.1-8b", precision="bf16", lora=True).peak_bytes > 16 * 2**30
True

``memcalc.estimate`` and ``memcalc.plan`` are also the names of two pipeline stages (the
packages ``memcalc/estimate/`` and ``memcalc/plan/``); Python binds a subpackage to its parent's
attribute whenever it is imported, so a plain function of that name would be replaced. The two
stage packages are therefore made callable: calling them runs :func:`memcalc.api.estimate` /
:func:`memcalc.api.plan`, and ``memcalc.estimate.peak`` etc. stay the modules they are.
"""

import types as _types
from typing import Any

__version__ = "0.1.0"

#: names served lazily from memcalc.api (estimate and plan: the callable stages below)
_API = ("measure", "EstimateResult", "PlanResult", "options_from")

__all__ = ["__version__", "UserError", "estimate", "plan", *_API]


class _CallableStage(_types.ModuleType):
    """A stage package that, called, runs the API function of its name (see the module docstring)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from memcalc import api

        return getattr(api, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)


from memcalc import estimate, plan  # noqa: E402  (the stages' __init__ only: docstrings)

estimate.__class__ = _CallableStage
plan.__class__ = _CallableStage


def __getattr__(name: str) -> Any:
    if name in _API:
        from memcalc import api

        return getattr(api, name)
    if name == "UserError":
        from memcalc.core.errors import UserError

        return UserError
    raise AttributeError(f"module 'memcalc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

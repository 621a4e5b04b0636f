"""The validator's way to memcalc's prediction: the Python API (:func:`memcalc.api.estimate`), as any
user reaches the estimator; the validator imports nothing else of it (``.importlinter``).

``command.py`` (``memcalc validate``), ``hf_grid.py`` and ``sharded/grid.py`` predict here;
``record.py`` and ``measure.py`` never import this module: :func:`memcalc.api.measure` imports
``measure.py``, and an import of the API from there would close a cycle (``tests/unit/test_shape.py``).
"""

from __future__ import annotations

from typing import Any

from memcalc.core.spec import ExperimentSpec

from .record import Prediction


def estimate(exp: ExperimentSpec) -> Any:
    """The estimator's ``Estimate`` of ``exp`` (:attr:`memcalc.api.EstimateResult.estimate`)."""
    from memcalc.api import estimate as api_estimate

    return api_estimate(exp).estimate


def predict(exp: ExperimentSpec) -> Prediction:
    """memcalc's estimate of ``exp`` as a record holds it; one it cannot make says why."""
    try:
        est = estimate(exp)
    except Exception as e:  # an unsupported combination is reported beside the measurement
        return Prediction.failed(e)
    return Prediction.of(est)

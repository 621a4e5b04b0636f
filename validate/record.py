"""A ``memcalc validate`` record: one measurement beside memcalc's prediction for the model as measured.

Every record is made here (:func:`make_record`; its keys: ``command.py``'s docstring): by ``memcalc
validate`` (``command.py``), ``memcalc.measure()`` and the Hugging Face callback (``measure.py``).
This module does not predict: the caller hands the :class:`Prediction` in, for the spec
:func:`target_spec` names. ``command.py`` and the grids predict through :mod:`memcalc.api`
(:mod:`.predict`); ``memcalc.measure()`` and the callback pass the estimate they built. The API
imports ``measure.py``, so nothing that module imports may import the API back (an import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from memcalc.core.spec import ExperimentSpec
from memcalc.core.rules import framework_model
from memcalc.core.units import fmt_bytes
from memcalc.inputs.profiles import compose

from .trainers import TRAINERS

if TYPE_CHECKING:
    from .step import Measurement


@dataclass(frozen=True)
class Prediction:
    """memcalc's estimate as a record holds it: the peak bytes and phase, why there is none
    (``no estimate: ...``) and the bytes a compiled step saves for backward."""

    peak_bytes: Optional[int] = None
    peak_phase: Optional[str] = None
    why: str = ""
    saved_bytes: Optional[int] = None
    #: pipeline parallelism: each rank's estimated peak (``--json``'s ``pipeline.stages``; None: a middle rank of a
    #: long pipeline, not simulated: memcalc.core.pipeline.simulated_ranks)
    stage_bytes: Optional[list[Optional[int]]] = None

    @classmethod
    def of(cls, est: Any) -> Prediction:
        """From the estimator's ``Estimate`` (:attr:`memcalc.api.EstimateResult.estimate`)."""
        compiled = est.extra.get("compiled")
        pipe = est.extra.get("pipeline")
        return cls(est.peak_bytes, est.peak_phase, "", compiled["saved_bytes"] if compiled else None,
                   _by_rank(pipe) if pipe else None)

    @classmethod
    def failed(cls, e: Exception) -> Prediction:
        """An unsupported combination: reported beside the measurement."""
        return cls(why=f"no estimate: {e}")


def hf_estimator_spec(exp: ExperimentSpec) -> ExperimentSpec:
    """The spec memcalc estimates for a traced HF step: ``exp`` with its profile's framework set to
    ``hf`` (the PyTorch version, kernel choice and allocator rounding kept from ``exp``;
    :func:`memcalc.inputs.profiles.compose`); a profile that is hf's already is kept as it is (a rule
    field it sets, such as ``qlora_fp32_cast``, is what the trace ran)."""
    if exp.profile.framework == "hf":
        return exp
    return exp.model_copy(update={"profile": compose(exp.profile, "hf", None)})


def target_spec(exp: ExperimentSpec, scale_layers: Optional[int], framework: str) -> ExperimentSpec:
    """The spec whose estimate a record compares with: the model as measured (``scale_layers``
    layers when given), under the HF rules (:func:`hf_estimator_spec`) when ``framework`` is hf, a
    trainer's (torchtune, litgpt: :func:`trainer_estimator_spec`) when it is one."""
    target = exp if scale_layers is None else exp.model_copy(
        update={"model": exp.model.model_copy(update={"n_layers": scale_layers})})
    if framework == "hf":
        return hf_estimator_spec(target)
    if framework in TRAINERS:
        return trainer_estimator_spec(target, framework)
    return target


def trainer_estimator_spec(exp: ExperimentSpec, framework: str) -> ExperimentSpec:
    """The spec memcalc estimates for a trainer's traced step (validate/trainers/): the profile's rules
    of ``framework`` (:func:`memcalc.inputs.profiles.compose`) and the model as that trainer builds it
    (:func:`memcalc.core.rules.framework_model`: LitGPT's untied head and fused qkv). A profile that is
    already the trainer's (``--framework NAME`` resolved it) is kept as it is: composing it again would
    put the rule fields' defaults back over its flags (``--loss full`` under torchtune)."""
    model, _notes = framework_model(exp.model, framework, exp.training.lora)
    profile = exp.profile if exp.profile.framework == framework else compose(exp.profile, framework, None)
    return exp.model_copy(update={"profile": profile, "model": model})


def pct(a: Optional[int], b: Optional[int]) -> Optional[float]:
    """(a - b) / b in percent, 3 decimals (None without both, or b 0)."""
    if a is None or b is None or b == 0:
        return None
    return round((a - b) / b * 100, 3)


def _partition_gap(real: Optional[int], mine: Optional[int]) -> str:
    """memcalc's saved set beside PyTorch's partition (``runner._check_partition``), for the reason."""
    if real is None or mine is None:
        return ""
    gap = f"{100 * (mine - real) / real:+.2f}%" if real else "both nothing" if not mine else "PyTorch saves nothing"
    return f", memcalc {fmt_bytes(mine)} ({gap})"


def make_record(name: str, exp: Optional[ExperimentSpec], meas: Measurement, scale_layers: Optional[int],
                prediction: Optional[Prediction] = None) -> dict:
    """One record (see ``command.py``'s docstring): ``meas`` beside ``prediction``, memcalc's estimate
    of ``target_spec(exp, scale_layers, meas.framework)`` (``exp`` None: a config that could not be
    read, nothing predicted)."""
    p = prediction if prediction is not None else Prediction()
    published = exp.published_peak_bytes if exp is not None and scale_layers is None else None
    reason = "; ".join(r for r in (meas.reason + _partition_gap(meas.partition_saved_bytes, p.saved_bytes), p.why) if r)
    return {
        "config": name,
        "device": meas.device,
        "predicted_bytes": p.peak_bytes,
        "measured_bytes": meas.measured_bytes,
        "published_bytes": published,
        "error_pct": pct(p.peak_bytes, meas.measured_bytes),
        "published_error_pct": pct(meas.measured_bytes, published),
        "peak_phase": p.peak_phase,
        "measured_phase": meas.peak_phase,
        "measured_label": meas.peak_label or None,
        "first_step_bytes": meas.first_step_bytes,
        "reserved_bytes": meas.reserved_bytes,
        "allocator_sim_bytes": meas.sim_allocated_bytes,
        "allocator_sim_reserved_bytes": meas.sim_reserved_bytes,
        "partition_saved_bytes": meas.partition_saved_bytes,
        "predicted_saved_bytes": p.saved_bytes if meas.partition_saved_bytes is not None else None,
        # --activation-offload: the pinned host bytes the traced hooks offloaded (estimate --json:
        # host_activation_bytes)
        **({"host_activation_bytes": meas.host_activation_bytes} if meas.host_activation_bytes is not None else {}),
        "scale_layers": scale_layers,
        "status": meas.status,
        "reason": reason,
        "torch_version": meas.torch_version,
        "framework": meas.framework,
        "transformers_version": meas.transformers_version,
        "peft_version": meas.peft_version,
        # a trainer's libraries (validate/trainers/): e.g. {"litgpt": "0.5.13", "lightning": "2.6.6"}
        **({"library_versions": dict(meas.library_versions)} if meas.library_versions else {}),
        **({"pipeline_stages": _stages(meas.pipeline_stages, p.stage_bytes)} if meas.pipeline_stages else {}),
        "seconds": meas.seconds,
    }


def _by_rank(pipe: dict) -> list[Optional[int]]:
    """Each rank's estimated peak, in rank order (None where the estimate did not simulate the rank)."""
    peaks = {s["rank"]: s["peak_bytes"] for s in pipe["stages"]}
    return [peaks.get(r) for r in range(pipe["pp"])]


def _stages(traced: list[dict], predicted: Optional[list[Optional[int]]]) -> list[dict]:
    """``validate --pp``: every rank's traced peak (validate/sharded/pipeline.py) beside its estimate."""
    out = []
    for s in traced:
        est = predicted[s["rank"]] if predicted is not None and s["rank"] < len(predicted) else None
        out.append({"rank": s["rank"], "layers": s["layers"], "measured_bytes": s["peak_bytes"],
                    "predicted_bytes": est, "error_pct": pct(est, s["peak_bytes"]),
                    "measured_phase": s["phase"], "measured_label": s["label"]})
    return out

"""The Python API: :func:`estimate`, :func:`plan` and :func:`measure`, with the CLI's inputs; the
``memcalc`` commands call it and only render its results.

Keyword arguments are named like the command-line flags (``--lora-rank`` is ``lora_rank=``),
that is like the fields of :class:`memcalc.inputs.resolve.Options`, which every keyword this
module does not consume is forwarded to (so a flag added there works here at once). Results
hold integer bytes; ``to_dict()`` is exactly the ``--json`` document of the same command.
Bad input raises :class:`memcalc.UserError` (a :class:`ValueError`) with the one line the CLI
prints after ``memcalc: error:``.

>>> import memcalc
>>> r = memcalc.estimate(model="llama-3.1-8b", precision="bf16", lora=True, gpu=["rtx-4090", "h100-80gb"])
>>> isinstance(r.peak_bytes, int), r.phase in r.to_dict()["phases"]
(True, True)
>>> r.fits
{'rtx-4090': False, 'h100-80gb': True}
>>> memcalc.estimate(model="llama-3.1-8b", qlora=True, checkpoint="full", gpu="rtx-4090").fits
{'rtx-4090': True}
>>> memcalc.estimate(model="llama-3.1-8b", checkpoint="every-0")
Traceback (most recent call last):
...
memcalc.core.errors.UserError: unknown --checkpoint 'every-0'; valid: none, full, every-K (e.g. every-2), sqrt, selective, selective-op

Never imports torch; :func:`measure` hands over to ``memcalc.validate.measure`` (torch) when it
is called.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from memcalc.core.errors import UserError
from memcalc.core import aliases
from memcalc.inputs.api_types import check_args, check_choice, check_options, option_choices

if TYPE_CHECKING:
    from memcalc.core.spec import ExperimentSpec
    from memcalc.engine.result import Estimate
    from memcalc.inputs.resolve import Options, Resolved

__all__ = ["EstimateResult", "PlanResult", "UserError", "estimate", "plan", "measure", "options_from", "experiments",
           "list_models", "list_configs", "list_gpus", "list_profiles", "error_line"]

def options_from(**kwargs: Any) -> "Options":
    """The :class:`~memcalc.inputs.resolve.Options` of these keyword arguments (flag names with
    ``_`` for ``-``); a name that is not an option is a :class:`TypeError` listing the valid ones.

    ``model=`` may also be a Hugging Face config as a dict (a parsed config.json) or a transformers
    ``PretrainedConfig`` (``model.config``), passed to :func:`estimate`; it is read by the same
    reader as a config.json file.

    >>> options_from(model="gpt2", batch=2).batch
    2
    """
    from memcalc.inputs.resolve import Options

    valid = {f.name for f in fields(Options)}
    bad = sorted(set(kwargs) - valid)
    if bad:
        raise TypeError(f"unknown argument{'s' if len(bad) > 1 else ''} {', '.join(bad)}; "
                        f"valid: {', '.join(sorted(valid))}")
    kwargs = check_options(kwargs)
    for name, choices in option_choices().items():
        if name in kwargs:
            kwargs[name] = check_choice(name, kwargs[name], choices)
    return Options(**kwargs)


def _resolve(spec: "Optional[ExperimentSpec]", kwargs: dict[str, Any]) -> "Resolved":
    """The experiment and where its inputs came from: ``spec`` as given, or the options resolved as
    the CLI resolves its flags."""
    from pydantic import ValidationError

    from memcalc.inputs.resolve import Resolved, resolve

    if spec is not None:
        if kwargs:
            raise UserError(f"give spec= or options ({', '.join(sorted(kwargs))}), not both")
        from memcalc.core.spec import ExperimentSpec

        if not isinstance(spec, ExperimentSpec):
            raise UserError(f"spec= must be a memcalc.core.spec.ExperimentSpec, not {type(spec).__name__}")
        return Resolved(spec, origin={k: "spec" for k in ("model", "profile", *spec.training.model_dump())})
    model = kwargs.get("model")
    if not isinstance(model, (str, Mapping)) and callable(getattr(model, "to_json_string", None)):
        # a transformers PretrainedConfig: what save_pretrained writes as config.json (keys that differ
        # from the class's defaults; memcalc's readers take those defaults for the rest)
        model = json.loads(model.to_json_string(use_diff=True))
    try:
        if isinstance(model, Mapping):
            return _resolve_config_dict(dict(model), kwargs)
        return resolve(options_from(**kwargs))
    except ValidationError as e:  # as the CLI: one line
        from memcalc.inputs.pydantic_errors import pydantic_error_line

        raise UserError(pydantic_error_line(e, "input")) from None


def _resolve_config_dict(cfg: dict[str, Any], kwargs: dict[str, Any]) -> "Resolved":
    """``model=`` a Hugging Face config dict: written to a temporary ``NAME/config.json`` and read as
    ``--model PATH`` would be; the source becomes ``{"kind": "hf-config", "value": NAME}``."""
    from memcalc.inputs.presets import ModelSource
    from memcalc.inputs.resolve import resolve

    given = cfg.get("_name_or_path")
    name = (given.strip().rstrip("/").rsplit("/", 1)[-1] if isinstance(given, str) and given.strip()
            else str(cfg.get("model_type") or "model"))
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip(".") or "model"
    with tempfile.TemporaryDirectory(prefix="memcalc-") as tmp:
        os.mkdir(folder := os.path.join(tmp, name))
        path = os.path.join(folder, "config.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, default=str)
        shown = f"<{name} config dict>"  # messages name the dict, not the temporary file
        try:
            with contextlib.redirect_stderr(notes := io.StringIO()):  # the reader's note on keys it does not read
                res = resolve(options_from(**{**kwargs, "model": path}))
        except UserError as e:
            raise UserError(str(e).replace(path, shown)) from None
        finally:
            sys.stderr.write(notes.getvalue().replace(path, shown))
    res.model_source = ModelSource("hf-config", name)
    return res


def _cards(gpu: Union[None, str, Sequence[str]]) -> list:
    from memcalc.inputs.gpus import get_gpu, list_gpus

    if gpu is None:
        return list_gpus()
    gpu = aliases.gpus(gpu)  # rtx-4090,rtx-3090: two cards
    return [get_gpu(g) for g in ([gpu] if isinstance(gpu, str) else gpu)]


@dataclass(frozen=True)
class EstimateResult:
    """One predicted training step (integer bytes), as ``memcalc estimate`` shows it.

    ``estimate`` is the engine's :class:`~memcalc.engine.result.Estimate` (timeline, phases, first step; the
    three peaks and ``device_parts`` on the one ``gpu=`` card, else gpu_side's reference card); ``resolved``
    the experiment with where each input came from; ``cards`` the GPUs the fits are for.
    """

    estimate: "Estimate"
    resolved: "Resolved"
    cards: tuple
    limits: Optional[dict] = None
    #: card name -> the smallest changes that make the setup fit it (:class:`memcalc.plan.remedies.Remedy`)
    to_make_it_fit: Optional[dict] = None

    @property
    def spec(self) -> "ExperimentSpec":
        """The experiment that was estimated."""
        return self.estimate.experiment

    @property
    def peak_bytes(self) -> int:
        """Peak allocated bytes of the step (``torch.cuda.max_memory_allocated`` over a run)."""
        return self.estimate.peak_bytes

    @property
    def phase(self) -> str:
        """The phase that sets the peak (forward, backward, optimizer step, ...)."""
        return self.estimate.peak_phase

    @property
    def peak_at(self) -> str:
        """Where in the step the peak is (e.g. ``bwd layer 0``)."""
        return self.estimate.peak_label

    @property
    def required_bytes(self) -> int:
        """What a GPU must have: the device total (reserved + CUDA context + NCCL, :mod:`memcalc.core.gpu_side`)."""
        return self.estimate.required_bytes

    @property
    def breakdown(self) -> dict[str, int]:
        """Bytes alive at the peak by kind (:data:`memcalc.engine.result.KINDS`: weights, optimizer_state,
        gradients, activations, temporaries; the table, chart and HTML name them the same, spaced), summing
        to :attr:`peak_bytes`; ``to_dict()["breakdown"]`` splits each kind by component."""
        return dict(self.estimate.components_by_kind)

    @property
    def components(self) -> dict[str, int]:
        """Bytes alive at the peak by component name (sums to :attr:`peak_bytes`)."""
        return dict(self.estimate.components)

    @property
    def params(self) -> int:
        return self.estimate.params

    @property
    def trainable_params(self) -> int:
        return self.estimate.trainable_params

    @cached_property
    def gpus(self) -> list[dict[str, Any]]:
        """Per GPU: name, capacity_bytes, fits, headroom_bytes (the ``gpus`` rows of ``--json``)."""
        from memcalc.render.report import fits_rows

        return fits_rows(self.estimate, list(self.cards))

    @property
    def fits(self) -> dict[str, bool]:
        """GPU name -> whether :attr:`required_bytes` fits its capacity."""
        return {r["name"]: r["fits"] for r in self.gpus}

    def to_dict(self) -> dict[str, Any]:
        """The ``memcalc estimate --json`` document of the same inputs (JSON types, integer bytes)."""
        from memcalc.render.report import dumps

        return json.loads(dumps(self.document()))

    def document(self) -> dict[str, Any]:
        """The ``--json`` document as built (Python values: :meth:`to_dict` is it through JSON); the
        recipe's own report (``recipe``) and the limits (``max_batch``, ``max_seq``, ``limits``)
        join the estimate's when given."""
        from memcalc.render.report import to_json

        doc = to_json(self.estimate, self.resolved, list(self.cards))
        doc["to_make_it_fit"] = {g: [x.as_json() for x in xs] for g, xs in (self.to_make_it_fit or {}).items()}
        if self.resolved.recipe is not None:
            doc["recipe"] = self.resolved.recipe
        if self.limits:
            doc.update({k: self.limits[k] for k in ("max_batch", "max_seq") if k in self.limits}, limits=self.limits)
        return doc

    def __repr__(self) -> str:
        from memcalc.core.units import fmt_bytes

        return (f"EstimateResult({self.spec.name}: peak {fmt_bytes(self.peak_bytes)} ({self.peak_bytes:,} bytes) "
                f"in {self.phase}, requires {fmt_bytes(self.required_bytes)})")


@aliases.notes_on_success  # an alias's note, then a refusal: one line still
def estimate(spec: "Optional[ExperimentSpec]" = None, *, gpu: Union[None, str, Sequence[str]] = None,
             max_batch: bool = False, max_seq: bool = False, timeline: bool = True, **options: Any) -> EstimateResult:
    """Predict the peak memory of one training step: ``memcalc estimate`` as a function.

    ``options`` are the flags of ``memcalc estimate`` (``model``, ``params``, ``config``, ``batch``,
    ``seq``, ``grad_accum``, ``precision``, ``lora``, ``qlora``, ``checkpoint``, ``zero``, ``gpus``,
    ...; see :class:`memcalc.inputs.resolve.Options`), or ``spec=`` an
    :class:`~memcalc.core.spec.ExperimentSpec`. ``gpu`` restricts the fits to these GPUs (names or
    capacities such as ``"24GB"``); ``max_batch`` / ``max_seq`` also search the largest batch /
    sequence that fits the one ``gpu``. ``timeline=False``: the same numbers, without ``estimate.timeline``.

    >>> r = estimate(model="gpt2", batch=2, seq=512, precision="bf16", gpu=["24GB"])
    >>> r.peak_bytes == sum(r.breakdown.values())
    True
    >>> r.to_dict()["peak_bytes"] == r.peak_bytes
    True
    >>> estimate(model="gpt2", batch=0)
    Traceback (most recent call last):
    ...
    memcalc.core.errors.UserError: --batch must be positive, got 0
    """
    from memcalc.estimate.peak import card_side, estimate as run_estimate
    from memcalc.inputs.trainer_defaults import half_for_cards
    check_args(estimate, gpu=gpu, max_batch=max_batch, max_seq=max_seq, timeline=timeline)
    res = half_for_cards(_resolve(spec, options), cards := tuple(_cards(gpu)), asked=gpu is not None and spec is None)
    limits, limit_gpu = None, None
    if max_batch or max_seq:
        from memcalc.plan.limits import check_one_gpu, estimate_limits

        limit_gpu = check_one_gpu([gpu] if isinstance(gpu, str) else gpu, "--max-batch" if max_batch else "--max-seq")
    side = card_side(res.exp, cards[0]) if len(cards) == 1 else None  # else the reference card's
    est = run_estimate(res.exp, timeline=timeline, replay=True, side=side)
    if limit_gpu is not None:
        limits = estimate_limits(res.exp, limit_gpu, max_batch, max_seq)
    from memcalc.render.report import fits_rows

    fits, fix = {r["name"]: r["fits"] for r in fits_rows(est, list(cards))}, None
    if not all(fits.values()):  # what would make it fit (memcalc.plan, numpy: only then)
        from memcalc.plan.remedies import remedies_for

        fix = remedies_for(res.exp, cards, fits, gpu is not None,
                           None if spec is not None else (lambda ch: _resolve(None, {**options, **ch}).exp),
                           lambda e, g: fits_rows(e, [g])[0], options)
    return EstimateResult(est, res, cards, limits, fix)


@dataclass(frozen=True)
class PlanResult:
    """``memcalc plan`` as an object: ``raw`` is the plan (:class:`memcalc.plan.search.GpuPlan` with
    ``gpu=``, else :class:`memcalc.plan.cluster.ClusterPlan`); ``recipe`` the report of the
    ``recipe=`` files it took its model, sequence, framework and loss from."""

    raw: Any
    recipe: Optional[dict] = None

    @property
    def gpu_plan(self) -> bool:
        """Whether this is the plan for one GPU (``gpu=``) rather than the per-GPU counts."""
        from memcalc.plan.search import GpuPlan

        return isinstance(self.raw, GpuPlan)

    @property
    def options(self) -> list[dict[str, Any]]:
        """One GPU: every technique combination (fits, peak_bytes, required_bytes, max_batch, ...);
        else one row per GPU (min_gpus_full, min_gpus_lora, ...)."""
        doc = self.to_dict()
        return doc["options"] if self.gpu_plan else doc["gpus"]

    @property
    def fitting(self) -> list[dict[str, Any]]:
        """One GPU: the combinations that fit (empty for the per-GPU counts)."""
        return [o for o in self.options if o.get("fits")] if self.gpu_plan else []

    def document(self) -> dict[str, Any]:
        """The ``--json`` document as built (:meth:`to_dict` is it through JSON)."""
        from memcalc.render.plan_report import cluster_plan_json, gpu_plan_json

        doc = gpu_plan_json(self.raw) if self.gpu_plan else cluster_plan_json(self.raw)
        return {**doc, **({"recipe": self.recipe} if self.recipe is not None else {})}

    def to_dict(self) -> dict[str, Any]:
        """The ``memcalc plan --json`` document of the same inputs."""
        from memcalc.render.report import dumps

        return json.loads(dumps(self.document()))


#: what plan says of a recipe: what it takes from it, and that it searches the rest
RECIPE_NOTE = ("recipe: plan takes the model, sequence length, framework and loss from it and searches the rest "
               "(batch, precision, optimizer, checkpointing, LoRA/QLoRA); `memcalc estimate --recipe` gives the "
               "recipe's own setup")


@aliases.notes_on_success
def plan(model: Union[None, str] = None, params: Union[None, str, int, float] = None, *, gpu: Optional[str] = None,
         seq: Union[int, str, None] = None, profile: Optional[str] = None, framework: Optional[str] = None,
         torch: Optional[str] = None, loss: Optional[str] = None, loss_chunks: Optional[int] = None,
         loss_tokens: Optional[float] = None, all: bool = False, compile: bool = False,
         recipe: Union[str, Sequence[str], None] = None, adapter_config: Optional[str] = None,
         kernels: Optional[str] = None, lora: bool = False, qlora: bool = False, full: bool = False) -> PlanResult:
    """Which GPU, how many, with which techniques: ``memcalc plan`` as a function.

    With ``gpu``: every option on that GPU (``all=True`` keeps those that do not fit; ``compile=True`` adds
    torch.compile budgets; ``lora``/``qlora``/``full``: only those runs; each row with its ``memcalc estimate``
    command). Without: for each catalog GPU, how many a full fine-tune and a LoRA run need. ``recipe`` (files,
    as ``--recipe``) and ``adapter_config`` give model, sequence, framework, loss, kernels the arguments do not.

    >>> p = plan(model="llama-3.1-8b", gpu="rtx-4090")    # doctest: +SKIP
    >>> [o["option"] for o in p.fitting][:3]               # doctest: +SKIP
    >>> plan(model="gpt2", all=True)
    Traceback (most recent call last):
    ...
    memcalc.core.errors.UserError: --all lists the combinations that do not fit one GPU; give --gpu too
    """
    check_args(plan, **{k: v for k, v in locals().items() if k != "params"})  # params: as --params reads it
    seq, framework, gpu = aliases.seq(seq), aliases.framework(framework), aliases.one_gpu(gpu)  # 4k, transformers
    from memcalc.inputs.gpus import get_gpu
    from memcalc.inputs.profiles import plan_model_profile
    from memcalc.plan.options import check_one_gpu_flags, plan_model
    from memcalc.plan.rows import adapter_kinds, cluster_commands, dedup, keep_adapters, with_commands

    kinds, rec = adapter_kinds(full, lora, qlora, gpu), None  # --lora/--qlora/--full: the plan for one GPU only
    if recipe is not None or adapter_config is not None:  # the recipe's model, seq, framework, loss; plan the rest
        from memcalc.inputs.recipes import load_recipe

        rec = load_recipe([recipe] if isinstance(recipe, str) else list(recipe or ()), adapter_config)
        v = rec.values
        if model is None and params is None:
            model = v.get("model")
        seq = seq if seq is not None else v.get("seq")
        if profile is None and framework is None and "framework" in v:
            framework = v["framework"]
        if loss is None and loss_chunks is None and "loss" in v:
            loss, loss_chunks = v["loss"], v.get("loss_chunks")
        loss_tokens = v.get("loss_tokens") if loss_tokens is None else loss_tokens
        kernels = v.get("kernels") if kernels is None else kernels
    framework = check_choice("framework", framework, option_choices()["framework"])
    loss = check_choice("loss", loss, option_choices()["loss"])
    m, notes = plan_model(model, params)  # a number is read as --params reads "7e9"
    if rec is not None:
        notes[:0] = [*rec.lines(), RECIPE_NOTE]
    # the same default as estimate's for --model/--params: Hugging Face transformers + PEFT
    m, prof, more = plan_model_profile(m, profile, framework, torch, loss, loss_chunks, loss_tokens, kernels)
    notes += more  # the profile's note; LitGPT's own lm_head (core.rules.framework_model)
    check_one_gpu_flags(gpu, all, compile, prof.kernels)
    recipe_doc = rec.as_json() if rec is not None else None
    if gpu is None:
        from memcalc.plan.cluster import plan_cluster

        cp = cluster_commands(plan_cluster(m, seq, prof), dict(locals()))  # type: ignore[arg-type]  # (an int: aliases.seq)
        cp.notes[:0] = notes
        return PlanResult(cp, recipe_doc)
    from memcalc.plan.options import compile_techniques, techniques
    from memcalc.plan.search import plan_gpu

    techs = keep_adapters(techniques() + (compile_techniques() if compile else []), kinds)
    gp = plan_gpu(m, get_gpu(gpu), seq, prof, include_all=all, options=techs)  # type: ignore[arg-type]
    gp.options = with_commands(dedup(gp.options), gp.half, gp.seq, gpu, dict(locals()))
    gp.notes[:0] = notes
    return PlanResult(gp, recipe_doc)


def experiments(configs: Sequence[str] = (), *, all_configs: bool = False,
                **options: Any) -> list[tuple[str, Union[ExperimentSpec, UserError]]]:
    """The experiments ``memcalc validate`` runs, by name: each of ``configs`` (reference config
    names or files; ``all_configs`` adds every shipped one) with ``options`` over it, or, with no
    config, the one experiment of ``options``. Of several configs, one that does not resolve is
    its :class:`UserError` in the list (the others still run); a single one raises it."""
    from memcalc.inputs.configs import list_configs

    names = list(configs)
    if all_configs:
        names += [n for n in list_configs() if n not in names]
    if not names:
        exp = _resolve(None, dict(options)).exp
        return [(exp.name, exp)]
    items: list[tuple[str, Union[ExperimentSpec, UserError]]] = []
    for n in names:
        try:
            items.append((n, _resolve(None, dict(options, config=n)).exp))
        except UserError as e:
            if len(names) == 1:
                raise
            items.append((n, e))
    return items


def list_models() -> list[dict[str, Any]]:
    """The model presets (``memcalc models --json``): name, Hugging Face id, shape, parameter counts."""
    from memcalc.inputs.presets import list_presets, preset_summary

    return [preset_summary(name) for name in list_presets()]


def list_configs() -> list[dict[str, Any]]:
    """The shipped reference configs and their published peaks (``memcalc configs --json``)."""
    from memcalc.inputs.configs import list_configs as names, load_config

    rows = []
    for name in names():
        e = load_config(name)
        tr = e.training
        rows.append({"name": name, "description": e.description, "precision": tr.precision,
                     "checkpoint": tr.checkpoint, "fused_optimizer": tr.fused_optimizer, "compile": tr.compile,
                     "memory_budget": tr.memory_budget, "published_peak_bytes": e.published_peak_bytes})
    return rows


def list_gpus() -> list[dict[str, Any]]:
    """The GPU catalog (``memcalc gpus --json``), capacities in bytes."""
    from memcalc.inputs.gpus import list_gpus as catalog

    return [g.model_dump() for g in catalog()]


def list_profiles() -> list[dict[str, Any]]:
    """The kernel profiles, every field (``memcalc profiles --json``)."""
    from memcalc.inputs.profiles import PROFILES

    return [p.model_dump() for p in PROFILES.values()]


def error_line(e: BaseException) -> Optional[str]:
    """The one line a pydantic ``ValidationError`` is reported as (None for any other error)."""
    core = sys.modules.get("pydantic_core")  # (none can be raised before pydantic is imported)
    if core is None or not isinstance(e, core.ValidationError):
        return None
    from memcalc.inputs.pydantic_errors import pydantic_error_line

    return pydantic_error_line(e, "input")


def measure(spec: "Optional[ExperimentSpec]" = None, *, output: Optional[str] = None, name: Optional[str] = None,
            quiet: bool = False, **options: Any):
    """Measure a real training loop beside memcalc's estimate of the same setup (a context manager).

    Takes the inputs of :func:`estimate`; call ``m.step()`` after every optimizer step. On CUDA,
    each step's ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` is recorded (the peak is reset
    after each); at the end, predicted vs measured and the gap are printed and, with ``output`` (checked as
    ``--output``), a record as ``validate --output`` writes; without CUDA ``measured_bytes`` null. Needs torch::

        with memcalc.measure(model="llama-3.1-8b", batch=4, seq=2048, lora=True, output="run.json") as m:
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                m.step()
        print(m.record["measured_bytes"], m.record["predicted_bytes"], m.record["error_pct"])
    """
    check_args(measure, output=output, name=name, quiet=quiet)
    try:
        from memcalc.validate.measure import Measure
    except ImportError as e:  # torch missing
        raise UserError(f"measure() needs torch: pip install 'memcalc[validate]' ({e})") from None
    return Measure(estimate(spec, **options), output=output, name=name, quiet=quiet, predict=estimate)

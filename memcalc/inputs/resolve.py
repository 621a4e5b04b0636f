"""From command-line options to one ExperimentSpec, remembering where each input came from.

Precedence: flag > recipe (``--recipe``: its values fill the Options the user left unset,
memcalc.inputs.recipes) > config file > default.
Every input is tagged ``flag``, ``recipe FILE:KEY``, ``config``, ``default`` or ``inferred`` so
reports can mark what the user did not set; every default that depends on the setup
(framework, PyTorch version, precision, LoRA adapter dtype) carries its reason in
``Resolved.reasons``.

Defaults that depend on the setup:

- framework: ``plain`` for a ``--config`` experiment (its profile: the reference configs
  were measured with memcalc's own layers); ``hf`` for a model from ``--model`` (a preset
  is a Hugging Face model written from its config.json; a config.json or hub id is one)
  and for ``--params`` (what most users fine-tune with: transformers + PEFT);
- PyTorch version: the profile's (2.8 unless ``--profile``/the config says otherwise);
- precision: with LoRA/QLoRA and no precision given, ``bf16`` (a bf16 base; QLoRA computes
  in bf16, ``bnb_4bit_compute_dtype=torch.bfloat16`` in the QLoRA recipes); full fine-tuning
  ``fp32`` (what Hugging Face Trainer runs without ``--bf16``/``--fp16``);
- LoRA adapter dtype: the framework's (``KernelProfile.lora_dtype``: hf fp32, the others the
  base's dtype).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from pydantic import ValidationError

from memcalc.core.errors import UserError
from memcalc.inputs.data_files import clip
from memcalc.inputs.profiles import DEFAULT_TORCH, LORA_DTYPE_WHY, compose, get_profile, profile_for, with_loss
from memcalc.core.spec import (DEFAULT_LOSS_CHUNKS, FRAMEWORKS, HEAD_TARGET, LORA_DTYPES, LORA_TARGET_ALIASES, LORA_TARGETS, SHARDINGS,
                               ExperimentSpec, KernelProfile, ModelSpec, TrainingSpec, canonical_targets,
                               lora_targets_error)

if TYPE_CHECKING:
    from memcalc.inputs.presets import ModelSource


@dataclass
class Options:
    """Raw options as parsed (None = not given)."""

    model: Optional[str] = None
    params: Optional[str] = None
    config: Optional[str] = None
    batch: Optional[int] = None
    seq: Optional[int] = None
    grad_accum: Optional[int] = None
    precision: Optional[str] = None
    bf16: bool = False
    master_weights: bool = False
    optimizer: Optional[str] = None
    optimizer_impl: Optional[str] = None
    checkpoint: Optional[str] = None
    fused_optimizer: bool = False
    compile: bool = False
    memory_budget: Optional[float] = None
    lora: bool = False
    lora_rank: Optional[int] = None
    lora_alpha: Optional[float] = None
    lora_targets: Optional[str] = None
    lora_dropout: Optional[float] = None
    qlora: bool = False
    lora_dtype: Optional[str] = None
    profile: Optional[str] = None
    framework: Optional[str] = None
    torch: Optional[str] = None
    loss: Optional[str] = None
    loss_chunks: Optional[int] = None
    zero: Optional[int] = None
    gpus: Optional[int] = None
    offload_optimizer: bool = False
    sharding: Optional[str] = None
    tp: Optional[int] = None
    sequence_parallel: bool = False
    activation_offload: bool = False
    #: path of a DeepSpeed config (``--deepspeed``; HF TrainingArguments' ``deepspeed``): implies sharding deepspeed
    deepspeed: Optional[str] = None
    dora: bool = False
    #: --recipe FILE (repeatable: a training recipe and a PEFT adapter config) and --adapter-config FILE:
    #: their values fill the fields above that the user left unset (memcalc.inputs.recipes)
    recipe: Optional[list[str]] = None
    adapter_config: Optional[str] = None


@dataclass
class Resolved:
    """The experiment, plus the origin of each input and the notes on inferred values."""

    exp: ExperimentSpec
    origin: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: where --model's model came from (preset, Hugging Face id, cache, Hub, file); None without --model
    model_source: Optional["ModelSource"] = None
    #: input -> why its default is what it is (only for defaults that depend on the setup)
    reasons: dict[str, str] = field(default_factory=dict)
    #: the recipe read (--recipe): its kind, files, key -> option mapping, ignored and unread keys; None without
    recipe: Optional[dict[str, Any]] = None


#: the largest K of --checkpoint every-K (more layers than any model has; checked before int())
MAX_CHECKPOINT_EVERY = 100_000


def parse_checkpoint(value: str) -> tuple[str, Optional[int]]:
    """none | full | every-K (1 <= K <= MAX_CHECKPOINT_EVERY) | sqrt | selective | selective-op."""
    v = value.strip().lower()
    if v in ("none", "full", "sqrt", "selective", "selective-op"):
        return v, None
    m = re.fullmatch(r"every-?(\d+)", v)
    if m and (len(m.group(1).lstrip("0")) > len(str(MAX_CHECKPOINT_EVERY)) or int(m.group(1)) > MAX_CHECKPOINT_EVERY):
        raise UserError(f"--checkpoint {clip(v)}: K must be between 1 and {MAX_CHECKPOINT_EVERY:,}")
    if m and int(m.group(1)) >= 1:
        k = int(m.group(1))
        return ("full", None) if k == 1 else ("every-k", k)
    raise UserError(f"unknown --checkpoint {clip(value)!r}; valid: none, full, every-K (e.g. every-2), sqrt, selective, selective-op")


def parse_targets(value: str, model: Optional[ModelSpec] = None) -> tuple[str, ...]:
    """``--lora-targets``: comma-separated q,k,v,o,gate,up,down or their PEFT module names
    (q_proj, ..., down_proj), or all (every projection ``model`` has). With ``model``, a target
    it does not have (gate on a plain MLP) is an error naming the ones it has."""
    if value.strip().lower() == "all":
        return model.lora_targets if model is not None else LORA_TARGETS
    ts = canonical_targets(t for t in value.split(",") if t.strip())
    bad = [t for t in ts if t not in LORA_TARGETS]
    if bad or not ts:
        shown = ", ".join(bad) or repr(value)
        shown = shown if len(shown) <= 60 else shown[:56] + "..."
        raise UserError(f"unknown --lora-targets {shown}; valid: {', '.join(LORA_TARGETS)} "
                        f"(or PEFT's {', '.join(LORA_TARGET_ALIASES)}), or all")
    missing = [t for t in ts if model is not None and t not in model.lora_targets and t != HEAD_TARGET]
    if missing:
        raise UserError(f"--lora-targets: {lora_targets_error(model, missing)}")
    return ts


def _check_positive(name: str, v: Optional[float]) -> None:
    if v is not None and v <= 0:
        raise UserError(f"--{name} must be positive, got {v}")


def _check_finite(name: str, v: Optional[float]) -> None:
    if v is not None and not math.isfinite(v):
        raise UserError(f"--{name} must be a finite number, got {v}")


def resolve(o: Options) -> Resolved:
    """Build the experiment from options (see module docstring)."""
    # each model source is imported when it is used (--params never loads the presets, the
    # Hugging Face hub client or YAML): the estimate's start-up time
    recipe = None
    if o.recipe or o.adapter_config:  # the recipe's values under the flags (memcalc.inputs.recipes)
        from memcalc.inputs.recipes import apply_recipe

        o, recipe, from_recipe = apply_recipe(o)
    for name in ("lora_alpha", "lora_dropout", "memory_budget"):
        _check_finite(name.replace("_", "-"), getattr(o, name))
    for name in ("batch", "seq", "grad_accum", "lora_rank", "lora_alpha", "gpus", "tp"):
        _check_positive(name.replace("_", "-"), getattr(o, name))
    if o.zero is not None and o.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero must be 0, 1, 2 or 3, got {o.zero}")
    if o.memory_budget is not None and not 0 <= o.memory_budget <= 1:
        raise UserError(f"--memory-budget must be within [0, 1], got {o.memory_budget}")
    origin: dict[str, str] = {}
    notes: list[str] = []
    base: Optional[ExperimentSpec] = None
    if o.config:
        from memcalc.inputs.configs import load_config

        base = load_config(o.config)
    sources = [s for s in ("model", "params") if getattr(o, s)]
    if len(sources) > 1:
        raise UserError("give one of --model or --params, not both")
    model: ModelSpec
    model_source = None
    if o.model:
        from memcalc.inputs.presets import resolve_model_source

        model, model_source = resolve_model_source(o.model)
        origin["model"] = "flag"
    elif o.params:
        from memcalc.inputs.infer import infer_params

        model, reasons = infer_params(o.params)
        notes.extend(reasons)
        origin["model"] = "inferred"
    elif base is not None:
        model = base.model
        origin["model"] = "config"
    else:
        raise UserError("no model: give --model NAME|config.json, --params N, or --config NAME|FILE (see `memcalc models`)")

    profile, reasons = _profile(o, base, origin)

    tr: dict[str, Any] = base.training.model_dump() if base is not None else {}
    tr_origin = {k: "config" for k in tr} if base is not None else {}

    def put(key: str, value: Any) -> None:
        if value is not None:
            tr[key] = value
            tr_origin[key] = "flag"

    put("batch", o.batch)
    put("seq", o.seq)
    put("grad_accum", o.grad_accum)
    if o.bf16 and o.precision not in (None, "bf16"):
        raise UserError(f"--bf16 means --precision bf16; it conflicts with --precision {o.precision}")
    put("precision", "bf16" if o.bf16 else o.precision)
    if o.master_weights:
        put("master_weights", True)
    put("optimizer", o.optimizer)
    put("optimizer_impl", o.optimizer_impl)
    if o.checkpoint is not None:
        mode, k = parse_checkpoint(o.checkpoint)
        put("checkpoint", mode)
        put("checkpoint_every", k)
    if o.fused_optimizer:
        put("fused_optimizer", True)
    if o.compile or o.memory_budget is not None:
        put("compile", True)
    put("memory_budget", o.memory_budget)
    put("zero", o.zero)
    put("gpus", o.gpus)
    if o.sharding is not None and o.sharding not in SHARDINGS:
        raise UserError(f"unknown --sharding {clip(o.sharding)!r}; valid: {', '.join(SHARDINGS)}")
    put("sharding", o.sharding)
    put("tp", o.tp)
    if o.deepspeed is not None:
        _apply_deepspeed(o, model, tr, tr_origin, notes)
    if o.sequence_parallel:
        put("sequence_parallel", True)
    if o.activation_offload:
        put("activation_offload", True)
    if o.offload_optimizer:
        put("offload_optimizer", True)
    if o.lora_dtype is not None and o.lora_dtype not in LORA_DTYPES:
        raise UserError(f"unknown --lora-dtype {clip(o.lora_dtype)!r}; valid: {', '.join(LORA_DTYPES)}")
    lora_flags = o.lora or o.qlora or o.dora or any(v is not None for v in (o.lora_rank, o.lora_alpha, o.lora_targets,
                                                                      o.lora_dropout, o.lora_dtype))
    if lora_flags:
        cur = dict(tr.get("lora") or {})
        if o.lora_rank is not None:
            cur["rank"] = o.lora_rank
        if o.lora_alpha is not None:
            cur["alpha"] = o.lora_alpha
        if o.lora_targets is not None:
            cur["targets"] = parse_targets(o.lora_targets, model)
        elif "targets" not in cur and model.attention_lora_targets != ("q", "k", "v", "o"):
            cur["targets"] = model.attention_lora_targets  # the default q,k,v,o as this model names them
        if o.lora_dropout is not None:
            cur["dropout"] = o.lora_dropout
        if o.qlora:
            cur["qlora"] = True
        if o.dora:
            cur["dora"] = True
        if o.lora_dtype is not None:
            cur["dtype"] = o.lora_dtype
        tr["lora"] = cur
        tr_origin["lora"] = "flag"
    if tr.get("lora") is not None:
        cur = dict(tr["lora"])
        if o.lora_dtype is not None:
            origin["lora_dtype"] = "flag"
        elif cur.get("dtype") is not None:
            origin["lora_dtype"] = "config"
        else:  # None: the framework's (profile.lora_dtype); --json shows the value used as adapter_dtype
            origin["lora_dtype"] = "default"
            reasons["lora_dtype"] = f"{profile.framework}: {LORA_DTYPE_WHY[profile.framework]}"
        tr["lora"] = cur
        if "precision" not in tr:
            tr["precision"] = "bf16"
            tr_origin["precision"] = "default"
            reasons["precision"] = ("QLoRA: a bf16 base (QLoRA computes in bf16, bnb_4bit_compute_dtype=bfloat16)"
                                    if cur.get("qlora") else "LoRA: a bf16 base (the model loaded in bfloat16)")
    elif "precision" not in tr:
        reasons["precision"] = "full fine-tuning: what Hugging Face Trainer runs without --bf16/--fp16 (fp32 weights)"
    if "seq" not in tr:
        tr["seq"] = min(2048, model.max_seq_len)
        tr_origin["seq"] = "default"
        if model.max_seq_len < 2048:
            notes.append(f"seq defaults to {model.name}'s maximum, {model.max_seq_len} (below 2048)")
    try:
        training = TrainingSpec(**tr)
    except ValidationError as e:
        from memcalc.inputs.pydantic_errors import pydantic_error_line

        raise UserError(pydantic_error_line(e, "training options")) from None
    for k in TrainingSpec.model_fields:
        origin.setdefault(k, tr_origin.get(k, "default"))

    if o.loss is not None or o.loss_chunks is not None:  # flags override the profile's loss fields
        profile = with_loss(profile, o.loss, o.loss_chunks)
        origin.update({k: "flag" for k, v in (("cross_entropy", o.loss), ("loss_chunks", o.loss_chunks)) if v is not None})
        if profile.cross_entropy == "full" and o.loss_chunks == DEFAULT_LOSS_CHUNKS:
            # (other values under full are noted in the estimate's assumptions)
            notes.append(f"--loss-chunks {o.loss_chunks} has no effect: the loss is full cross-entropy (add --loss chunked)")
    published = base.published_peak_bytes if base is not None and not _changed(base, model, training, profile) else None
    try:
        exp = ExperimentSpec(
            name=base.name if base is not None else model.name,
            description=base.description if base is not None else "",
            model=model,
            training=training,
            profile=profile,
            published_peak_bytes=published,
            published_source=base.published_source if published is not None else None,
        )
    except ValidationError as e:  # a config's LoRA targets that --model does not have
        from memcalc.inputs.pydantic_errors import pydantic_error_line

        raise UserError(pydantic_error_line(e, "experiment")) from None
    if recipe is None:
        return Resolved(exp, origin, notes, model_source, reasons)
    from memcalc.inputs.recipes import ORIGIN_KEYS

    for opt in (k for k in recipe.values if k in from_recipe):  # origin "recipe FILE:KEY" for what the recipe set
        for key in ORIGIN_KEYS.get(opt, ()):
            if origin.get(key) not in (None, "default") and not origin[key].startswith("recipe"):
                origin[key] = f"recipe {recipe.keys[opt]}"
    return Resolved(exp, origin, recipe.lines() + notes, model_source, reasons, recipe.as_json())


def _apply_deepspeed(o: Options, model: ModelSpec, tr: dict, tr_origin: dict, notes: list) -> None:
    """``--deepspeed FILE`` (memcalc.inputs.deepspeed_config): sharding deepspeed, the file's ZeRO stage,
    buffers, precision, micro-batch and accumulation. A flag that contradicts the file is an error
    showing both; a value the file leaves "auto" keeps the flag's."""
    from memcalc.inputs.deepspeed_config import read_deepspeed

    ds = read_deepspeed(o.deepspeed, model.d_model)
    if o.zero is not None and o.zero != ds.stage:
        raise UserError(f"--zero {o.zero} conflicts with --deepspeed {o.deepspeed} (zero_optimization.stage {ds.stage})")
    if o.sharding is not None and o.sharding != "deepspeed":
        raise UserError(f"--sharding {o.sharding} conflicts with --deepspeed {o.deepspeed} (sharding deepspeed)")
    flag_prec = "bf16" if o.bf16 else o.precision
    for key, flag, shown in (("precision", flag_prec, "--precision"), ("batch", o.batch, "--batch"),
                             ("grad_accum", o.grad_accum, "--grad-accum")):
        if key in ds.training and flag is not None and flag != ds.training[key]:
            raise UserError(f"{shown} {flag} conflicts with --deepspeed {o.deepspeed} ({key} {ds.training[key]})")
    for key, value in ds.training.items():
        tr[key] = value
        tr_origin[key] = "config"
    tr.update(sharding="deepspeed", zero=ds.stage, deepspeed=ds.spec)
    if tr.get("precision") in ("bf16", "fp16") and not tr.get("master_weights"):
        # ZeRO keeps an fp32 partition under bf16/fp16 (stage_1_and_2.py single_partition_of_fp32_groups)
        tr["master_weights"] = True
        tr_origin["master_weights"] = "config"
    tr_origin.update(sharding="config", zero="config", deepspeed="config")
    notes.extend(ds.notes)


def _model_why(o: Options) -> str:
    """Why the framework defaults to hf for this model source."""
    if o.params:
        return "--params: most fine-tuning runs use Hugging Face transformers + PEFT"
    from memcalc.inputs.presets import list_presets

    if o.model and o.model.strip().lower() in list_presets():
        return "a preset is a Hugging Face model (written from its config.json), trained with transformers + PEFT"
    return "the model comes from a Hugging Face id, config.json or model file, trained with transformers + PEFT"


def _profile(o: Options, base: Optional[ExperimentSpec], origin: dict[str, str]) -> tuple[KernelProfile, dict[str, str]]:
    """The kernel profile: ``--profile NAME`` (or the config's profile, or the default for the model's
    source), then ``--framework`` / ``--torch`` replace that part of it
    (:func:`memcalc.inputs.profiles.compose`). Returns it with the reasons of its defaults."""
    if o.framework is not None and o.framework not in FRAMEWORKS:
        raise UserError(f"unknown --framework {clip(o.framework)!r}; valid: {', '.join(FRAMEWORKS)}")
    reasons: dict[str, str] = {}
    if o.profile:
        profile = get_profile(o.profile)
        origin["profile"] = origin["framework"] = origin["torch_version"] = "flag"
    elif base is not None:  # a --config experiment (with or without --model/--params): its profile
        profile = base.profile
        origin["profile"] = origin["framework"] = origin["torch_version"] = "config"
    else:
        profile = profile_for("hf", DEFAULT_TORCH)
        origin["profile"] = origin["framework"] = origin["torch_version"] = "default"
        reasons["framework"] = _model_why(o)
        reasons["torch_version"] = "the version the framework rules were checked against"
    if o.framework is not None or o.torch is not None:
        profile = compose(profile, o.framework, o.torch)
        origin["profile"] = "flag"
        origin.update({k: "flag" for k, v in (("framework", o.framework), ("torch_version", o.torch)) if v is not None})
    return profile, reasons


def _changed(base: ExperimentSpec, model: ModelSpec, training: TrainingSpec, profile) -> bool:
    """A flag changed the reference setup, so its published peak no longer applies."""
    return base.model != model or base.training != training or base.profile != profile

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
- precision: with LoRA/QLoRA and no precision given (a ``--config`` file naming none gives none;
  one naming fp32 keeps it, said in a note), ``bf16`` (a bf16 base; QLoRA computes
  in bf16, ``bnb_4bit_compute_dtype=torch.bfloat16`` in the QLoRA recipes); full fine-tuning
  ``fp32`` (what Hugging Face Trainer runs without ``--bf16``/``--fp16``);
- LoRA adapter dtype: the framework's (``KernelProfile.lora_dtype``: hf fp32, the others the
  base's dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from pydantic import ValidationError

from memcalc.core.errors import UserError
from memcalc.core.rules import QUANT_METHODS, framework_model
from memcalc.inputs.data_files import clip
from memcalc.inputs.parsers import parse_checkpoint, parse_modules_to_save, parse_targets
from memcalc.inputs.trainer_defaults import default_precision, fsdp1_qlora_profile, trainer_checkpointing
from memcalc.inputs.profiles import (DEFAULT_TORCH, LORA_DTYPE_WHY, compose, get_profile, profile_for, with_kernels,
                                     with_loss)
from memcalc.core.spec import (COMPILE_SCOPES, CP_METHODS, DEFAULT_LOSS_CHUNKS, FRAMEWORKS, LORA_DTYPES, SHARDINGS,
                               ExperimentSpec, KernelProfile, ModelSpec, TrainingSpec)

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
    galore_rank: Optional[int] = None
    checkpoint: Optional[str] = None
    reentrant: bool = False
    fused_optimizer: bool = False
    compile: bool = False
    memory_budget: Optional[float] = None
    compile_scope: Optional[str] = None
    lora: bool = False
    lora_rank: Optional[int] = None
    lora_alpha: Optional[float] = None
    lora_targets: Optional[str] = None
    lora_dropout: Optional[float] = None
    qlora: bool = False
    quant: Optional[str] = None
    lora_dtype: Optional[str] = None
    profile: Optional[str] = None
    framework: Optional[str] = None
    torch: Optional[str] = None
    loss: Optional[str] = None
    loss_chunks: Optional[int] = None
    loss_tokens: Optional[float] = None
    #: ``--kernels``: a kernel library replacing the model's layers (liger); ``liger_ops``: which of its kernels
    #: (a recipe's liger_kernel_config / axolotl plugin keys)
    kernels: Optional[str] = None
    liger_ops: Optional[tuple[str, ...]] = None
    zero: Optional[int] = None
    gpus: Optional[int] = None
    offload_optimizer: bool = False
    sharding: Optional[str] = None
    tp: Optional[int] = None
    ep: Optional[int] = None
    ep_capacity_factor: Optional[float] = None
    cp: Optional[int] = None
    cp_method: Optional[str] = None
    sequence_parallel: bool = False
    pp: Optional[int] = None
    pp_schedule: Optional[str] = None
    microbatches: Optional[int] = None
    pp_stages_per_rank: Optional[int] = None
    pp_first_stage_less_layers: Optional[int] = None
    pp_last_stage_less_layers: Optional[int] = None
    #: ``--first-seq``: the run's first micro-batch length (TrainingSpec.first_seq)
    first_seq: Optional[int] = None
    activation_offload: bool = False
    #: path of a DeepSpeed config (``--deepspeed``; HF TrainingArguments' ``deepspeed``): implies sharding deepspeed
    deepspeed: Optional[str] = None
    dora: bool = False
    #: ``--modules-to-save`` / a recipe's ``modules_to_save``: PEFT's whole trainable copies (LoraSpec.modules_to_save)
    modules_to_save: Optional[str] = None
    bnb_saves_input: bool = False
    #: ``--no-double-quant``: QLoRA absmax constants in fp32 (LoraSpec.double_quant False)
    no_double_quant: bool = False
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


def _check_number(name: str, v: Optional[float], positive: bool) -> None:
    """One line for an option that is not a finite number (or, ``positive``, not above 0). An integer too
    large for a float (the API's ``lora_alpha=10**400``) is not finite: math.isfinite raised OverflowError."""
    if v is None:
        return
    try:
        bad = v <= 0 if positive else not math.isfinite(v)
    except OverflowError:
        bad = True
    if bad:
        from memcalc.inputs.pydantic_errors import _short_repr

        raise UserError(f"--{name} must be {'positive' if positive else 'a finite number'}, got {_short_repr(v)}")


#: the numeric options that must be finite, and those that must be positive (checked in this order)
_FINITE = ("lora_alpha", "lora_dropout", "memory_budget", "ep_capacity_factor")
_POSITIVE = ("batch", "seq", "first_seq", "grad_accum", "galore_rank", "lora_rank", "lora_alpha", "gpus", "tp", "ep",
             "cp", "pp", "pp_stages_per_rank")
#: the training fields a flag sets as given (None: not given), before --deepspeed
_VALUE_FLAGS = ("batch", "seq", "grad_accum", "precision", "master_weights", "optimizer", "optimizer_impl",
                "galore_rank", "checkpoint", "checkpoint_every", "checkpoint_reentrant", "fused_optimizer", "compile",
                "memory_budget", "compile_scope", "zero", "gpus", "sharding", "tp", "ep", "ep_capacity_factor", "cp",
                "cp_method", "pp", "pp_schedule", "microbatches", "pp_stages_per_rank", "pp_first_stage_less_layers",
                "pp_last_stage_less_layers", "first_seq")
#: the on/off flags set after --deepspeed (a flag over the file's offload_optimizer is the flag's)
_LATE_SWITCHES = ("sequence_parallel", "activation_offload", "offload_optimizer")
#: the LoRA fields a flag sets as given: Options field -> LoraSpec field
_LORA_FLAGS = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}


class _Training:
    """The training fields being assembled (a config's, then the flags'), with each one's origin."""

    def __init__(self, base: Optional[ExperimentSpec]) -> None:
        self.values: dict[str, Any] = base.training.model_dump() if base is not None else {}
        self.origin: dict[str, str] = {k: "config" for k in self.values} if base is not None else {}
        self.named_precision = base is not None and "precision" in base.training.model_fields_set
        if base is not None and not self.named_precision:  # the setup's default decides (LoRA: bf16), as --model
            del self.values["precision"], self.origin["precision"]

    def put(self, key: str, value: Any, origin: str = "flag") -> None:
        """Set ``key`` unless ``value`` is None (the flag was not given)."""
        if value is not None:
            self.values[key] = value
            self.origin[key] = origin

    def spec(self) -> TrainingSpec:
        try:
            return TrainingSpec(**self.values)
        except ValidationError as e:
            from memcalc.inputs.pydantic_errors import pydantic_error_line

            raise UserError(pydantic_error_line(e, "training options")) from None


def resolve(o: Options) -> Resolved:
    """Build the experiment from options (see module docstring)."""
    # each model source is imported when it is used (--params never loads the presets, the
    # Hugging Face hub client or YAML): the estimate's start-up time
    recipe, from_recipe = None, set()
    if o.recipe or o.adapter_config is not None:  # the recipe's values under the flags (memcalc.inputs.recipes)
        from memcalc.inputs.recipes import apply_recipe

        o, recipe, from_recipe = apply_recipe(o)
    _check_numbers(o)
    base = _load_config(o)
    origin: dict[str, str] = {}
    notes: list[str] = []
    model, model_source = _model(o, base, origin, notes)
    profile, reasons = _profile(o, base, origin)

    tr = _Training(base)
    _put_flags(o, model, tr, notes)
    _put_lora_flags(o, model, tr)
    profile = fsdp1_qlora_profile(profile, tr.values, reasons, notes)
    _setup_defaults(o, model, profile, tr, origin, reasons, notes)
    training = tr.spec()
    for k in TrainingSpec.model_fields:
        origin.setdefault(k, tr.origin.get(k, "default"))
    profile = _loss_flags(o, profile, origin, notes)
    profile = kernel_flags(o, profile, origin)
    model, why = framework_model(model, profile.framework, training.lora)  # LitGPT: untied head, fused qkv
    notes.extend(why)
    exp = _experiment(base, model, training, profile)
    if recipe is None:
        return Resolved(exp, origin, notes, model_source, reasons)
    _recipe_origins(recipe, from_recipe, origin)
    return Resolved(exp, origin, recipe.lines() + notes, model_source, reasons, recipe.as_json())


def _check_numbers(o: Options) -> None:
    """The numeric flags' ranges (before anything is read)."""
    for names, positive in ((_FINITE, False), (_POSITIVE, True)):
        for name in names:
            _check_number(name.replace("_", "-"), getattr(o, name), positive)
    if o.zero is not None and o.zero not in (0, 1, 2, 3):
        raise UserError(f"--zero must be 0, 1, 2 or 3, got {o.zero}")
    if o.memory_budget is not None and not 0 <= o.memory_budget <= 1:
        raise UserError(f"--memory-budget must be within [0, 1], got {o.memory_budget}")


def _load_config(o: Options) -> Optional[ExperimentSpec]:
    """``--config``'s experiment, or None ("" is refused, not taken as no --config)."""
    if o.config is None:
        return None
    from memcalc.inputs.configs import load_config

    return load_config(o.config)


def _model(o: Options, base: Optional[ExperimentSpec], origin: dict[str, str],
           notes: list[str]) -> tuple[ModelSpec, Optional["ModelSource"]]:
    """The model: ``--model``, ``--params`` (with the notes on what was inferred) or the config's;
    and where --model's came from."""
    if o.model is not None and o.params is not None:  # ("" and 0 are given: refused, not taken as absent)
        raise UserError("give one of --model or --params, not both")
    if o.model is not None:
        from memcalc.inputs.presets import resolve_model_source

        origin["model"] = "flag"
        return resolve_model_source(o.model)
    if o.params is not None:
        from memcalc.inputs.infer import infer_params

        model, reasons = infer_params(o.params)
        notes.extend(reasons)
        origin["model"] = "inferred"
        return model, None
    if base is not None:
        origin["model"] = "config"
        return base.model, None
    raise UserError("no model: give --model NAME|config.json, --params N, or --config NAME|FILE (see `memcalc models`)")


def _flag_values(o: Options) -> dict[str, Any]:
    """What the flags before --deepspeed set (None: not given), their choices checked."""
    if o.bf16 and o.precision not in (None, "bf16"):
        raise UserError(f"--bf16 means --precision bf16; it conflicts with --precision {o.precision}")
    checkpoint, every = parse_checkpoint(o.checkpoint) if o.checkpoint is not None else (None, None)
    if o.sharding is not None and o.sharding not in SHARDINGS:
        raise UserError(f"unknown --sharding {clip(o.sharding)!r}; valid: {', '.join(SHARDINGS)}")
    if o.cp_method is not None and o.cp_method not in CP_METHODS:
        raise UserError(f"unknown --cp-method {clip(o.cp_method)!r}; valid: {', '.join(CP_METHODS)}")
    if o.compile_scope is not None and o.compile_scope not in COMPILE_SCOPES:
        raise UserError(f"unknown --compile-scope {clip(o.compile_scope)!r}; valid: {', '.join(COMPILE_SCOPES)}")
    return dict(
        batch=o.batch, seq=o.seq, grad_accum=o.grad_accum, precision="bf16" if o.bf16 else o.precision,
        master_weights=o.master_weights or None, optimizer=o.optimizer, optimizer_impl=o.optimizer_impl,
        galore_rank=o.galore_rank,
        checkpoint=checkpoint, checkpoint_every=every, checkpoint_reentrant=o.reentrant or None,
        fused_optimizer=o.fused_optimizer or None,
        compile=(o.compile or o.memory_budget is not None or o.compile_scope is not None) or None,
        memory_budget=o.memory_budget, compile_scope=o.compile_scope,
        zero=o.zero, gpus=o.gpus, sharding=o.sharding, tp=o.tp, ep=o.ep, ep_capacity_factor=o.ep_capacity_factor,
        cp=o.cp, cp_method=o.cp_method, pp=o.pp, pp_schedule=o.pp_schedule, microbatches=o.microbatches,
        pp_stages_per_rank=o.pp_stages_per_rank, pp_first_stage_less_layers=o.pp_first_stage_less_layers,
        pp_last_stage_less_layers=o.pp_last_stage_less_layers, first_seq=o.first_seq,
    )


def _put_flags(o: Options, model: ModelSpec, tr: _Training, notes: list[str]) -> None:
    """The training flags over the config's values; --deepspeed's file over both (a flag
    contradicting it is an error), then the on/off flags it does not set."""
    values = _flag_values(o)
    for key in _VALUE_FLAGS:
        tr.put(key, values[key])
    if o.deepspeed is not None:
        from memcalc.inputs.deepspeed_config import apply_deepspeed

        apply_deepspeed(o, model.d_model, tr.values, tr.origin, notes, lora=_lora_given(o))
    for key in _LATE_SWITCHES:
        tr.put(key, getattr(o, key) or None)


def _lora_given(o: Options) -> bool:
    """Whether any LoRA flag was given (each one means LoRA)."""
    return any((o.lora, o.qlora, o.dora, o.bnb_saves_input, o.no_double_quant)) or any(
        v is not None for v in (o.lora_rank, o.lora_alpha, o.lora_targets, o.lora_dropout, o.lora_dtype, o.quant,
                                o.modules_to_save))


def _put_lora_flags(o: Options, model: ModelSpec, tr: _Training) -> None:
    """The LoRA flags over the config's adapter; without ``--lora-targets``, the default q,k,v,o as
    this model names them."""
    if o.lora_dtype is not None and o.lora_dtype not in LORA_DTYPES:
        raise UserError(f"unknown --lora-dtype {clip(o.lora_dtype)!r}; valid: {', '.join(LORA_DTYPES)}")
    if not _lora_given(o):
        return
    cur = dict(tr.values.get("lora") or {})
    for flag, key in _LORA_FLAGS.items():
        if getattr(o, flag) is not None:
            cur[key] = getattr(o, flag)
    if o.lora_targets is not None:
        cur["targets"] = parse_targets(o.lora_targets, model)
    elif "targets" not in cur and model.attention_lora_targets != ("q", "k", "v", "o"):
        cur["targets"] = model.attention_lora_targets  # the default q,k,v,o as this model names them
    for switch in ("qlora", "dora", "bnb_saves_input"):
        if getattr(o, switch):
            cur[switch] = True
    if o.no_double_quant:
        cur["double_quant"] = False
    if o.lora_dtype is not None:
        cur["dtype"] = o.lora_dtype
    if o.quant is not None:
        if o.quant not in QUANT_METHODS:
            raise UserError(f"unknown --quant {clip(o.quant)!r}; valid: {', '.join(QUANT_METHODS)}")
        cur["quant"] = o.quant
    if o.modules_to_save is not None:
        cur["modules_to_save"] = parse_modules_to_save(o.modules_to_save)
    tr.put("lora", cur)


def _setup_defaults(o: Options, model: ModelSpec, profile: KernelProfile, tr: _Training,
                    origin: dict[str, str], reasons: dict[str, str], notes: list[str]) -> None:
    """The defaults that depend on the setup (module docstring): the adapter's dtype, the
    precision, the sequence length; with their reasons and notes."""
    lora = tr.values.get("lora")
    if lora is not None:
        tr.values["lora"] = dict(lora)
        _lora_dtype_origin(o, lora, profile, origin, reasons)
        if "precision" not in tr.values:
            precision, reasons["precision"] = default_precision("qlora" if lora.get("qlora") else "lora")
            tr.put("precision", precision, origin="default")
        if o.config and _lora_given(o) and (tr.origin["precision"] == "default" or (
                tr.named_precision and tr.origin["precision"] == "config" and not o.deepspeed)):
            from memcalc.inputs.configs import lora_precision_note
            notes.append(lora_precision_note(o.config, tr.values["precision"], tr.named_precision))
    elif "precision" not in tr.values:  # (TrainingSpec's own default: fp32)
        reasons["precision"] = default_precision("none")[1]
    if tr.values.get("compile") and "compile_scope" not in tr.values and profile.framework == "torchtune":
        tr.put("compile_scope", "layer", origin="default")
        reasons["compile_scope"] = ("torchtune: training.compile_model compiles each TransformerSelfAttentionLayer "
                                    "apart (torchtune/training/_compile.py) and compile_loss the loss")
    trainer_checkpointing(profile, tr.values, tr.origin, reasons, notes)
    if "seq" not in tr.values:
        tr.put("seq", min(2048, model.max_seq_len), origin="default")
        if model.max_seq_len < 2048:
            notes.append(f"seq defaults to {model.name}'s maximum, {model.max_seq_len} (below 2048)")


def _lora_dtype_origin(o: Options, lora: dict, profile: KernelProfile, origin: dict[str, str],
                       reasons: dict[str, str]) -> None:
    if o.lora_dtype is not None:
        origin["lora_dtype"] = "flag"
    elif lora.get("dtype") is not None:
        origin["lora_dtype"] = "config"
    else:  # None: the framework's (profile.lora_dtype); --json shows the value used as adapter_dtype
        origin["lora_dtype"] = "default"
        reasons["lora_dtype"] = f"{profile.framework}: {LORA_DTYPE_WHY[profile.framework]}"


def _loss_flags(o: Options, profile: KernelProfile, origin: dict[str, str], notes: list[str]) -> KernelProfile:
    """``--loss`` / ``--loss-chunks`` over the profile's loss fields."""
    if o.loss is None and o.loss_chunks is None and o.loss_tokens is None:
        return profile
    profile = with_loss(profile, o.loss, o.loss_chunks, o.loss_tokens)
    origin.update({k: "flag" for k, v in (("cross_entropy", o.loss), ("loss_chunks", o.loss_chunks),
                                          ("loss_tokens", o.loss_tokens)) if v is not None})
    if profile.cross_entropy == "full" and o.loss_chunks == DEFAULT_LOSS_CHUNKS:
        # (other values under full are noted in the estimate's assumptions)
        notes.append(f"--loss-chunks {o.loss_chunks} has no effect: the loss is full cross-entropy (add --loss chunked)")
    return profile


def kernel_flags(o: Options, profile: KernelProfile, origin: dict[str, str]) -> KernelProfile:
    """``--kernels`` (and a recipe's ``liger_ops``) over the profile; Liger runs on transformers' model code only."""
    origin.update({k: "flag" for k, v in (("kernels", o.kernels), ("liger_ops", o.liger_ops)) if v is not None})
    return with_kernels(profile, o.kernels, o.liger_ops)


def _experiment(base: Optional[ExperimentSpec], model: ModelSpec, training: TrainingSpec,
                profile: KernelProfile) -> ExperimentSpec:
    """The experiment; a config's published peak kept only while no flag changed its setup."""
    published = base.published_peak_bytes if base is not None and not _changed(base, model, training, profile) else None
    try:
        return ExperimentSpec(
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


def _recipe_origins(recipe: Any, from_recipe: set[str], origin: dict[str, str]) -> None:
    """Origin ``recipe FILE:KEY`` for each input the recipe set (and no flag or default did)."""
    from memcalc.inputs.recipes import ORIGIN_KEYS

    for opt in (k for k in recipe.values if k in from_recipe):
        for key in ORIGIN_KEYS.get(opt, ()):
            if origin.get(key) not in (None, "default") and not origin[key].startswith("recipe"):
                origin[key] = f"recipe {recipe.keys[opt]}"


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

"""``--deepspeed ds_config.json``: a DeepSpeed config read into the training spec.

What each key becomes (every key changes the estimate or is listed as ignored, with why):

- ``zero_optimization``: its stage (2 or 3) and buffer sizes become
  :class:`memcalc.core.spec.DeepSpeedSpec`; ``offload_optimizer.device`` cpu/nvme becomes
  ``TrainingSpec.offload_optimizer``; ``offload_param.device`` cpu/nvme ``DeepSpeedSpec.offload_param``.
- ``bf16.enabled`` / ``fp16.enabled``: precision bf16 / fp16 with fp32 master weights (ZeRO
  keeps its fp32 partition, stage_1_and_2.py ``single_partition_of_fp32_groups``); neither: fp32.
- ``train_micro_batch_size_per_gpu`` / ``gradient_accumulation_steps``: batch / grad_accum.
- ``"auto"``: resolved as Hugging Face's integration resolves it
  (transformers/integrations/deepspeed.py ``HfTrainerDeepSpeedConfig``): ``trainer_config_process``
  fills micro-batch, accumulation and bf16/fp16 from the trainer's arguments (here: the
  corresponding memcalc flags), ``trainer_config_finalize`` fills ``reduce_bucket_size =
  hidden_size**2``, ``stage3_prefetch_bucket_size = int(0.9 * hidden_size**2)`` and
  ``stage3_param_persistence_threshold = 10 * hidden_size``. A ``bf16``/``fp16`` "auto" that decides the
  precision is said in a note (:func:`auto_precision_note`): Hugging Face fills it from
  ``TrainingArguments.bf16``/``fp16`` (``fill_match("bf16.enabled", args.bf16 or args.bf16_full_eval)``), so
  without ``--bf16``/``--precision`` it is false; DeepSpeed alone drops "auto" to the field's default, false
  (deepspeed 0.19 runtime/config_utils.py ``DeepSpeedConfigModel.__init__``, precision_config.py
  ``DeepSpeedBF16Config.enabled = False``): fp32 either way.

A key memcalc does not model is listed in one note (``IGNORED`` has the reasons); a bad value
is a :class:`~memcalc.core.errors.UserError` (exit 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from memcalc.core.errors import UserError

#: zero_optimization keys read into DeepSpeedSpec (DeepSpeed's name -> the spec's field)
ZERO_KEYS = {
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
}

#: keys that cannot change the estimate, with the reason (zero_optimization's and top-level)
IGNORED = {
    "reduce_scatter": "reduce-scatter or all-reduce of the bucket: the same bucket and flatten copy",
    "allgather_partitions": "all-gather or broadcast of the updated partitions: in place into the flat buffer",
    "round_robin_gradients": "reorders gradient partitions over ranks; not modelled",
    "sub_group_size": "ZeRO-3 optimizer sub-groups (1e9 elements by default) exceed the models traced; not modelled",
    "stage3_gather_16bit_weights_on_model_save": "acts only when a checkpoint is saved",
    "stage3_gather_fp16_weights_on_model_save": "acts only when a checkpoint is saved",
    "gather_16bit_weights_on_model_save": "acts only when a checkpoint is saved",
    "elastic_checkpoint": "acts only when a checkpoint is saved",
    "ignore_unused_parameters": "every parameter of a decoder is used",
    "load_from_fp32_weights": "acts only when a checkpoint is loaded",
    "cpu_offload_use_pin_memory": "host memory pinning: the host side, not the GPU's",
    "memory_efficient_linear": "ZeRO-3's own linear autograd function saves what nn.Linear saves",
    "train_batch_size": "derived: micro-batch x accumulation x GPUs",
    "optimizer": "the optimizer comes from --optimizer / --optimizer-impl (DeepSpeed's FusedAdam: --optimizer-impl fused)",
    "scheduler": "a learning-rate schedule allocates no tensors",
    "gradient_clipping": "clipping scales the gradient partition in place (unscale_and_clip_grads)",
    "steps_per_print": "logging",
    "wall_clock_breakdown": "logging",
    "zero_allow_untested_optimizer": "a permission, not a buffer",
    "zero_force_ds_cpu_optimizer": "a permission, not a buffer",
    "tensorboard": "logging", "wandb": "logging", "csv_monitor": "logging", "comms_logger": "logging",
    "flops_profiler": "profiling", "prescale_gradients": "a scale, applied in place",
    "gradient_predivide_factor": "a scale, applied in place",
    "dump_state": "logging", "activation_checkpointing": "DeepSpeed's own checkpointing API is not used by "
    "Hugging Face models (they call torch.utils.checkpoint: --checkpoint)",
}

#: HF's trainer_config_finalize: the keys it fills from the model's hidden size
AUTO_FROM_HIDDEN = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


@dataclass
class DeepSpeedInputs:
    """What a DeepSpeed config sets: DeepSpeedSpec fields and training fields (None = not set,
    or "auto" left to memcalc's own flag), with one-line notes."""

    stage: int
    spec: dict[str, Any]
    training: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    #: the sections ("bf16", "fp16") whose ``enabled`` is "auto" and decides the precision (none set true)
    auto_precision: tuple[str, ...] = ()


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.strip().lower() == "auto"


def _int(path: str, key: str, v: Any, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise UserError(f"{path}: {key} must be a whole number, got {_shown(v)}")
    if v < low:
        raise UserError(f"{path}: {key} must be at least {low}, got {int(v)}")
    return int(v)


def _bool(path: str, key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise UserError(f"{path}: {key} must be true or false, got {_shown(v)}")
    return v


def _enabled(path: str, raw: dict, name: str) -> Optional[bool]:
    """``bf16.enabled`` / ``fp16.enabled``: True/False, or None for "auto" or absent."""
    sec = raw.get(name)
    if sec is None:
        return None
    if not isinstance(sec, dict):
        raise UserError(f"{path}: {name} must be an object like {{\"enabled\": true}}, got {_shown(sec)}")
    v = sec.get("enabled", False)
    return None if _is_auto(v) else _bool(path, f"{name}.enabled", v)


def _offload(path: str, zo: dict, key: str) -> bool:
    sec = zo.get(key)
    if sec is None:
        return False
    if not isinstance(sec, dict):
        raise UserError(f"{path}: zero_optimization.{key} must be an object like {{\"device\": \"cpu\"}}")
    dev = sec.get("device", "none")
    if dev not in ("none", "cpu", "nvme", None):
        raise UserError(f"{path}: zero_optimization.{key}.device must be none, cpu or nvme, got {_shown(dev)}")
    return dev in ("cpu", "nvme")


def _shown(value: Any) -> str:
    """A config value as JSON for an error line, cut to 60 characters (a 4,000-digit number is not echoed)."""
    from memcalc.inputs.data_files import clip

    return clip(json.dumps(value), 60)


def load_json(path: str) -> dict:
    from memcalc.inputs.data_files import check_name, clip

    check_name(path, "--deepspeed")
    if not path.strip():  # (Path("") is the current folder)
        raise UserError(f"--deepspeed {path!r}: an empty path; give a file path")
    p = Path(path)
    try:
        found = p.exists() and not p.is_dir()  # (a FIFO or a device: refused unread by read_user_file)
    except OSError as e:  # a name the OS refuses (a component over 255 bytes)
        raise UserError(f"--deepspeed {clip(path, 200)}: {e.strerror or e}") from None
    if not found:
        raise UserError(f"--deepspeed {clip(path, 200)}: {'a directory' if p.is_dir() else 'no such file'}")
    from memcalc.inputs.data_files import check_size, read_user_file

    text = read_user_file(p, "--deepspeed")  # at most 1 MiB, UTF-8
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--deepspeed {path}: not valid JSON ({e})") from None
    except RecursionError:
        raise UserError(f"--deepspeed {path}: nests too deep to be a DeepSpeed config") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise UserError(f"--deepspeed {path}: not valid JSON ({clip(str(e), 120)})") from None
    check_size(raw, f"--deepspeed {path}")  # values and depth, as every other file read
    if not isinstance(raw, dict):
        raise UserError(f"--deepspeed {path}: a DeepSpeed config is a JSON object, got {type(raw).__name__}")
    return raw


def read_deepspeed(path: str, hidden_size: int) -> DeepSpeedInputs:
    """Read ``path`` (see the module docstring); ``hidden_size`` fills HF's "auto" buffer sizes."""
    raw = load_json(path)
    zo, stage = _stage(path, raw)
    spec, autos = _zero_spec(path, zo, hidden_size)
    spec = {"stage": stage, **spec, "offload_param": _offload(path, zo, "offload_param")}
    training: dict[str, Any] = {"offload_optimizer": _offload(path, zo, "offload_optimizer") or None}
    precision = _precision(path, raw)
    training.update(precision)
    auto = () if precision else tuple(n for n in ("bf16", "fp16") if n in raw and _enabled(path, raw, n) is None)
    for key, fld in (("train_micro_batch_size_per_gpu", "batch"), ("gradient_accumulation_steps", "grad_accum")):
        if key in raw and not _is_auto(raw[key]):
            training[fld] = _int(path, key, raw[key], low=1)
    notes = []
    if autos:
        notes.append(f"DeepSpeed \"auto\" values filled as Hugging Face's integration does (hidden size {hidden_size}): "
                     + ", ".join(autos))
    listed = _ignored(raw, zo)
    if listed:
        notes.append("DeepSpeed config keys ignored (no effect on the estimate): " + ", ".join(listed))
    return DeepSpeedInputs(stage, spec, {k: v for k, v in training.items() if v is not None}, notes, auto)


def apply_deepspeed(o: Any, hidden_size: int, tr: dict, tr_origin: dict, notes: list, lora: bool) -> None:
    """``--deepspeed FILE`` over the training fields ``tr`` (memcalc.inputs.resolve's, ``o`` its Options):
    sharding deepspeed, the file's ZeRO stage, buffers, precision, micro-batch and accumulation. A flag that
    contradicts the file is an error showing both; a value the file leaves "auto" keeps the flag's (or the
    ``--config`` experiment's), and a precision "auto" says what it resolved to (``lora``: LoRA is on)."""
    ds = read_deepspeed(o.deepspeed, hidden_size)
    if o.zero is not None and o.zero != ds.stage:
        raise UserError(f"--zero {o.zero} conflicts with --deepspeed {o.deepspeed} "
                        f"(zero_optimization.stage {ds.stage})")
    if o.sharding is not None and o.sharding != "deepspeed":
        raise UserError(f"--sharding {o.sharding} conflicts with --deepspeed {o.deepspeed} (sharding deepspeed)")
    flag_prec = "bf16" if o.bf16 else o.precision
    for key, flag, shown in (("precision", flag_prec, "--precision"), ("batch", o.batch, "--batch"),
                             ("grad_accum", o.grad_accum, "--grad-accum")):
        if key in ds.training and flag is not None and flag != ds.training[key]:
            raise UserError(f"{shown} {flag} conflicts with --deepspeed {o.deepspeed} ({key} {ds.training[key]})")
    if ds.auto_precision:
        src = {"flag": "--bf16" if o.bf16 else f"--precision {o.precision}", "config": f"--config {o.config}"}
        given = src.get(tr_origin.get("precision") or "", "")
        lora = lora or tr.get("lora") is not None
        notes.append(auto_precision_note(ds.auto_precision, tr.get("precision"), given, lora))
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


def auto_precision_note(auto: tuple[str, ...], precision: Optional[str], source: str, lora: bool) -> str:
    """What the ``auto`` sections' ``enabled`` resolved to, and why: the precision ``source`` gave
    (a flag, the ``--config`` experiment), else false as Hugging Face and DeepSpeed resolve it (module
    docstring); with LoRA and no precision the base stays as loaded, LoRA's default bf16."""
    if precision is not None:
        vals = ", ".join(f"{n}.enabled={str(precision == n).lower()}" for n in auto)
        return (f"DeepSpeed \"auto\" resolved as Hugging Face fills it from TrainingArguments.bf16/fp16 "
                f"(transformers integrations/deepspeed.py trainer_config_process), here {source}: {vals}, "
                f"precision {precision}")
    then = ("DeepSpeed casts nothing, the base stays as loaded: LoRA's default, a bf16 base" if lora else
            "fp32 weights, gradients and optimizer state (--bf16 or --precision for a 16-bit run)")
    return (f"DeepSpeed {' and '.join(n + '.enabled' for n in auto)} \"auto\" resolved to false: no --bf16 or "
            f"--precision, and Hugging Face fills \"auto\" from TrainingArguments.bf16/fp16 (default False; "
            f"integrations/deepspeed.py trainer_config_process), as DeepSpeed alone drops \"auto\" to its default, "
            f"false (runtime/config_utils.py DeepSpeedConfigModel): {then}")


def _stage(path: str, raw: dict) -> tuple[dict, int]:
    """``zero_optimization`` and its stage (2 or 3)."""
    zo = raw.get("zero_optimization")
    if not isinstance(zo, dict) or "stage" not in zo:
        raise UserError(f"--deepspeed {path}: needs zero_optimization.stage (2 or 3); memcalc models DeepSpeed ZeRO-2/3")
    stage = zo["stage"]
    if isinstance(stage, bool) or stage not in (2, 3):
        raise UserError(f"--deepspeed {path}: zero_optimization.stage must be 2 or 3 (the stages memcalc models), "
                        f"got {_shown(stage)}")
    return zo, stage


def _zero_spec(path: str, zo: dict, hidden_size: int) -> tuple[dict[str, Any], list[str]]:
    """The :data:`ZERO_KEYS` that ``zo`` sets, as DeepSpeedSpec fields ("auto" filled from the hidden
    size as Hugging Face fills it), and the "auto" values filled (``key=value``)."""
    spec: dict[str, Any] = {}
    autos: list[str] = []
    for key, fld in ZERO_KEYS.items():
        if key not in zo:
            continue
        v = zo[key]
        if _is_auto(v):
            if key not in AUTO_FROM_HIDDEN:
                raise UserError(f"--deepspeed {path}: zero_optimization.{key} is \"auto\", which Hugging Face fills only "
                                f"for {', '.join(AUTO_FROM_HIDDEN)}, the batch, accumulation and bf16/fp16")
            v = AUTO_FROM_HIDDEN[key](hidden_size)
            autos.append(f"{key}={v:,}")
        if key in ("overlap_comm", "contiguous_gradients"):
            spec[fld] = _bool(path, f"zero_optimization.{key}", v)
        else:
            spec[fld] = _int(path, f"zero_optimization.{key}", v, low=1 if key == "reduce_bucket_size" else 0)
    return spec, autos


def _precision(path: str, raw: dict) -> dict[str, Any]:
    """``bf16.enabled`` / ``fp16.enabled``: precision bf16 / fp16 with master weights; neither on and
    neither "auto": fp32; else nothing (the flags')."""
    bf16, fp16 = _enabled(path, raw, "bf16"), _enabled(path, raw, "fp16")
    if bf16 and fp16:
        raise UserError(f"--deepspeed {path}: bf16.enabled and fp16.enabled are both true; DeepSpeed takes one")
    if bf16 or fp16:
        return {"precision": "bf16" if bf16 else "fp16", "master_weights": True}
    if not ("bf16" in raw and bf16 is None) and not ("fp16" in raw and fp16 is None):  # neither on, neither "auto"
        return {"precision": "fp32"}
    return {}


def _ignored(raw: dict, zo: dict) -> list[str]:
    """The keys memcalc does not read (:data:`IGNORED` says why), zero_optimization's first."""
    known = set(ZERO_KEYS) | {"stage", "offload_optimizer", "offload_param"}
    top = [k for k in raw if k not in ("zero_optimization", "bf16", "fp16", "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps")]
    return [f"zero_optimization.{k}" for k in zo if k not in known] + top

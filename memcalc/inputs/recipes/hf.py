"""Hugging Face ``TrainingArguments`` / TRL ``SFTConfig`` (+ TRL ``ModelConfig``) as JSON or YAML, and
PEFT ``adapter_config.json`` / ``LoraConfig`` -> Options.

Field names and defaults follow transformers 5.23 ``training_args.py`` (``per_device_train_batch_size``
default 8; ``optim`` default ``adamw_torch_fused`` from PyTorch 2.8, the profile's version),
TRL's ``SFTConfig`` (``max_length``, formerly ``max_seq_length``; ``packing``) and ``ModelConfig``
(``model_name_or_path``, ``torch_dtype``/``dtype``, ``use_peft``, ``lora_r``, ``lora_alpha``,
``lora_dropout``, ``lora_target_modules``, ``use_dora``, ``load_in_4bit``, ``load_in_8bit``), and PEFT's
``LoraConfig`` (``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``, ``use_dora``,
``modules_to_save`` (embed_tokens, lm_head: LoraSpec.modules_to_save), ``rank_pattern``).

This is memcalc's one reader of ``TrainingArguments``: ``--recipe`` reads a file with :func:`read`, and the
Trainer callback (``memcalc.integrations.transformers.MemcalcCallback``) reads the live arguments with
:func:`options_from_hf`, which hands ``args.to_dict()`` to the same :func:`read`. The ``optim`` names are the
optimizer registry's ``hf`` aliases (:func:`memcalc.core.optimizers.alias_table`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from memcalc.core.errors import UserError
from memcalc.core.optimizers import alias_table
from memcalc.inputs.data_files import clip
from memcalc.inputs.recipes import trl
from memcalc.inputs.recipes.common import (Reader, Recipe, bool_value, choice, float_value, int_value, model_for_hub_id,
                                           optimizer_name, peft_targets, set_deepspeed, set_fsdp)

#: TrainingArguments.per_device_train_batch_size's default (transformers training_args.py)
HF_DEFAULT_BATCH = 8
#: TrainingArguments.optim's default: transformers 5.24 training_args.py sets ``default_optim = "adamw_torch_fused"``
#: when torch >= 2.8 (the profile's version), ``"adamw_torch"`` before
HF_DEFAULT_OPTIM = "adamw_torch_fused"

#: the model's load dtype (``torch_dtype`` / ``dtype``) -> 16-bit or not
TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "auto": "auto", "bf16": "bf16",
                "fp16": "fp16", "fp32": "fp32"}

IGNORE = (
    "output_dir", "overwrite_output_dir", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs",
    "warmup_ratio", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "num_train_epochs", "max_steps", "logging_*", "log_level*", "save_*", "eval_*", "evaluation_strategy",
    "do_train", "do_eval", "do_predict", "per_device_eval_batch_size", "hub_*", "push_to_hub", "report_to",
    "seed", "data_seed", "run_name", "remove_unused_columns", "dataloader_*", "model_revision", "revision",
    "dataset_*", "chat_template*", "preprocessing_num_workers", "trust_remote_code", "tf32", "label_names",
    "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "disable_tqdm", "ddp_*",
    "eos_token", "pad_token", "group_by_length", "optim_args",
    "neftune_noise_alpha", "include_*", "prediction_loss_only", "use_cpu", "local_rank", "resume_from_checkpoint",
    "use_flash_attention_2", "task_type", "peft_type", "base_model_name_or_path", "inference_mode", "bias",
    "fan_in_fan_out", "init_lora_weights", "auto_mapping", "layers_pattern", "layers_to_transform",
    "use_rslora", "lora_task_type", "env.*", "bf16_full_eval", "fp16_full_eval", "torch_empty_cache_steps",
    "peft_version", "loftq_config", "megatron_*", "revision", "lora_bias", "exclude_modules",
    "bnb_4bit_quant_storage", "model_init_kwargs",
)


def read(raw: dict[str, Any], rec: Recipe, src: str, strict: bool = True) -> None:
    """TrainingArguments / SFTConfig (with TRL ModelConfig keys, or an embedded ``peft_config``).

    ``strict`` (``--recipe``): a setting memcalc cannot model is a :class:`UserError`; without it (the
    Trainer callback, which must never stop a run) an unknown ``optim`` or Liger's kernels are a note
    and the estimate keeps memcalc's default."""
    r = Reader(raw, rec, src, IGNORE)
    sft = trl.is_trl(raw)
    if sft:
        trl.defaults(r, strict)
    else:
        r.set("framework", "hf", "(Hugging Face Trainer)", "hf")
    _model_and_shape(r)
    checkpointing(r)
    packing(r, "packing")
    precision(r, "bf16", "fp16", dtype_of(r))
    optimizer(r, "optim", strict)
    if r.has("torch_compile") and bool_value(r.get("torch_compile"), f"{src}:torch_compile"):
        r.set("compile", True, "torch_compile")
    _liger(r, strict)
    if r.has("deepspeed"):
        set_deepspeed(r, r.get("deepspeed"), "deepspeed", src)
    fsdp = r.get("fsdp")
    if fsdp not in (None, "", []):
        set_fsdp(r, fsdp, "fsdp", "fsdp_config")
    attention(r, "attn_implementation")
    _trl_peft(r)
    if sft:
        trl.read(r, strict)
    if isinstance(raw.get("peft_config"), dict):
        r.read.add("peft_config")
        peft(raw["peft_config"], rec, src, "peft_config.")
    r.finish()


def _model_and_shape(r: Reader) -> None:
    """The model id, the micro-batch (TrainingArguments' default 8), accumulation and TRL's sequence length."""
    src = r.src
    if r.has("model_name_or_path"):
        mid = r.get("model_name_or_path")
        r.set("model", model_for_hub_id(str(mid), f"{src}:model_name_or_path", r.rec), "model_name_or_path", mid)
    if r.has("per_device_train_batch_size"):
        r.set("batch", int_value(r.get("per_device_train_batch_size"), f"{src}:per_device_train_batch_size"),
              "per_device_train_batch_size")
    else:
        r.set("batch", HF_DEFAULT_BATCH, "per_device_train_batch_size (TrainingArguments default)")
    if r.has("gradient_accumulation_steps"):
        r.set("grad_accum", int_value(r.get("gradient_accumulation_steps"), f"{src}:gradient_accumulation_steps"),
              "gradient_accumulation_steps")
    for k in ("max_length", "max_seq_length"):
        if r.has(k):
            r.set("seq", int_value(r.get(k), f"{src}:{k}"), k)
            break


def optimizer(r: Reader, key: str, strict: bool = True) -> None:
    """``optim`` (absent: TrainingArguments' default, :data:`HF_DEFAULT_OPTIM`) -> the optimizer registry's
    ``hf`` alias: the optimizer and the implementation it builds (transformers trainer_optimizer.py)."""
    optim = r.get(key)
    if optim is None:
        name, alias = alias_table("hf")[HF_DEFAULT_OPTIM]
        r.set("optimizer", name, f"{key} (TrainingArguments default: {HF_DEFAULT_OPTIM})")
        r.set("optimizer_impl", alias.impl, f"{key} (default)")
        return
    if not strict and (not isinstance(optim, str) or optim.strip() not in alias_table("hf")):
        r.rec.note(f"optim {optim} is not modelled; the estimate assumes adamw")
        return
    name, impl = optimizer_name(r, key, "hf")
    if name == "sgd" and float_value(_optim_args(r).get("momentum", 0), f"{r.src}:optim_args momentum"):
        r.set("optimizer", "sgd-momentum", f"{key}+optim_args", f"{optim}, {r.get('optim_args')}")
        return
    r.set("optimizer", name, key, optim)
    if impl:
        r.set("optimizer_impl", impl, key, optim)


def _optim_args(r: Reader) -> dict[str, str]:
    """``optim_args`` as transformers 5.24 trainer_optimizer.py ``_parse_optim_args`` reads it (``"a=1,b=2"``);
    ``_get_sgd`` takes its ``momentum`` (torch.optim.SGD then keeps one buffer per parameter)."""
    text = r.get("optim_args")
    if not isinstance(text, str) or not text.strip():
        return {}
    pairs = [p.split("=", 1) for p in text.replace(" ", "").split(",") if p]
    if not all(len(kv) == 2 for kv in pairs):
        raise UserError(f"{r.src}:optim_args: expected key=value pairs separated by commas, got {clip(repr(text))}")
    return {kv[0]: kv[1] for kv in pairs}


#: ``liger_kernel_config`` keys (the ``apply_liger_kernel_to_<model_type>`` keyword arguments) -> ``liger_ops``
LIGER_CONFIG = {"rope": "rope", "rms_norm": "rms_norm", "swiglu": "glu", "geglu": "glu",
                "fused_linear_cross_entropy": "flce"}


def _liger(r: Reader, strict: bool) -> None:
    """``use_liger_kernel`` (TrainingArguments, and so TRL's SFTConfig; ``use_liger``: TRL's former name) -> kernels
    liger, and ``liger_kernel_config`` (the keyword arguments Trainer passes to ``_apply_liger_kernel_to_instance``,
    transformers 5.24 integrations/liger.py; each defaults to True in liger_kernel's apply functions) -> which
    kernels."""
    key = next((k for k in ("use_liger_kernel", "use_liger") if r.has(k) and bool_value(r.get(k), f"{r.src}:{k}")),
               None)
    cfg = r.get("liger_kernel_config")
    if key is None:
        return
    r.set("kernels", "liger", key, True)
    if cfg is None:
        return
    if not isinstance(cfg, dict):
        raise UserError(f"{r.src}:liger_kernel_config: expected a mapping of kernel names to true/false, got "
                        f"{clip(repr(cfg))}")
    ops = {"rope", "rms_norm", "glu", "flce"}
    for k, v in cfg.items():
        on = bool_value(v, f"{r.src}:liger_kernel_config.{k}")
        r.read.add(f"liger_kernel_config.{k}")
        if k == "cross_entropy" and on:
            raise UserError(f"{r.src}:liger_kernel_config.cross_entropy: Liger's cross-entropy on full logits is not "
                            "modelled; valid: fused_linear_cross_entropy (the default)")
        if k in LIGER_CONFIG:
            (ops.add if on else ops.discard)(LIGER_CONFIG[k])
        elif k != "cross_entropy":
            raise UserError(f"{r.src}:liger_kernel_config.{k}: not a Liger kernel memcalc models; valid: "
                            f"{', '.join([*LIGER_CONFIG, 'cross_entropy'])}")
    r.set("liger_ops", tuple(o for o in ("rope", "rms_norm", "glu", "flce") if o in ops), "liger_kernel_config", cfg)


def dtype_of(r: Reader) -> Any:
    """The model's load dtype (TRL ModelConfig ``torch_dtype``/``dtype``, or ``model_init_kwargs``), or None."""
    for k in ("torch_dtype", "dtype", "model_init_kwargs.torch_dtype", "model_init_kwargs.dtype"):
        if r.has(k):
            return (k, choice(r.get(k), TORCH_DTYPES, f"{r.src}:{k}"))
    return None


def precision(r: Reader, bf16_key: str, fp16_key: str, dtype: Any) -> None:
    """``bf16``/``fp16`` (Trainer: autocast) over the model's load dtype: 16-bit weights -> pure 16-bit
    (``bf16``/``fp16``: weights, gradients, state in that dtype, as the model was loaded); fp32 weights
    (``float32``, or no dtype with full fine-tuning) -> ``amp-bf16``/``amp-fp16``; none -> the default,
    with its reason."""
    src = r.src
    bf = r.get(bf16_key)
    fp = r.get(fp16_key)
    bf16 = bf is not None and (bf == "auto" or bool_value(bf, f"{src}:{bf16_key}"))
    fp16 = fp is not None and bool_value(fp, f"{src}:{fp16_key}")
    if bf == "auto":
        r.rec.note(f"{bf16_key}: auto means bf16 on GPUs that support it (Ampere and newer); the estimate is bf16")
    if bf16 and fp16:
        raise UserError(f"{src}: {bf16_key} and {fp16_key} are both set; choose one")
    key, dt = dtype if dtype else (None, None)
    if bf16 or fp16:
        half = "bf16" if bf16 else "fp16"
        flag = bf16_key if bf16 else fp16_key
        if dt == "fp32":
            r.set("precision", f"amp-{half}", f"{flag}+{key}", "float32")
        elif dt in ("bf16", "fp16"):
            r.set("precision", dt, key, r.get(key))  # the weights' dtype; autocast then computes in it too
            if dt != half:
                r.rec.note(f"{flag} autocast over {dt} weights: estimated as pure {dt}")
        else:
            r.set("precision", half, flag, True)
            if dt is None:
                r.rec.note(f"{flag}: true and no torch_dtype: the model is taken as loaded in {half} (transformers 5 "
                           f"loads a checkpoint's own dtype); give --precision amp-{half} for fp32 weights")
    elif dt in ("bf16", "fp16", "fp32"):
        r.set("precision", dt, key, r.get(key))


def checkpointing(r: Reader) -> None:
    """``activation_checkpointing`` (transformers 5.2x; ``gradient_checkpointing`` is its deprecated alias, read
    when the new name is absent: training_args.py ``__post_init__``) -> checkpoint full, or every-K with
    ``activation_checkpointing_kwargs.every_n_layers`` K, and its ``offload`` -> activation_offload."""
    src = r.src
    key = next((k for k in ("activation_checkpointing", "gradient_checkpointing") if r.has(k)), None)
    r.get("gradient_checkpointing")  # the alias a live TrainingArguments mirrors
    if key is None:
        return
    on = bool_value(r.get(key), f"{src}:{key}")
    kw = next((k for k in (f"{key}_kwargs", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
               if isinstance(r.raw.get(k), dict)), "") if on else ""

    def kwarg(name: str) -> Any:
        return r.get(f"{kw}.{name}") if kw else None

    every = 1 if kwarg("every_n_layers") is None else int_value(kwarg("every_n_layers"), f"{src}:{kw}.every_n_layers")
    r.set("checkpoint", "none" if not on else "full" if every == 1 else f"every-{every}", key, on)
    if kwarg("offload") is not None and bool_value(kwarg("offload"), f"{src}:{kw}.offload"):
        r.set("activation_offload", True, f"{kw}.offload")
    if kwarg("use_reentrant") is not None and bool_value(kwarg("use_reentrant"), f"{src}:{kw}.use_reentrant"):
        r.set("reentrant", True, f"{kw}.use_reentrant")
    for k in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        r.get(k)


def attention(r: Reader, key: str) -> None:
    """flash_attention_2 / sdpa: memcalc models SDPA's flash kernel (what FA2 saves: the output and its
    logsumexp); eager attention saves the full score matrices, modelled only for the families whose
    modeling file forces it."""
    v = r.get(key)
    if v is not None and not isinstance(v, str):  # transformers takes a name (or a Hub kernel repo id)
        raise UserError(f"{r.src}:{key}: expected an attention implementation name such as sdpa, "
                        f"flash_attention_2 or eager, got {clip(repr(v))}")
    if v is not None and v.strip() == "eager":
        r.rec.note(f"{key}: eager: the estimate uses SDPA's kernels (eager attention saves the (B, H, T, T) "
                   "scores and probabilities per layer: more memory than estimated)")


def packing(r: Reader, key: str) -> None:
    if r.has(key) and bool_value(r.get(key), f"{r.src}:{key}"):
        r.rec.note(f"{key}: sequences are packed to the maximum length, so the estimate at that length is the "
                   "step's memory (without packing it is the worst case)")


def _trl_peft(r: Reader) -> None:
    """TRL ``ModelConfig``'s PEFT keys (``use_peft`` turns them on; ``load_in_4bit`` is QLoRA)."""
    src = r.src
    use = r.has("use_peft") and bool_value(r.get("use_peft"), f"{src}:use_peft")
    q4 = r.has("load_in_4bit") and bool_value(r.get("load_in_4bit"), f"{src}:load_in_4bit")
    if r.has("load_in_8bit") and bool_value(r.get("load_in_8bit"), f"{src}:load_in_8bit"):
        raise UserError(f"{src}:load_in_8bit: an 8-bit (LLM.int8) base is not modelled; valid: load_in_4bit "
                        "(QLoRA, NF4) or a 16-bit base")
    lora_keys = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_dora")
    if not use and not q4:
        for k in lora_keys:
            if r.has(k):
                r.rec.note(f"{k} is set but use_peft is not: TRL trains the whole model; the LoRA keys are ignored")
        return
    if not use:
        if not isinstance(r.raw.get("peft_config"), dict):
            raise UserError(f"{src}:load_in_4bit without use_peft: a 4-bit base cannot be fully fine-tuned; "
                            "set use_peft: true")
        r.set("qlora", True, "load_in_4bit")  # the embedded peft_config is the adapter
        nf4_keys(r, "bnb_4bit_quant_type", "use_bnb_nested_quant")
        return
    r.set("lora", True, "use_peft")
    if r.get("lora_modules_to_save"):  # TRL ModelConfig.lora_modules_to_save -> LoraConfig(modules_to_save=...)
        v = r.get("lora_modules_to_save")
        r.set("modules_to_save", modules_to_save(v, f"{src}:lora_modules_to_save"), "lora_modules_to_save", v)
    if q4:
        r.set("qlora", True, "load_in_4bit")
        nf4_keys(r, "bnb_4bit_quant_type", "use_bnb_nested_quant")
    lora_settings(r, 16, 32.0, 0.05, "TRL ModelConfig")  # TRL ModelConfig's defaults
    if r.has("lora_target_modules"):
        t = r.get("lora_target_modules")
        r.set("lora_targets", peft_targets(t, f"{src}:lora_target_modules"), "lora_target_modules", t)
    if r.has("use_dora") and bool_value(r.get("use_dora"), f"{src}:use_dora"):
        r.set("dora", True, "use_dora")


def nf4_keys(r: Reader, type_key: str, nested_key: str, default: bool = False, whose: str = "TRL ModelConfig") -> None:
    """The NF4 keys; ``nested_key`` omitted means ``default``, what the library builds: TRL 1.16
    ``trl/trainer/model_config.py ModelConfig.use_bnb_nested_quant`` defaults to False and
    ``trl/trainer/utils.py get_quantization_config`` passes it as ``bnb_4bit_use_double_quant`` (transformers'
    ``BitsAndBytesConfig`` default is False too, ``utils/quantization_config.py``); False: fp32 absmax
    (LoraSpec.double_quant False, ``--no-double-quant``)."""
    src = r.src
    if r.has(type_key) and r.get(type_key) != "nf4":
        raise UserError(f"{src}:{type_key}: {clip(repr(r.get(type_key)))} is not modelled; valid: nf4")
    if r.has(nested_key):
        if not bool_value(r.get(nested_key), f"{src}:{nested_key}"):
            r.set("no_double_quant", True, nested_key, r.get(nested_key))
    elif not default:
        r.set("no_double_quant", True, f"{nested_key} ({whose} default False)", False)
        r.rec.note(f"{nested_key} is not set: {whose} quantizes without double quantization (its default False), "
                   "so the 4-bit base keeps its absmax constants in fp32")


def read_adapter(raw: dict[str, Any], rec: Recipe, src: str) -> None:
    """A PEFT ``adapter_config.json`` on its own (``--adapter-config`` or a second ``--recipe``)."""
    r = Reader(raw, rec, src, IGNORE + ("qalora_group_size", "lora_ga_config", "corda_config", "eva_config",
                                         "use_qalora", "arrow_config", "alora_invocation_tokens",
                                         "ensure_weight_tying"))
    for k in PEFT_READ:  # what peft() reads (or refuses): not "ignored"
        r.get(k)
    r.finish()
    peft(raw, rec, src, "")


#: the LoraConfig keys :func:`peft` reads or refuses
PEFT_READ = ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_dora", "modules_to_save",
             "rank_pattern", "alpha_pattern", "target_parameters", "trainable_token_indices", "layer_replication")


def peft(cfg: dict[str, Any], rec: Recipe, src: str, prefix: str) -> None:
    """PEFT LoraConfig keys -> LoRA options (PEFT defaults: r 8, lora_alpha 8, lora_dropout 0)."""
    where = f"{src}:{prefix}"
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise UserError(f"{where}peft_type: {clip(repr(cfg.get('peft_type')))} is not modelled; valid: LORA")

    def put(option: str, value: Any, key: str, raw: Any = None) -> None:
        rec.set(option, value, src, prefix + key, raw)

    put("lora", True, "peft_type", cfg.get("peft_type", "LORA"))
    put("lora_rank", int_value(cfg.get("r", 8), f"{where}r"), "r" if "r" in cfg else "r (PEFT default)")
    put("lora_alpha", float_value(cfg.get("lora_alpha", 8), f"{where}lora_alpha"),
        "lora_alpha" if "lora_alpha" in cfg else "lora_alpha (PEFT default)")
    d = float_value(cfg.get("lora_dropout") or 0, f"{where}lora_dropout")
    if d:
        put("lora_dropout", d, "lora_dropout")
    if cfg.get("target_modules") is not None:
        put("lora_targets", peft_targets(cfg["target_modules"], f"{where}target_modules"), "target_modules",
            cfg["target_modules"])
    if cfg.get("use_dora") is not None and bool_value(cfg["use_dora"], f"{where}use_dora"):
        put("dora", True, "use_dora")
    if cfg.get("modules_to_save"):
        put("modules_to_save", modules_to_save(cfg["modules_to_save"], f"{where}modules_to_save"), "modules_to_save",
            cfg["modules_to_save"])
    for k in ("rank_pattern", "alpha_pattern", "target_parameters", "trainable_token_indices",
              "layer_replication"):
        if cfg.get(k):
            raise UserError(f"{where}{k}: {clip(repr(cfg[k]))} is not modelled (memcalc adapts every target "
                            "alike, with nothing else trainable); remove it")


def modules_to_save(value: Any, where: str) -> str:
    """PEFT ``modules_to_save`` (a list of module names, or one name) as ``--modules-to-save`` text; names
    memcalc does not model are a one-line error listing the valid ones."""
    from memcalc.core.training_spec import MODULES_TO_SAVE, canonical_modules_to_save

    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise UserError(f"{where}: {clip(repr(value))} is not a list of module names")
    names = canonical_modules_to_save(items)
    bad = [n for n in names if n not in MODULES_TO_SAVE]
    if bad:
        raise UserError(f"{where}: {clip(', '.join(bad))} is not modelled; valid: {', '.join(MODULES_TO_SAVE)}")
    return ",".join(names)


def lora_settings(r: Reader, rank: int, alpha: float, dropout: Optional[float], whose: str) -> None:
    """``lora_r``, ``lora_alpha`` and ``lora_dropout`` (TRL's and axolotl's names), each with
    ``whose`` default when absent (``dropout`` None: no dropout set); a dropout of 0 sets none."""
    src = r.src
    if r.has("lora_r"):
        r.set("lora_rank", int_value(r.get("lora_r"), f"{src}:lora_r"), "lora_r")
    else:
        r.set("lora_rank", rank, f"lora_r ({whose} default)")
    if r.has("lora_alpha"):
        r.set("lora_alpha", float_value(r.get("lora_alpha"), f"{src}:lora_alpha"), "lora_alpha")
    else:
        r.set("lora_alpha", alpha, f"lora_alpha ({whose} default)")
    if r.has("lora_dropout"):
        d = float_value(r.get("lora_dropout"), f"{src}:lora_dropout")
        if d:
            r.set("lora_dropout", d, "lora_dropout")
    elif dropout is not None:
        r.set("lora_dropout", dropout, f"lora_dropout ({whose} default)")


#: What ``TrainingArguments.to_dict()`` always holds (transformers 5.24 defaults), for a partial mapping
LIVE_DEFAULTS = {"per_device_train_batch_size": HF_DEFAULT_BATCH, "gradient_accumulation_steps": 1,
                 "optim": HF_DEFAULT_OPTIM}
#: Sharding keys a live run has already applied: the callback estimates its own GPU without them
LIVE_NOT_READ = ("deepspeed", "fsdp", "fsdp_config")


def options_from_hf(args: Mapping[str, Any], model_dtype: Optional[str] = None,
                    peft: Optional[Mapping[str, Any]] = None,
                    load_in_4bit: bool = False,
                    double_quant: Optional[bool] = None) -> tuple[dict[str, Any], list[str]]:
    """memcalc options (:class:`memcalc.inputs.resolve.Options` fields) for a live Hugging Face run, read by
    :func:`read` (the ``--recipe`` reader), and one note per setting that is approximated or not modelled.

    ``args``: ``TrainingArguments.to_dict()`` (or TRL ``SFTConfig``'s); ``model_dtype``: the dtype of the
    model's weights (``"bfloat16"``, ``"float16"``, ``"float32"``), read as a recipe's ``torch_dtype``;
    ``peft``: the adapter's ``LoraConfig.to_dict()``, read as an embedded ``peft_config``; ``load_in_4bit``:
    a bitsandbytes 4-bit base (QLoRA), whose compute dtype is what ``bf16``/``fp16`` say; ``double_quant``: its
    quantization config's ``bnb_4bit_use_double_quant`` (None: not known, transformers 5.24
    ``utils/quantization_config.py BitsAndBytesConfig``'s default False, with a note).

    A live ``to_dict()`` lists every field: the false and unset ones are left out, as a file would leave
    them; ``deepspeed``/``fsdp`` are not read (one note: the estimate is for one GPU without sharding).

    >>> opts, notes = options_from_hf({"per_device_train_batch_size": 4, "bf16": True,
    ...                                "activation_checkpointing": True, "optim": "adamw_torch_fused"},
    ...                               model_dtype="float32")
    >>> opts == {"batch": 4, "grad_accum": 1, "precision": "amp-bf16", "checkpoint": "full",
    ...          "optimizer": "adamw", "optimizer_impl": "fused"}
    True
    """
    live = {k: getattr(v, "value", v) for k, v in args.items()}  # enums (optim, ...) as their names
    raw: dict[str, Any] = {**LIVE_DEFAULTS, **{k: v for k, v in live.items() if v is not None and v is not False}}
    notes = [f"{k} is not read; the estimate is for one GPU without sharding" for k in LIVE_NOT_READ[:2] if raw.get(k)]
    for k in LIVE_NOT_READ:
        raw.pop(k, None)
    if load_in_4bit:
        dtype = "float16" if raw.get("fp16") else "bfloat16" if raw.get("bf16") else None
        raw["load_in_4bit"] = True
        raw["use_bnb_nested_quant"] = bool(double_quant)  # read as TRL's key (its value becomes this one)
        if double_quant is None:
            notes.append("the model's quantization config does not give bnb_4bit_use_double_quant: transformers' "
                         "BitsAndBytesConfig default False (fp32 absmax)")
    else:
        dtype = (model_dtype or "float32").replace("torch.", "")
        dtype = dtype if dtype in TORCH_DTYPES else "float32"  # float64 and the like: as fp32
    if dtype:
        raw["torch_dtype"] = dtype
    if peft:
        raw["peft_config"] = {k: getattr(v, "value", v) for k, v in peft.items()}
    rec = Recipe(kind="hf")
    read(raw, rec, "TrainingArguments", strict=False)
    # the framework only where TRL's SFTConfig says trl (its fused head); plain TrainingArguments: the default hf
    opts = {k: v for k, v in rec.values.items() if k != "model" and (k != "framework" or v == "trl")}
    return opts, notes + rec.notes

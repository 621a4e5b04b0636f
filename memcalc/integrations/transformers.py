"""``MemcalcCallback`` for the Hugging Face ``Trainer``: memcalc's estimate beside the real run.

>>> from memcalc.integrations.transformers import MemcalcCallback        # doctest: +SKIP
>>> trainer = Trainer(model=model, args=args, train_dataset=ds,
...                   callbacks=[MemcalcCallback(output="run.json")])   # doctest: +SKIP
>>> trainer.train()                                                     # doctest: +SKIP
memcalc: predicted 30.571 GiB (peak in backward), measured 29.904 GiB (max_memory_allocated over 10 steps), gap +2.23%

At ``on_train_begin`` the callback reads the model's config (``model.config`` as its config.json, read by
memcalc's Hugging Face config reader), the ``TrainingArguments`` (:func:`options_from_hf`) and the
PEFT config of a ``PeftModel``, and estimates that setup; at every ``on_step_end`` it records
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` and resets the peak; at
``on_train_end`` it prints predicted vs measured and writes a record in ``memcalc validate``'s
format (``memcalc.validate.measure``). Without CUDA nothing is measured (one warning line) and the
record holds the estimate with ``measured_bytes`` null.

This module is torch-free: ``MemcalcCallback`` (a ``transformers.TrainerCallback``) is imported
from ``memcalc.validate.callback`` on first access.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

__all__ = ["MemcalcCallback", "options_from_hf"]

#: HF ``TrainingArguments.optim`` -> (memcalc optimizer, optimizer_impl); source: transformers 5.23
#: training_args.py OptimizerNames and trainer_optimizer.py (adamw_torch: torch.optim.AdamW with
#: foreach, CUDA's default; adamw_torch_fused: fused=True; sgd: torch.optim.SGD, momentum 0 unless
#: optim_args; adamw_bnb_8bit / adamw_8bit: bitsandbytes AdamW8bit; lion_32bit: bitsandbytes Lion)
HF_OPTIMIZERS: dict[str, tuple[str, Optional[str]]] = {
    "adamw_torch": ("adamw", "foreach"),
    "adamw_torch_fused": ("adamw", "fused"),
    "adafactor": ("adafactor", None),
    "sgd": ("sgd", None),
    "adamw_bnb_8bit": ("adamw-8bit", None),
    "adamw_8bit": ("adamw-8bit", None),
    "paged_adamw_8bit": ("adamw-8bit", None),
    "lion_32bit": ("lion", None),
    "paged_lion_32bit": ("lion", None),
    "paged_adamw_32bit": ("adamw", None),
}


def _targets(value: Any) -> Optional[str]:
    """PEFT ``target_modules`` (a list/set of module names, one name, or ``all-linear``) as ``--lora-targets``."""
    if value is None:
        return None
    if isinstance(value, str):
        return "all" if value == "all-linear" else value
    if isinstance(value, Iterable):
        return ",".join(sorted(str(v) for v in value))
    return str(value)


def options_from_hf(args: Mapping[str, Any], model_dtype: Optional[str] = None,
                    peft: Optional[Mapping[str, Any]] = None, load_in_4bit: bool = False) -> tuple[dict[str, Any], list[str]]:
    """memcalc options (:class:`memcalc.inputs.resolve.Options` fields) for a Hugging Face run, and
    one note per setting that is approximated or not modelled.

    ``args``: ``TrainingArguments.to_dict()`` (or TRL ``SFTConfig``'s); ``model_dtype``: the dtype of
    the model's weights (``"bfloat16"``, ``"float16"``, ``"float32"``); ``peft``: the adapter's
    ``LoraConfig.to_dict()``; ``load_in_4bit``: a bitsandbytes 4-bit base (QLoRA).

    - batch = ``per_device_train_batch_size``, grad_accum = ``gradient_accumulation_steps``, seq =
      TRL's ``max_length`` / ``max_seq_length`` when present;
    - precision: the weights' dtype, with ``bf16``/``fp16`` autocast over fp32 weights as
      ``amp-bf16``/``amp-fp16`` (autocast over 16-bit weights computes in those weights' dtype);
    - ``activation_checkpointing`` (alias ``gradient_checkpointing``) -> checkpoint full, or every-K
      with ``activation_checkpointing_kwargs={"every_n_layers": K}``, and its ``offload`` ->
      activation_offload (transformers 5.23 training_args.py); ``torch_compile`` -> compile;
    - ``optim`` -> :data:`HF_OPTIMIZERS`;
    - PEFT: r, lora_alpha, lora_dropout, target_modules, use_dora; ``load_in_4bit`` -> QLoRA.

    TODO(recipes): memcalc/inputs/recipes/hf_args.py (branch ``recipes``) reads the same
    TrainingArguments fields from a file for ``--recipe``; at merge, make this call that reader (or
    the reverse) so the two mappings cannot drift.

    >>> opts, notes = options_from_hf({"per_device_train_batch_size": 4, "bf16": True,
    ...                                "activation_checkpointing": True, "optim": "adamw_torch_fused"},
    ...                               model_dtype="float32")
    >>> opts == {"batch": 4, "grad_accum": 1, "precision": "amp-bf16", "checkpoint": "full",
    ...          "optimizer": "adamw", "optimizer_impl": "fused"}
    True
    """
    o: dict[str, Any] = {}
    notes: list[str] = []
    o["batch"] = int(args.get("per_device_train_batch_size") or 8)  # TrainingArguments' default: 8
    o["grad_accum"] = int(args.get("gradient_accumulation_steps") or 1)
    seq = args.get("max_length") or args.get("max_seq_length")
    if seq:
        o["seq"] = int(seq)
    bf16, fp16 = bool(args.get("bf16")), bool(args.get("fp16"))
    dt = (model_dtype or "float32").replace("torch.", "")
    if load_in_4bit:
        if fp16:
            o["precision"] = "fp16"
        elif bf16:
            o["precision"] = "bf16"
    elif dt in ("bfloat16", "float16"):
        o["precision"] = "bf16" if dt == "bfloat16" else "fp16"
        if (bf16 and dt == "float16") or (fp16 and dt == "bfloat16"):
            notes.append(f"{'bf16' if bf16 else 'fp16'} autocast over {dt} weights: estimated as pure {dt}")
    else:
        o["precision"] = "amp-bf16" if bf16 else "amp-fp16" if fp16 else "fp32"
    ckpt = args.get("activation_checkpointing")
    ckpt = args.get("gradient_checkpointing") if ckpt is None else ckpt  # the alias before transformers 5.2x
    kw = args.get("activation_checkpointing_kwargs") or args.get("gradient_checkpointing_kwargs") or {}
    kw = kw if isinstance(kw, Mapping) else {}
    if ckpt:
        every = kw.get("every_n_layers") or 1
        o["checkpoint"] = "full" if int(every) == 1 else f"every-{int(every)}"
        if kw.get("offload"):
            o["activation_offload"] = True
    if args.get("torch_compile"):
        o["compile"] = True
    optim = str(getattr(args.get("optim"), "value", args.get("optim")) or "adamw_torch")
    if optim in HF_OPTIMIZERS:
        o["optimizer"], impl = HF_OPTIMIZERS[optim]
        if impl is not None:
            o["optimizer_impl"] = impl
        if optim.startswith("paged_"):
            notes.append(f"optim {optim}: paged state estimated as on the GPU (its worst case)")
    else:
        notes.append(f"optim {optim} is not modelled; the estimate assumes adamw")
    for key in ("deepspeed", "fsdp"):
        if args.get(key):
            notes.append(f"{key} is not read; the estimate is for one GPU without sharding")
    if peft:
        ptype = str(getattr(peft.get("peft_type"), "value", peft.get("peft_type")) or "LORA")
        if ptype != "LORA":
            notes.append(f"PEFT {ptype} is not modelled; the estimate is for LoRA")
        o["lora"] = True
        if peft.get("r") is not None:
            o["lora_rank"] = int(peft["r"])
        if peft.get("lora_alpha") is not None:
            o["lora_alpha"] = float(peft["lora_alpha"])
        if peft.get("lora_dropout") is not None:
            o["lora_dropout"] = float(peft["lora_dropout"])
        targets = _targets(peft.get("target_modules"))
        if targets is not None:
            o["lora_targets"] = targets
        if peft.get("use_dora"):
            o["dora"] = True
    if load_in_4bit:
        o["qlora"] = True
    return o, notes


def __getattr__(name: str) -> Any:
    if name == "MemcalcCallback":
        try:
            from memcalc.validate.callback import MemcalcCallback
        except ImportError as e:
            from memcalc.core.errors import UserError

            raise UserError(f"MemcalcCallback needs torch and transformers ({e})") from None
        return MemcalcCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""axolotl YAML (``axolotl train FILE``) -> Options.

Keys follow axolotl's config schema (src/axolotl/utils/schemas/config.py ``AxolotlInputConfig``):
``base_model``, ``adapter`` (lora | qlora), ``lora_r``/``lora_alpha``/``lora_dropout``,
``lora_target_modules`` / ``lora_target_linear`` (every linear layer but the head), ``load_in_4bit``,
``sequence_len``, ``micro_batch_size``, ``gradient_accumulation_steps``, ``gradient_checkpointing``
(true, or "offload": activations offloaded), ``activation_offloading``, ``bf16``/``fp16`` (auto: bf16
where supported), ``optimizer`` (transformers' ``optim`` names), ``sample_packing``,
``flash_attention``, ``deepspeed``, ``fsdp``/``fsdp_config``/``fsdp_version``. axolotl trains with the
Hugging Face Trainer and PEFT: framework hf; it loads the model in bf16 when ``bf16`` is on
(axolotl/loaders/model.py sets ``torch_dtype`` from ``bf16``/``fp16``), so bf16 is pure bf16.
"""

from __future__ import annotations

from typing import Any

from memcalc.core.errors import UserError
from memcalc.inputs.recipes.common import (Reader, Recipe, bool_value, choice, int_value, model_for_hub_id,
                                           peft_targets, set_deepspeed, set_fsdp)
from memcalc.inputs.recipes.hf import nf4_keys, attention, lora_settings, modules_to_save, optimizer, packing

IGNORE = (
    "base_model_config", "model_type", "tokenizer_type", "tokenizer_config", "is_*_derived_model", "strict",
    "datasets", "test_datasets", "dataset_prepared_path", "val_set_size", "output_dir", "lora_model_dir",
    "eval_sample_packing", "pad_to_sequence_len", "wandb_*", "mlflow_*", "num_epochs", "lr_scheduler",
    "learning_rate", "tf32", "resume_from_checkpoint", "logging_steps", "loss_watchdog_*", "warmup_*",
    "evals_per_epoch", "saves_per_epoch", "weight_decay", "special_tokens", "tokens", "train_on_inputs",
    "group_by_length", "early_stopping_patience", "local_rank", "eval_*", "save_*", "debug", "hub_*",
    "xformers_attention", "lora_fan_in_fan_out", "chat_template", "max_grad_norm", "seed", "trust_remote_code",
    "dataloader_*", "auto_resume_from_checkpoints", "shuffle_merged_datasets", "lr_*", "cosine_*", "adam_*",
    "max_steps", "logging_*", "plugins", "default_system_message", "sdp_attention", "s2_attention",
    "gradient_checkpointing_kwargs.*", "use_tensorboard", "dataset_*", "micro_batch_size_eval",
)

ADAPTERS = {"lora": False, "qlora": True}


def read(raw: dict[str, Any], rec: Recipe, src: str) -> None:
    r = Reader(raw, rec, src, IGNORE)
    r.set("framework", "hf", "(axolotl: Hugging Face Trainer + PEFT)", "hf")
    if r.has("base_model"):
        mid = r.get("base_model")
        r.set("model", model_for_hub_id(str(mid), f"{src}:base_model", rec), "base_model", mid)
    if r.has("micro_batch_size"):
        r.set("batch", int_value(r.get("micro_batch_size"), f"{src}:micro_batch_size"), "micro_batch_size")
    if r.has("gradient_accumulation_steps"):
        r.set("grad_accum", int_value(r.get("gradient_accumulation_steps"), f"{src}:gradient_accumulation_steps"),
              "gradient_accumulation_steps")
    if r.has("sequence_len"):
        r.set("seq", int_value(r.get("sequence_len"), f"{src}:sequence_len"), "sequence_len")
    gc = r.get("gradient_checkpointing")
    if gc is not None:
        if isinstance(gc, str) and gc.strip().lower() in ("offload", "offload_disk"):
            if gc.strip().lower() == "offload_disk":
                raise UserError(f"{src}:gradient_checkpointing: offload_disk is not modelled; valid: true, false, offload")
            r.set("checkpoint", "full", "gradient_checkpointing", gc)
            r.set("activation_offload", True, "gradient_checkpointing", gc)
        else:
            on = bool_value(gc, f"{src}:gradient_checkpointing")
            r.set("checkpoint", "full" if on else "none", "gradient_checkpointing", on)
    if r.has("activation_offloading") and bool_value(r.get("activation_offloading"), f"{src}:activation_offloading"):
        r.set("activation_offload", True, "activation_offloading")
    packing(r, "sample_packing")
    _precision(r)
    optimizer(r, "optimizer")  # transformers' optim names; absent: TrainingArguments' default
    fa = r.get("flash_attention")
    if fa is not None:
        bool_value(fa, f"{src}:flash_attention")  # flash or SDPA: memcalc's flash kernel either way
    attention(r, "attn_implementation")
    if r.has("torch_compile") and bool_value(r.get("torch_compile"), f"{src}:torch_compile"):
        r.set("compile", True, "torch_compile")
    _liger(r)
    if r.has("cut_cross_entropy") and bool_value(r.get("cut_cross_entropy"), f"{src}:cut_cross_entropy"):
        if r.rec.values.get("kernels") == "liger":  # CutCrossEntropyPlugin and Liger's FLCE both own the loss
            raise UserError(f"{src}:cut_cross_entropy: with the Liger plugin too is not modelled; keep one")
        r.set("kernels", "cce", "cut_cross_entropy", True)  # integrations/cut_cross_entropy: cce_patch(model_type)
    for k in ("unsloth_lora_mlp", "unsloth_lora_qkv", "unsloth_lora_o", "lora_mlp_kernel",
              "lora_qkv_kernel",
              "lora_o_kernel"):
        if r.has(k) and bool_value(r.get(k), f"{src}:{k}"):
            raise UserError(f"{src}:{k}: custom fused kernels are not modelled; remove it")
    if r.has("deepspeed"):
        set_deepspeed(r, r.get("deepspeed"), "deepspeed", src)
    fsdp = r.get("fsdp")
    if fsdp not in (None, "", []):
        set_fsdp(r, fsdp, "fsdp", "fsdp_config")
    elif r.has("fsdp_version") or r.has("fsdp_config"):
        set_fsdp(r, "full_shard auto_wrap", "fsdp_config", "fsdp_config")  # axolotl >= 0.10: fsdp_config alone
    _lora(r)
    r.finish()


#: axolotl's Liger plugin keys (axolotl/integrations/liger/args.py LigerArgs) -> liger_ops; the plugin passes each
#: as the apply function's argument (plugin.py: apply_liger_kernel_to_<model_type>(rope=cfg.liger_rope, ...)),
#: so a kernel runs only where its key is true
AXOLOTL_LIGER = {"liger_rope": "rope", "liger_rms_norm": "rms_norm", "liger_glu_activation": "glu",
                 "liger_fused_linear_cross_entropy": "flce"}


def _liger(r: Reader) -> None:
    """axolotl's Liger plugin keys -> kernels liger with the kernels set true."""
    src = r.src
    on = [op for k, op in AXOLOTL_LIGER.items() if r.has(k) and bool_value(r.get(k), f"{src}:{k}")]
    if r.has("liger_cross_entropy") and bool_value(r.get("liger_cross_entropy"), f"{src}:liger_cross_entropy"):
        raise UserError(f"{src}:liger_cross_entropy: Liger's cross-entropy on full logits is not modelled; valid: "
                        "liger_fused_linear_cross_entropy")
    if r.has("liger_layer_norm") and bool_value(r.get("liger_layer_norm"), f"{src}:liger_layer_norm"):
        r.rec.note("liger_layer_norm: the families whose Liger kernels are modelled (Llama, Mistral, Qwen2, Gemma) "
                   "have no LayerNorm; it changes nothing")
    if on:
        r.set("kernels", "liger", "liger_*", True)
        r.set("liger_ops", tuple(on), ", ".join(k for k, op in AXOLOTL_LIGER.items() if op in on), True)


def _precision(r: Reader) -> None:
    src = r.src
    bf, fp = r.get("bf16"), r.get("fp16")
    bf16 = bf is not None and (bf == "auto" or bool_value(bf, f"{src}:bf16"))
    fp16 = fp is not None and bool_value(fp, f"{src}:fp16")
    if bf16 and fp16:
        raise UserError(f"{src}: bf16 and fp16 are both set; choose one")
    if bf == "auto":
        r.rec.note("bf16: auto means bf16 on GPUs that support it (Ampere and newer); the estimate is bf16")
    if bf16 or fp16:
        r.set("precision", "bf16" if bf16 else "fp16", "bf16" if bf16 else "fp16", bf if bf16 else fp)
    if r.has("float16") or r.has("bfloat16"):
        for k in ("float16", "bfloat16"):
            if r.has(k) and bool_value(r.get(k), f"{src}:{k}"):
                r.set("precision", "fp16" if k == "float16" else "bf16", k, True)


def _lora(r: Reader) -> None:
    src = r.src
    adapter = r.get("adapter")
    q4 = r.has("load_in_4bit") and bool_value(r.get("load_in_4bit"), f"{src}:load_in_4bit")
    if r.has("load_in_8bit") and bool_value(r.get("load_in_8bit"), f"{src}:load_in_8bit"):
        raise UserError(f"{src}:load_in_8bit: an 8-bit (LLM.int8) base is not modelled; valid: load_in_4bit with "
                        "adapter: qlora, or a 16-bit base")
    if adapter is None:
        if q4:
            raise UserError(f"{src}:load_in_4bit without adapter: a 4-bit base needs adapter: qlora")
        for k in ("lora_r", "lora_target_modules", "lora_target_linear"):
            if r.has(k):
                r.rec.note(f"{k} is set but adapter is not: axolotl trains the whole model; the LoRA keys are ignored")
        return
    qlora = choice(adapter, ADAPTERS, f"{src}:adapter")
    if qlora and not q4:
        raise UserError(f"{src}:adapter: qlora needs load_in_4bit: true (axolotl refuses it otherwise)")
    r.set("lora", True, "adapter", adapter)
    if qlora:
        r.set("qlora", True, "adapter", adapter)
        # axolotl src/axolotl/loaders/model.py ModelLoader._set_quantization_config: its BitsAndBytesConfig has
        # bnb_4bit_use_double_quant True unless bnb_config_kwargs overrides it (not transformers' default False)
        kw = "bnb_config_kwargs."
        nf4_keys(r, kw + "bnb_4bit_quant_type", kw + "bnb_4bit_use_double_quant", True, "axolotl")
    lora_settings(r, 8, 16.0, None, "axolotl")
    linear = r.has("lora_target_linear") and bool_value(r.get("lora_target_linear"), f"{src}:lora_target_linear")
    mods = r.get("lora_target_modules")
    if linear:  # every linear layer but the head (PEFT all-linear); lora_target_modules adds nothing to it
        r.set("lora_targets", "all", "lora_target_linear", True)
    elif mods is not None:
        r.set("lora_targets", peft_targets(mods, f"{src}:lora_target_modules"), "lora_target_modules", mods)
    if r.has("peft_use_dora") and bool_value(r.get("peft_use_dora"), f"{src}:peft_use_dora"):
        r.set("dora", True, "peft_use_dora")
    if r.get("lora_modules_to_save"):  # axolotl passes it to LoraConfig(modules_to_save=...)
        v = r.get("lora_modules_to_save")
        r.set("modules_to_save", modules_to_save(v, f"{src}:lora_modules_to_save"), "lora_modules_to_save", v)

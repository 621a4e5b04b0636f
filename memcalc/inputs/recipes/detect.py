"""Which kind of recipe a parsed file is, from the keys only each kind has."""

from __future__ import annotations

from typing import Any

from memcalc.core.errors import UserError

KINDS = ("torchtune", "hf", "axolotl", "litgpt", "peft")
DESCRIBE = {
    "torchtune": "torchtune recipe YAML",
    "hf": "Hugging Face TrainingArguments / TRL SFTConfig",
    "axolotl": "axolotl YAML",
    "litgpt": "LitGPT config YAML",
    "peft": "PEFT adapter_config.json / LoraConfig",
}

_HF_KEYS = {"per_device_train_batch_size", "model_name_or_path", "optim", "gradient_checkpointing_kwargs",
            "max_seq_length", "max_length", "use_peft", "lr_scheduler_type", "num_train_epochs", "logging_steps",
            "per_device_eval_batch_size", "evaluation_strategy", "eval_strategy", "save_strategy", "output_dir",
            "gradient_accumulation_steps", "gradient_checkpointing", "bf16", "fp16", "deepspeed", "fsdp",
            "peft_config"}
_AXOLOTL_KEYS = {"base_model", "micro_batch_size", "sequence_len", "sample_packing", "lora_target_linear",
                 "num_epochs", "adapter", "datasets", "dataset_prepared_path"}
_LITGPT_KEYS = {"checkpoint_dir", "out_dir", "model_name", "lora_query", "lora_value", "lora_projection", "lora_head"}


def _has_torchtune_component(raw: Any) -> bool:
    if isinstance(raw, dict):
        c = raw.get("_component_")
        if isinstance(c, str) and c.startswith("torchtune."):
            return True
        return any(_has_torchtune_component(v) for v in raw.values())
    if isinstance(raw, list):
        return any(_has_torchtune_component(v) for v in raw)
    return False


def detect(raw: Any, where: str) -> str:
    """One of KINDS, or a one-line error saying what memcalc reads."""
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"{where}: a recipe is a YAML/JSON mapping of settings; this is "
                        f"{'empty' if not raw else type(raw).__name__}")
    keys = set(raw)
    if _has_torchtune_component(raw):
        return "torchtune"
    if "peft_type" in keys or ({"r", "target_modules"} <= keys):
        return "peft"
    if "zero_optimization" in keys or "train_micro_batch_size_per_gpu" in keys:
        raise UserError(f"{where} is a DeepSpeed config, not a training recipe: name it in the recipe "
                        "(deepspeed: FILE) or pass it with the DeepSpeed flags")
    if keys & _LITGPT_KEYS or (isinstance(raw.get("train"), dict) and "micro_batch_size" in raw["train"]):
        return "litgpt"
    if keys & _AXOLOTL_KEYS:
        return "axolotl"
    if keys & _HF_KEYS:
        return "hf"
    raise UserError(f"cannot tell what kind of recipe {where} is (none of the keys a torchtune, TRL/Hugging Face, "
                    f"axolotl, LitGPT or PEFT file has); memcalc reads: {', '.join(DESCRIBE.values())}")

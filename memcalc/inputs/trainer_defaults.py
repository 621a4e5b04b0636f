"""The defaults a trainer runs with that memcalc's own would get wrong: activation checkpointing; and
the precision policy ``estimate`` and ``plan`` share (:func:`default_precision`).

Without ``--checkpoint`` (nor a config's, nor a recipe's), memcalc checkpoints nothing, as Hugging
Face Trainer does (``TrainingArguments.gradient_checkpointing`` is False). Three trainers turn it on
themselves; the estimate follows them and says so (a note, and the reason in ``--verbose`` and
``--json``), each rule with its source:

- Hugging Face QLoRA under PEFT's k-bit preparation (the profile's ``qlora_fp32_cast``):
  ``prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)`` (peft 0.21.2
  ``utils/other.py``) calls ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={})``;
  with no ``use_reentrant`` in them transformers 5's ``_activation_checkpointing_enable`` passes none
  to ``torch.utils.checkpoint``, which then takes ``use_reentrant=True`` (torch 2.13
  ``utils/checkpoint.py``, with its warning): every layer, reentrant (``checkpoint_reentrant``).
- TRL: ``SFTConfig.gradient_checkpointing`` defaults to True (trl 1.16.0 ``trainer/sft_config.py``,
  "Defaults to True instead of False"); Trainer enables it with
  ``gradient_checkpointing_kwargs=None``, which ``_activation_checkpointing_enable`` makes
  ``{"use_reentrant": False}``: every layer, non-reentrant.
- Unsloth LoRA: ``FastLanguageModel.get_peft_model(use_gradient_checkpointing="unsloth")`` is the
  default (unsloth 2026.10.9 ``models/llama.py``): Unsloth's own checkpointing
  (:mod:`memcalc.engine.unsloth_checkpoint`).

Left as memcalc's own: batch 1 and sequence 2048 (the trainers' 8 x up to ``max_length`` depend on
the data), the optimizer's implementation (TRL's ``adamw_torch_fused``: plan's rows would part from
the estimate), torchtune and LitGPT (their recipe files say what they run: ``--recipe``).
"""

from __future__ import annotations

from dataclasses import replace
from collections.abc import Sequence
from typing import Any, Optional

from memcalc.core.spec import KernelProfile

#: trainer -> (reentrant, why): the trainers that checkpoint every layer unless told not to
TRAINER_CHECKPOINTING: dict[str, tuple[bool, str]] = {
    "hf-qlora": (True, "PEFT's prepare_model_for_kbit_training runs with use_gradient_checkpointing=True by default "
                       "and passes no use_reentrant, so torch.utils.checkpoint takes True (peft 0.21 utils/other.py, "
                       "torch 2.13 utils/checkpoint.py)"),
    "trl": (False, "TRL's SFTConfig.gradient_checkpointing defaults to True and Trainer enables it non-reentrant "
                   "(trl 1.16 sft_config.py; transformers 5 _activation_checkpointing_enable)"),
    "unsloth": (False, "Unsloth's get_peft_model defaults to use_gradient_checkpointing=\"unsloth\" (unsloth 2026.10 "
                       "models/llama.py)"),
}


def trainer_of(profile: KernelProfile, lora: Any) -> str | None:
    """The :data:`TRAINER_CHECKPOINTING` key that applies to a setup (``lora``: its adapter fields, or None)."""
    if profile.framework == "hf" and lora is not None and lora.get("qlora") and profile.qlora_fp32_cast:
        return "hf-qlora"
    if profile.framework == "trl":
        return "trl"
    if profile.framework == "unsloth" and lora is not None:
        return "unsloth"
    return None


def trainer_checkpointing(profile: KernelProfile, values: dict[str, Any], origin: dict[str, str],
                          reasons: dict[str, str], notes: list[str]) -> None:
    """Where no ``checkpoint`` is among the training ``values`` being assembled, the trainer's own
    (:data:`TRAINER_CHECKPOINTING`), its ``origin`` "default", its reason and a note."""
    key = None if "checkpoint" in values else trainer_of(profile, values.get("lora"))
    if key is None:
        return
    reentrant, why = TRAINER_CHECKPOINTING[key]
    values["checkpoint"], origin["checkpoint"], reasons["checkpoint"] = "full", "default", why
    if reentrant and "checkpoint_reentrant" not in values:
        values["checkpoint_reentrant"], origin["checkpoint_reentrant"] = True, "default"
        reasons["checkpoint_reentrant"] = why
    notes.append(f"checkpointing every layer{', reentrant,' if reentrant else ''} by default: {why}; "
                 "--checkpoint none to run without")


#: why QLoRA under FSDP1 runs without PEFT's k-bit fp32 cast (the note and the reason)
FSDP1_QLORA_NO_CAST = (
    "QLoRA under FSDP1 runs without PEFT's prepare_model_for_kbit_training: its fp32 norms beside the bf16-storage "
    "4-bit weights of one decoder layer make a flat parameter FSDP1 refuses ('Must flatten tensors with uniform "
    "dtype', torch 2.13 distributed/fsdp/_flat_param.py _validate_tensors_to_flatten), so the trainers skip it "
    "(TRL prepare_peft_model is_sharded_qlora; axolotl _prepare_model_for_quantization 'make sure everything is "
    "in the same dtype'): the norms, embedding and head stay bf16, and it turns no checkpointing on")


def fsdp1_qlora_profile(profile: KernelProfile, values: dict[str, Any], reasons: dict[str, str],
                        notes: list[str]) -> KernelProfile:
    """The profile a QLoRA step under FSDP1 runs with (``values``: the training fields being assembled):
    without the k-bit fp32 cast (:data:`FSDP1_QLORA_NO_CAST`); any other setup's profile as it is. The
    validator builds the same base (validate/sharded/hf_fsdp1_qlora.py)."""
    lora = values.get("lora")
    fsdp1 = (values.get("sharding") == "fsdp1" and (values.get("zero") or 0) >= 2 and (values.get("gpus") or 1) > 1)
    if not (profile.qlora_fp32_cast and fsdp1 and lora is not None and lora.get("qlora")):
        return profile
    reasons["qlora_fp32_cast"] = FSDP1_QLORA_NO_CAST
    notes.append(FSDP1_QLORA_NO_CAST)
    return profile.model_copy(update={"qlora_fp32_cast": False})


#: adapters ("none" | "lora" | "qlora") -> (--precision, why): what estimate assumes without --precision
#: (Hugging Face Trainer on one GPU) and what plan's LoRA / QLoRA setups run (memcalc/plan/cluster.py)
DEFAULT_PRECISION: dict[str, tuple[str, str]] = {
    "none": ("fp32", "full fine-tuning: what Hugging Face Trainer runs without --bf16/--fp16 (fp32 weights)"),
    "lora": ("bf16", "LoRA: a bf16 base (the model loaded in bfloat16)"),
    "qlora": ("bf16", "QLoRA: a bf16 base (QLoRA computes in bf16, bnb_4bit_compute_dtype=bfloat16)"),
}
#: the one departure, plan's multi-GPU full fine-tune: FSDP2 as torchtitan runs it (MixedPrecisionPolicy
#: param_dtype bf16, reduce_dtype fp32, over fp32 shards: --precision bf16 --master-weights), not Trainer's
#: fp32; its printed estimate command states both flags (memcalc/plan/rows.py cluster_command)
SHARDED_FULL_PRECISION = ("bf16", True)


def default_precision(adapters: str) -> tuple[str, str]:
    """--precision's default for a kind of run (``adapters``: none, lora, qlora) and its reason."""
    return DEFAULT_PRECISION[adapters]


#: the 16-bit type a card without bf16 runs in its place (data/gpus.yaml ``bf16: false``: T4, V100): fp16, as
#: Hugging Face's notebooks for them load the model (torch_dtype=torch.float16) and train (fp16=True)
NO_BF16 = {"bf16": "fp16", "amp-bf16": "amp-fp16"}


def half_on(card: Any, precision: str) -> Optional[str]:
    """The precision ``card`` runs a ``precision`` step in when that is not ``precision`` itself: fp16 for
    bf16 (amp-fp16 for amp-bf16) on a card without bf16 (:data:`NO_BF16`); None where it runs as given. The
    one rule for such cards: :func:`half_for_cards` (``--gpu``) and the catalog's verdict
    (:func:`memcalc.render.report.fits_rows`: its ``runs_as``) judge them by the fp16 run, the same bytes."""
    return NO_BF16[precision] if getattr(card, "bf16", True) is False and precision in NO_BF16 else None


def half_for_cards(res: Any, cards: Sequence[Any], asked: bool) -> Any:
    """``res`` (:class:`memcalc.inputs.resolve.Resolved`) for the ``cards`` asked (``asked``: ``--gpu`` given)
    when none of them has bf16: a bf16 precision that is memcalc's default becomes fp16 (the same bytes: both
    2-byte types; its reason says so); one the user gave stays, with a note. Anything else: ``res`` as it is."""
    tr = res.exp.training
    no = [getattr(c, "display_name", c.name) for c in cards if half_on(c, tr.precision) is not None]
    if not asked or not cards or len(no) < len(cards):
        return res
    names = ", ".join(no)
    if res.origin.get("precision") != "default":
        return replace(res, notes=[*res.notes, f"{names} has no bf16: --precision {tr.precision} as given; "
                                               f"{NO_BF16[tr.precision]} is what runs there (the same bytes)"])
    exp = res.exp.model_copy(update={"training": tr.model_copy(update={"precision": NO_BF16[tr.precision]})})
    why = f"{res.reasons.get('precision', 'default')}; {names} has no bf16: fp16, the same bytes"
    return replace(res, exp=exp, reasons={**res.reasons, "precision": why})

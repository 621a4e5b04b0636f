"""TRL ``SFTConfig`` keys on top of the Hugging Face reader (:mod:`memcalc.inputs.recipes.hf`): a file with
any of :data:`TRL_KEYS` is an SFTTrainer run, which selects ``--framework trl`` (TRL's fused LM head,
:data:`memcalc.inputs.profiles.FRAMEWORKS` ``"trl"``).

Read (trl 1.16.0 trl/trainer/sft_config.py, base_config.py):

- ``loss_type``: ``"nll"`` (the default) and ``"chunked_nll"`` (its deprecated alias) are the fused head;
  ``"dft"`` adds ``per_token_loss * log_probs.exp().detach()`` (one more (B, T-1) fp32 tensor saved):
  not modelled, an error;
- ``completion_only_loss`` / ``assistant_only_loss``: they decide which labels are -100, so how many tokens
  reach the head, which the file cannot say (it is the data's completion share): a note naming
  ``--loss-tokens``;
- ``activation_offloading`` -> ``activation_offload`` (trl/models/activation_offloading.py, torchtune's
  OffloadActivations; the head's saved tensors are offloaded too, see profiles.py);
- the SFTConfig defaults that differ from TrainingArguments' (sft_config.py's note): ``gradient_checkpointing``
  true and ``bf16`` true unless ``fp16`` (base_config.py ``__post_init__``), ``max_length`` 1024.
"""

from __future__ import annotations

from memcalc.core.errors import UserError
from memcalc.inputs.recipes.common import Reader, bool_value

#: keys only a TRL SFTConfig has (TrainingArguments has none of them)
TRL_KEYS = frozenset({"max_length", "max_seq_length", "packing", "completion_only_loss", "assistant_only_loss",
                      "loss_type", "activation_offloading", "dataset_text_field", "padding_free", "use_peft"})
#: SFTConfig.max_length's default
TRL_DEFAULT_MAX_LENGTH = 1024
LOSS_TYPES = ("nll", "chunked_nll")


def is_trl(raw: dict) -> bool:
    """The file is a TRL SFTConfig (one of :data:`TRL_KEYS`)."""
    return bool(TRL_KEYS & set(raw))


def defaults(r: Reader, strict: bool) -> None:
    """SFTConfig's own defaults, before the HF reader reads the keys (a file: ``strict``; the live
    arguments of the Trainer callback hold every value already)."""
    if not strict:
        return
    if not (r.has("bf16") or r.has("fp16")):
        r.raw = {**r.raw, "bf16": True}
        r.rec.note("bf16: not set, SFTConfig's default (true unless fp16, trl base_config.py)")
    if not (r.has("gradient_checkpointing") or r.has("activation_checkpointing")):
        r.set("checkpoint", "full", "gradient_checkpointing (SFTConfig default: true)")


def read(r: Reader, strict: bool) -> None:
    """The TRL keys of the module docstring; after the HF reader's."""
    src = r.src
    r.set("framework", "trl", "(TRL SFTConfig)", "trl")
    if strict and not (r.has("max_length") or r.has("max_seq_length")):
        r.set("seq", TRL_DEFAULT_MAX_LENGTH, "max_length (SFTConfig default)")
    if r.has("loss_type"):
        lt = r.get("loss_type")
        if lt not in LOSS_TYPES:
            why = (f"{src}:loss_type {lt!r} is not modelled (dft keeps one more (batch, seq) fp32 tensor); "
                   f"memcalc models {', '.join(LOSS_TYPES)}")
            if strict:
                raise UserError(why)
            r.rec.note(why)
        r.set("loss", "trl-fused", "loss_type", lt)
    for k in ("completion_only_loss", "assistant_only_loss"):
        if r.has(k) and r.get(k) is not None and bool_value(r.get(k), f"{src}:{k}"):
            r.rec.note(f"{k}: only the completion's tokens reach TRL's fused head; their share is the data's: "
                       "give it with --loss-tokens (default 1: every token)")
    if r.has("activation_offloading") and bool_value(r.get("activation_offloading"), f"{src}:activation_offloading"):
        r.set("activation_offload", True, "activation_offloading")

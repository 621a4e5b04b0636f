"""The command line's compound values: ``--checkpoint every-K``, ``--lora-targets``, ``--modules-to-save``
(each a bad value is one line naming the valid ones)."""

from __future__ import annotations

import re
from typing import Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import (HEAD_TARGET, LORA_TARGET_ALIASES, LORA_TARGETS, ModelSpec, canonical_targets,
                               lora_targets_error)
from memcalc.inputs.data_files import clip

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
    raise UserError(f"unknown --checkpoint {clip(value)!r}; valid: none, full, every-K (e.g. every-2), sqrt, "
                    "selective, selective-op")


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
    # only q, k, v of a fused qkv: ExperimentSpec._check_lora_targets decides (LitGPT's LoRAQKVLinear adapts them)
    if missing and model is not None and not (model.fused_qkv and set(missing) <= {"q", "k", "v"}):
        raise UserError(f"--lora-targets: {lora_targets_error(model, missing)}")
    return ts



def parse_modules_to_save(text: str) -> tuple[str, ...]:
    """``--modules-to-save embed_tokens,lm_head`` (PEFT's names or their aliases) as LoraSpec wants them."""
    from memcalc.core.training_spec import MODULES_TO_SAVE, canonical_modules_to_save

    names = canonical_modules_to_save(t for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in MODULES_TO_SAVE]
    if bad or not names:
        raise UserError(f"--modules-to-save: unknown module {', '.join(bad) or repr(text)}; valid: "
                        f"{', '.join(MODULES_TO_SAVE)}")
    return names

"""``--recipe FILE``: a training setup file (torchtune, Hugging Face / TRL, axolotl, LitGPT, PEFT adapter
config) read into the same :class:`memcalc.inputs.resolve.Options` the flags fill.

:func:`load_recipe` detects each file's kind (:mod:`.detect`) and runs its reader (one module per kind);
:func:`apply_recipe` puts the recipe's values under the flags: a flag the user gave wins, the recipe fills
the rest, and the inputs table shows each recipe value's origin as ``recipe FILE:KEY``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

from memcalc.core.errors import UserError
from memcalc.inputs.data_files import clip, parse_text, path_kind, read_user_file
from memcalc.inputs.recipes.common import Recipe
from memcalc.inputs.recipes.detect import DESCRIBE, detect

__all__ = ["Recipe", "load_recipe", "apply_recipe", "ORIGIN_KEYS"]

#: Options field -> the origin keys of resolve's inputs table it sets
ORIGIN_KEYS = {
    "model": ("model",), "batch": ("batch",), "seq": ("seq",), "grad_accum": ("grad_accum",),
    "precision": ("precision",), "optimizer": ("optimizer",), "optimizer_impl": ("optimizer_impl",),
    "checkpoint": ("checkpoint", "checkpoint_every"), "fused_optimizer": ("fused_optimizer",),
    "compile": ("compile",), "lora": ("lora",), "lora_rank": ("lora",), "lora_alpha": ("lora",),
    "lora_targets": ("lora",), "lora_dropout": ("lora",), "qlora": ("lora",), "dora": ("lora",),
    "modules_to_save": ("lora",), "no_double_quant": ("lora",),
    "framework": ("framework", "profile"), "loss": ("cross_entropy",), "loss_chunks": ("loss_chunks",),
    "loss_tokens": ("loss_tokens",),
    "zero": ("zero",), "gpus": ("gpus",), "sharding": ("sharding",), "activation_offload": ("activation_offload",),
    "deepspeed": ("deepspeed",), "kernels": ("kernels",), "liger_ops": ("liger_ops",),
}
#: Options fields that stand for one choice: the user giving any of them keeps the recipe's out of all
GROUPS = ({"model", "params", "config"}, {"precision", "bf16"}, {"profile", "framework"})


def _read(path: str, flag: str = "--recipe") -> tuple[str, dict]:
    if not path.strip():  # (Path("") is the current folder)
        raise UserError(f"{flag} {path!r}: an empty path; give a file path")
    p = Path(path).expanduser()
    kind = path_kind(p)
    if kind in ("dir", "none"):
        raise UserError(f"{flag} {clip(path, 200)}: {'a directory' if kind == 'dir' else 'no such file'}")
    raw = parse_text(read_user_file(p, flag), str(p))  # a FIFO or a device: refused unread
    return detect(raw, p.name), raw


def load_recipe(paths: Sequence[str], adapter_config: Optional[str] = None) -> Recipe:
    """Read the recipe files (one training recipe, optionally a PEFT adapter config as a second file or
    ``adapter_config``) into one :class:`Recipe`."""
    from memcalc.inputs.recipes import axolotl, hf, litgpt, torchtune

    readers = {"torchtune": torchtune.read, "hf": hf.read, "axolotl": axolotl.read, "litgpt": litgpt.read}
    files = list(paths) + ([adapter_config] if adapter_config is not None else [])  # "" is refused, not ignored
    parsed = [(f, *_read(f, "--adapter-config" if i == len(paths) else "--recipe")) for i, f in enumerate(files)]
    if adapter_config is not None and parsed[-1][1] != "peft":
        raise UserError(f"--adapter-config {clip(adapter_config, 200)}: not a PEFT adapter config "
                        f"(it looks like a {DESCRIBE[parsed[-1][1]]})")
    mains = [(f, k, raw) for f, k, raw in parsed if k != "peft"]
    peft = [(f, k, raw) for f, k, raw in parsed if k == "peft"]
    if len(mains) > 1:
        raise UserError(f"give one training recipe (and optionally a PEFT adapter config); these are all recipes: "
                        f"{', '.join(Path(f).name for f, _, _ in mains)}")
    if len(peft) > 1:
        raise UserError("give at most one PEFT adapter config")
    rec = Recipe(kind="+".join([k for _, k, _ in mains] + ["peft"] * len(peft)), files=[str(f) for f in files])
    for f, k, raw in mains:
        readers[k](raw, rec, Path(f).name)
    for f, _, raw in peft:
        if mains and mains[0][1] not in ("hf", "axolotl"):
            raise UserError(f"{Path(f).name}: a PEFT adapter config goes with a Hugging Face / TRL or axolotl "
                            f"recipe (the {mains[0][1]} recipe sets its own LoRA)")
        hf.read_adapter(raw, rec, Path(f).name)
        if not mains and "framework" not in rec.values:  # PEFT runs on transformers: framework hf
            rec.set("framework", "hf", Path(f).name, "peft_type", raw.get("peft_type"))
    return rec


def apply_recipe(o):  # o: memcalc.inputs.resolve.Options
    """``o`` with the recipe's values in every field the user left unset, and the recipe.
    Returns ``(options, recipe, fields_from_recipe)``."""
    rec = load_recipe(o.recipe or [], o.adapter_config)
    defaults = {f.name: f.default for f in dataclasses.fields(o)}
    given = {k for k in defaults if getattr(o, k) != defaults[k] and k not in ("recipe", "adapter_config")}
    for g in GROUPS:
        if given & g:
            given |= g
    changes = {k: v for k, v in rec.values.items() if k not in given and k in defaults}
    unknown = set(rec.values) - set(defaults)
    assert not unknown, f"recipe readers set options Options does not have: {unknown}"
    return dataclasses.replace(o, **changes), rec, set(changes)

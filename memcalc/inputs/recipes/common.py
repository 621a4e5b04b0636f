"""What every recipe reader shares: the mapping being built, key bookkeeping, names -> memcalc names.

A reader walks one parsed recipe file and fills a :class:`Recipe`: each memory-relevant key it
reads becomes a value of an :class:`memcalc.inputs.resolve.Options` field (the dataclass the flags
fill), remembered with the ``file:key`` it came from; keys that cannot change the memory of a
training step are matched against the reader's ignore patterns and listed by name in one line;
keys neither read nor ignored are listed as *not read* (a stated note, never silent); a value
memcalc cannot model is a :class:`~memcalc.core.errors.UserError` naming the valid ones.
"""

from __future__ import annotations

import math

import fnmatch
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from memcalc.core.errors import UserError
from memcalc.core.optimizers import AliasKind, alias_table
from memcalc.inputs.data_files import clip

#: LoRA target names as PEFT / Hugging Face modules call them, beyond memcalc.core.spec.LORA_TARGET_ALIASES:
#: the output head (PEFT ``lm_head``; memcalc's ``head`` target comes with the techniques branch).
HEAD_TARGET = "head"
EXTRA_TARGET_ALIASES = {"lm_head": HEAD_TARGET, "output": HEAD_TARGET}

def bool_value(value: Any, where: str) -> bool:
    """A YAML/JSON boolean (true/false, or the strings "true"/"false"); anything else is an error."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise UserError(f"{where}: expected true or false, got {clip(repr(value))}")


def int_value(value: Any, where: str) -> int:
    """A positive integer (a YAML int, or a string of digits); anything else is an error."""
    # isdecimal, not isdigit: "²" is a digit int() refuses
    digits = isinstance(value, str) and value.strip().isdecimal()
    if isinstance(value, bool) or not (isinstance(value, int) or digits):
        raise UserError(f"{where}: expected a positive integer, got {clip(repr(value))}")
    if isinstance(value, str) and len(value.strip()) > len(str(MAX_RECIPE_INT)):
        raise UserError(f"{where}: {clip(value.strip())} is out of range; at most {MAX_RECIPE_INT:,}")
    v = int(value)
    if v <= 0:
        raise UserError(f"{where}: expected a positive integer, got {v}")
    if v > MAX_RECIPE_INT:
        raise UserError(f"{where}: {clip(str(v))} is out of range; at most {MAX_RECIPE_INT:,}")
    return v


#: the largest integer a recipe key takes (2**31 - 1: above any batch, sequence, rank or step count)
MAX_RECIPE_INT = 2**31 - 1


def float_value(value: Any, where: str) -> float:
    """A number (int, float or a numeric string)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        v = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int of 400 digits
        raise UserError(f"{where}: expected a number, got {clip(repr(value))}") from None
    if not math.isfinite(v):
        raise UserError(f"{where}: expected a finite number, got {clip(repr(value))}")
    return v


def choice(value: Any, table: dict[str, Any], where: str) -> Any:
    """``table[value]``; an unknown value is an error listing the valid ones."""
    key = value.strip() if isinstance(value, str) else value
    if isinstance(key, (str, int, float)) and key in table:  # a list or dict is not a name (and not hashable)
        return table[key]
    raise UserError(f"{where}: unknown value {clip(repr(value))}; valid: {', '.join(map(str, table))}")


def flatten(raw: Any, prefix: str = "") -> list[str]:
    """Dotted leaf keys of nested mappings (a list is a leaf; an empty mapping is its own leaf)."""
    if not isinstance(raw, dict) or (prefix and not raw):
        return [prefix] if prefix else []
    out: list[str] = []
    for k, v in raw.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.extend(flatten(v, key))
    return out


@dataclass
class Recipe:
    """The Options a recipe sets, where each came from, and what it left out."""

    kind: str
    files: list[str] = field(default_factory=list)
    #: Options field -> value
    values: dict[str, Any] = field(default_factory=dict)
    #: Options field -> "file:key"
    keys: dict[str, str] = field(default_factory=dict)
    #: one row per recipe key read: key, its value, the option it set and the value given to it
    mapping: list[dict[str, Any]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def set(self, option: str, value: Any, src: str, key: str, raw: Any = None) -> None:
        """Option ``option`` = ``value``, read from ``src:key`` (its raw value ``raw``)."""
        self.values[option] = value
        self.keys[option] = f"{src}:{key}"
        self.mapping.append({"key": f"{src}:{key}", "value": raw if raw is not None else value,
                             "option": option, "to": value})

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def lines(self) -> list[str]:
        """The notes the estimate prints: the ignored keys in one line, the keys not read, the rest."""
        out = []
        name = ", ".join(Path(f).name for f in self.files)
        if self.ignored:
            out.append(f"recipe {name} ({self.kind}): ignored (no effect on the memory of a training step): "
                       + ", ".join(self.ignored))
        if self.unread:
            out.append(f"recipe {name}: not read (unknown to memcalc; check that they do not change memory): "
                       + ", ".join(self.unread))
        out.extend(f"recipe: {n}" for n in self.notes)
        return out

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "files": list(self.files), "mapping": self.mapping, "ignored": self.ignored,
                "unread": self.unread, "notes": self.notes}


class Reader:
    """One recipe file being read: ``get`` marks a dotted key (and everything under it) as read;
    ``finish`` sorts the remaining leaves into ignored (matching the reader's patterns) and not read."""

    def __init__(self, raw: dict[str, Any], rec: Recipe, src: str, ignore: Iterable[str]):
        self.raw, self.rec, self.src = raw, rec, src
        self.read: set[str] = set()
        self.ignore = tuple(ignore)

    def get(self, dotted: str, default: Any = None) -> Any:
        """The value at ``a.b.c`` (None-valued keys count as absent), marked as read."""
        cur: Any = self.raw
        for part in dotted.split("."):
            if not isinstance(cur, dict) or part not in cur:
                return default
            cur = cur[part]
        self.read.add(dotted)
        return default if cur is None else cur

    def has(self, dotted: str) -> bool:
        return self.get(dotted) is not None

    def set(self, option: str, value: Any, key: str, raw: Any = None) -> None:
        self.rec.set(option, value, self.src, key, raw)

    def finish(self) -> None:
        ign: list[str] = []
        unread: list[str] = []
        leaves = flatten(self.raw)
        touched = {r.split(".")[0] for r in self.read}  # top-level keys partly read: name their ignored leaves
        for leaf in leaves:
            parts = leaf.split(".")
            prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            if any(p in self.read for p in prefixes):
                continue
            if any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in self.ignore):
                name = leaf if parts[0] in touched else parts[0]
                if name not in ign:
                    ign.append(name)
            else:
                unread.append(leaf)
        self.rec.ignored.extend(k for k in ign if k not in self.rec.ignored)
        self.rec.unread.extend(k for k in unread if k not in self.rec.unread)


def optimizer_name(r: Reader, key: str, *kinds: AliasKind) -> tuple[str, Optional[str]]:
    """The memcalc optimizer and ``optimizer_impl`` (None: its default) that the external name at ``key``
    builds, from the optimizer registry's aliases of these kinds (an unknown name lists the valid ones;
    an approximated one says how in a note)."""
    value = r.get(key)
    table = {k: v for kind in kinds for k, v in alias_table(kind).items()}
    name, alias = choice(value, table, f"{r.src}:{key}")
    if alias.note:
        r.rec.note(f"{alias.name}: {alias.note}")
    return name, alias.impl


def model_for_hub_id(repo_id: str, where: str, rec: Recipe) -> str:
    """The ``--model`` value for a Hugging Face id in a recipe: the preset whose ``hf_id`` it is; else
    the preset whose id has the same repository name (a re-upload such as NousResearch/Llama-3.2-1B,
    or an ``-Instruct`` variant of the same architecture), said in a note; else the id itself, which
    ``--model`` resolves from the local Hugging Face cache or the Hub (or fails with one line)."""
    rid = repo_id.strip()
    ids = _preset_ids()
    found = next((p for p, hid in ids.items() if hid.lower() == rid.lower()), None)  # as presets.preset_for_hf_id
    if found is not None:
        return found
    want = _base_name(rid)
    same = sorted(p for p, hid in ids.items() if _base_name(hid) == want)
    if len(same) == 1:
        hid = ids[same[0]]
        rec.note(f"{where} {rid}: preset {same[0]} (Hugging Face id {hid}: the same model under another "
                 "organisation or as its instruct variant)")
        return same[0]
    return rid


@functools.lru_cache(maxsize=1)
def _preset_ids() -> dict[str, str]:
    """Preset name -> Hugging Face id (the shipped presets do not change while memcalc runs)."""
    from memcalc.inputs.presets import preset_hf_ids

    return preset_hf_ids()


def _base_name(repo_id: str) -> str:
    """A repository name without its organisation, ``Meta-`` prefix and instruct/chat/-hf suffix, lowercased."""
    n = repo_id.strip().rsplit("/", 1)[-1].lower().removeprefix("meta-")
    for suffix in ("-instruct", "-it", "-chat", "-hf"):
        n = n.removesuffix(suffix)
    return n


def peft_targets(value: Any, where: str) -> str:
    """PEFT ``target_modules`` (a list of module names, or ``all-linear``) as a ``--lora-targets`` value:
    q_proj -> q, ..., lm_head -> head, all-linear -> all (PEFT: every linear layer but the output head,
    peft/tuners/tuners_utils.py ``_maybe_include_all_linear_layers``). A regex string is refused: memcalc
    cannot tell which modules it matches without the model's module names."""
    from memcalc.core.spec import LORA_TARGET_ALIASES, LORA_TARGETS

    if isinstance(value, (set, frozenset, tuple)):  # a live LoraConfig holds a set
        value = sorted(value)
    if isinstance(value, str):
        if value.strip().lower() in ("all-linear", "all_linear"):
            return "all"
        if "," not in value and value.strip() and value.strip().replace("_", "").isalnum():
            value = [value]
        else:
            raise UserError(f"{where}: a regular expression ({clip(value)}) is not supported; list the module "
                            f"names (q_proj, k_proj, ...) or use all-linear")
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where}: expected a list of module names, got {clip(repr(value))}")
    out: list[str] = []
    for name in value:
        n = name.strip()
        t = EXTRA_TARGET_ALIASES.get(n, LORA_TARGET_ALIASES.get(n, n))
        if t not in LORA_TARGETS and t != HEAD_TARGET:
            raise UserError(f"{where}: unknown module {clip(n)}; valid: {', '.join(LORA_TARGET_ALIASES)}, "
                            f"{', '.join(EXTRA_TARGET_ALIASES)} (or memcalc's {', '.join(LORA_TARGETS)})")
        if t not in out:
            out.append(t)
    return ",".join(out)


def set_deepspeed(r: Reader, value: Any, key: str, recipe_path: str) -> None:
    """A DeepSpeed config named by the recipe -> ``Options.deepspeed`` (its path; a relative path is
    looked up from the working directory, as the trainers do, else beside the recipe); the config is
    read by :mod:`memcalc.inputs.deepspeed_config` (stage, buckets, precision)."""
    if isinstance(value, dict):
        raise UserError(f"{r.src}:{key}: an inline DeepSpeed config is not supported; save it as a JSON file "
                        "and name the file")
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"{r.src}:{key}: expected the path of a DeepSpeed JSON config, got {clip(repr(value))}")
    path = Path(value).expanduser()
    try:
        if not path.is_absolute() and not path.exists() and (Path(recipe_path).parent / path).exists():
            path = Path(recipe_path).parent / path
    except OSError as e:  # a name the OS refuses (a component over 255 bytes)
        raise UserError(f"{r.src}:{key}: {clip(value, 200)}: {e.strerror or e}") from None
    r.set("deepspeed", str(path), key, value)


#: Hugging Face / axolotl ``fsdp`` options -> ZeRO stage (transformers FSDPOption)
FSDP_STAGES = {"full_shard": 3, "shard_grad_op": 2, "no_shard": 0}
FSDP_WORDS = (*FSDP_STAGES, "auto_wrap", "offload", "hybrid_shard", "hybrid_shard_zero2")


def set_fsdp(r: Reader, value: Any, key: str, cfg_key: str) -> None:
    """HF ``fsdp: "full_shard auto_wrap"`` (a string or a list) -> ZeRO stage 3 (shard_grad_op: 2) with
    sharding fsdp1, or fsdp2 when ``<cfg_key>.fsdp_version`` is 2 (transformers' TrainingArguments
    ``fsdp``/``fsdp_config``, accelerate's FullyShardedDataParallelPlugin); FSDP2 with
    ``reshard_after_forward: false`` is stage 2; ``activation_checkpointing: true`` checkpoints every
    layer. Hybrid sharding and parameter offload (``offload``, ``offload_params``) are not modelled: an
    error."""
    words = value.split() if isinstance(value, str) else value if isinstance(value, list) else None
    if not words or not all(isinstance(w, str) for w in words):
        raise UserError(f"{r.src}:{key}: expected FSDP options such as \"full_shard auto_wrap\", got {clip(repr(value))}")
    for w in words:
        if w not in FSDP_WORDS:
            raise UserError(f"{r.src}:{key}: unknown FSDP option {clip(w)}; valid: {', '.join(FSDP_WORDS)}")
        if w in ("offload", "hybrid_shard", "hybrid_shard_zero2"):
            raise UserError(f"{r.src}:{key}: FSDP {w} is not modelled; valid: full_shard, shard_grad_op, no_shard, "
                            "auto_wrap")
    stage = next((FSDP_STAGES[w] for w in words if w in FSDP_STAGES), 3)
    vkey = next((k for k in (f"{cfg_key}.fsdp_version", f"{cfg_key}.version", "fsdp_version") if r.has(k)), None)
    version = r.get(vkey) if vkey else None
    if version is not None and str(version) not in ("1", "2"):
        raise UserError(f"{r.src}:{vkey}: expected 1 or 2, got {clip(repr(version))}")
    for k in (f"{cfg_key}.offload_params", f"{cfg_key}.fsdp_offload_params", f"{cfg_key}.cpu_offload"):
        if r.has(k) and bool_value(r.get(k), f"{r.src}:{k}"):
            raise UserError(f"{r.src}:{k}: FSDP parameter offload is not modelled; remove it (or use "
                            "--offload-optimizer for optimizer state on the CPU)")
    for k in (f"{cfg_key}.activation_checkpointing", f"{cfg_key}.fsdp_activation_checkpointing"):
        if r.has(k) and bool_value(r.get(k), f"{r.src}:{k}"):
            r.set("checkpoint", "full", k, True)
    for k in (f"{cfg_key}.reshard_after_forward", f"{cfg_key}.fsdp_reshard_after_forward"):
        if r.has(k) and str(version) == "2" and stage == 3 and not bool_value(r.get(k), f"{r.src}:{k}"):
            stage = 2
    r.set("zero", stage, key, value)
    r.set("sharding", "fsdp2" if str(version) == "2" else "fsdp1", vkey or key, version if version is not None else value)
    r.rec.note("FSDP shards over the data-parallel GPUs, which the recipe does not name: give --gpus N")

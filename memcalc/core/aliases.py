"""The spellings users bring, read as memcalc's names: Hugging Face ``optim`` names for
``--optimizer``, dtype names for ``--precision``, ``4k`` for ``--seq``, comma lists of GPUs for
``--gpu``, ``transformers`` for ``--framework hf``.

Each alias resolves to the canonical value with one ``memcalc: note:`` line on stderr, written before
any output (the CLI and the Python API both resolve here, before the estimate runs); an unknown name
lists the valid ones and the aliases. Torch-free and pydantic-free.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from decimal import Decimal
from collections.abc import Iterator
from typing import Any, Optional

from memcalc.core.choices import FRAMEWORKS, PRECISIONS
from memcalc.core.errors import UserError
from memcalc.core.optimizers import OPTIMIZER_NAMES, OPTIMIZERS, alias_table

#: dtype names -> --precision: a dtype names what the weights, gradients and optimizer state are
#: stored in (torch_dtype / model.to(dtype)), i.e. pure 16-bit; autocast over fp32 weights
#: (Hugging Face Trainer's ``bf16=True`` on an fp32 model) is amp-bf16 / amp-fp16.
PRECISION_ALIASES: dict[str, str] = {
    "bfloat16": "bf16", "torch.bfloat16": "bf16", "bf16-true": "bf16",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16", "torch.half": "fp16", "16-true": "fp16",
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32", "32-true": "fp32",
    "bf16-mixed": "amp-bf16", "16-mixed": "amp-fp16",  # LitGPT / Lightning precision strings
}
_PRECISION_WHY = {
    "bf16": "weights, gradients and optimizer state in bfloat16; autocast over fp32 weights (Hugging Face Trainer's "
            "bf16=True on an fp32 model) is amp-bf16",
    "fp16": "weights, gradients and optimizer state in float16; autocast over fp32 weights (Hugging Face Trainer's "
            "fp16=True) is amp-fp16",
    "fp32": "everything in float32",
    "amp-bf16": "Lightning's autocast to bfloat16 over fp32 weights",
    "amp-fp16": "Lightning's autocast to float16 over fp32 weights",
}

#: --framework aliases: the library names people use for Hugging Face transformers + PEFT
FRAMEWORK_ALIASES: dict[str, str] = {"transformers": "hf", "huggingface": "hf", "hugging-face": "hf",
                                     "peft": "hf"}

#: --seq suffixes: k = 1024 tokens (the "4k" of a model card or a TRL/torchtune config is 4096), M = 1024 * 1024
SEQ_UNITS: dict[str, int] = {"k": 1024, "m": 1024 * 1024}
_SEQ = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM])?\s*$")


@functools.cache
def optimizer_aliases() -> dict[str, tuple[str, str]]:
    """External optimizer name -> (memcalc optimizer, why): Hugging Face ``optim`` names, torch.optim /
    bitsandbytes / torchao class paths, LitGPT's bare class names (the recipe readers' registry,
    :func:`memcalc.core.optimizers.alias_table`), less those that are memcalc's own names."""
    out = {}
    for name, (canon, alias) in alias_table("hf", "class", "litgpt").items():
        if name == canon:
            continue
        rec = OPTIMIZERS[canon]
        why = rec.help
        if rec.paged:
            why += ("; the paged state lives in CUDA unified memory, outside PyTorch's caching allocator: memcalc "
                    "reports it apart from the peak, and does not model its paging to the host under pressure")
        if alias.impl:
            why += f"; optimizer_impl {alias.impl}"
        if alias.note:
            why += f"; {alias.note}"
        out[name] = (canon, why)
    # the 8-bit names' case-insensitive twins are not added: Hugging Face's OptimizerNames are lower case
    return out


def alias_help(kind: str) -> str:
    """The aliases of ``kind`` (optimizer, precision, framework) for a flag's --help."""
    table: dict[str, str] = PRECISION_ALIASES if kind == "precision" else FRAMEWORK_ALIASES
    if kind == "optimizer":
        table = {k: v for k, (v, _) in optimizer_aliases().items() if "." not in k}
    return "Also: " + ", ".join(f"{k} ({v})" for k, v in table.items()) + "."


#: notes held by :func:`notes_on_success` (None: written at once)
_held: Optional[list[str]] = None


def _note(line: str) -> None:
    if _held is not None:
        _held.append(line)
    else:
        sys.stderr.write(f"memcalc: note: {line}\n")


@contextlib.contextmanager
def notes_held() -> Iterator[None]:
    """The alias notes made in the block held until it ends: written then (before the caller prints
    anything), dropped when it refuses its input (a ``ValueError``: :class:`UserError`, pydantic's
    ValidationError), so that a bad input after an alias (``--seq 2k`` on a 1,024-token model,
    ``--precision bfloat16 --batch 0``) is still one line on stderr; written before any other exception
    goes on. Nested blocks: the outermost decides."""
    global _held
    if _held is not None:
        yield
        return
    _held = []
    try:
        yield
    except ValueError:
        _held = None
        raise
    finally:
        lines, _held = _held or [], None
        for line in lines:
            _note(line)


def notes_on_success(fn: Any) -> Any:
    """``fn`` run in :func:`notes_held`."""
    @functools.wraps(fn)
    def held(*args: Any, **kwargs: Any) -> Any:
        with notes_held():
            return fn(*args, **kwargs)
    return held


def clip(text: str, limit: int = 40) -> str:
    """``text`` cut to ``limit`` characters for an error line (a 5,000-digit value is not echoed)."""
    return text if len(text) <= limit else text[: limit - 4] + "..."


def _choice(kind: str, value: Any, valid: tuple[str, ...], aliases: dict[str, str],
            why: dict[str, str]) -> Any:
    value = getattr(value, "value", value)  # an enum member (a caller's own)
    if not isinstance(value, str) or value in valid:
        return value
    key = value.strip()
    found = aliases.get(key, aliases.get(key.lower()))
    if found is None and key.lower() in valid:
        found = key.lower()
    if found is None:
        shown = [a for a in aliases if "." not in a]  # (class paths are the recipe readers')
        raise UserError(f"unknown --{kind} {value!r}; valid: {', '.join(valid)}; aliases: {', '.join(shown)}")
    reason = why.get(key, why.get(key.lower(), why.get(found, "")))
    _note(f"--{kind} {value} is {found}" + (f" ({reason})" if reason else ""))
    return found


def optimizer(value: Any) -> Any:
    """``--optimizer``: a memcalc name as is; an alias (``paged_adamw_8bit``) as its optimizer, with a note."""
    table = optimizer_aliases()
    return _choice("optimizer", value, OPTIMIZER_NAMES, {k: v for k, (v, _) in table.items()},
                   {k: w for k, (_, w) in table.items()})


def optimizer_impl_of(value: Any) -> Optional[str]:
    """The ``optimizer_impl`` an optimizer alias implies (``adamw_torch_fused``: fused), None otherwise."""
    if not isinstance(value, str):
        return None
    for name, (_, alias) in alias_table("hf", "class", "litgpt").items():
        if name == value.strip():
            return alias.impl
    return None


def precision(value: Any) -> Any:
    """``--precision``: a dtype name (``bfloat16``, ``torch.float16``) as memcalc's precision, with a note."""
    return _choice("precision", value, PRECISIONS, PRECISION_ALIASES,
                   {k: _PRECISION_WHY[v] for k, v in PRECISION_ALIASES.items()})


def framework(value: Any) -> Any:
    """``--framework``: ``transformers`` / ``huggingface`` as hf, with a note."""
    return _choice("framework", value, FRAMEWORKS, FRAMEWORK_ALIASES,
                   {k: "Hugging Face transformers + PEFT" for k in FRAMEWORK_ALIASES})


def seq(value: Any) -> Any:
    """``--seq``: an integer as is; ``4096`` as 4096; ``4k`` as 4,096 and ``1M`` as 1,048,576 (k = 1024
    tokens, as model cards and trainer configs mean "4k": 4096), with a note."""
    if not isinstance(value, str):
        return value
    m = _SEQ.match(value)
    if m is None:
        raise UserError(f"--seq {value!r} is not a sequence length; give tokens as an integer (4096) or with k / M "
                        "(4k = 4,096, 128k = 131,072, 1M = 1,048,576)")
    number, unit = m.groups()
    exact = Decimal(number) * (SEQ_UNITS[unit.lower()] if unit else 1)  # no float overflow (9...9k)
    if unit:  # (a plain integer meets TrainingSpec's bound, with its message)
        from memcalc.core.spec_base import MAX_SEQ

        if exact > MAX_SEQ:
            raise UserError(f"--seq {clip(value.strip())} is more than {MAX_SEQ:,} tokens, the longest sequence "
                            "memcalc takes")
    if exact != exact.to_integral_value():
        raise UserError(f"--seq {value} is {exact.normalize():f} tokens, not a whole number; give an integer")
    tokens = int(exact)
    if unit:
        _note(f"--seq {value} is {int(tokens):,} tokens ({unit} = {SEQ_UNITS[unit.lower()]:,})")
    return tokens


def gpus(value: Any) -> Any:
    """``--gpu``: a comma list (``rtx-4090,rtx-3090``) as its GPUs (a list); a list's items split likewise."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
        return parts if len(parts) > 1 else value
    if isinstance(value, (list, tuple)) and any(isinstance(v, str) and "," in v for v in value):
        return [p.strip() for v in value for p in (v.split(",") if isinstance(v, str) else [v]) if p.strip()]
    return value


def one_gpu(value: Any) -> Any:
    """``plan --gpu``: one GPU; a comma list is refused naming its cards."""
    cards = gpus(value)
    if isinstance(cards, list):
        raise UserError(f"plan --gpu plans for one GPU, not {value!r}; run plan once for each of {', '.join(cards)}")
    return value


def canonical(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (the API's / CLI's inputs) with every alias made memcalc's name, a note per alias on
    stderr; an optimizer alias that implies an implementation sets ``optimizer_impl`` unless given."""
    out = dict(values)
    if out.get("optimizer") is not None:
        given = out["optimizer"]
        out["optimizer"] = optimizer(given)
        impl = optimizer_impl_of(given) if given != out["optimizer"] else None
        if impl is not None and out.get("optimizer_impl") is None:
            out["optimizer_impl"] = impl
    for key, fn in (("precision", precision), ("framework", framework), ("seq", seq)):
        if out.get(key) is not None:
            out[key] = fn(out[key])
    return out


"""The GPU catalog (``data/gpus.yaml``): device memory to compare a predicted peak against.

``capacity_bytes`` is the whole-device total as ``nvidia-smi`` (``memory.total``, MiB)
or ``rocminfo`` (VRAM pool, KiB) reports it, in integer bytes; see the comment at the
top of ``data/gpus.yaml`` for the sources. The CUDA context and allocator slack are not
subtracted here; the estimate adds them to the requirement.

Names resolve case-insensitively through the slug, the display name and the aliases,
ignoring spaces, dashes and a leading vendor/brand word ("NVIDIA GeForce RTX 4090",
"rtx4090", "4090" all give ``rtx-4090``).
"""

from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from memcalc.inputs.data_files import load_file
from memcalc.core.errors import UserError

_FROZEN = ConfigDict(frozen=True, extra="forbid")
_BRANDS = ("nvidia", "geforce", "tesla", "amd", "instinct", "radeon")


class GPU(BaseModel):
    """One accelerator model and its memory."""

    model_config = _FROZEN

    name: str = Field(..., description="Slug used on the command line, e.g. rtx-4090.")
    display_name: str = Field(..., description="Full product name, e.g. NVIDIA GeForce RTX 4090.")
    aliases: tuple[str, ...] = Field((), description="Other accepted names, e.g. 4090, rtx4090.")
    vendor: Literal["nvidia", "amd"] = Field(..., description="Vendor.")
    architecture: str = Field(..., description="GPU architecture, e.g. Hopper, Ada Lovelace, CDNA 3.")
    memory_type: str = Field(..., description="Device memory technology, e.g. HBM3, GDDR6X.")
    marketed_capacity: float = Field(..., gt=0, description="The capacity figure on the spec sheet (its 'GB').")
    marketed_unit: Literal["GiB", "GB"] = Field(
        ..., description="What the spec sheet's 'GB' counts: GiB (2**30, binary DRAM sizes) or GB (10**9)."
    )
    capacity_bytes: int = Field(..., gt=0, description="Device memory total in bytes (nvidia-smi / rocminfo).")
    capacity_source: str = Field(..., description="Where capacity_bytes comes from, with the reported figure.")
    bf16: bool = Field(..., description="Native bfloat16 tensor-core math (Ampere and later, CDNA 2 and later).")
    fp8: bool = Field(..., description="Native FP8 tensor-core math (Ada, Hopper, Blackwell, CDNA 3).")

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", v):
            raise ValueError(f"GPU name {v!r} must be a lowercase slug (letters, digits, dashes)")
        return v


def _key(text: str) -> str:
    """Lowercase alphanumerics only, without a leading vendor/brand word."""
    k = re.sub(r"[^a-z0-9]", "", text.lower())
    stripped = True
    while stripped:
        stripped = False
        for brand in _BRANDS:
            if k.startswith(brand) and len(k) > len(brand):
                k = k[len(brand):]
                stripped = True
    return k


@lru_cache(maxsize=1)
def _catalog() -> tuple[GPU, ...]:
    raw = load_file("gpus.yaml")
    entries = raw.get("gpus") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise UserError("malformed gpus.yaml: expected a top-level 'gpus' list")
    from memcalc.inputs.pydantic_errors import pydantic_error_line

    out = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise UserError(f"malformed gpus.yaml: entry {i} is not a mapping")
        try:
            out.append(GPU(**entry))
        except ValidationError as e:
            raise UserError(pydantic_error_line(e, f"gpus.yaml (entry {entry.get('name', i)!r})")) from None
    return tuple(out)


@lru_cache(maxsize=1)
def _index() -> dict[str, GPU]:
    idx: dict[str, GPU] = {}
    for g in _catalog():
        for label in (g.name, g.display_name, *g.aliases):
            k = _key(label)
            assert idx.get(k, g) is g, f"gpus.yaml: {label!r} names both {idx[k].name} and {g.name}"
            idx[k] = g
    return idx


def list_gpus() -> list[GPU]:
    """The whole catalog, in file order (by capacity)."""
    return list(_catalog())


def gpu_names() -> list[str]:
    """The catalog's slugs, in file order."""
    return [g.name for g in _catalog()]


def get_gpu(name: str) -> GPU:
    """The GPU called ``name`` (slug, display name or alias; case, spaces and dashes ignored).

    Raises :class:`UserError` listing the valid names, with close matches when there are any.
    """
    idx = _index()
    k = _key(name) if isinstance(name, str) else ""
    if k in idx:
        return idx[k]
    names = gpu_names()
    # A unique prefix of at least 3 characters resolves ("a10" is an alias, "rtx50" -> rtx-5090).
    prefixed = sorted({g.name for key, g in idx.items() if len(k) >= 3 and key.startswith(k)}, key=names.index)
    if len(prefixed) == 1:
        return next(g for g in _catalog() if g.name == prefixed[0])
    if prefixed:
        hint = f" (ambiguous: {', '.join(prefixed)})"
    else:
        close = difflib.get_close_matches(k, list(idx), n=3, cutoff=0.6)
        matches = sorted({idx[c].name for c in close}, key=names.index)
        hint = f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""
    raise UserError(f"unknown GPU {name!r}{hint}; valid: {', '.join(names)}")

"""The GPU catalog (``data/gpus.yaml``): device memory to compare a predicted peak against.

``capacity_bytes`` is the whole-device total as ``nvidia-smi`` (``memory.total``, MiB)
or ``rocminfo`` (VRAM pool, KiB) reports it, in integer bytes; see the comment at the
top of ``data/gpus.yaml`` for the sources. The CUDA context, workspaces and NCCL
buffers are not subtracted here; the estimate's device total adds them (memcalc.core.gpu_side).

Names resolve case-insensitively through the slug, the display name and the aliases,
ignoring spaces, dashes and a leading vendor/brand word ("NVIDIA GeForce RTX 4090",
"rtx4090", "4090" all give ``rtx-4090``).
"""

from __future__ import annotations

import re
from decimal import Decimal
from functools import lru_cache
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from memcalc.inputs.data_files import clip, load_file
from memcalc.core.errors import UserError
from memcalc.core.units import GB, GiB, TiB

_FROZEN = ConfigDict(frozen=True, extra="forbid")
_BRANDS = ("nvidia", "geforce", "tesla", "amd", "instinct", "radeon")


class GPU(BaseModel):
    """One accelerator model and its memory."""

    model_config = _FROZEN

    name: str = Field(..., description="Slug used on the command line, e.g. rtx-4090.")
    display_name: str = Field(..., description="Full product name, e.g. NVIDIA GeForce RTX 4090.")
    aliases: tuple[str, ...] = Field((), description="Other accepted names, e.g. 4090, rtx4090.")
    vendor: Literal["nvidia", "amd", "any"] = Field(
        ..., description="Vendor; any for a GPU given by its capacity alone (--gpu 48GiB)."
    )
    architecture: str = Field(..., description="GPU architecture, e.g. Hopper, Ada Lovelace, CDNA 3.")
    memory_type: str = Field(..., description="Device memory technology, e.g. HBM3, GDDR6X.")
    marketed_capacity: float = Field(..., gt=0, description="The capacity figure on the spec sheet (its 'GB').")
    marketed_unit: Literal["GiB", "GB"] = Field(
        ..., description="What the spec sheet's 'GB' counts: GiB (2**30, binary DRAM sizes) or GB (10**9)."
    )
    capacity_bytes: int = Field(..., gt=0, description="Device memory total in bytes (nvidia-smi / rocminfo).")
    capacity_source: str = Field(..., description="Where capacity_bytes comes from, with the reported figure.")
    given_as: Optional[str] = Field(
        None, description="The --gpu value a card given by its capacity was named with, as typed (23.99GiB); "
        "None for a catalog card, whose name is its --gpu value."
    )
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


#: ``--gpu 48GiB`` / ``--gpu 24GB``: a capacity instead of a name (GiB = 2**30, GB = 10**9)
_CAPACITY = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*(gib|gb)\s*$", re.IGNORECASE)
_UNITS = {"gib": ("GiB", GiB), "gb": ("GB", GB)}
#: a capacity card's own name (``3-5gb``: the slug ``--json`` keys it by) read back as the capacity (3.5GB)
_CAPACITY_SLUG = re.compile(r"^\s*(\d+)-(\d+)(gib|gb)\s*$", re.IGNORECASE)
#: the largest capacity accepted as --gpu SIZE (far above any device)
MAX_CAPACITY_BYTES = 1024 * TiB


def capacity_gpu(value: str) -> Optional[GPU]:
    """A GPU entry named by its capacity (``48GiB``, ``24GB``, ``80gib``; or by such an entry's own name,
    ``3-5gb`` for 3.5GB, so that the name ``--json`` keys it by is a ``--gpu`` value too), or None when
    ``value`` is not a capacity. The capacity is taken as the whole device total; nothing is
    assumed of the vendor or architecture (bf16 is assumed, fp8 is not; neither moves memory).

    Raises :class:`UserError` for a capacity that is not positive, or above MAX_CAPACITY_BYTES.
    """
    slug = _CAPACITY_SLUG.match(value) if isinstance(value, str) else None
    m = _CAPACITY.match(f"{slug.group(1)}.{slug.group(2)}{slug.group(3)}" if slug else value) if isinstance(
        value, str) else None
    if not m:
        return None
    unit, scale = _UNITS[m.group(2).lower()]
    number = Decimal(m.group(1))
    shown = clip(value.strip())
    if number <= 0:  # before any arithmetic (-1e999999999GB overflows the Decimal context)
        raise UserError(f"--gpu {shown}: a capacity must be positive")
    # bound the exponent before any arithmetic (1e400GB)
    if number.adjusted() + len(str(scale)) - 1 > len(str(MAX_CAPACITY_BYTES)):
        raise UserError(f"--gpu {shown}: capacity out of range; give at most {MAX_CAPACITY_BYTES // TiB:,} TiB")
    capacity = int((number * scale).to_integral_value())
    if capacity <= 0:  # a positive number under one byte
        raise UserError(f"--gpu {shown}: a capacity must be positive")
    if capacity > MAX_CAPACITY_BYTES:
        raise UserError(f"--gpu {shown}: capacity out of range; give at most {MAX_CAPACITY_BYTES // TiB:,} TiB")
    text = f"{number.normalize():f}"
    return GPU(
        name=f"{text.replace('.', '-')}{unit.lower()}",
        display_name=f"{text} {unit} GPU",
        vendor="any",
        architecture="unspecified",
        memory_type="unspecified",
        marketed_capacity=float(number),
        marketed_unit=unit,
        capacity_bytes=capacity,
        capacity_source=f"--gpu {value.strip()}: {text} x {'2**30' if unit == 'GiB' else '10**9'} bytes, as given",
        given_as=value.strip(),
        bf16=True,
        fp8=False,
    )


def get_gpu(name: str) -> GPU:
    """The GPU called ``name`` (slug, display name or alias; case, spaces and dashes ignored),
    or a capacity such as ``48GiB`` or ``24GB`` (:func:`capacity_gpu`).

    Raises :class:`UserError` listing the valid names, with close matches when there are any.
    """
    by_size = capacity_gpu(name)
    if by_size is not None:
        return by_size
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
        import difflib  # (here: only a misspelt name needs it, not an estimate's start-up)

        close = difflib.get_close_matches(k, list(idx), n=3, cutoff=0.6)
        matches = sorted({idx[c].name for c in close}, key=names.index)
        hint = f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""
    raise UserError(f"unknown GPU {name!r}{hint}; valid: {', '.join(names)}, or a capacity such as 48GiB or 24GB")

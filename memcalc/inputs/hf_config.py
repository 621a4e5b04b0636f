"""Read a Hugging Face ``config.json`` (offline, no transformers import) into a ModelSpec.

``model_type`` picks the family adapter (:mod:`memcalc.inputs.hf_families`, one module per
``model_type``) whose ``read`` turns the keys into ModelSpec fields; the defaults are those of the
matching ``transformers`` 5.23 configuration class (the adapter's ``defaults``), so a config.json
that omits a key means what it means to transformers, and the module layout each family implies
(biases, norms, fused projections, experts, tied head) follows its ``modeling_*.py``.

Every key of a config is read, or deliberately ignored with a reason (the adapter's ``ignored``
and :data:`memcalc.inputs.hf_families.ignored.COMMON`); any other key is reported: one note on
stderr, or an error with ``strict`` (the fixture tests run strict).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from pydantic import ValidationError

from memcalc.core.errors import UserError
from memcalc.core.spec import ModelSpec
from memcalc.inputs.data_files import clip
from memcalc.inputs.hf_families.reader import Reader
from memcalc.inputs.hf_families.registry import get, ignored, supported_model_types


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_MODEL_TYPES":  # the registry's, a family registered since included
        return supported_model_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_hf_config(cfg: dict[str, Any], name: str, where: Optional[str] = None, strict: bool = False) -> ModelSpec:
    """The ModelSpec of a parsed Hugging Face ``config.json`` (``where`` names it in errors).

    Raises :class:`UserError` for an unknown ``model_type`` (listing the supported
    ones), a missing or mistyped key, or shapes ModelSpec rejects. Keys neither read nor
    deliberately ignored are an error with ``strict``, else one note on stderr.
    """
    where = where or "config.json"
    if not isinstance(cfg, dict):
        raise UserError(f"{where} must be a JSON object, not {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    family = get(model_type)
    if family is not None and family.refused:
        raise UserError(f"{where}: model_type {clip(str(model_type))} {family.refused}")
    if family is None:
        raise UserError(
            f"unsupported model_type {clip(repr(model_type), 60)} in {where}; "
            f"supported: {', '.join(supported_model_types())}"
        )
    r = Reader(cfg, where, str(model_type), family.defaults)
    fields = read_fields(family, r)
    fields["name"] = name
    if fields.get("head_dim") is not None and fields["head_dim"] * fields["n_heads"] == fields["d_model"]:
        fields["head_dim"] = None  # the default, d_model / n_heads
    unread = unread_keys(cfg, r.seen)
    if unread:
        shown = ", ".join(unread[:8]) + (f" and {len(unread) - 8} more" if len(unread) > 8 else "")
        if strict:
            raise UserError(f"{where} (model_type {model_type}) has keys memcalc does not read: {shown}")
        print(f"note: {where} (model_type {model_type}): keys memcalc does not read (they may change memory): "
              f"{shown}", file=sys.stderr)
    try:
        import copy

        return ModelSpec(**fields).with_hf_source(copy.deepcopy(cfg), where)
    except ValidationError as e:
        from memcalc.inputs.pydantic_errors import pydantic_error_line

        raise UserError(pydantic_error_line(e, where)) from None


def read_fields(family: Any, r: Reader) -> dict[str, Any]:
    """The family's fields, and the keys every family shares: ``use_cache`` (every transformers 5.24
    configuration class memcalc reads defaults it to true, e.g. models/llama/configuration_llama.py
    ``use_cache: bool = True``; a training forward then fills a DynamicCache unless checkpointing:
    :func:`memcalc.core.rules.kv_cache`)."""
    fields = family.read(r)
    fields["use_cache"] = r.bool("use_cache", family.defaults.get("use_cache", True))
    return fields


def unread_keys(cfg: dict[str, Any], seen: set[str]) -> list[str]:
    """Keys of ``cfg`` that its reader neither read (``seen``) nor lists as ignored, sorted."""
    skip = ignored(str(cfg.get("model_type")))
    return sorted(k for k in cfg if k not in seen and k not in skip)


def read_keys(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(keys of ``cfg`` its reader reads, keys it deliberately ignores), for the key-coverage test."""
    family = get(cfg["model_type"])
    if family is None or family.refused:
        raise KeyError(cfg["model_type"])
    r = Reader(cfg, "config.json", str(cfg.get("model_type")), family.defaults)
    read_fields(family, r)
    skip = ignored(str(cfg.get("model_type")))
    return sorted(k for k in cfg if k in r.seen), sorted(k for k in cfg if k not in r.seen and k in skip)

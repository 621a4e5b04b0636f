"""Read a Hugging Face ``config.json`` (offline, no transformers import) into a ModelSpec.

``model_type`` decides which reader runs (:mod:`memcalc.inputs.hf_families`: dense decoders,
fused-projection families, mixture-of-experts); the defaults are those of the matching
``transformers`` 5.23 configuration class, so a config.json that omits a key means what it
means to transformers, and the module layout each family implies (biases, norms, fused
projections, experts, tied head) follows its ``modeling_*.py``.

Every key of a config is read, or deliberately ignored with a reason
(:mod:`memcalc.inputs.hf_families.ignored`); any other key is reported: one note on stderr,
or an error with ``strict`` (the fixture tests run strict).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional

from pydantic import ValidationError

from memcalc.core.errors import UserError
from memcalc.core.spec import ModelSpec
from memcalc.inputs.hf_families import READERS, REFUSED, ignored

SUPPORTED_MODEL_TYPES = tuple(sorted(READERS))

# Hugging Face ACT2FN names -> ModelSpec.activation.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "relu": "relu",
}

_REQUIRED = object()


class _Reader:
    """Typed access to config keys; a missing or mistyped key is a one-line UserError.
    ``seen`` collects every key a reader looked at."""

    REQUIRED = _REQUIRED

    def __init__(self, cfg: dict[str, Any], where: str, model_type: str) -> None:
        self.cfg = cfg
        self.where = where
        self.model_type = model_type
        self.seen: set[str] = set()

    def _raw(self, key: str, default: Any) -> Any:
        self.seen.add(key)
        value = self.cfg.get(key, default)
        if value is None:  # JSON null means "use the default" in transformers configs
            value = default
        if value is _REQUIRED:
            raise UserError(f"Hugging Face config {self.where} (model_type {self.model_type}) lacks {key!r}")
        return value

    def int(self, key: str, default: Any = _REQUIRED) -> Optional[int]:
        value = self._raw(key, default)
        if value is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value != int(value) or value <= 0):  # JSON admits NaN and Infinity
            raise UserError(f"{key} in {self.where} must be a positive integer, got {value!r}")
        return int(value)

    def float(self, key: str, default: Any = _REQUIRED, lo: float = 0.0, hi: float = math.inf) -> float:
        value = self._raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi):
            raise UserError(f"{key} in {self.where} must be a number in [{lo:g}, {hi:g}], got {value!r}")
        return float(value)

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise UserError(f"{key} in {self.where} must be true or false, got {value!r}")
        return value

    def activation(self, key: str, default: str) -> str:
        value = self._raw(key, default)
        if not isinstance(value, str) or value not in _ACTIVATIONS:
            raise UserError(
                f"unsupported {key} {value!r} in {self.where}; valid: {', '.join(sorted(_ACTIVATIONS))}"
            )
        return _ACTIVATIONS[value]


_READERS: dict[str, Callable[[_Reader], dict[str, Any]]] = READERS


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
    r = _Reader(cfg, where, str(model_type))
    if model_type in REFUSED:
        REFUSED[model_type](r)
    if model_type not in _READERS:
        raise UserError(
            f"unsupported model_type {model_type!r} in {where}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    fields = _READERS[model_type](r)
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
        return ModelSpec(**fields)
    except ValidationError as e:
        from memcalc.inputs.pydantic_errors import pydantic_error_line

        raise UserError(pydantic_error_line(e, where)) from None


def unread_keys(cfg: dict[str, Any], seen: "set[str]") -> list[str]:
    """Keys of ``cfg`` that its reader neither read (``seen``) nor lists as ignored, sorted."""
    skip = ignored(str(cfg.get("model_type")))
    return sorted(k for k in cfg if k not in seen and k not in skip)


def read_keys(cfg: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(keys of ``cfg`` its reader reads, keys it deliberately ignores), for the key-coverage test."""
    r = _Reader(cfg, "config.json", str(cfg.get("model_type")))
    _READERS[cfg["model_type"]](r)
    skip = ignored(str(cfg.get("model_type")))
    return sorted(k for k in cfg if k in r.seen), sorted(k for k in cfg if k not in r.seen and k in skip)

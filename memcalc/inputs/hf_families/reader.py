"""Typed access to the keys of a Hugging Face ``config.json``: what an adapter's ``read`` is given.

A missing or mistyped key is a one-line :class:`~memcalc.core.errors.UserError`; ``seen`` collects
every key the adapter looked at (the rest must be ignored with a reason, :mod:`.registry`). A key
read without an inline default takes the adapter's ``defaults`` (its transformers configuration
class's), else it is required.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Mapping
from typing import Any, Optional, overload

from memcalc.core.errors import UserError
from memcalc.inputs.data_files import shorten

#: the largest integer a config key takes (2**31 - 1: above any width, depth, vocabulary or context length)
MAX_CONFIG_INT = 2**31 - 1


def _shown(value: Any) -> str:
    """``repr(value)`` cut for an error line (an int of 4,000 digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        digits = str(value)
        return digits if len(digits) <= 60 else f"{digits[:20]}... ({len(digits):,} digits)"
    return shorten(value)

# Hugging Face ACT2FN names -> ModelSpec.activation.
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "relu": "relu",
}

#: a key without a default: its absence is an error
REQUIRED: Any = object()
#: "the adapter's default for this key" (its ``defaults``, else REQUIRED)
FAMILY_DEFAULT: Any = object()


class Reader:
    """Typed access to config keys (see the module docstring)."""

    REQUIRED = REQUIRED

    def __init__(self, cfg: dict[str, Any], where: str, model_type: str,
                 defaults: Optional[Mapping[str, Any]] = None) -> None:
        self.cfg = cfg
        self.where = where
        self.model_type = model_type
        self.defaults: Mapping[str, Any] = defaults or {}
        self.seen: set[str] = set()

    def default(self, key: str, fallback: Any = REQUIRED) -> Any:
        """The adapter's default for ``key`` (its configuration class's), else ``fallback``."""
        return self.defaults.get(key, fallback)

    def _raw(self, key: str, default: Any) -> Any:
        self.seen.add(key)
        if default is FAMILY_DEFAULT:
            default = self.default(key)
        value = self.cfg.get(key, default)
        if value is None:  # JSON null means "use the default" in transformers configs
            value = default
        if value is REQUIRED:
            raise UserError(f"Hugging Face config {self.where} (model_type {self.model_type}) lacks {key!r}")
        return value

    @overload
    def int(self, key: str, default: None) -> Optional[builtins.int]: ...

    @overload
    def int(self, key: str, default: Any = FAMILY_DEFAULT) -> builtins.int: ...

    def int(self, key: str, default: Any = FAMILY_DEFAULT) -> Optional[builtins.int]:
        """A positive integer (``default`` None: null or absent is None)."""
        value = self._raw(key, default)
        if value is None:
            return None
        if isinstance(value, float) and math.isfinite(value) and value == int(value):  # 4096.0
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:  # JSON admits NaN and Infinity
            raise UserError(f"{key} in {self.where} must be a positive integer, got {_shown(value)}")
        if value > MAX_CONFIG_INT:
            raise UserError(f"{key} in {self.where} must be at most {MAX_CONFIG_INT:,}, got {_shown(value)}")
        return value

    def float(self, key: str, default: Any = FAMILY_DEFAULT, lo: float = 0.0, hi: float = math.inf) -> float:
        value = self._raw(key, default)
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi)
                or abs(value) > 1e300):  # an int of 400 digits has no float
            raise UserError(f"{key} in {self.where} must be a number in [{lo:g}, {hi:g}], got {_shown(value)}")
        return float(value)

    def bool(self, key: str, default: Any = FAMILY_DEFAULT) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise UserError(f"{key} in {self.where} must be true or false, got {_shown(value)}")
        return value

    def activation(self, key: str, default: Any = FAMILY_DEFAULT) -> str:
        value = self._raw(key, default)
        if not isinstance(value, str) or value not in ACTIVATIONS:
            raise UserError(
                f"unsupported {key} {_shown(value)} in {self.where}; valid: {', '.join(sorted(ACTIVATIONS))}"
            )
        return ACTIVATIONS[value]

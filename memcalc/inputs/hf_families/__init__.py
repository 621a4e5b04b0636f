"""The Hugging Face family adapters: one module per ``model_type`` (``<model_type>.py`` defining
``FAMILY``, a :class:`~.base.Family`: the keys it reads with their defaults, the keys it ignores
with a reason, its PEFT target names, the layout it builds, what the validator builds), found by
:mod:`.registry`. The estimator reads configs through them (:mod:`memcalc.inputs.hf_config`), the
validator builds the real model from them (:mod:`memcalc.validate.hf_model`), the tests take their
PEFT names from them. Shared pieces: :mod:`.reader` (typed key access), :mod:`.common` (the
llama-style keys, sliding windows, experts), :mod:`.ignored` (keys no family reads)."""

from __future__ import annotations

from memcalc.inputs.hf_families.base import EXPERT_PARAMS, LLAMA_LORA, Family, Fields, Inverse
from memcalc.inputs.hf_families.reader import Reader
from memcalc.inputs.hf_families.registry import families, get, ignored, register, supported_model_types, unregister

__all__ = ["EXPERT_PARAMS", "LLAMA_LORA", "Family", "Fields", "Inverse", "Reader", "families", "get", "ignored",
           "register", "supported_model_types", "unregister"]

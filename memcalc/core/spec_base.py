"""The base of every spec (frozen, unknown keys refused, no booleans for numbers) and the upper
bounds on sizes. The specs themselves: :mod:`memcalc.core.model_spec` (the model),
:mod:`memcalc.core.training_spec` (the training step, its adapters and DeepSpeed settings),
:mod:`memcalc.core.spec` (the kernel profile, the whole experiment, and every spec by name).
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

# allow_inf_nan=False: a float field (norm_eps, alpha, dropout, budgets) must be finite.
_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _numeric_only(annotation: Any) -> bool:
    """The annotation is int or float (possibly Optional) or a Literal of integers, not bool."""
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, int) and not isinstance(a, bool) for a in args)
    return typing.get_origin(annotation) is typing.Union and any(a in (int, float) for a in args) and bool not in args


class Spec(BaseModel):
    """A frozen spec whose numeric fields refuse true/false (pydantic would read them as 1/0)."""

    model_config = _FROZEN

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for k, v in data.items():
                if v is True or v is False:
                    f = cls.model_fields.get(k)
                    if f is not None and _numeric_only(f.annotation):
                        raise ValueError(f"{k} = {str(v).lower()}: expected a number, not a boolean")
        return data


#: Upper bounds on sizes, far above real models (so a typo or a fuzzer's 10**30 is one line, and
#: the step's simulation, about linear in layers, stays within seconds):
#: layers: the deepest decoder LLMs have 126 (Llama 3.1 405B), DeepNet trained 1,000 (arXiv 2203.00555);
MAX_LAYERS = 1024
#: sequence / context: 2**24 = 16,777,216 tokens, 1.6 x Llama 4 Scout's 10M context;
MAX_SEQ = 2**24
#: widths (d_model, d_ff, vocab, head_dim): 2**20 = 1,048,576, 4 x Gemma 3's 262,144-token vocabulary
#: and 19 x the widest FFN of Llama 3.1 405B (53,248);
MAX_WIDTH = 2**20
#: micro-batch, accumulation steps, GPUs: 2**20 = 1,048,576 (more than the largest clusters' GPUs).
MAX_COUNT = 2**20

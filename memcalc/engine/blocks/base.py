"""What the blocks' parameter rules return (:class:`ParamTensor`), the callbacks they add
parameters through (:data:`Linear`, :data:`Norm`), and a multiply by a Python scalar
(:func:`scaled`) that several blocks use."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext
    from memcalc.engine.records import T


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor. ``layer`` is None for embedding, final norm and head."""

    name: str
    shape: tuple[int, ...]
    layer: Optional[int]
    trainable: bool
    kind: str  # "linear" (2-D weight of a projection), "experts" (3-D routed-expert weights), "router",
    #            "embedding", "norm", "bias", "slopes" (ALiBi slopes, attention sinks), "lora"
    quantizable: bool = False  # a frozen 2-D linear weight that QLoRA stores as NF4

    @cached_property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


#: a layer's projection: ``linear(short, name, d_in, d_out, bias)`` adds its weight, bias and adapter
#: (:func:`memcalc.engine.blocks.adapters.projection_params`)
Linear = Callable[[str, str, int, int, bool], None]
#: a layer's norm: ``norm(name, shape, bias)`` (:func:`memcalc.engine.blocks.norm.norm_params`)
Norm = Callable[[str, tuple[int, ...], bool], None]


def scaled(fwd: ForwardContext, a: T, factor: float) -> T:
    """``a * factor`` (a Python scalar: a new tensor that saves nothing); takes ``a``'s reference."""
    y = fwd.ops.scale(a, factor)
    fwd.ops.drop(a)
    return y

"""A model as a layout: the embedding, one :class:`LayerSpec` per decoder layer, the head.

:class:`memcalc.core.spec.ModelSpec` stays the file format (presets, Hugging Face configs,
``--params``); :func:`layout_of` reads it as what the step is made of, layer by layer. A layer's
spec holds what makes one layer differ from another in a model -- its attention (standard or
MLA; full, or a sliding window of W tokens: :func:`memcalc.core.rules.layer_slides`), its
feed-forward block (dense, fused gate/up, or mixture of experts:
:meth:`memcalc.core.spec.MoESpec.is_moe_layer`) -- and nothing that every layer shares (widths,
norms, biases, positions: the ModelSpec's own fields). The engine asks the same two rules per
layer, so the layout is where per-layer variety lives: a model family whose layers differ in a
new way adds the field here (and its rule), and the extrapolation in depth
(``memcalc.plan.depth``, ``memcalc.compile.graph``) follows.

From the layers the layout derives a :attr:`Layout.prefix` (leading layers outside the pattern:
DeepSeek's dense first layers) and a :attr:`Layout.period` (the repeating unit after it: 2 for
Gemma-2's and gpt-oss' sliding/full alternation, 6 for Gemma-3's five sliding layers and a full
one, 1 for a uniform stack); the :attr:`Layout.suffix` is what is left after the last whole
period. A copy of the model with ``units`` whole periods (:meth:`Layout.depth_at`) has the same
prefix and suffix and ``units`` periods between: :meth:`Layout.truncates_to` checks that a
shallow copy's own layout is exactly that.

Why extrapolating in whole periods is exact: a shallow copy is the same ModelSpec with fewer
layers, so the engine builds it by the same per-layer rules, and the rules that make one layer
differ from another are the layout's (``rules.layer_slides``, ``MoESpec.is_moe_layer``: the engine
asks them per layer); :meth:`Layout.truncates_to` checks that each copy holds the deep model's
prefix, periods and suffix, in place. Variety the layout does not name but that shows within the
copies (a per-layer rule with another period) makes their interior periods differ or breaks the
exact affine checks (``memcalc.plan.depth``, ``memcalc.compile.graph``): the step falls back to
the direct simulation. What no check can see is a rule that first differs deeper than the copies
(prefix + 5 periods + suffix): such a rule belongs in :class:`LayerSpec`, and
``tests/unit/test_depth.py`` compares every shipped preset's extrapolated peaks with direct
simulations at full depth.

Torch-free (frozen dataclasses); engine, compile and plan read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Literal, Optional

from memcalc.core.rules import layer_slides

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.core.spec import ModelSpec


@dataclass(frozen=True)
class Embedding:
    """The token embedding (and a learned position table)."""

    vocab_size: int
    d_model: int
    positions: str
    scale: float


@dataclass(frozen=True)
class LayerSpec:
    """What makes one decoder layer differ from another in the same model."""

    #: "mha": q/k/v projections (grouped or not); "mla": DeepSeek's multi-head latent attention
    attention: Literal["mha", "mla"]
    #: the sliding window in tokens, None = full (causal) attention
    window: Optional[int]
    #: "dense": the MLP of width d_ff; "fused": the same with one gate_up projection; "moe": the
    #: mixture-of-experts block
    mlp: Literal["dense", "fused", "moe"]


@dataclass(frozen=True)
class Head:
    """The final norm and the LM head (the loss's kind, full or chunked, is the kernel profile's)."""

    final_norm: bool
    tied: bool
    bias: bool
    logit_softcap: Optional[float]
    logit_scale: float


@dataclass(frozen=True)
class Layout:
    """The embedding, the layers in order and the head; the layers' prefix, period and suffix."""

    embedding: Embedding
    layers: tuple[LayerSpec, ...]
    head: Head
    #: leading layers outside the repeating pattern
    prefix: int
    #: the length of the repeating unit after the prefix
    period: int

    @property
    def units(self) -> int:
        """Whole periods after the prefix."""
        return (len(self.layers) - self.prefix) // self.period

    @property
    def suffix(self) -> int:
        """Layers after the last whole period (a period cut short)."""
        return (len(self.layers) - self.prefix) % self.period

    def depth_at(self, units: int) -> int:
        """The layers of a copy of this model with ``units`` whole periods: prefix + units x period
        + suffix."""
        return self.prefix + units * self.period + self.suffix

    def truncated(self, units: int) -> tuple[LayerSpec, ...]:
        """The layers such a copy must have: the prefix, the first ``units`` periods, the suffix."""
        n, cut = len(self.layers), self.prefix + units * self.period
        return self.layers[:cut] + self.layers[n - self.suffix:]

    def truncates_to(self, other: Layout, units: int) -> bool:
        """``other`` (the layout of a copy at :meth:`depth_at` ``(units)`` layers) has the layers of
        :meth:`truncated`, the same embedding and the same head."""
        return (other.layers == self.truncated(units) and other.embedding == self.embedding
                and other.head == self.head)


def prefix_and_period(layers: tuple[LayerSpec, ...]) -> tuple[int, int]:
    """(prefix, period) of a sequence of layers: ``layers[i] == layers[i + period]`` for every ``i``
    from the prefix on, with at least one whole period after the prefix; of the pairs that hold, the
    one with the shortest prefix + period (the fewest layers a copy with one period has), ties to
    the shorter period. (0, n) always holds: a model without a pattern is its own period."""
    n = len(layers)
    if not n:
        return 0, 1
    best = (n, n)  # (prefix + period, period)
    for p in range(1, n + 1):
        if p >= best[0]:
            break
        i = n - p - 1
        while i >= 0 and layers[i] == layers[i + p]:
            i -= 1
        pre = i + 1
        if n - pre >= p and pre + p < best[0]:
            best = (pre + p, p)
    return best[0] - best[1], best[1]


def layer_spec(m: ModelSpec, i: int) -> LayerSpec:
    """Layer ``i`` of ``m`` (0-based), by the rules the engine asks per layer."""
    mlp: Literal["dense", "fused", "moe"] = "fused" if m.fused_gate_up else "dense"
    if m.moe is not None and m.moe.is_moe_layer(i):
        mlp = "moe"
    return LayerSpec(attention="mla" if m.mla is not None else "mha",
                     window=m.sliding_window if layer_slides(m, i) else None, mlp=mlp)


@lru_cache(maxsize=1024)
def layout_of(m: ModelSpec) -> Layout:
    """``m`` as a :class:`Layout`."""
    layers = tuple(layer_spec(m, i) for i in range(m.n_layers))
    prefix, period = prefix_and_period(layers)
    return Layout(
        embedding=Embedding(m.vocab_size, m.d_model, m.positions, m.embedding_scale),
        layers=layers,
        head=Head(m.final_norm, m.tie_embeddings, m.lm_head_bias, m.logit_softcap, m.logit_scale),
        prefix=prefix, period=period,
    )


def copies_hold(m: ModelSpec, units: tuple[int, ...]) -> bool:
    """Each copy of ``m`` with ``units`` whole periods (:meth:`Layout.depth_at` layers) has as its
    own layout the deep one cut short (:meth:`Layout.truncates_to`); a pattern that depends on the
    depth itself does not, and is simulated at full depth."""
    lay = layout_of(m)
    return all(lay.truncates_to(layout_of(m.model_copy(update={"n_layers": lay.depth_at(k)})), k) for k in units)


@lru_cache(maxsize=4096)
def repeating(m: ModelSpec, units: tuple[int, ...]) -> Optional[Layout]:
    """``m``'s layout where its depth may be extrapolated from copies with ``units`` whole periods,
    else None: more layers than the copies together, and :func:`copies_hold`."""
    lay = layout_of(m)
    deep = m.n_layers > sum(lay.depth_at(k) for k in units)
    return lay if deep and copies_hold(m, units) else None


def place(layer: int, units: int, cut: tuple[int, int]) -> tuple[Optional[int], str]:
    """Layer ``layer`` of a copy of ``units`` whole periods, its layout cut as (prefix, period):
    (the period it is in, its offset in it as a suffix of its place's name: "" in a period of one
    layer) or (None, its own place: "prefix i", "suffix j")."""
    prefix, period = cut
    if layer < prefix:
        return None, f"prefix {layer}"
    unit, offset = divmod(layer - prefix, period)
    if unit >= units:
        return None, f"suffix {layer - prefix - units * period}"
    return unit, f" {offset}" if period > 1 else ""

"""``--params N``: a plausible Llama-style decoder with about N parameters, and the reasons for it.

The family is Meta's Llama (``llama/model.py``): SwiGLU MLP, RMSNorm, RoPE, untied
embeddings, vocabulary 32000, head_dim 128, ``max_seq_len`` 4096 (Llama 2). Widths
below 6144 use full multi-head attention (Llama-2 7B/13B); from 6144 on, GQA with 8
key/value heads (Llama-2-70B).

Feed-forward width, from Llama's ``FeedForward``::

    hidden = int(2 * 4 * d / 3)
    if ffn_dim_multiplier: hidden = int(ffn_dim_multiplier * hidden)
    d_ff = multiple_of * ceil(hidden / multiple_of)

with ``multiple_of`` 256 and no multiplier below 6144 (7B: 11008, 13B: 13824), and
``multiple_of`` 4096 with multiplier 1.3 from 6144 on (70B: 28672).

Depth follows the family's aspect ratio: a layer count interpolated (log-log) through
published shapes (GPT-2 small 12 x 768, TinyLlama 22 x 2048, Llama-3.2-3B 28 x 3072,
Llama-2 32 x 4096, 40 x 5120, LLaMA 60 x 6656, Llama-2-70B 80 x 8192,
Llama-3.1-405B 126 x 16384). A small grid of widths (multiples of 128 below 2048,
256 below 6144, 1024 above), layer counts, and d_ff within -20%/+30% of the rule in
steps of 256 is searched; among shapes within 2% of N, the one closest to the
family's depth and d_ff rule wins. Requests too small for a 32000-token vocabulary
(below about 9M parameters) keep the smallest shape and shrink the vocabulary.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import NamedTuple, Optional

from memcalc.core.errors import UserError
from memcalc.engine.params import count_params
from memcalc.inputs.data_files import shorten
from memcalc.core.spec import ModelSpec, MoESpec
from memcalc.core.units import fmt_count

VOCAB = 32000
HEAD_DIM = 128
MAX_SEQ = 4096
GQA_FROM = 6144  # widths from here on use GQA with GQA_KV_HEADS kv heads (Llama-2-70B)
GQA_KV_HEADS = 8
TOLERANCE = 0.02
MIN_PARAMS = 1e6
MAX_PARAMS = 1e13

# (d_model, n_layers) of published decoders; the depth curve passes through them.
DEPTH_ANCHORS: tuple[tuple[int, int], ...] = (
    (256, 4),
    (512, 8),
    (768, 12),  # GPT-2 small
    (1024, 16),
    (2048, 22),  # TinyLlama 1.1B
    (3072, 28),  # Llama 3.2 3B
    (4096, 32),  # Llama 2 7B
    (5120, 40),  # Llama 2 13B
    (6656, 60),  # LLaMA 33B
    (8192, 80),  # Llama 2 70B
    (16384, 126),  # Llama 3.1 405B
)

# Search weights: distance from the family depth (log), from the d_ff rule (log), count error.
_W_DEPTH, _W_FF, _W_ERR = 1.0, 0.5, 0.5
_FF_RANGE = (0.8, 1.3)
_FF_STEP = 256


def llama_ffn(d_model: int, multiple_of: int = 256, ffn_dim_multiplier: Optional[float] = None) -> int:
    """Llama's ``FeedForward`` hidden width for model width ``d_model`` (see module docstring)."""
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def family_ffn(d_model: int) -> int:
    """The family's d_ff rule: Llama-2 7B/13B below GQA_FROM, Llama-2-70B's from there."""
    if d_model >= GQA_FROM:
        return llama_ffn(d_model, 4096, 1.3)
    return llama_ffn(d_model, 256)


def family_depth(d_model: int) -> float:
    """The family's layer count for a width: log-log interpolation through DEPTH_ANCHORS."""
    (d0, l0), (d1, l1) = DEPTH_ANCHORS[0], DEPTH_ANCHORS[-1]
    if d_model <= d0:
        return max(1.0, l0 * d_model / d0)
    if d_model >= d1:
        return l1 * d_model / d1
    for (da, la), (db, lb) in zip(DEPTH_ANCHORS, DEPTH_ANCHORS[1:]):
        if da <= d_model <= db:
            t = math.log(d_model / da) / math.log(db / da)
            return math.exp(math.log(la) + t * (math.log(lb) - math.log(la)))
    raise AssertionError("unreachable: anchors cover the range")  # pragma: no cover


def _widths() -> list[int]:
    return list(range(128, 2048, 128)) + list(range(2048, GQA_FROM, 256)) + list(range(GQA_FROM, 65536 + 1, 1024))


def _kv_heads(d_model: int) -> int:
    return GQA_KV_HEADS if d_model >= GQA_FROM else d_model // HEAD_DIM


def _layer_params(d: int, d_ff: int) -> int:
    """One decoder layer: q, o (d x d), k, v (d x kv_dim), gate/up/down (d x d_ff), two RMSNorm weights."""
    kv_dim = _kv_heads(d) * HEAD_DIM
    return 2 * d * d + 2 * d * kv_dim + 3 * d * d_ff + 2 * d


def _total(d: int, n_layers: int, d_ff: int, vocab: int = VOCAB) -> int:
    """Embedding + untied head (vocab x d each), layers, final norm."""
    return 2 * vocab * d + d + n_layers * _layer_params(d, d_ff)


class _Shape(NamedTuple):
    score: float
    d_model: int
    n_layers: int
    d_ff: int
    vocab: int
    total: int


def _search(n: float, prune: bool = True) -> Optional[_Shape]:
    """The best vocab-32000 shape within TOLERANCE of n, or None if there is none.

    With ``prune``, widths whose rule-shaped depth for n is more than 3x off the
    family's depth are skipped (they cannot win); the caller retries without it.
    """
    best: Optional[_Shape] = None
    for d in _widths():
        emb = 2 * VOCAB * d + d
        if emb >= n * (1 + TOLERANCE):
            break  # wider only grows the embedding
        target = family_depth(d)
        base = family_ffn(d)
        if prune and not target / 3 <= (n - emb) / _layer_params(d, base) <= target * 3:
            continue
        lo = max(_FF_STEP, int(base * _FF_RANGE[0]) // _FF_STEP * _FF_STEP)
        hi = int(base * _FF_RANGE[1])
        for ff in range(lo, hi + 1, _FF_STEP):
            per_layer = _layer_params(d, ff)
            # Every depth whose count is within the tolerance.
            l_lo = max(1, math.ceil((n * (1 - TOLERANCE) - emb) / per_layer))
            l_hi = math.floor((n * (1 + TOLERANCE) - emb) / per_layer)
            for n_layers in range(l_lo, l_hi + 1):
                total = emb + n_layers * per_layer
                err = abs(total - n) / n
                if err > TOLERANCE:
                    continue
                score = (_W_DEPTH * abs(math.log(n_layers / target)) + _W_FF * abs(math.log(ff / base))
                         + _W_ERR * err)
                if best is None or score < best.score:
                    best = _Shape(score, d, n_layers, ff, VOCAB, total)
    return best


def _small(n: float) -> _Shape:
    """Below what a 32000-token vocabulary allows: the narrowest shape, vocabulary filling the rest."""
    d = HEAD_DIM
    ff = family_ffn(d)
    n_layers = max(1, round(family_depth(d)))
    while n_layers > 1 and n - _total(d, n_layers, ff, 0) < 2 * d * 64:
        n_layers -= 1
    vocab = min(VOCAB, max(64, round((n - _total(d, n_layers, ff, 0)) / (2 * d) / 64) * 64))
    return _Shape(0.0, d, n_layers, ff, vocab, _total(d, n_layers, ff, vocab))


def infer_from_params(n: float) -> tuple[ModelSpec, list[str]]:
    """A Llama-style ModelSpec with about ``n`` parameters (within 2%), and one line per choice made.

    Raises :class:`UserError` for ``n`` outside [1e6, 1e13] or not finite.
    """
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n):
        raise UserError(f"--params must be a finite number, got {n!r}")
    if not MIN_PARAMS <= n <= MAX_PARAMS:
        raise UserError(f"--params {n:.4g} is out of range; give between 1e6 and 1e13 (1M to 10T parameters)")
    shape = _search(n) or _search(n, prune=False)
    small = shape is None
    if shape is None:
        shape = _small(n)
    d, n_layers, ff, vocab = shape.d_model, shape.n_layers, shape.d_ff, shape.vocab
    heads, kv = d // HEAD_DIM, _kv_heads(d)
    m = ModelSpec(
        name=f"llama-style-{fmt_count(round(n))}",
        n_layers=n_layers,
        d_model=d,
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=ff,
        vocab_size=vocab,
        max_seq_len=MAX_SEQ,
        mlp="gated",
        activation="silu",
        norm="rmsnorm",
        norm_eps=1e-5,
        positions="rope",
        tie_embeddings=False,
        final_norm=True,
    )
    total = count_params(m).total
    assert total == shape.total, (total, shape)
    pct = 100 * (total - n) / n
    reasons = [
        f"inferred: Llama-style decoder, {n_layers} layers x {d}, ff {ff}, vocab {vocab}: "
        f"{fmt_count(total)} params ({pct:+.1f}%)",
        "assumed: SwiGLU MLP, RMSNorm, RoPE, untied embeddings, head_dim 128 "
        + (f"({heads} heads, GQA with {kv} kv heads as in Llama-2-70B)" if kv != heads
           else f"({heads} heads, full multi-head attention as in Llama-2 7B/13B)")
        + f", max_seq_len {MAX_SEQ}",
    ]
    if ff != family_ffn(d):
        how = "widened" if ff > family_ffn(d) else "narrowed"
        reasons.append(f"ff {how} from the Llama rule's {family_ffn(d)} to {ff} to land within 2% of {n:.3g}")
    depth = family_depth(d)
    if abs(n_layers - depth) >= 1:
        reasons.append(f"depth {n_layers} vs the family's ~{depth:.0f} layers at width {d}, to match the count")
    if small:
        reasons.append(f"vocab reduced from {VOCAB} to {vocab}: a {VOCAB}-token embedding and head alone "
                       f"would hold {fmt_count(2 * VOCAB * d)} params")
    return m, reasons


_COUNT = re.compile(r"^\s*([+-]?(?:\d[\d_,]*(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)
#: the most decimal digits a count may have before the range check (MAX_PARAMS has 14)
_MAX_DIGITS = 15
_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(value: str) -> int:
    """A parameter count: ``7e9``, ``7B``, ``1.5b``, ``350M``, ``7000000000``, ``7_000_000_000``, ``1.2T``.

    Suffixes K/M/B (or G)/T are decimal (10**3, 10**6, 10**9, 10**12), case-insensitive.
    Raises :class:`UserError` for anything else, a count that is not positive, or one
    with more than 15 digits (far above MAX_PARAMS; checked before any arithmetic).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = repr(value)
    if not isinstance(value, str):
        raise UserError(f"--params must be a number such as 7e9, 7B or 350M, got {value!r}")
    m = _COUNT.match(value)
    if not m:
        raise UserError(f"--params {shorten(value, 40)} is not a parameter count; use e.g. 7e9, 7B, 1.5b, 350M or 7000000000")
    try:
        number = Decimal(m.group(1).replace("_", "").replace(",", ""))
    except InvalidOperation:
        raise UserError(f"--params {shorten(value, 40)} is not a parameter count; use e.g. 7e9, 7B, 1.5b, 350M") from None
    if not number.is_finite():  # pragma: no cover - the pattern admits digits only
        raise UserError(f"--params must be a finite number, got {value!r}")
    # Bound the exponent before any arithmetic: 1e999999999 would otherwise expand to a
    # billion-digit integer (or overflow Decimal's context).
    if number and number.adjusted() + len(str(_SUFFIX[m.group(2).lower()])) - 1 > _MAX_DIGITS:
        raise UserError(f"--params {shorten(value, 40)} is out of range; give between 1e6 and 1e13 (1M to 10T parameters)")
    count = int((number * _SUFFIX[m.group(2).lower()]).to_integral_value())
    if count <= 0:
        raise UserError(f"--params must be positive, got {shorten(value, 40)}")
    return count


# -- mixture of experts: --params TOTAL-A<ACTIVE> -------------------------------------------------
_MOE = re.compile(r"^\s*(.+?)\s*-\s*a\s*(.+?)\s*$", re.IGNORECASE)
#: Qwen3-MoE's routing (Qwen3-30B-A3B, Qwen3-235B-A22B config.json: num_experts_per_tok 8); the
#: routed experts' width is the dense rule's d_ff / top_k, so the active FFN equals the dense one
#: (Qwen3-30B-A3B: 8 x 768 = 6144 at d_model 2048), in steps of 64
MOE_TOP_K = 8
MOE_FF_STEP = 64
MOE_EXPERT_STEP = 8
#: the most routed experts per layer --params TOTAL-A<ACTIVE> infers: four times the most in a published MoE
#: (Qwen3-Next-80B-A3B config.json: num_experts 512; Kimi K2: 384; DeepSeek-V3: 256)
MOE_MAX_EXPERTS = 2048


def infer_params(value: str) -> tuple[ModelSpec, list[str]]:
    """``--params``: a count (``7e9``, ``7B``: :func:`infer_from_params`) or a mixture of experts given
    as ``TOTAL-A<ACTIVE>`` (``30B-A3B``, as Qwen names its MoE checkpoints: :func:`infer_moe`).

    The last line names the shipped presets of that size, if any (:func:`preset_note`); the model
    stays the inferred one (the user asked for it)."""
    if isinstance(value, str):
        m = _MOE.match(value)
        if m:
            model, reasons = infer_moe(parse_count(m.group(1)), parse_count(m.group(2)))
            return model, reasons + preset_note(m.group(1), m.group(2))
    model, reasons = infer_from_params(float(parse_count(value)))
    return model, reasons + (preset_note(value) if isinstance(value, str) else [])


# -- the shipped presets of the size asked ---------------------------------------------------------
#: (preset, total, active) of every shipped preset (``data/models/*.yaml``): ``count_params(m).total``
#: and ``active_params(m)`` (memcalc/engine/params.py), precomputed so that ``--params`` need not read
#: the presets; tests/unit/test_infer.py checks it against them (and prints the rows to paste)
PRESET_SIZES: tuple[tuple[str, int, int], ...] = (
    ("deep-one-1.6b", 1_631_455_744, 1_631_455_744),
    ("deepseek-v3", 671_026_404_352, 37_552_282_624),
    ("gemma-2-9b", 9_241_705_984, 9_241_705_984),
    ("gemma-3-1b", 999_885_952, 999_885_952),
    ("gpt-oss-20b", 20_914_757_184, 4_187_440_704),
    ("gpt2", 124_439_808, 124_439_808),
    ("gpt2-xl", 1_557_611_200, 1_557_611_200),
    ("granite-3.1-8b", 8_170_848_256, 8_170_848_256),
    ("llama-2-13b", 13_015_864_320, 13_015_864_320),
    ("llama-2-70b", 68_976_648_192, 68_976_648_192),
    ("llama-2-7b", 6_738_415_616, 6_738_415_616),
    ("llama-3.1-405b", 405_853_388_800, 405_853_388_800),
    ("llama-3.1-70b", 70_553_706_496, 70_553_706_496),
    ("llama-3.1-8b", 8_030_261_248, 8_030_261_248),
    ("llama-3.2-1b", 1_235_814_400, 1_235_814_400),
    ("llama-3.2-3b", 3_212_749_824, 3_212_749_824),
    ("llama-3.3-70b", 70_553_706_496, 70_553_706_496),
    ("mistral-7b", 7_241_732_096, 7_241_732_096),
    ("mistral-7b-v0.3", 7_248_023_552, 7_248_023_552),
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
    ("olmo-2-7b", 7_298_617_344, 7_298_617_344),
    ("phi-1.5", 1_418_270_720, 1_418_270_720),
    ("phi-4", 14_659_507_200, 14_659_507_200),
    ("qwen2.5-7b", 7_615_616_512, 7_615_616_512),
    ("qwen3-0.6b", 596_049_920, 596_049_920),
    ("qwen3-14b", 14_768_307_200, 14_768_307_200),
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
    ("qwen3-32b", 32_762_123_264, 32_762_123_264),
    ("qwen3-4b", 4_022_468_096, 4_022_468_096),
    ("qwen3-8b", 8_190_735_360, 8_190_735_360),
    ("smollm3-3b", 3_075_098_624, 3_075_098_624),
    ("tinyllama-1.1b", 1_100_048_384, 1_100_048_384),
)


#: the most presets :func:`preset_note` names (the closest); the rest are counted
PRESET_NOTE_MAX = 3


def typed_range(value: str) -> tuple[float, float]:
    """The counts ``value`` names at the precision it was typed: from half a unit of its last digit
    below to one unit above (``30B``: 29.5B to 31B), as published names round or truncate
    (Qwen3-30B-A3B holds 30.53B, Mixtral-8x7B's 46.70B is "47B"). ``3e10``: one digit (25B to 40B);
    a plain integer (``30000000000``) names itself only."""
    m = _COUNT.match(value)
    assert m is not None, value  # parse_count accepted it
    exponent = Decimal(m.group(1).replace("_", "").replace(",", "")).as_tuple().exponent
    assert isinstance(exponent, int), value  # finite: parse_count checked
    unit = 10.0 ** exponent * _SUFFIX[m.group(2).lower()]
    count = parse_count(value)
    return count - unit / 2, count + unit


def preset_note(total: str, active: Optional[str] = None) -> list[str]:
    """One line naming the shipped presets whose total (and, for ``TOTAL-A<ACTIVE>``, active) count
    lies in :func:`typed_range` of what was typed (:data:`PRESET_SIZES`; a dense count matches dense
    presets only, an MoE form MoE presets only), closest total first; none: no line."""
    t_lo, t_hi = typed_range(total)
    a_lo, a_hi = typed_range(active) if active is not None else (0.0, 0.0)
    hits = [(name, t, a) for name, t, a in PRESET_SIZES
            if t_lo <= t < t_hi and ((a < t and a_lo <= a < a_hi) if active is not None else a == t)]
    if not hits:
        return []
    hits.sort(key=lambda h: abs(h[1] - parse_count(total)))
    sizes = ", ".join(f"{n} ({fmt_count(t)}" + (f", {fmt_count(a)} active)" if a < t else ")")
                      for n, t, a in hits[:PRESET_NOTE_MAX])
    if len(hits) > PRESET_NOTE_MAX:
        sizes += f" and {len(hits) - PRESET_NOTE_MAX} more (memcalc models)"
    if len(hits) == 1:
        return [f"a preset of this size exists: {sizes}; --model {hits[0][0]} uses its real shapes"]
    return [f"presets of this size exist: {sizes}; --model with one of them uses its real shapes"]


def infer_moe(total: int, active: int) -> tuple[ModelSpec, list[str]]:
    """A Llama-style mixture of experts with about ``total`` parameters of which about ``active`` are
    used per token, and one line per choice made.

    The dense backbone (width, depth, attention) is :func:`infer_from_params` of ``active``; every
    layer's MLP becomes ``n_experts`` routed experts, top-8 (:data:`MOE_TOP_K`), each of width
    ``d_ff / 8`` (so the active FFN is the dense one's), with a router Linear(d_model, n_experts);
    ``n_experts`` (a multiple of 8) brings the total to ``total``. Routing is assumed balanced
    (``MoESpec.routing``). Ignores shared experts and dense first layers (DeepSeek), which a
    count cannot tell.
    """
    if not active < total:
        raise UserError(f"--params {fmt_count(total)}-A{fmt_count(active)}: the active count must be below the "
                        f"total (TOTAL-A<ACTIVE>, e.g. 30B-A3B)")
    dense, _ = infer_from_params(float(active))
    d, n_layers = dense.d_model, dense.n_layers
    rule_ff = max(MOE_FF_STEP, round(dense.d_ff / MOE_TOP_K / MOE_FF_STEP) * MOE_FF_STEP)

    def model(n_experts: int, ff: int) -> ModelSpec:
        return dense.model_copy(update={
            "name": f"llama-style-moe-{fmt_count(total)}-a{fmt_count(active)}",
            "moe": MoESpec(n_experts=n_experts, top_k=MOE_TOP_K, d_ff_expert=ff)})

    best = None
    # the expert width within -25%/+25% of the rule (steps of 64), the expert count (a multiple of 8)
    # that brings the total closest: the pair with the smallest sum of the two relative errors wins
    for ff in range(max(MOE_FF_STEP, rule_ff * 3 // 4 // MOE_FF_STEP * MOE_FF_STEP), rule_ff * 5 // 4 + 1, MOE_FF_STEP):
        base = count_params(model(MOE_TOP_K, ff)).total  # top_k experts: what every token uses
        per_expert = n_layers * (3 * d * ff + d)  # three projections and one router column per layer
        n_experts = MOE_TOP_K + max(0, round((total - base) / per_expert / MOE_EXPERT_STEP) * MOE_EXPERT_STEP)
        got_total = base + (n_experts - MOE_TOP_K) * per_expert
        got_active = got_total - n_layers * (n_experts - MOE_TOP_K) * 3 * d * ff
        score = abs(got_total - total) / total + abs(got_active - active) / active
        if best is None or score < best[0]:
            best = (score, n_experts, ff, got_total, got_active)
    assert best is not None
    _, n_experts, ff, got_total, got_active = best
    if n_experts > MOE_MAX_EXPERTS:
        raise UserError(f"--params {fmt_count(total)}-A{fmt_count(active)}: {fmt_count(total)} total over "
                        f"{fmt_count(active)} active takes {n_experts:,} experts per layer; memcalc infers at most "
                        f"{MOE_MAX_EXPERTS:,} (published MoEs have up to 512): give a larger active count")
    m = model(n_experts, ff)
    assert count_params(m).total == got_total, (count_params(m).total, got_total)
    reasons = [
        f"inferred: Llama-style mixture of experts, {n_layers} layers x {d}, {n_experts} experts of ff {ff}, "
        f"top-{MOE_TOP_K}: {fmt_count(got_total)} params ({100 * (got_total - total) / total:+.1f}%), "
        f"{fmt_count(got_active)} active ({100 * (got_active - active) / active:+.1f}%)",
        f"assumed: the backbone of a dense {fmt_count(active)} model (vocab {dense.vocab_size}, head_dim "
        f"{HEAD_DIM}), every layer sparse, top-{MOE_TOP_K} routing over experts of the dense ff / "
        f"{MOE_TOP_K} (Qwen3-MoE's ratio), no shared experts, tokens spread evenly over the experts",
    ]
    return m, reasons

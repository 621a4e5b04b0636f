"""memcalc.core.layout: a ModelSpec as embedding, layers and head; the layers' prefix, period and
suffix, which the extrapolation in depth (memcalc.plan.depth, memcalc.compile.graph) keys on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.core.layout import layout_of, prefix_and_period
from memcalc.core.spec import MoESpec
from memcalc.engine.blocks.attention_variants import layer_slides
from memcalc.inputs.presets import list_presets, load_preset

from conftest import tiny_llama

# (prefix, period, suffix) of every shipped preset. source: each preset's sliding_window /
# full_attention_every (HF layer_types) and moe.first_dense_layers / moe.every (first_k_dense_replace,
# decoder_sparse_step); a preset not listed is a uniform stack, (0, 1, 0)
PRESET_CUTS = {
    "deepseek-v3": (3, 1, 0),  # three dense layers, then MoE
    "gemma-2-9b": (0, 2, 0),  # sliding, full
    "gemma-3-1b": (0, 6, 2),  # five sliding and a full one; 26 = 4 x 6 + 2
    "gpt-oss-20b": (0, 2, 0),  # sliding, full
}


@pytest.mark.parametrize("name", list_presets())
def test_preset_layouts(name):
    lay = layout_of(load_preset(name))
    assert (lay.prefix, lay.period, lay.suffix) == PRESET_CUTS.get(name, (0, 1, 0))


def _repeats(lay) -> bool:
    """Every layer from the prefix on is the layer one period before it (the definition), and one
    whole period at least follows the prefix."""
    ls = lay.layers
    return (len(ls) - lay.prefix >= lay.period
            and all(ls[i] == ls[i + lay.period] for i in range(lay.prefix, len(ls) - lay.period)))


patterns = st.fixed_dictionaries({
    "n_layers": st.integers(1, 80),
    "window": st.one_of(st.none(), st.integers(1, 4096)),
    "full_every": st.integers(0, 7),
    "moe": st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(1, 5))),
    "mla": st.booleans(),
})


@settings(max_examples=100, deadline=None)
@given(patterns)
def test_layout_repeats_with_its_period(pat):
    # source: definition (memcalc/core/layout.py prefix_and_period); the layer specs follow the rules
    # the engine asks per layer (layer_slides, MoESpec.is_moe_layer)
    kw = dict(n_layers=pat["n_layers"], sliding_window=pat["window"],
              full_attention_every=pat["full_every"] if pat["window"] else 0)
    if pat["moe"] is not None:
        kw["moe"] = MoESpec(n_experts=4, top_k=2, d_ff_expert=64, first_dense_layers=pat["moe"][0], every=pat["moe"][1])
    if pat["mla"]:
        kw["mla"] = {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16}
    m = tiny_llama(**kw)
    lay = layout_of(m)
    assert _repeats(lay)
    for i, spec in enumerate(lay.layers):
        assert (spec.window is not None) == layer_slides(m, i)
        assert (spec.mlp == "moe") == (m.moe is not None and m.moe.is_moe_layer(i))
        assert spec.attention == ("mla" if pat["mla"] else "mha")
    # no (prefix, period) that also holds has fewer layers in one period with its prefix
    p0 = lay.prefix + lay.period
    for period in range(1, p0):
        for prefix in range(0, p0 - period):
            ls = lay.layers
            assert not (len(ls) - prefix >= period
                        and all(ls[i] == ls[i + period] for i in range(prefix, len(ls) - period))), (prefix, period)
    # a copy with fewer whole periods is the deep layout cut short (what memcalc.plan.depth checks)
    for units in range(1, lay.units + 1):
        short = layout_of(m.model_copy(update={"n_layers": lay.depth_at(units)}))
        assert lay.truncates_to(short, units)


def test_prefix_and_period_table():
    # source: definition: the shortest prefix + period that repeats
    a, b, c = "a", "b", "c"
    assert prefix_and_period(()) == (0, 1)
    assert prefix_and_period((a,)) == (0, 1)
    assert prefix_and_period((a,) * 7) == (0, 1)
    assert prefix_and_period((a, b) * 5) == (0, 2)
    assert prefix_and_period((a, b) * 5 + (a,)) == (0, 2)  # a suffix of one layer
    assert prefix_and_period((c, c, c) + (a,) * 9) == (3, 1)  # DeepSeek: dense first layers
    assert prefix_and_period((c,) + (a, b) * 4) == (1, 2)
    assert prefix_and_period((a, b, c)) == (0, 3)  # no pattern: the model is its own period

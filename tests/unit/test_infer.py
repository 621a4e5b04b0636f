"""--params inference (a Llama-style shape within 2%) and parameter-count parsing."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memcalc.core.errors import UserError
from memcalc.inputs.infer import family_depth, family_ffn, infer_from_params, llama_ffn, parse_count
from memcalc.engine.params import count_params


@pytest.mark.slow  # 150 inferred shapes (seconds); the quick lane keeps the fixed anchors below
@settings(max_examples=150, deadline=None)
@given(n=st.floats(5e7, 5e11, allow_nan=False, allow_infinity=False))
def test_within_two_percent(n):
    m, reasons = infer_from_params(n)
    total = count_params(m).total
    assert abs(total - n) / n <= 0.02
    assert m.vocab_size == 32000 and m.dim_head == 128 and m.mlp == "gated" and m.norm == "rmsnorm"
    assert not m.tie_embeddings and m.positions == "rope"
    assert reasons[0].startswith("inferred: Llama-style decoder, ")


@pytest.mark.slow  # the quick lane keeps the fixed anchors below
@settings(max_examples=40, deadline=None)
@given(exp=st.floats(6.0, 13.0))
def test_whole_range_gives_a_valid_model_close_to_n(exp):
    n = 10.0**exp
    m, _ = infer_from_params(n)
    assert abs(count_params(m).total - n) / n <= 0.02


def test_7b_is_llama_2_7b_shape():
    m, reasons = infer_from_params(7e9)
    assert (m.n_layers, m.d_model, m.n_heads, m.kv_heads) == (32, 4096, 32, 32)
    assert reasons[0] == "inferred: Llama-style decoder, 32 layers x 4096, ff 11520, vocab 32000: 6.94B params (-0.9%)"
    assert any("11008" in r for r in reasons)  # says the d_ff left the Llama rule, and from what


def test_llama_2_7b_count_gives_llama_2_7b_exactly():
    m, _ = infer_from_params(6_738_415_616)
    assert (m.n_layers, m.d_model, m.d_ff) == (32, 4096, 11008)
    assert count_params(m).total == 6_738_415_616


def test_13b_and_70b_follow_the_family():
    m, _ = infer_from_params(13e9)
    assert (m.n_layers, m.d_model, m.d_ff, m.kv_heads) == (40, 5120, 13824, 40)
    m, reasons = infer_from_params(70e9)
    assert (m.n_layers, m.d_model, m.d_ff, m.kv_heads) == (80, 8192, 28672, 8)
    assert any("GQA with 8 kv heads" in r for r in reasons)


def test_llama_ffn_rule_matches_published_widths():
    assert llama_ffn(4096) == 11008  # Llama 2 7B
    assert llama_ffn(5120) == 13824  # Llama 2 13B
    assert llama_ffn(8192, 4096, 1.3) == 28672  # Llama 2 70B
    assert llama_ffn(4096, 1024, 1.3) == 14336  # Llama 3 8B
    assert family_ffn(4096) == 11008 and family_ffn(8192) == 28672


def test_depth_curve_passes_through_anchors_and_grows():
    assert family_depth(4096) == pytest.approx(32)
    assert family_depth(5120) == pytest.approx(40)
    assert family_depth(8192) == pytest.approx(80)
    ds = [128 * k for k in range(1, 400)]
    depths = [family_depth(d) for d in ds]
    assert all(b >= a for a, b in zip(depths, depths[1:]))


def test_tiny_request_shrinks_vocab_and_says_so():
    m, reasons = infer_from_params(1e6)
    assert abs(count_params(m).total - 1e6) / 1e6 <= 0.02
    assert m.vocab_size < 32000 and any("vocab reduced" in r for r in reasons)


@pytest.mark.parametrize("bad", [999_999, 1.1e13, math.inf, -math.inf, math.nan, 0, -7e9])
def test_out_of_range_rejected(bad):
    with pytest.raises(UserError):
        infer_from_params(bad)


# ---------------------------------------------------------------- parse_count


@pytest.mark.parametrize("text,value", [
    ("7e9", 7_000_000_000), ("7B", 7_000_000_000), ("7b", 7_000_000_000), ("1.5b", 1_500_000_000),
    ("350M", 350_000_000), ("350m", 350_000_000), ("7000000000", 7_000_000_000), ("7_000_000_000", 7_000_000_000),
    ("7,000,000,000", 7_000_000_000), ("1.2T", 1_200_000_000_000), ("125k", 125_000), ("  7B ", 7_000_000_000),
    ("0.1B", 100_000_000), ("1.5e9", 1_500_000_000), ("7G", 7_000_000_000), (".5B", 500_000_000),
])
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["seven", "7X", "", "7 B B", "nan", "inf", "1e", "B", "7BB", "--7"])
def test_parse_count_rejects_non_numeric(text):
    with pytest.raises(UserError) as e:
        parse_count(text)
    assert repr(text) in str(e.value)


@pytest.mark.parametrize("text", ["0", "-7e9", "0.0001"])
def test_parse_count_rejects_non_positive(text):
    with pytest.raises(UserError, match="positive"):
        parse_count(text)


# -- --params TOTAL-A<ACTIVE>: a mixture of experts ------------------------------------------------
#: the inferred total and active counts land within this of what was asked
MOE_TOLERANCE = 0.03


@pytest.mark.parametrize("value,total,active", [
    ("30B-A3B", 30e9, 3e9),  # source: Qwen/Qwen3-30B-A3B's name (30.5B total, 3.3B active)
    ("235B-A22B", 235e9, 22e9),  # source: Qwen/Qwen3-235B-A22B's name
    ("47B-A13B", 47e9, 13e9),  # source: Mixtral-8x7B (46.7B total, 12.9B active)
    ("16B-a2.4b", 16e9, 2.4e9),  # source: DeepSeek-V2-Lite (15.7B total, 2.4B active); lower case
    ("120B-A5B", 120e9, 5e9),  # source: gpt-oss-120b (117B total, 5.1B active)
])
def test_moe_params_land_near_total_and_active(value, total, active):
    from memcalc.inputs.infer import MOE_TOP_K, infer_params

    m, reasons = infer_params(value)
    assert m.moe is not None and m.moe.top_k == MOE_TOP_K and m.moe.n_experts % 8 == 0
    got_total = count_params(m).total
    got_active = got_total - m.n_layers * (m.moe.n_experts - m.moe.top_k) * 3 * m.d_model * m.moe.d_ff_expert
    assert abs(got_total - total) / total <= MOE_TOLERANCE
    assert abs(got_active - active) / active <= MOE_TOLERANCE
    assert reasons[0].startswith("inferred: Llama-style mixture of experts") and "active" in reasons[0]


@pytest.mark.parametrize("args,code,message", [
    (["estimate", "--params", "3B-A30B"], 2, "the active count must be below the total"),
    (["estimate", "--params", "30B-Ax"], 2, "--params 'x' is not a parameter count"),
    (["estimate", "--params", "30B-A3B", "--bf16", "--lora", "--seq", "256", "--json"], 0, ""),
])
def test_moe_params_cli(args, code, message):
    from typer.testing import CliRunner

    from memcalc.cli import app

    r = CliRunner().invoke(app, args)
    assert r.exit_code == code, r.output
    assert message in r.stderr
    if code == 0:
        inferred = json.loads(r.stdout)["inferred"]
        assert inferred[0].startswith("inferred: Llama-style mixture of experts")
        # the shipped preset of that size is named, the model stays the inferred one
        assert inferred[-1].startswith("a preset of this size exists: qwen3-30b-a3b (30.53B, 3.35B active)")
        assert json.loads(r.stdout)["model"].startswith("llama-style-moe-")


# -- --params names the shipped presets of the size typed (issue 29) ------------------------------
@pytest.mark.parametrize("value,note", [
    # source: Qwen/Qwen3-30B-A3B (30.53B total, 3.35B active: truncated in its name)
    ("30B-A3B", "a preset of this size exists: qwen3-30b-a3b (30.53B, 3.35B active); --model qwen3-30b-a3b"),
    # source: deepseek-ai/DeepSeek-V3's model card ("671B total parameters with 37B activated")
    ("671B-A37B", "a preset of this size exists: deepseek-v3 (671.03B, 37.55B active)"),
    # source: Mixtral-8x7B (46.70B total, 12.88B active: rounded up to 47B, 13B)
    ("47b-a13b", "a preset of this size exists: mixtral-8x7b"),
    # source: memcalc models (no Qwen3-235B-A22B preset ships): no line
    ("235B-A22B", None),
    # the typed precision: 30.5B reaches 30.45B-30.6B (30.53B in), 31B 30.5B-32B (in), 29B 28.5B-30B (out)
    ("30.5B-A3.3B", "qwen3-30b-a3b"), ("31B-A3B", "qwen3-30b-a3b"), ("29B-A3B", None),
    # an MoE form never names a dense preset, a dense count never an MoE one (qwen3-32b, qwen3-30b-a3b)
    ("32B-A32B", None), ("30B", None),
    # one digit typed: 3e10 reaches 25B-40B (qwen3-32b in)
    ("3e10", "a preset of this size exists: qwen3-32b (32.76B)"),
    # source: Qwen/Qwen3-4B (4.02B; llama-3.2-3b's 3.21B is below 3.5B)
    ("4B", "a preset of this size exists: qwen3-4b (4.02B); --model qwen3-4b uses its real shapes"),
    # several: the closest three and a count of the rest (7.5B to 9B: llama-3.1-8b, granite, qwen3-8b, qwen2.5-7b)
    ("8e9", "presets of this size exist: llama-3.1-8b (8.03B), granite-3.1-8b (8.17B), qwen3-8b (8.19B) and 1 more"),
    # a plain integer names itself only
    ("8030261248", "a preset of this size exists: llama-3.1-8b"), ("8000000000", None),
])
def test_params_name_the_preset_of_that_size(value, note):
    from memcalc.inputs.infer import preset_note

    total, _, active = value.partition("-")
    lines = preset_note(total, active[1:] if active else None)
    if note is None:
        assert lines == []
    else:
        assert len(lines) == 1 and (lines[0].startswith(note) or f": {note} (" in lines[0]), lines

"""``--kernels liger``: ``memcalc estimate`` against the real transformers + PEFT step with Liger-Kernel applied as
the Trainer applies it (``validate/hf_liger.py``: liger_kernel's Python unmodified, its Triton launches no-ops),
traced on meta, over :mod:`memcalc.validate.kernels_grid` (Llama, Mistral and Qwen2 scaled down, Gemma-2B at one
layer; full fine-tuning, LoRA on q,v and on every projection; checkpointing none and full; bf16 and fp32; all of
Liger's kernels, and FLCE alone).

# source: each row is a trace of transformers 5.24 + PEFT 0.21 + liger-kernel 0.8.5 on meta (kernels_grid.grid)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("liger_kernel")

from memcalc.validate.hf_runner import measure_hf  # noqa: E402
from memcalc.validate.kernels_grid import estimate_phases, grid  # noqa: E402

#: issue 27: "agree with memcalc estimate within 2% on the CI grids"
TOLERANCE_PCT = 2.0

_SMALL = ("llama-mini", "mistral-mini", "qwen2-mini")
#: rows whose gap is a residual of the HF rules that Liger's smaller head uncovers (kernels none: the same
#: bytes, hidden under the logits' peak)
KNOWN_GAPS: dict[str, str] = {
}

ITEMS = grid()


def _params():
    for name, exp in ITEMS:
        marks = [pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[name])] if name in KNOWN_GAPS else []
        yield pytest.param(name, exp, id=name, marks=marks)


def test_the_grid_is_at_least_30_setups():
    assert len(ITEMS) >= 30
    assert set(KNOWN_GAPS) <= {n for n, _ in ITEMS}


@pytest.mark.parametrize("name,exp", list(_params()))
def test_liger_estimate_matches_the_liger_trace(name, exp):
    meas = measure_hf(exp, "meta")
    assert meas.status == "ok", meas.reason
    predicted, _phases = estimate_phases(exp)
    gap_pct = (predicted - meas.measured_bytes) / meas.measured_bytes * 100
    assert abs(gap_pct) <= TOLERANCE_PCT, (
        f"{name}: predicted {predicted:,} B, traced {meas.measured_bytes:,} B ({gap_pct:+.2f}%)")


def test_liger_leaves_transformers_as_it_was():
    """After a Liger trace, the modeling module is transformers' own again (hf_liger.liger_trace restores it), so a
    later trace without Liger in the same process builds the unpatched model."""
    from transformers.models.llama import modeling_llama

    before = (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)
    _name, exp = ITEMS[0]
    assert measure_hf(exp, "meta").status == "ok"
    assert (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == before


def test_liger_refuses_what_it_does_not_model():
    """A family outside memcalc.core.liger's, or autocast: skipped with the estimator's one-line reason."""
    _name, exp = ITEMS[0]
    amp = exp.model_copy(update={"training": exp.training.model_copy(update={"precision": "amp-bf16"})})
    meas = measure_hf(amp, "meta")
    assert meas.status == "skipped" and "under autocast" in meas.reason

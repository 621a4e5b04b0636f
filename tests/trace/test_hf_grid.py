"""Issue 11's bar: ``memcalc estimate --framework hf`` within 2% of the real transformers + PEFT step
traced on the meta device (``memcalc validate --framework hf``), over the grid of
:mod:`memcalc.validate.hf_grid` (Llama, Mistral, Qwen2, GPT-2 and phi shapes at full width, 4 layers;
full fine-tuning, LoRA on q,v and on every projection, LoRA dropout 0 and 0.05; fp32, bf16 and
AMP; checkpointing none and full; batch and sequence varied).

# source: each row is a trace of transformers 5.x + PEFT 0.2x (versions in the validate records),
# AutoModelForCausalLM.from_config on meta, only kernel dispatch routed as CUDA's (validate/hf_kernels.py)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("peft")

from memcalc.validate.hf_grid import grid, hf_gap  # noqa: E402

#: issue 11: "within 2% of memcalc validate --framework hf --device meta"
TOLERANCE_PCT = 2.0

ITEMS = grid()


@pytest.mark.parametrize("name,exp", ITEMS, ids=[n for n, _ in ITEMS])
def test_hf_estimate_matches_the_hf_trace(name, exp):
    gap_pct, line = hf_gap(name, exp)
    assert abs(gap_pct) <= TOLERANCE_PCT, line

"""The load phase (memcalc.engine.loading): what each framework's loader allocates before the step.

The per-tensor quantizers are checked against their meta traces here (numbers below); whole loads
of torchtune and transformers against the libraries' own loaders in tests/trace/test_load_trace.py.
"""

from __future__ import annotations

import pytest

from memcalc.core.spec import ExperimentSpec
from memcalc.engine.loading import _summary, bnb_quantize_steps, load_phase, torchao_to_nf4_steps
from memcalc.engine.weights import param_rows

N = 256 * 512  # a 256 x 512 bf16 weight

# (steps, highest live bytes above the start, bytes that stay): exact, no tolerance
QUANTIZERS = [
    # source: bitsandbytes 0.50.2 functional.quantize_4bit traced on meta (fake kernels), no double
    # quantisation: peak 74,752 B, 74,240 B left (packed 65,536 + absmax 8,192 + code 512)
    (bnb_quantize_steps(N, 64, False), 74_752, 74_240),
    # source: the same with compress_statistics=True: peak 87,552 B and 71,168 B left, each with the
    # process-wide dynamic map (name2qmap, 1,024 B) made in that first call, which _bnb allocates once
    (bnb_quantize_steps(N, 64, True), 87_552 - 1_024, 71_168 - 1_024),
    # source: torchao 0.14.1 to_nf4 traced on meta: peak 9,051,136 B and 330,752 B left, both
    # counting the 262,144-byte input; + 512 B for the 16-value NF4 table torch.tensor makes on CUDA
    # (a factory the meta trace does not see)
    (torchao_to_nf4_steps(N, 2), 9_051_136 - 262_144 + 512, 330_752 - 262_144 + 512),
]


@pytest.mark.parametrize("steps,top,kept", QUANTIZERS, ids=["bnb", "bnb-dq", "torchao"])
def test_quantizer_steps(steps, top, kept):
    got_top, stays = _summary(steps, 512)
    assert (got_top, sum(n for _, n in stays)) == (top, kept)


def _exp(framework: str, qlora: bool = True) -> ExperimentSpec:
    from memcalc.api import _resolve

    opts = {"model": "llama-3.2-1b", "framework": framework, "batch": 1, "seq": 128}
    return _resolve(None, {**opts, "qlora": qlora} if qlora else {**opts, "lora": True}).exp


@pytest.mark.parametrize("framework,label", [
    ("hf", "prepare_model_for_kbit_training"),  # the head's fp32 copy beside its bf16 one, last
    ("torchtune", "load_state_dict"),  # an NF4 copy_ with every parameter built
    # the 4-bit head (weights.quantized_head: Lightning replaces torch.nn.Linear, lm_head too) quantized as
    # it is built: its bf16 init and fp16 copy (2 x 525 MB on llama-3.2-1b's 128,256 x 2,048 head) beside
    # the bf16 embedding, above the StableEmbedding swap's second embedding
    ("litgpt", "building lm_head.weight (_Linear4bit.quantize_)"),
])
def test_load_phase(framework, label):
    """The summarised phase equals the one that records every event; the events balance; the
    peak is at the loader step the framework's code puts it."""
    exp = _exp(framework)
    fast, full = load_phase(exp), load_phase(exp, events=True)
    assert (fast.peak_bytes, fast.peak_label, fast.live_bytes) == (full.peak_bytes, full.peak_label, full.live_bytes)
    assert full.peak_label.startswith(label), full.peak_label
    live: dict[int, int] = {}
    for uid, n in full.events or []:
        if n:
            live[uid] = n
        else:
            live.pop(uid)
    assert sum(live.values()) == full.live_bytes < full.peak_bytes


def test_without_qlora_the_load_is_the_weights():
    exp = _exp("hf", qlora=False)
    ld = load_phase(exp)
    assert ld.peak_bytes == ld.live_bytes == sum(r[1] for r in param_rows(exp))

"""Context parallelism (``--cp``, memcalc.engine.context_parallel), torch-free: bad input is one line, the
ring's replay (memcalc.core.ring_attention) balances, and the long-context row of issue 31 is answered.
The estimate against the traced rank is tests/trace/test_context_parallel.py (slow)."""

from __future__ import annotations

import pytest
from conftest import one_line_error
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.dtypes import DType
from memcalc.core.ring_attention import Shapes, ring_backward, ring_forward, worst_rank

TINY = ["estimate", "--params", "1e8", "--bf16"]

# (args, exit code, message)
CLI_ERRORS = [
    # source: torch 2.13 _HeadTailLoadBalancer: 2 x cp equal chunks per sequence
    ([*TINY, "--seq", "1000", "--cp", "8"], 2, "seq (1000) must divide by 2 x cp = 16"),
    # source: deepspeed 0.19 sequence/layer.py _generate_layout_params asserts heads % world == 0
    (["estimate", "--model", "llama-3.1-8b", "--bf16", "--seq", "6144", "--cp", "3", "--cp-method", "ulysses"],
     2, "n_heads (32) must divide by cp"),
    # source: memcalc.core.choices.CP_METHODS
    ([*TINY, "--cp", "2", "--cp-method", "striped"], 2, "unknown --cp-method 'striped'; valid: ring, ulysses"),
    ([*TINY, "--cp", "0"], 2, "--cp must be positive"),
    # source: torch 2.13 _sdpa_handler: the ring dispatches the flash / efficient kernels only (flash modelled)
    (["estimate", "--params", "1e8", "--precision", "fp32", "--seq", "512", "--cp", "2"], 2,
     "--cp-method ring is modelled with the flash kernel"),
]


@pytest.mark.parametrize("args,code,message", CLI_ERRORS)
def test_cli_errors(args, code, message):
    one_line_error(CliRunner().invoke(app, args), code, message)


def _live_after(events) -> dict:
    live: dict = {}
    for op, name, b in events:
        if op == "+":
            assert name not in live, f"{name} allocated twice"
            live[name] = b
        else:
            assert name in live, f"{name} freed but not alive"
            live.pop(name)
    return live


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("copies", [False, True])
def test_ring_replay_frees_all_but_its_results(cp, copies):
    # source: _templated_ring_attention returns (out, lse); the backward returns dq and one dk/dv buffer
    s = Shapes(2, 8, 4, 64, 32, DType.bf16, copies)
    for r in range(cp):
        assert set(_live_after(ring_forward(r, cp, s))) == {"out", "lse"}
        assert set(_live_after(ring_backward(r, cp, s))) == {"dq", "dkv"}
    assert 0 <= worst_rank(cp, s) < cp


@pytest.mark.slow  # two full-size estimates (about 1 s): torch-free, but over the quick lane's budget
def test_long_context_row_per_rank():
    # source: issue 31's Done-when row: Llama-3.1-8B at 1M tokens over 32 context-parallel ranks, per rank
    import memcalc.api

    one = memcalc.api.estimate(model="llama-3.1-8b", seq="32k", bf16=True, checkpoint="full").estimate.peak_bytes
    r = memcalc.api.estimate(model="llama-3.1-8b", seq="1m", cp=32, bf16=True, checkpoint="full").estimate
    # 1M tokens over 32 ranks is 32k tokens a rank: everything outside attention as at 32k on one GPU; the ring's
    # all-gathered K/V (32 x 2 x 8 kv heads x 32k x 128 x 2 B = 1 GiB) and fp32 accumulators live inside one
    # layer's attention, below the peak that the head and loss set (32k x 128,256 fp32 logits and their gradient)
    assert r.peak_bytes == one and "head" in r.peak_label


@pytest.mark.parametrize("cp", [2, 5, 32])
def test_compressed_ring_keeps_the_peak_and_the_end(cp):
    # source: memcalc.core.ring_attention.compressed: the simulator replays the ring as a few blocks
    from memcalc.core.ring_attention import compressed, summary

    s = Shapes(1, 32, 8, 4096, 128, DType.bf16, True)
    r = worst_rank(cp, s)
    for events in (list(ring_forward(r, cp, s)), list(ring_backward(r, cp, s))):
        assert summary(compressed(events, 512), 512) == summary(events, 512)


@pytest.mark.slow  # a cluster plan (about 1.5 s of CPU)
def test_plan_offers_context_parallelism_for_long_sequences():
    # source: memcalc.plan.layouts: from seq 16k the search tries dp x cp; at 128k tokens Llama-3.1-8B's
    # activations (its 128k x 128,256 fp32 logits alone are 64 GiB) need context parallelism on every card
    import memcalc.api

    plan = memcalc.api.plan(model="llama-3.1-8b", seq="128k")
    layouts = [g["layout_full"] for g in plan.options if g["layout_full"]]
    assert layouts and all(lay.get("cp", 1) > 1 for lay in layouts)


@pytest.mark.parametrize("tr,note", [
    # source: memcalc.core.ring_attention.gpus_note: --gpus counts data-parallel replicas of the tp x cp x pp
    # group (docs/multi-gpu.md; TrainingSpec.gpus), so --gpus 32 --cp 32 is 32 x 32 GPUs
    ({"gpus": 32, "cp": 32}, "gpus 32 counts data-parallel replicas, each of 32 GPUs (cp 32): 1,024 GPUs in all "
                             "(32 data-parallel x cp 32); for 32 GPUs in all set gpus 1"),
    # source: the same, the group being tp x pp
    ({"gpus": 2, "tp": 2, "pp": 2}, "gpus 2 counts data-parallel replicas, each of 4 GPUs (tp 2 x pp 2): 8 GPUs in "
                                    "all (2 data-parallel x tp 2 x pp 2); for 4 GPUs in all set gpus 1"),
    # source: the same: --gpus that equals no degree is taken as given (no note)
    ({"gpus": 4, "cp": 2}, None),
])
def test_gpus_equal_to_a_degree_is_noted(tr, note):
    from memcalc.core.ring_attention import gpus_note
    from memcalc.core.spec import TrainingSpec

    assert gpus_note(TrainingSpec(**tr)) == note

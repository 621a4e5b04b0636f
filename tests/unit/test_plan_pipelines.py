"""plan --model's pipeline x tensor-parallel layouts (memcalc/plan/pipelines.py, issue 31)."""

from __future__ import annotations

import shlex

import pytest

from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec
from memcalc.engine.pipeline import simulate_pp
from memcalc.estimate.peak import card_side, required_bytes
from memcalc.estimate.step import strategy_for
from memcalc.inputs.gpus import list_gpus
from memcalc.inputs.presets import load_preset
from memcalc.plan.cluster import cluster_setups
from memcalc.core.pipeline import simulated_ranks
from memcalc.plan.pipelines import pipeline_command, pipeline_degrees, search_pipelines, stage_peaks

TINY = ModelSpec(name="tiny", n_layers=12, d_model=64, n_heads=4, d_ff=128, vocab_size=512, max_seq_len=1024)


@pytest.mark.parametrize("pp,schedule,checkpoint,tp,M", [
    # source: memcalc.engine.pipeline.simulate_pp, every rank; the rule plan.pipelines.simulated_ranks relies on
    (4, "1f1b", "full", 1, 4), (4, "1f1b", "none", 2, 8), (6, "gpipe", "full", 2, 6),
    # source: as above, over torchtitan's uneven split (12 layers over 5 stages: 2, 3, 3, 3, 1): rank 1 holds the
    # most layers of the middle ranks (the extra layers go to the lowest stages)
    (5, "1f1b", "full", 1, 5),
    # source: the same for interleaved 1F1B (2 stages per rank): the warm-up falls by 2 forwards a hop
    pytest.param(6, "interleaved-1f1b", "none", 1, 6, marks=pytest.mark.slow),
])
def test_no_middle_rank_peaks_above_the_second(pp, schedule, checkpoint, tp, M):
    # the middle ranks hold the same layers and buffers; 1F1B's warm-up (pp - rank) is the second's the most
    tr = TrainingSpec(batch=M, seq=32, precision="bf16", master_weights=True, pp=pp, microbatches=M,
                      pp_schedule=schedule, checkpoint=checkpoint, tp=tp, sequence_parallel=tp > 1)
    exp = ExperimentSpec(model=TINY, training=tr)
    stages = simulate_pp(exp, strategy_for(exp), record_timeline=False, ranks=range(pp)).stages
    peaks = [s["peak_bytes"] for s in stages]
    assert max(peaks[1:pp - 1]) == peaks[1]
    picked = simulate_pp(exp, strategy_for(exp), record_timeline=False, ranks=[0, 1, pp - 1])
    assert picked.peak_bytes == max(peaks)
    assert simulated_ranks(pp) == (list(range(pp)) if pp <= 4 else [0, 1, pp - 1])


@pytest.mark.slow  # every rank of two pipelines (a second)
@pytest.mark.parametrize("pp,M", [(6, 12), (8, 8)])
def test_zero_bubble_simulates_the_second_to_last_rank_too(pp, M):
    # source: memcalc.engine.pipeline.simulate_pp, every rank: under zero bubble rank r defers r weight backwards
    # (ScheduleInterleavedZeroBubble num_1f1b_microbatches = rank), so the middle ranks peak higher down the line
    # (the even split, weights 0 and 0: every middle rank holds 2 layers; torchtitan's default split: the last
    # rank of each layer count is simulated too)
    for less in (0, 1):
        tr = TrainingSpec(batch=M, seq=32, precision="bf16", master_weights=True, pp=pp, microbatches=M,
                          pp_schedule="zero-bubble", pp_first_stage_less_layers=less, pp_last_stage_less_layers=less)
        exp = ExperimentSpec(model=TINY.model_copy(update={"n_layers": 2 * pp}), training=tr)
        peaks = [s["peak_bytes"] for s in simulate_pp(exp, strategy_for(exp), record_timeline=False,
                                                      ranks=range(pp)).stages]
        if not less:
            assert max(peaks[1:pp - 1]) == peaks[pp - 2] > peaks[1]
            assert simulated_ranks(pp, schedule="zero-bubble") == [0, 1, pp - 2, pp - 1]
        assert simulate_pp(exp, strategy_for(exp), record_timeline=False).peak_bytes == max(peaks)


@pytest.mark.slow  # every rank of three pipelines (about a second)
@pytest.mark.parametrize("schedule,V,M,less", [
    # source: memcalc.engine.pipeline.simulate_pp, every rank, FSDP2 under the multi-stage runtime
    # (engine.pipeline_fsdp: each stage's REDUCE_GRAD after its last backward; V 4 evicts and gathers again)
    ("interleaved-1f1b", 2, 6, 1), ("interleaved-1f1b", 4, 12, 1), ("zero-bubble", 2, 12, 0),
])
def test_fsdp2_multi_stage_picks_the_worst_rank(schedule, V, M, less):
    pp = 6
    tr = TrainingSpec(batch=M, seq=32, precision="bf16", master_weights=True, pp=pp, microbatches=M, gpus=4, zero=3,
                      pp_schedule=schedule, pp_stages_per_rank=V, pp_first_stage_less_layers=less,
                      pp_last_stage_less_layers=less)
    exp = ExperimentSpec(model=TINY.model_copy(update={"n_layers": 2 * pp * V}), training=tr)
    peaks = [s["peak_bytes"] for s in simulate_pp(exp, strategy_for(exp), record_timeline=False,
                                                  ranks=range(pp)).stages]
    assert simulate_pp(exp, strategy_for(exp), record_timeline=False).peak_bytes == max(peaks)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_middle_stage_of_other_layers_is_simulated_too(schedule):
    # source: memcalc.engine.pipeline.simulate_pp, every rank. Dense MLPs of width 16 in the first 3 layers, MoE
    # after (DeepSeek's first_k_dense_replace): with 2 layers a stage, rank 1 holds a dense and an MoE layer,
    # ranks 2-4 two MoE layers each, which under GPipe (every rank holds every micro-batch) peak above rank 1
    from memcalc.core.model_spec import MoESpec

    moe = TINY.model_copy(update={"d_ff": 16, "moe": MoESpec(n_experts=8, top_k=4, d_ff_expert=128,
                                                               first_dense_layers=3)})
    tr = TrainingSpec(batch=6, seq=32, precision="bf16", master_weights=True, pp=6, microbatches=6,
                      pp_schedule=schedule, pp_first_stage_less_layers=0, pp_last_stage_less_layers=0)  # (even)
    exp = ExperimentSpec(model=moe, training=tr)
    every = simulate_pp(exp, strategy_for(exp), record_timeline=False, ranks=range(6))
    assert simulated_ranks(6, moe, less=(0, 0)) == [0, 1, 2, 5]
    assert simulate_pp(exp, strategy_for(exp), record_timeline=False).peak_bytes == every.peak_bytes
    if schedule == "gpipe":
        peaks = [s["peak_bytes"] for s in every.stages]
        assert peaks[2] > peaks[1]  # the rule [0, 1, last] alone would have been low


def test_a_model_that_cannot_be_pipelined_says_why():
    # source: memcalc.core.pipeline.check_pp (tied embeddings, MoE and MLA are refused with --pp)
    tied = TINY.model_copy(update={"tie_embeddings": True})
    full = cluster_setups(tied, 64, _profile())["full"]["full"]
    tp, pps, why = pipeline_degrees(full)
    assert (tp, pps) == (None, [])
    assert "tied embeddings" in why


def test_degrees_tp_within_a_node_pp_the_divisors_and_powers_of_two():
    # source: llama-3.1-405b's 126 layers (data/hf_configs/meta-llama--Llama-3.1-405B.json), 128 heads, 8 kv heads;
    # the powers of two up to 126 + 2 split as torchtitan's default does (memcalc.core.pipeline.stage_layers)
    full = cluster_setups(load_preset("llama-3.1-405b"), 2048, _profile())["full"]["full"]
    assert pipeline_degrees(full) == (8, [2, 3, 4, 6, 7, 8, 9, 14, 16, 18, 21, 32, 42, 63, 64, 126, 128], None)


def _estimate_command(command: str):
    """``memcalc.api.estimate`` of a printed ``memcalc estimate ...`` command (its flags as keywords)."""
    from memcalc.api import estimate

    kw, flags = {}, iter(shlex.split(command)[2:])
    for a in flags:
        key = a[2:].replace("-", "_")
        kw[key] = True if key in ("master_weights", "sequence_parallel") else next(flags)
    return estimate(**{k: (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in kw.items()})


def _profile():
    from memcalc.inputs.profiles import DEFAULT_PROFILE, get_profile

    return get_profile(DEFAULT_PROFILE)


@pytest.mark.slow  # simulates TinyLlama's pipelines (seconds)
def test_each_row_is_the_fewest_and_its_command_reproduces_its_peak():
    # source: memcalc estimate of the row's command (every rank simulated); tolerance: none (bytes)

    model = load_preset("tinyllama-1.1b")  # 22 layers: pp 2, 4, 8, 11, 16, 22; 32 heads, 4 kv heads: tp 4
    full = cluster_setups(model, 1024, _profile())["full"]["full"]
    cards = [g for g in list_gpus() if g.name in ("rtx-4080", "a100-40gb", "h100-80gb")]
    rows, why = search_pipelines(full, cards)
    assert why is None
    for r in rows:
        lay = r.layout
        assert lay is not None and lay.tp == 4
        assert lay.required_bytes <= r.gpu.capacity_bytes
        smaller = [p for p in (2, 4, 8, 11, 16, 22) if p < lay.pp]
        if smaller:  # the next smaller pp does not fit (on the card's own GPU side)
            from memcalc.plan.pipelines import pipeline_setup

            below = pipeline_setup(full, smaller[-1], 4)
            assert required_bytes(stage_peaks(below).peak_bytes, card_side(below, r.gpu)) > r.gpu.capacity_bytes
        got = _estimate_command(pipeline_command(1024, lay, r.gpu.name, ["--model", "tinyllama-1.1b"]))
        assert got.peak_bytes == lay.peak_bytes, r.gpu.name
        # source: memcalc/core/gpu_side.py: each card's own context and workspaces (the rtx-4090's: Ada)
        assert lay.required_bytes == required_bytes(got.peak_bytes, card_side(got.spec, r.gpu)), r.gpu.name
        # source: memcalc/core/gpu_side.py: the rtx-4080's (Ada) context and workspaces, not the H100's
        assert lay.required_bytes == required_bytes(got.peak_bytes, card_side(got.spec, r.gpu)), r.gpu.name


# -- expert-parallel layouts (memcalc/plan/experts.py) ---------------------------------------------------------
def test_a_dense_model_has_no_expert_layouts_and_no_note():
    # source: memcalc.plan.experts.expert_refusal (no experts to shard: nothing to say)
    from memcalc.plan.experts import search_experts

    full = cluster_setups(TINY, 64, _profile())["full"]["full"]
    assert search_experts(full, list_gpus()) == ([], None)


def test_experts_ep_does_not_divide_says_why():
    # source: memcalc.core.expert_parallel.check_ep (ep 8 must divide the routed experts)
    from memcalc.core.spec import MoESpec
    from memcalc.plan.experts import search_experts

    moe = TINY.model_copy(update={"moe": MoESpec(n_experts=4, top_k=2, d_ff_expert=32)})
    full = cluster_setups(moe, 64, _profile())["full"]["full"]
    rows, why = search_experts(full, list_gpus())
    assert rows == [] and "must divide the routed experts (4)" in why


@pytest.mark.slow  # estimates Qwen3-30B-A3B at several GPU counts (seconds)
def test_expert_rows_are_the_fewest_counts_and_commands_reproduce_their_peaks():
    # source: memcalc estimate of the row's command; tolerance: none (bytes)
    from memcalc.plan.experts import COUNTS, expert_command, expert_setup, search_experts
    from memcalc.plan.simulations import estimated_peak

    full = cluster_setups(load_preset("qwen3-30b-a3b"), 2048, _profile())["full"]["full"]
    cards = [g for g in list_gpus() if g.name in ("rtx-4090", "h100-80gb")]
    rows, why = search_experts(full, cards)
    assert why is None
    for r in rows:
        lay = r.layout
        assert lay is not None and lay.required_bytes <= r.gpu.capacity_bytes
        i = COUNTS.index(lay.gpus)
        if i:
            smaller = expert_setup(full, COUNTS[i - 1])
            assert required_bytes(estimated_peak(smaller), card_side(smaller, r.gpu)) > r.gpu.capacity_bytes
        got = _estimate_command(expert_command(2048, lay, r.gpu.name, "fsdp2", ["--model", "qwen3-30b-a3b"]))
        assert got.peak_bytes == lay.peak_bytes, r.gpu.name
        # source: memcalc/core/gpu_side.py: each card's own context and workspaces (the rtx-4090's: Ada)
        assert lay.required_bytes == required_bytes(got.peak_bytes, card_side(got.spec, r.gpu)), r.gpu.name


def test_a_sequence_tp_does_not_divide_takes_no_tensor_parallelism():
    # source: memcalc.engine.tensor_parallel.TensorParallel.of (sequence parallelism needs seq % tp == 0);
    # plan --model llama-3.1-8b --seq 1001 stopped with that error before
    from memcalc.plan.layouts import tp_degrees

    full = cluster_setups(load_preset("llama-3.1-405b"), 1001, _profile())["full"]["full"]
    assert tp_degrees(full) == []
    assert pipeline_degrees(full)[0] == 1
    full = cluster_setups(load_preset("llama-3.1-405b"), 1002, _profile())["full"]["full"]
    assert tp_degrees(full) == [2] and pipeline_degrees(full)[0] == 2


def test_a_moe_model_pipelines_over_expert_parallel_ranks_not_tensor_parallel():
    # source: memcalc.plan.pipelines.pipeline_ep (torchtitan's MoE layout: ep within the node, tp 1); 12 routed
    # experts: 8 does not divide them, 4 does
    from memcalc.core.spec import MoESpec
    from memcalc.plan.pipelines import pipeline_ep

    moe = TINY.model_copy(update={"moe": MoESpec(n_experts=12, top_k=2, d_ff_expert=32)})
    full = cluster_setups(moe, 64, _profile())["full"]["full"]
    assert pipeline_ep(full) == 4 and pipeline_ep(cluster_setups(TINY, 64, _profile())["full"]["full"]) == 1
    assert pipeline_degrees(full) == (1, [2, 3, 4, 6, 8, 12], None)


@pytest.mark.slow  # simulates Qwen3-30B-A3B's pipelines (seconds)
def test_moe_pipeline_rows_are_pp_x_ep_and_commands_reproduce_their_peaks():
    # source: memcalc estimate of the row's command (--ep 8 --gpus 8: the stage's expert-parallel ranks); tolerance:
    # none (bytes)

    full = cluster_setups(load_preset("qwen3-30b-a3b"), 2048, _profile())["full"]["full"]
    cards = [g for g in list_gpus() if g.name in ("rtx-4090", "h100-80gb")]
    rows, why = search_pipelines(full, cards)
    assert why is None
    for r in rows:
        lay = r.layout
        assert lay is not None and (lay.tp, lay.ep) == (1, 8) and lay.gpus == lay.pp * 8
        assert lay.required_bytes <= r.gpu.capacity_bytes
        source = ["--model", "qwen3-30b-a3b", "--framework", "plain"]  # _profile()'s framework
        got = _estimate_command(pipeline_command(2048, lay, r.gpu.name, source))
        assert got.peak_bytes == lay.peak_bytes, r.gpu.name
        assert got.spec.training.ep == 8 and got.spec.training.gpus == 8

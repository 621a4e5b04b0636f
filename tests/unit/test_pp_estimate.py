"""Pipeline parallelism in the estimator, torch-free: the schedules' action orders, what a rank holds, and
the inputs it refuses.

The traced grid (the estimate against torch.distributed.pipelining's real schedules on the fake process
group, every rank) is ``tests/trace/test_pp_grid.py`` (slow); it also checks :func:`actions` against torch's
own pipeline order.
"""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.pipeline import stage_layers
from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec
from memcalc.core.pp_schedules import rank_actions
from memcalc.engine.pipeline import actions
from memcalc.estimate.peak import estimate

MODEL = ModelSpec(name="tiny", n_layers=4, d_model=128, n_heads=4, d_ff=256, vocab_size=256, max_seq_len=512)


def exp(**tr) -> ExperimentSpec:
    return ExperimentSpec(model=MODEL, training=TrainingSpec(seq=64, **{"batch": 4, **tr}))


@pytest.mark.parametrize("schedule,pp,M,rank,order", [
    # source: torch 2.13 schedules.py ScheduleGPipe._step_microbatches (all forwards, then all backwards)
    ("gpipe", 2, 3, 1, "F0 F1 F2 B0 B1 B2"),
    # source: Schedule1F1B._step_microbatches: warmup min(M, pp - rank) forwards, then B/F in turn, B first
    ("1f1b", 4, 6, 0, "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"),
    ("1f1b", 4, 6, 3, "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"),
    ("1f1b", 2, 2, 0, "F0 F1 B0 B1"),
])
def test_actions_follow_torchs_loops(schedule, pp, M, rank, order):
    assert " ".join(f"{k}{i}" for k, i in actions(schedule, pp, M, rank)) == order


@pytest.mark.parametrize("schedule,pp,V,M,rank,order", [
    # source: torch 2.13 ScheduleInterleaved1F1B.pipeline_order[0] for 2 ranks x 2 stages, 4 micro-batches:
    # warm-up (V - 1) * 2 + 2 * (pp - 1 - rank) = 4 forwards, depth first (two micro-batches per stage in turn)
    ("interleaved-1f1b", 2, 2, 4, 0, "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3"),
    # source: the same schedule's pipeline_order[1] (the last rank: warm-up 2 forwards, stage 3 holds the head)
    ("interleaved-1f1b", 2, 2, 4, 1, "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3"),
    # source: ScheduleInterleavedZeroBubble.pipeline_order[1]: each backward split into I (input) and W (weights),
    # the W from step warm-up + rank on, the rest at the end
    ("zero-bubble", 2, 2, 4, 1, "F1.0 F1.1 F3.0 I3.0 F3.1 I3.1 W3.0 F1.2 I1.0 W3.1 F1.3 I1.1 W1.0 F3.2 I3.2 W1.1 "
                                "F3.3 I3.3 W3.2 I1.2 W3.3 I1.3 W1.2 W1.3"),
])
def test_multi_stage_orders_follow_torchs_pipeline_order(schedule, pp, V, M, rank, order):
    assert " ".join(f"{k}{s}.{i}" for k, s, i in rank_actions(schedule, pp, V, M, rank)) == order


@pytest.mark.slow  # two pipelines' every rank (0.1 s): the traced grid covers the numbers
def test_zero_bubble_keeps_more_than_interleaved():
    # source: invariant -- the same order of forwards, but each micro-batch's graph and its intermediates'
    # gradients stay from I to W, and the input gradients to the step's end: never less than interleaved 1F1B
    common = dict(pp=2, microbatches=4, batch=4, precision="bf16")
    zb = estimate(exp(pp_schedule="zero-bubble", **common))
    il = estimate(exp(pp_schedule="interleaved-1f1b", **common))
    assert zb.peak_bytes > il.peak_bytes
    assert zb.extra["pipeline"]["torch_schedule"] == "ScheduleInterleavedZeroBubble"


def test_interleaved_rank_holds_its_looped_stages():
    # source: generate_stage_to_rank_mapping(style="loop"): rank r holds stages r, r + pp; the embedding on stage 0
    # (rank 0), the head on stage pp * V - 1 (the last rank); every rank's stages reported
    est = estimate(exp(pp=2, microbatches=2, pp_schedule="interleaved-1f1b", batch=2))
    pipe = est.extra["pipeline"]
    assert pipe["stages_per_rank"] == 2 and pipe["torch_schedule"] == "ScheduleInterleaved1F1B"
    assert [[s["stage"] for s in r["stages"]] for r in pipe["stages"]] == [[0, 2], [1, 3]]
    # (torchtitan's split of 4 layers over 4 stages, _generate_llm_fqn_per_model_part(4, 4): 1, 2, 1, 0)
    assert [[s["layers"] for s in r["stages"]] for r in pipe["stages"]] == [[[0, 1], [3, 4]], [[1, 3], [4, 4]]]


@pytest.mark.parametrize("n_layers,pp,less,split", [
    # source: torchtitan 0.3.0 distributed/pipeline_parallel.py _generate_llm_fqn_per_model_part(4, 8), pipeline_llm's
    # default weights (config/configs.py pipeline_parallel_{first,last}_stage_less_layers = 1): 10 effective
    # layers, 2 + 1 to the first 2 stages, the first and last one layer less, even where 4 divides 8
    (8, 4, (1, 1), [(0, 2), (2, 5), (5, 7), (7, 8)]),
    # source: _generate_llm_fqn_per_model_part(4, 32): Llama-3 8B's 32 layers over 4 stages, 8, 9, 8, 7
    (32, 4, (1, 1), [(0, 8), (8, 17), (17, 25), (25, 32)]),
    # source: _generate_llm_fqn_per_model_part(4, 32, 0, 0): weights 0 and 0, the even split
    (32, 4, (0, 0), [(0, 8), (8, 16), (16, 24), (24, 32)]),
    # source: _generate_llm_fqn_per_model_part(3, 32, 0, 0): 32 over 3, one more to the first 2
    (32, 3, (0, 0), [(0, 11), (11, 22), (22, 32)]),
    # source: _generate_llm_fqn_per_model_part(4, 32, 2, 1): 35 effective, 9 to the first 3, 7, 9, 9, 7
    (32, 4, (2, 1), [(0, 7), (7, 16), (16, 25), (25, 32)]),
    # source: _generate_llm_fqn_per_model_part(8, 61): 63 effective layers, 7 + 1 to the first 7 stages, the first
    # and last one layer less (embedding, head)
    (61, 8, (1, 1), [(0, 7), (7, 15), (15, 23), (23, 31), (31, 39), (39, 47), (47, 55), (55, 61)]),
    # source: _generate_llm_fqn_per_model_part(2, 3): 5 effective layers, 3 + 2, less one each
    (3, 2, (1, 1), [(0, 2), (2, 3)]),
    # source: _generate_llm_fqn_per_model_part(3, 1): the end stages hold only the embedding / the head
    (1, 3, (1, 1), [(0, 0), (0, 1), (1, 1)]),
])
def test_split(n_layers, pp, less, split):
    assert stage_layers(n_layers, pp, 1, *less) == split


def test_stages_hold_their_share_and_gpipe_holds_more():
    # source: invariant -- a stage holds its layers' weights only; GPipe keeps every micro-batch in flight,
    # 1F1B at most pp - rank (so never more)
    one = estimate(exp())
    two = estimate(exp(pp=2, microbatches=4))
    stages = two.extra["pipeline"]["stages"]
    assert len(stages) == 2 and two.components["weights"] < one.components["weights"]
    assert two.peak_bytes == max(s["peak_bytes"] for s in stages)
    gpipe = estimate(exp(pp=2, microbatches=4, pp_schedule="gpipe"))
    assert gpipe.peak_bytes > two.peak_bytes


def test_fsdp2_under_pp_never_reshards_after_forward():
    # source: torchtitan 0.3.0 distributed/fsdp.py get_fsdp_reshard_after_forward_policy("default", pp_enabled=True)
    # is False, so --zero 2 and --zero 3 run the same step; the stage's unsharded parameters stay (pipelining's
    # set_reshard_after_backward(False) until perform_reduce_grad) and its fp32 gradients accumulate unsharded
    z3 = estimate(exp(pp=2, microbatches=2, gpus=2, zero=3, precision="bf16", master_weights=True))
    z2 = estimate(exp(pp=2, microbatches=2, gpus=2, zero=2, precision="bf16", master_weights=True))
    assert z3.peak_bytes == z2.peak_bytes
    assert {"unsharded gradients (FSDP2, accumulated)", "unsharded parameters (FSDP2)"} <= set(z3.components)


def run(args: list[str]):
    return CliRunner().invoke(app, ["estimate", "--model", "llama-2-7b", *args])


@pytest.mark.slow  # (torch-free; a three-rank estimate of 22 layers through the CLI: about half a second)
def test_uneven_split_on_the_command_line():
    # source: torchtitan 0.3.0 _generate_llm_fqn_per_model_part(3, 22): 24 effective layers, 8 a stage, the ends one
    # less (tinyllama-1.1b's 22 layers over 3 stages: 7, 8, 7)
    import json

    r = CliRunner().invoke(app, ["estimate", "--model", "tinyllama-1.1b", "--pp", "3", "--batch", "3", "--seq", "64",
                                 "--json"])
    assert r.exit_code == 0, r.output
    stages = json.loads(r.output)["pipeline"]["stages"]
    assert [s["layers"] for s in stages] == [[0, 7], [7, 15], [15, 22]]


@pytest.mark.parametrize("args,code,message", [
    # source: torchtitan 0.3.0 _generate_llm_fqn_per_model_part raises for more stages than layers + 2
    (["--pp", "35", "--batch", "35"], 2, "'Number of stages (35) cannot be greater than effective layers (34)'"),
    # source: torch Schedule1F1B.__init__ raises for n_microbatches < num_stages
    (["--pp", "4", "--microbatches", "2", "--batch", "4"], 2, "needs --microbatches >= --pp: 2 < 4"),
    # source: TrainingSpec.pp_schedule's Literal (pydantic lists the valid names)
    (["--pp", "2", "--batch", "2", "--pp-schedule", "zb"], 2,
     "pp_schedule = 'zb': Input should be 'gpipe', '1f1b', 'interleaved-1f1b', 'zero-bubble' or 'zbv-zero-bubble'"),
    # source: torch ScheduleInterleaved1F1B.__init__: M % max(1, M // pp) must be 0
    (["--pp", "4", "--pp-schedule", "interleaved-1f1b", "--microbatches", "9", "--batch", "9"], 2,
     "needs --microbatches a multiple of its rounds, max(1, 9 // 4) = 2: 9 is not"),
    # source: torchtitan 0.3.0 _get_pipeline_metadata: multi-stage schedules need >= 2 stages per rank
    (["--pp", "4", "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "1"], 2,
     "needs --pp-stages-per-rank >= 2, not 1"),
    # source: the same: single-stage schedules hold exactly 1 stage per rank
    (["--pp", "4", "--pp-stages-per-rank", "2"], 2, "--pp-schedule 1f1b runs one stage per rank"),
    # source: torchtitan 0.3.0 _generate_llm_fqn_per_model_part(4, 32, 12, 1): 45 effective, 11 a stage
    (["--pp", "4", "--batch", "4", "--pp-first-stage-less-layers", "12"], 2,
     "raises 'input_weight (12) exceeds minimum layers per stage (11).'"),
    # source: _generate_llm_fqn_per_model_part(4, 32, 0, 11): 43 effective, 10 a stage
    (["--pp", "4", "--batch", "4", "--pp-first-stage-less-layers", "0", "--pp-last-stage-less-layers", "11"], 2,
     "raises 'output_weight (11) exceeds minimum layers per stage (10).'"),
    # source: _generate_llm_fqn_per_model_part(33, 32, 0, 0): 33 stages, 32 effective layers
    (["--pp", "33", "--batch", "33", "--pp-first-stage-less-layers", "0", "--pp-last-stage-less-layers", "0"], 2,
     "'Number of stages (33) cannot be greater than effective layers (32)'"),
    # source: TrainingSpec.pp_first_stage_less_layers ge=0 (a weight below 0 is not a count of layers less)
    (["--pp", "2", "--batch", "2", "--pp-first-stage-less-layers", "-1"], 2,
     "pp_first_stage_less_layers = -1: Input should be greater than or equal to 0"),
    # source: torchtitan 0.3.0 _generate_llm_fqn_per_model_part over pp x V stages: no more than the layers + 2
    (["--pp", "12", "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "3", "--batch", "12"], 2,
     "'Number of stages (36) cannot be greater than effective layers (34)'"),
    # source: memcalc.core.pipeline.check_pp: FSDP2 (--zero 2/3) composes with --pp, ZeRO-1 / DeepSpeed do not
    (["--pp", "2", "--batch", "2", "--gpus", "2", "--zero", "1"], 2, "not with --sharding fsdp2 --zero 1 over"),
    # source: torchtitan 0.3.0 apply_fsdp_to_decoder: experts Shard(1) when the FSDP degree exceeds the experts, and
    # torch 2.13 fully_shard raises on an uneven dim 1 (Mixtral's gate_up 28672 over 12)
    (["--model", "mixtral-8x7b", "--pp", "2", "--batch", "2", "--gpus", "12", "--zero", "3"], 2,
     "'FSDP does not support uneven sharding on dim 1'"),
    # source: torchtitan 0.3.0 parallel_dims.py: the ep ranks are borrowed from each stage's data-parallel ranks
    (["--model", "mixtral-8x7b", "--pp", "2", "--batch", "2", "--ep", "2"], 2, "--ep 2 must divide --gpus 1"),
    # source: memcalc.core.pipeline.check_pp: torchtitan composes its ring attention (not DeepSpeed's Ulysses)
    # with pipelines
    (["--pp", "2", "--batch", "2", "--cp", "2", "--cp-method", "ulysses"], 2,
     "not with --cp-method ulysses (torchtitan composes its ring attention with pipelines"),
    # source: memcalc.core.pipeline.check_pp: FSDP2 over a stage's dp x cp ranks composes; ZeRO-1 over them does not
    (["--pp", "2", "--batch", "2", "--cp", "2", "--zero", "1"], 2,
     "not with --cp with --sharding fsdp2 --zero 1 (FSDP2, --zero 2 or 3, composes)"),
])
def test_bad_pipeline_input_is_one_line(args, code, message):
    r = run(args)
    assert r.exit_code == code, r.output
    assert message in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("tr,message", [
    # source: torch 2.13 torch/utils/checkpoint.py CheckpointFunction.backward: reentrant checkpointing raises under
    # torch.autograd.grad, which zero bubble's input backward is (_backward.py stage_backward_input)
    ({"pp_schedule": "zero-bubble", "checkpoint": "full", "checkpoint_reentrant": True},
     "incompatible with .grad()"),
    # source: torch 2.13 schedules.py ScheduleZBVZeroBubble.__init__: 'ZBV requires exactly 2 stages per rank'
    ({"pp_schedule": "zbv-zero-bubble", "pp_stages_per_rank": 3}, "exactly 2 stages per rank"),
])
def test_multi_stage_refusals(tr, message):
    from memcalc.core.errors import UserError
    from memcalc.core.pipeline import check_pp

    with pytest.raises(UserError, match=re.escape(message)):
        check_pp(exp(pp=2, microbatches=2, batch=2, **tr))


def test_pp_by_ep_stage_holds_n_experts_over_ep():
    # source: hand count, torchtitan 0.3.0 moe_sharding.expert_param_placement_sparse (Shard(0) over ep) on each
    # stage: rank 1 of pp 2 holds layer 1 (an MoE layer) and the head; ep 2 leaves it 4 of the 8 experts, 4 x
    # (gate_up 2 x 64 x 128 + down 128 x 64) = 98,304 elements fewer: bf16 weights 2 bytes each, AdamW's two bf16
    # moments 4 bytes
    from memcalc.core.spec import MoESpec

    moe = MODEL.model_copy(update={"n_layers": 2, "moe": MoESpec(n_experts=8, top_k=2, d_ff_expert=64)})

    def est(ep: int):
        return estimate(ExperimentSpec(model=moe, training=TrainingSpec(
            batch=2, seq=64, precision="bf16", pp=2, microbatches=2, gpus=2, ep=ep)))

    one, two = est(1), est(2)
    assert one.peak_label.startswith("rank 1 ") and two.peak_label.startswith("rank 1 ")
    n = 4 * (2 * 64 * 128 + 128 * 64)
    c1, c2 = one.components, two.components  # (the gradients alive differ with the moment of each peak)
    assert (c1["weights"] - c2["weights"], c1["optimizer state"] - c2["optimizer state"]) == (2 * n, 4 * n)


def test_pp_by_ep_by_fsdp2_shards_the_experts_over_efsdp():
    # source: hand count, torchtitan 0.3.0 distributed/fsdp.py apply_fsdp_to_decoder (ep_degree 2: the routed
    # experts on the efsdp mesh, gpus / ep = 2 ranks, the rest over the 4 data-parallel ranks; torch 2.13 makes one
    # FSDPParamGroup per mesh) on each stage (memcalc.engine.pipeline_ep_fsdp): rank 1 holds layer 1's 4 local
    # experts, 4 x (gate_up 2 x 64 x 128 + down 128 x 64) elements, bf16: a shard of half of them at rest, all 4
    # unsharded from micro-batch 0's all-gather to the end (no reshard under pipelining)
    from memcalc.core.spec import MoESpec

    moe = MODEL.model_copy(update={"n_layers": 2, "moe": MoESpec(n_experts=8, top_k=2, d_ff_expert=64)})
    est = estimate(ExperimentSpec(model=moe, training=TrainingSpec(
        batch=2, seq=64, precision="bf16", pp=2, microbatches=2, gpus=4, ep=2, zero=3)))
    experts = 4 * (2 * 64 * 128 + 128 * 64) * 2
    assert est.components["weights (FSDP2 shard 1/2)"] == experts // 2
    dense = estimate(ExperimentSpec(model=moe, training=TrainingSpec(
        batch=2, seq=64, precision="bf16", pp=2, microbatches=2, gpus=4, zero=3)))
    assert dense.components["unsharded parameters (FSDP2)"] - est.components["unsharded parameters (FSDP2)"] == experts


def test_pp_by_cp_stages_exchange_the_sequence_shard():
    # source: torchtitan 0.3.0 trainer.py pp_forward_backward_step: every micro-batch is cp-sharded
    # (prepare_context_parallel_input -> cp_shard) before the schedule runs, so torch's PipelineStage receives
    # (b, seq / cp, d) hidden states (stage.py _setup_forward_recv_info / _create_grad_recv_info): rank 0 (the first
    # stage) holds M = 2 gradient buffers of 2 x 64 / 2 x 128 bf16 elements, 16,384 bytes each; beside the whole
    # batch (4 x 64 int64 ids and labels, 2,048 bytes each) the shards cp_shard makes, 1,024 bytes each
    def est(cp: int):
        return estimate(exp(pp=2, microbatches=2, precision="bf16", cp=cp))

    one, two = est(1), est(2)
    assert one.peak_label.startswith("rank 0 ") and two.peak_label.startswith("rank 0 ")
    c1, c2 = one.components, two.components
    assert (c1["pipeline receive buffers"], c2["pipeline receive buffers"]) == (2 * 32_768, 2 * 16_384)
    assert (c1["inputs"], c2["inputs"]) == (2 * 2_048, 2 * 2_048 + 2 * 1_024)


def test_pp_by_cp_fsdp2_shards_over_dp_times_cp():
    # source: torchtitan 0.3.0 parallelize_llama: apply_fsdp_to_decoder on the dp_shard_cp mesh (the data-parallel
    # and context-parallel ranks flattened; memcalc.engine.context_parallel.shard_group): --cp 2 --zero 3 shards each
    # stage over 2 ranks, as --gpus 2 --zero 3 does (the same shards, optimizer state and unsharded parameters)
    def parts(**tr):
        c = estimate(exp(pp=2, microbatches=2, precision="bf16", zero=3, **tr)).components
        return c["weights (FSDP2 shard 1/2)"], c["optimizer state"], c["unsharded parameters (FSDP2)"]

    assert parts(cp=2) == parts(gpus=2)

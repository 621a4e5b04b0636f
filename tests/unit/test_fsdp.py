"""FSDP2's per-rank model (memcalc.engine.fsdp): quick, torch-free invariants and rules.

The traced grid (the estimate against FSDP2's real code on PyTorch's fake process group) is
``tests/trace/test_fsdp_grid.py`` (slow lane).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.dtypes import DType
from memcalc.core.spec import ExperimentSpec, TrainingSpec
from memcalc.engine.fsdp import fsdp2_active, host_offload_bytes, padded_shard_numel, policy
from memcalc.engine.params import count_params
from memcalc.engine.timeline import weights_and_state_bytes
from memcalc.estimate.peak import estimate
from memcalc.inputs.infer import infer_from_params

SMALL, _ = infer_from_params(1e8)  # a Llama-style ~100M model: quick to simulate
SMALL = SMALL.model_copy(update={"n_layers": 3})


def _exp(**tr) -> ExperimentSpec:
    base = dict(batch=1, seq=128, precision="bf16", master_weights=True, zero=3, gpus=4)
    return ExperimentSpec(model=SMALL, training=TrainingSpec(**{**base, **tr}))


@pytest.mark.parametrize("shape,gpus,elems", [
    # source: _fsdp_param.py FSDPParam._init_sharded_param: torch.chunk on dim 0, every shard padded
    # to chunk 0's size (ceil(rows / N) rows)
    ((4096, 4096), 8, 512 * 4096),
    ((256, 2048), 3, 86 * 2048),  # 256 rows over 3 ranks: 86, 86, 84 -> padded to 86
    ((32000, 2048), 16, 2000 * 2048),
    ((2048,), 3, 683),  # a norm weight: 1-D, rows = elements
    ((5, 7), 8, 7),  # fewer rows than ranks: one row each, the rest empty but padded
])
def test_padded_shard_numel(shape, gpus, elems):
    assert padded_shard_numel(shape, gpus) == elems


@pytest.mark.parametrize("precision,master,orig,param,reduce", [
    # source: torchtitan's default MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over
    # fp32 shards (_fsdp_param.py init_dtype_attrs clamps a dtype equal to the original to None)
    ("bf16", True, DType.fp32, DType.bf16, DType.fp32),
    ("fp16", True, DType.fp32, DType.fp16, DType.fp32),
    ("bf16", False, DType.bf16, DType.bf16, DType.bf16),  # source: pure bf16, no policy
    ("fp32", False, DType.fp32, DType.fp32, DType.fp32),  # source: fp32, no policy
    ("amp-bf16", False, DType.fp32, DType.fp32, DType.fp32),  # source: autocast casts inside ops
])
def test_policy_dtypes(precision, master, orig, param, reduce):
    pol = policy(TrainingSpec(precision=precision, master_weights=master, zero=3, gpus=8))
    assert (pol.orig, pol.param, pol.reduce) == (orig, param, reduce)


@pytest.mark.parametrize("zero,gpus,sharding,active", [  # FSDP2 only (FSDP1: engine.fsdp1)
    (3, 8, "fsdp2", True), (2, 8, "fsdp2", True),
    (3, 1, "fsdp2", False),  # source: one GPU, nothing to shard
    (1, 8, "fsdp2", False),  # source: FSDP has no stage 1 (DDP + ZeroRedundancyOptimizer instead)
    (3, 8, "fsdp1", False), (3, 8, "deepspeed", False),
])
def test_fsdp2_runs_only_when_it_shards(zero, gpus, sharding, active):
    assert fsdp2_active(TrainingSpec(zero=zero, gpus=gpus, sharding=sharding)) is active


@pytest.mark.parametrize("zero", [2, 3])
def test_more_ranks_never_more_weights_and_state(zero):
    # source: every FSDP2 shard is ceil(rows / N) rows, non-increasing in N
    seen = [weights_and_state_bytes(_exp(zero=zero, gpus=n)) for n in (2, 4, 8, 16)]
    assert seen == sorted(seen, reverse=True) and seen[0] > seen[-1]


@pytest.mark.parametrize("tr", [
    {}, {"checkpoint": "full"}, {"precision": "fp32", "master_weights": False}, {"master_weights": False},
    {"gpus": 16}, {"grad_accum": 2},
])
def test_zero2_peak_at_least_zero3(tr):
    # source: reshard_after_forward=False (zero 2) keeps every layer's unsharded parameters from its
    # forward to its backward; True (zero 3) frees them and all-gathers again
    z3 = estimate(_exp(**{**tr, "zero": 3}), timeline=False).peak_bytes
    z2 = estimate(_exp(**{**tr, "zero": 2}), timeline=False).peak_bytes
    assert z2 >= z3


def test_fsdp2_buffers_in_the_breakdown():
    est = estimate(_exp(), timeline=False)
    # source: _fsdp_param_group.py _root_post_backward_final_callback: this small model (a large
    # vocabulary for its size) peaks in the root's reduce-scatter at the end of backward, with the
    # reduce-scatter input (N x the root's shard, fp32) and the fp32 gradient shards alive
    assert {"reduce-scatter buffers (FSDP2)", "gradient shards (FSDP2)"} <= set(est.components)
    assert est.peak_phase == "backward"


def test_mixed_precision_has_no_master_copy():
    # source: _fsdp_api.py MixedPrecisionPolicy: "The optimizer step uses the sharded parameter in the
    # original dtype" -- the optimizer steps fp32 shards: two fp32 AdamW moments per shard element
    n = count_params(SMALL).total
    with_mp = weights_and_state_bytes(_exp(gpus=4))
    shards = 4 * n / 4 + 8 * n / 4  # fp32 shards + two fp32 moments, over 4 ranks
    assert abs(with_mp - shards) / shards < 0.01


def test_lora_master_weights_keep_the_frozen_base_16_bit():
    # source: accelerate 1.15 utils/fsdp_utils.py fsdp2_prepare_model casts up the trainable parameters only
    # (torch 2.13 _fsdp_param_group.py _init_mp_dtypes: one original dtype among the trainable ones): bf16 base
    # shards, fp32 adapter shards and moments (tests/trace/test_fsdp_grid.py traces it)
    from memcalc.core.spec import LoraSpec

    lora = LoraSpec(rank=16)
    n, trainable = count_params(SMALL).total, count_params(SMALL, lora).trainable
    got = weights_and_state_bytes(_exp(lora=lora))
    want = (2 * (n - trainable) + (4 + 8) * trainable) / 4
    assert abs(got - want) / want < 0.01, (got, want)
    host = host_offload_bytes(_exp(lora=lora, offload_optimizer=True))
    assert host < host_offload_bytes(_exp(offload_optimizer=True))


def test_offload_host_bytes_and_gpu_without_shards():
    # source: CPUOffloadPolicy (_fsdp_param.py: shards moved to CPU; foreach_reduce copies each
    # gradient shard to CPU; the optimizer steps there): host = shards + gradient shards + state
    exp = _exp(offload_optimizer=True)
    n = count_params(SMALL).total
    host = host_offload_bytes(exp)
    assert abs(host - (4 + 4 + 8) * n / 4) / ((4 + 4 + 8) * n / 4) < 0.01
    assert weights_and_state_bytes(exp) == 0
    assert estimate(exp, timeline=False).extra["host_offload_bytes"] == host


_ARGS = ["estimate", "--params", "1e8", "--seq", "128", "--bf16", "--master-weights", "--gpu", "rtx-4090"]


@pytest.mark.parametrize("args,code,message", [
    # source: the inputs table names whose mechanics run (engine.fsdp.sharding_mechanics)
    (_ARGS + ["--zero", "3", "--gpus", "8"], 0,
     "ZeRO-3 over 8 GPUs (FSDP2, reshard after forward, MixedPrecisionPolicy bf16/fp32)"),
    (_ARGS + ["--zero", "2", "--gpus", "8"], 0, "(FSDP2, no reshard after forward"),
    (_ARGS + ["--zero", "1", "--gpus", "8"], 0, "FSDP has no stage 1"),
    (_ARGS + ["--zero", "3", "--gpus", "8", "--sharding", "fsdp1"], 0,
     "(FSDP1, FULL_SHARD, flat parameters, MixedPrecision bf16/fp32)"),
    (_ARGS + ["--zero", "2", "--gpus", "8", "--sharding", "fsdp1"], 0, "(FSDP1, SHARD_GRAD_OP"),
    (_ARGS + ["--zero", "3", "--gpus", "8", "--sharding", "deepspeed"], 0, "DeepSpeed: flat fp32 partition, reduce buckets, per-layer gathers"),
    (_ARGS + ["--zero", "3", "--gpus", "8", "--offload-optimizer"], 0, "FSDP2 CPUOffloadPolicy"),
    (_ARGS + ["--zero", "3", "--sharding", "fsdp1"], 0, "sharding fsdp1 has no effect"),
    (_ARGS + ["--zero", "3", "--gpus", "8", "--sharding", "nope"], 2, "fsdp2"),
])
@pytest.mark.slow  # the quick lane stays under 30 s; CI runs it
def test_cli_rows(args, code, message):
    r = CliRunner().invoke(app, [*args, "--verbose"], env={"COLUMNS": "300"})  # the inputs table, its cells on one line
    assert r.exit_code == code, r.output
    assert message in " ".join(r.output.split())


def test_json_has_host_offload_bytes():
    r = CliRunner().invoke(app, _ARGS + ["--zero", "3", "--gpus", "8", "--offload-optimizer", "--json"])
    doc = json.loads(r.stdout)
    assert isinstance(doc["host_offload_bytes"], int) and doc["host_offload_bytes"] > 0


@pytest.mark.slow  # a cluster plan: seconds
def test_plan_states_its_sharding():
    # source: issue 13 "plan states which sharding its counts assume": text and --json
    r = CliRunner().invoke(app, ["plan", "--model", "gpt2", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["sharding"] == "fsdp2" and "FSDP2" in doc["sharding_mechanics"]
    r = CliRunner().invoke(app, ["plan", "--model", "gpt2"], env={"COLUMNS": "300"})
    assert "sharding assumed: ZeRO-3 by fsdp2" in r.output


@pytest.mark.parametrize("args,code,message", [
    # source: torchtitan's op-level policy is a --checkpoint mode (inputs/resolve.py parse_checkpoint)
    (["estimate", "--params", "1e8", "--seq", "128", "--checkpoint", "selective-op", "--gpu", "rtx-4090"], 0,
     "selective-op"),
    (["estimate", "--params", "1e8", "--checkpoint", "selective-ops"], 2, "selective-op"),
])
def test_selective_op_cli(args, code, message):
    r = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert r.exit_code == code, r.output
    assert message in r.output

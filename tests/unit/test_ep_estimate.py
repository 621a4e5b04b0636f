"""Expert parallelism in the estimator, torch-free: what a rank holds, and the inputs it refuses.

The traced grid (the estimate against torchtitan's all-to-all dispatcher on the fake process group)
is ``tests/trace/test_expert_parallel.py`` (slow).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.expert_parallel import max_capacity_factor, received_rows
from memcalc.core.spec import ExperimentSpec, ModelSpec, MoESpec, TrainingSpec
from memcalc.engine.weights import param_rows

MODEL = ModelSpec(name="tiny-moe", n_layers=2, d_model=128, n_heads=4, d_ff=256, vocab_size=512,
                  moe=MoESpec(n_experts=8, top_k=2, d_ff_expert=64, n_shared_experts=1))


def spec(ep: int, gpus: int) -> ExperimentSpec:
    return ExperimentSpec(model=MODEL, training=TrainingSpec(batch=2, seq=128, precision="bf16", gpus=gpus, ep=ep))


def weight_bytes(exp: ExperimentSpec, part: str) -> int:
    return sum(r[1] for r in param_rows(exp) if part in r[0])


@pytest.mark.parametrize("ep,gpus", [
    (2, 2),  # source: torchtitan 0.3.0 moe_sharding.expert_param_placement_sparse: Shard(0) over ep
    (4, 4),
    (2, 8),  # source: parallel_dims.py efsdp = dp_shard // ep: without FSDP each ep group holds all experts
])
def test_a_rank_holds_n_experts_over_ep(ep, gpus):
    one, many = spec(1, 1), spec(ep, gpus)
    assert weight_bytes(many, ".moe.experts.") * ep == weight_bytes(one, ".moe.experts.")
    # the router and the shared experts are whole on every rank
    for part in (".moe.router.", ".moe.shared_experts."):
        assert weight_bytes(many, part) == weight_bytes(one, part) > 0


# source: core/expert_parallel.py: the capacity factor scales the rows a rank receives, and is bounded
# by every rank routing all its tokens to this rank's experts (torchtitan's dispatcher drops none)
@pytest.mark.parametrize("sent,cf,rows", [(512, 1.0, 512), (512, 1.5, 768), (3, 1.5, 4)])
def test_received_rows(sent, cf, rows):
    assert received_rows(sent, cf) == rows


def test_capacity_bound():
    assert max_capacity_factor(top_k=2, n_experts=8, ep=4) == 4  # 4 ranks x 2 local experts / 2
    assert max_capacity_factor(top_k=8, n_experts=128, ep=2) == 2
    assert max_capacity_factor(top_k=8, n_experts=16, ep=8) == Fraction(8 * 2, 8)


def run(args: list[str]):
    return CliRunner().invoke(app, args)


#: the quick lane keeps the two refusals the issue names; each CliRunner row costs about 0.1 s
SLOW = pytest.mark.slow

# (args, exit code, message): one line on stderr, exit 2
BAD_EP = [
    (["estimate", "--model", "llama-3.1-8b", "--ep", "2", "--gpus", "2"], 2,
     "llama-3.1-8b is a dense model (no experts to shard)"),  # source: EP shards routed experts only
    (["estimate", "--model", "qwen3-30b-a3b", "--ep", "3", "--gpus", "3"], 2,
     "--ep 3 must divide the routed experts (128): 128 / 3 = 42.6667 (remainder 2)"),  # source: Shard(0) evenly
    pytest.param(["estimate", "--model", "qwen3-30b-a3b", "--ep", "4"], 2,
     "--ep 4 must divide --gpus 1", marks=SLOW),  # source: parallel_dims.py, ep borrows data-parallel ranks
    pytest.param(["estimate", "--model", "qwen3-30b-a3b", "--ep", "2", "--gpus", "2", "--zero", "3", "--sharding",
                  "fsdp1"], 2, "not with --zero 3 --sharding fsdp1", marks=SLOW),  # source: FSDP2 x EP only
    pytest.param(["estimate", "--model", "qwen3-30b-a3b", "--ep", "0"], 2, "--ep must be positive", marks=SLOW),
    pytest.param(["estimate", "--model", "qwen3-30b-a3b", "--ep", "2", "--gpus", "2", "--ep-capacity-factor", "3"], 2,
     "at most ep x min(top_k, n_experts / ep) / top_k = 2 x 8 / 8 = 2", marks=SLOW),  # source: no token dropped
    pytest.param(["estimate", "--model", "qwen3-30b-a3b", "--ep", "2", "--gpus", "2", "--ep-capacity-factor", "0.5"], 2,
     "ep_capacity_factor = 0.5", marks=SLOW),  # source: >= 1, the even split is the least a busiest rank receives
]


@pytest.mark.parametrize("args,code,message", BAD_EP)
def test_bad_ep_is_one_line_exit_2(args, code, message):
    r = run(args)
    assert r.exit_code == code, r.output
    assert message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.output


@pytest.mark.slow  # two full estimates with their "to make it fit" searches: seconds
@pytest.mark.parametrize("args", [
    # source: plan/remedies.py tried --lora on top, which --ep (and --tp) refuse in the engine: the
    # whole estimate failed with that refusal instead of skipping the change
    ["estimate", "--model", "deepseek-v3", "--bf16", "--ep", "8", "--gpus", "8", "--seq", "512"],
    ["estimate", "--model", "llama-3.1-70b", "--bf16", "--tp", "2", "--seq", "512"],
])
def test_a_remedy_the_engine_refuses_is_skipped(args):
    r = run(args)
    assert r.exit_code == 0, r.output
    assert "LoRA / QLoRA adapters" not in r.output


# source: torchtitan 0.3.0 distributed/fsdp.py apply_fsdp_to_decoder: with ep > 1 the experts are FSDP-sharded
# over efsdp = gpus / ep ranks, Shard(0), or Shard(1) when efsdp x ep exceeds the experts; the rest over gpus
@pytest.mark.parametrize("shape,kind,n,ep,experts,numel", [
    ((4, 128, 64), "experts", 8, 2, 8, 1 * 128 * 64),  # efsdp 4 over 4 local experts: one each
    ((4, 128, 64), "experts", 16, 2, 8, 4 * 16 * 64),  # efsdp 8 x ep 2 = 16 > 8 experts: Shard(1), 128 / 8 rows
    ((4, 128, 64), "experts", 4, 4, 16, 4 * 128 * 64),  # gpus == ep: efsdp 1, the local experts whole
    ((512, 128), "weights", 8, 2, 8, 64 * 128),  # anything else over all 8 ranks
])
def test_fsdp2_shards_the_experts_over_efsdp(shape, kind, n, ep, experts, numel):
    from memcalc.engine.expert_fsdp import fsdp_shard_numel

    assert fsdp_shard_numel(shape, kind, n, ep, experts) == numel


def test_fsdp2_expert_shards_are_gpus_over_ep():
    # source: the same rule on the parameter rows of a ZeRO-3 run: experts 1/(gpus/ep), the rest 1/gpus
    exp = ExperimentSpec(model=MODEL, training=TrainingSpec(batch=2, seq=128, precision="bf16", gpus=8, ep=2, zero=3))
    one = spec(1, 1)
    assert weight_bytes(exp, ".moe.experts.") * 8 == weight_bytes(one, ".moe.experts.")  # / ep 2 / efsdp 4
    assert weight_bytes(exp, ".moe.router.") * 8 == weight_bytes(one, ".moe.router.")


@pytest.mark.slow  # a binary search over direct estimates of a 48-layer model: seconds
def test_max_batch_with_ep():
    # source: plan/depth.py applies(): the depth extrapolation's one-GPU reference (gpus 1) is no --ep setup
    # (ep divides gpus), so expert-parallel steps are simulated directly; --max-batch used to fail with
    # "--ep 4 must divide --gpus 1"
    r = run(["estimate", "--model", "qwen3-30b-a3b", "--bf16", "--ep", "4", "--gpus", "8", "--zero", "3", "--gpu",
             "h100-80gb", "--max-batch", "--seq", "1024"])
    assert r.exit_code == 0, r.output
    assert "max batch at seq 1024" in r.stdout

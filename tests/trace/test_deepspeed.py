"""DeepSpeed ZeRO-2/3: the estimate against one rank of DeepSpeed's own step, traced.

Each row runs ``deepspeed.initialize`` + two steps (the second measured) as rank 0 of N on
PyTorch's fake process group, on fake tensors (memcalc.validate.deepspeed_trace), and compares
the peak with memcalc's model of DeepSpeed's buffers (memcalc.engine.deepspeed). Models are
presets at 2 layers, sequences of 256-512 tokens: each trace takes seconds.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from memcalc.core.spec import DeepSpeedSpec, ExperimentSpec, TrainingSpec  # noqa: E402
from memcalc.estimate.peak import estimate  # noqa: E402
from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.validate.deepspeed_trace import trace_deepspeed  # noqa: E402

TOLERANCE_PCT = 3.0  # issue 13: DeepSpeed setups within 3% of the traced rank peak
OFFLOAD_TOLERANCE_PCT = 2.0  # issue 28: offload_param "a trace row within 2%"
MIXED = dict(precision="bf16", master_weights=True)

# (preset, layers, stage, gpus, training, DeepSpeed config) -- every row a distinct combination
GRID = [
    # source: DeepSpeed defaults (zero/config.py): one 5e8-element bf16 bucket holds every gradient; peak at the
    # end-of-backward reduction (its flatten copy)
    ("tinyllama-1.1b", 2, 2, 4, dict(seq=256, **MIXED), {}),
    # source: a 2e7 bucket reduces 11 times in backward; 8 ranks; the peak moves to the optimizer step
    ("tinyllama-1.1b", 2, 2, 8, dict(seq=256, **MIXED), dict(reduce_bucket_size=20_000_000)),
    # source: fp32 (no bf16 section), overlap_comm doubles the bucket; the head's gradient exceeds the bucket
    ("tinyllama-1.1b", 2, 2, 4, dict(seq=256, precision="fp32"), dict(reduce_bucket_size=50_000_000, overlap_comm=True)),
    # source: full activation checkpointing (torch.utils.checkpoint inside DeepSpeed's backward), 2 ranks
    ("tinyllama-1.1b", 2, 2, 2, dict(seq=512, checkpoint="full", **MIXED), {}),
    # source: contiguous_gradients false: no bucket, gradients live until their reduction
    ("gpt2", 2, 2, 4, dict(seq=256, **MIXED), dict(contiguous_gradients=False)),
    # source: batch 4, 16 ranks, a 1e7 bucket
    ("gpt2", 2, 2, 16, dict(batch=4, seq=256, **MIXED), dict(reduce_bucket_size=10_000_000)),
    # source: gradient accumulation 4 (two micro-steps traced, the second the boundary): the gradient partition
    # stays across micro-steps, the bucket is made again in each
    ("gpt2", 2, 2, 4, dict(seq=256, grad_accum=4, **MIXED), dict(reduce_bucket_size=10_000_000)),
    # source: one GPU is DeepSpeed too (issue 28): world size 1 builds the same flat fp32 partition (flat / 1), a
    # 1e7 bucket and the gradient partition (stage_1_and_2.py DeepSpeedZeroOptimizer.__init__); the estimate
    # without them was -14.2%
    ("gpt2", 2, 2, 1, dict(seq=256, **MIXED), dict(reduce_bucket_size=10_000_000)),
    # -- ZeRO-3
    # source: DeepSpeed defaults: the whole model is within stage3_max_reuse_distance (1e9), so every layer stays
    # gathered from its forward to its backward; the 5e8 bucket exists from the start
    ("tinyllama-1.1b", 2, 3, 4, dict(seq=256, **MIXED), {}),
    # source: fp32, a 5e7 bucket the head's gradient does not fit (it is reduce-scattered on its own, uncopied)
    ("tinyllama-1.1b", 2, 3, 4, dict(seq=256, precision="fp32"), dict(reduce_bucket_size=50_000_000)),
    # source: stage3_max_reuse_distance 0 releases each layer after its forward; full checkpointing, 2 ranks
    ("tinyllama-1.1b", 3, 3, 2, dict(seq=512, checkpoint="full", **MIXED), dict(max_reuse_distance=0)),
    # source: ZeRO-3 on one GPU: ds_tensor partitions of the whole numel and the gathered parameters beside them
    # (stage3.py, partition_parameters.py), the flat gradient partition; the estimate without them was -22.5%
    ("gpt2", 2, 3, 1, dict(seq=256, **MIXED), dict(reduce_bucket_size=10_000_000)),
    # source: offload_param on one GPU (issue 28): the 16-bit partitions in a pinned host buffer (stage3.py
    # _create_param_groups_fp16_flat_cpu_memory), each gather a host-to-GPU copy (NoGatherHandle .to(device)); the
    # estimate without it kept the partitions on the GPU (+8.9%)
    ("gpt2", 2, 3, 1, dict(seq=256, **MIXED), dict(reduce_bucket_size=10_000_000, offload_param=True)),
    # source: offload_param with stage3_max_reuse_distance 0 and no prefetch: each layer's GPU copy released after its
    # forward and copied again for its backward; full checkpointing
    ("tinyllama-1.1b", 2, 3, 1, dict(seq=256, checkpoint="full", **MIXED),
     dict(reduce_bucket_size=10_000_000, offload_param=True, max_reuse_distance=0, prefetch_bucket_size=0)),
    # source: 16 ranks, batch 4, a persistence threshold of 1e6 keeps GPT-2's attention and norm parameters whole
    ("gpt2", 2, 3, 16, dict(batch=4, seq=256, **MIXED), dict(reduce_bucket_size=10_000_000,
                                                           param_persistence_threshold=1_000_000)),
]


def _exp(preset, layers, stage, gpus, tr, ds) -> ExperimentSpec:
    m = load_preset(preset).model_copy(update={"n_layers": layers})
    training = TrainingSpec(zero=stage, gpus=gpus, sharding="deepspeed", deepspeed=DeepSpeedSpec(stage=stage, **ds), **tr)
    return ExperimentSpec(name=preset, model=m, training=training)


def _id(row) -> str:
    preset, layers, stage, gpus, tr, ds = row
    return f"{preset}-L{layers}-zero{stage}-n{gpus}-" + "-".join(f"{k}={v}" for k, v in {**tr, **ds}.items())


@pytest.mark.parametrize("row", GRID, ids=[_id(r) for r in GRID])
def test_estimate_matches_deepspeed_trace(row):
    exp = _exp(*row)
    meas = trace_deepspeed(exp)
    assert meas.status == "ok", meas.reason
    est = estimate(exp, timeline=False)
    gap = 100 * (est.peak_bytes - meas.measured_bytes) / meas.measured_bytes
    offload = exp.training.deepspeed.offload_param
    if offload:  # the pinned host partitions, reported apart: exactly what the trace marked host
        assert meas.host_param_bytes == est.extra["host_param_bytes"], (meas.host_param_bytes, est.extra)
    tolerance = OFFLOAD_TOLERANCE_PCT if offload else TOLERANCE_PCT
    assert abs(gap) <= tolerance, (f"estimate {est.peak_bytes:,} B ({est.peak_phase}) vs trace "
                                   f"{meas.measured_bytes:,} B ({meas.peak_phase}): {gap:+.2f}%")


def test_grid_is_large_enough():
    assert len(GRID) >= 6 and len({_id(r) for r in GRID}) == len(GRID)


@pytest.mark.parametrize("tr,why", [
    (dict(optimizer="sgd"), "AdamW"),  # source: the tracer runs AdamW/Adam (DeepSpeed's optimizers)
    (dict(precision="fp16", master_weights=True), "fp16"),  # source: DeepSpeed's CPU accelerator has no fp16
    (dict(precision="amp-bf16"), "autocast"),  # source: DeepSpeed runs bf16/fp16 weights, not autocast
])
def test_unsupported_setups_are_skipped_with_the_reason(tr, why):
    meas = trace_deepspeed(_exp("gpt2", 1, 2, 4, dict(seq=128, **tr), {}))
    assert meas.status == "skipped" and why in meas.reason


@pytest.mark.parametrize("gpus", [["--gpus", "4"], []])  # source: one GPU runs DeepSpeed's engine too (issue 28)
def test_validate_command_traces_a_deepspeed_config(tmp_path, gpus):
    """``memcalc validate --deepspeed CONFIG --gpus N`` (docs/multi-gpu.md, DeepSpeed) reaches DeepSpeed's tracer: the
    config's stage sets --zero, rank 0 is traced, and the record compares it with the estimate; without
    --gpus, the one rank of world size 1."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from memcalc.cli import app

    config = Path(__file__).parent.parent / "traces" / "deepspeed" / "zero2.json"
    r = CliRunner().invoke(app, ["validate", "--model", "tinyllama-1.1b", "--deepspeed", str(config), *gpus,
                                 "--seq", "64", "--scale-layers", "1", "--device", "meta", "--json"])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(r.stdout)
    assert rec["status"] == "ok", rec
    assert "DeepSpeed" in rec["device"], rec
    assert abs(rec["predicted_bytes"] - rec["measured_bytes"]) <= TOLERANCE_PCT / 100 * rec["measured_bytes"], rec

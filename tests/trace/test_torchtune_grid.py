"""``memcalc validate --framework torchtune``: torchtune 0.6.1's own builders, loss and recipe step
traced on meta (validate/trainers/torchtune.py), beside ``memcalc estimate --framework torchtune``.

Scaled-down models (1-2 layers, small widths and vocabularies), well under a second a row.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("torch")
pytest.importorskip("torchtune")

from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from conftest import one_line_error  # noqa: E402


def run(args):
    return CliRunner().invoke(app, args)


def test_cli_framework_torchtune_json():
    r = run(["validate", "--framework", "torchtune", "--model", "llama-3.2-1b", "--bf16", "--seq", "64",
             "--scale-layers", "1", "--device", "meta", "--json"])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(r.stdout)
    assert rec["framework"] == "torchtune" and rec["status"] == "ok", rec
    assert rec["library_versions"]["torchtune"] == "0.6.1", rec
    assert isinstance(rec["measured_bytes"], int) and isinstance(rec["predicted_bytes"], int)


# (args, exit code, message); source: validate/trainers/torchtune.py refusals, each citing the recipe or builder
BAD = [
    (["--model", "gpt2"], 2, "gpt2 has a norm other than pre-norm RMSNorm"),
    (["--model", "llama-3.2-1b", "--bf16", "--activation-offload"], 2,
     "enable_activation_offloading should only be True when enable_activation_checkpointing is True"),
    (["--model", "llama-3.2-1b", "--bf16", "--lora", "--lora-targets", "q,v,gate"], 2,
     "torchtune adapts the MLP whole (apply_lora_to_mlp)"),
    (["--model", "llama-3.2-1b", "--precision", "amp-bf16"], 2, "the recipes train in one dtype, fp32 or bf16"),
    (["--model", "llama-3.2-1b", "--bf16", "--lora", "--lora-targets", "q,v,head"], 2,
     "apply_lora_to_output is not supported when the projection is tied"),
    (["--model", "llama-3.2-1b", "--bf16", "--lora", "--fused-optimizer"], 2,
     "lora_finetune_single_device has no optimizer_in_bwd"),
]


@pytest.mark.parametrize("args,code,message", BAD)
def test_cli_torchtune_bad_input_one_line_exit_2(args, code, message):
    one_line_error(run(["validate", "--framework", "torchtune", *args, "--device", "meta"]), code, message)


# -- the grid: estimate vs torchtune's traced step ----------------------------------------------
from memcalc.validate.predict import estimate  # noqa: E402
from memcalc.validate.trainers.torchtune import measure  # noqa: E402
from memcalc.validate.trainers.torchtune_grid import grid  # noqa: E402

#: |estimate - trace| / trace, in percent, every grid row (issue 27: within 2%)
GRID_TOLERANCE_PCT = 2.0

#: rows with a known mechanism the estimator does not follow yet (strict: they must fail); the QLoRA
#: recompute and offloading rows pass since torchtune's layer keeps ``attn_out`` through the MLP
#: (engine/blocks/layer.py), its checkpointed regions save ``h`` alone (engine/offload.py
#: rope_region_inputs) and a region's trailing nodes run before its inputs' reload (engine/checkpoint.py)
KNOWN_GAPS: dict[str, str] = {}

ROWS = grid()


@pytest.mark.parametrize("name,exp", [
    pytest.param(n, e, id=n, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[n])] if n in KNOWN_GAPS else [])
    for n, e in ROWS  # source: torchtune 0.6.1 traced on meta (validate/trainers/torchtune.py), each row
])
def test_torchtune_grid_estimate_within_tolerance(name, exp):
    meas = measure(exp, "meta")
    assert meas.status == "ok", meas.reason
    est = estimate(exp).peak_bytes
    gap = (est - meas.measured_bytes) / meas.measured_bytes * 100
    assert abs(gap) <= GRID_TOLERANCE_PCT, f"{name}: estimate {est:,} B, trace {meas.measured_bytes:,} B ({gap:+.2f}%)"


def test_grid_has_30_setups():
    assert len(ROWS) >= 30


# the shipped presets at full width and vocabulary (2 layers): the RoPE cache over max_seq_len 131072
# (rules.torchtune_rope_buffers, 32-64 MiB) and torchao's NF4 dequantization at real sizes
#: measured gap 0.00% on both rows; the RoPE cache alone is 0.7-1.1% of them, so this catches its rule
PRESET_TOLERANCE_PCT = 0.1

PRESET_ROWS = [
    # source: torchtune 0.6.1 lora_llama3_2 (tied), traced on meta
    ("llama-3.2-1b", dict(batch=4, seq=1024, precision="bf16", checkpoint="full",
                          lora=dict(rank=64, alpha=128, targets=("q", "v")))),
    # source: torchtune 0.6.1 lora_llama3_1 with quantize_base (torchao NF4), traced on meta
    ("llama-3.1-8b", dict(batch=2, seq=2048, precision="bf16", checkpoint="full",
                          lora=dict(rank=8, alpha=16, targets=("q", "k", "v", "o", "gate", "up", "down"),
                                    qlora=True))),
]


@pytest.mark.parametrize("preset,training", PRESET_ROWS, ids=[p for p, _ in PRESET_ROWS])
def test_torchtune_presets_two_layers_within_tolerance(preset, training):
    from memcalc.core.spec import ExperimentSpec, TrainingSpec
    from memcalc.inputs.presets import load_preset
    from memcalc.inputs.profiles import profile_for

    exp = ExperimentSpec(model=load_preset(preset).model_copy(update={"n_layers": 2}),
                         training=TrainingSpec.model_validate(training), profile=profile_for("torchtune"))
    meas = measure(exp, "meta")
    est = estimate(exp).peak_bytes
    gap = (est - meas.measured_bytes) / meas.measured_bytes * 100
    assert abs(gap) <= PRESET_TOLERANCE_PCT, (f"{preset}: estimate {est:,} B, trace {meas.measured_bytes:,} B "
                                              f"({gap:+.2f}%)")


# -- reserved: the QLoRA rows' allocator replay, the model's set-up included --------------------
#: |estimate - trace| / trace of max_memory_reserved (the caching allocator replayed on both sides, the
#: recipe's QLoRA build and load_state_dict first: estimate/peak.setup_cache_events, the trace's
#: trainers/torchtune._setup_cache); segments are 2 MiB or 20 MiB, so one segment is 5-10% at this scale
RESERVED_TOLERANCE_PCT = 2.0

RESERVED_GAPS = {
    "gqa qlora bf16 loss=full ck=none 2x256": (
        "the estimate's replay reserves one 2 MiB small-pool segment more than the traced allocator "
        "(+5.56%; the traced reserved is the same without the set-up cache); mechanism not found"),
}


@pytest.mark.parametrize("name,exp", [
    pytest.param(n, e, id=n, marks=[pytest.mark.xfail(strict=True, reason=RESERVED_GAPS[n])] if n in RESERVED_GAPS
                 else [])
    for n, e in grid("qlora")  # source: torchtune 0.6.1 _setup_model + step traced on meta through CachingAllocatorSim
])
def test_torchtune_qlora_reserved_with_setup_cache(name, exp):
    meas = measure(exp, "meta", allocator_sim=True)
    assert meas.status == "ok", meas.reason
    est = estimate(exp).step_reserved_bytes
    gap = (est - meas.sim_reserved_bytes) / meas.sim_reserved_bytes * 100
    assert abs(gap) <= RESERVED_TOLERANCE_PCT, f"{name}: reserved {est:,} B vs traced {meas.sim_reserved_bytes:,} B"

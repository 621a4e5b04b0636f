"""``--framework unsloth``: the rules read from Unsloth's source (:mod:`memcalc.core.unsloth`), what the estimate
does with them, and the output's provenance (every Unsloth number read, none traced). Torch-free and quick: the rules
called directly, a few estimates of a 2-layer model, CliRunner rows that stop before any simulation."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import one_line_error, tiny_llama

from memcalc.api import estimate
from memcalc.cli import app
from memcalc.core.spec import ExperimentSpec, LoraSpec, TrainingSpec
from memcalc.core.unsloth import (GC_MIN_OFFLOAD_BYTES, UNTRACED, ce_buffer_bytes, ce_chunk_rows, gc_buffer_bytes,
                                  gc_offloads, provenance)

GIB = 2 ** 30

#: (rows, hidden, vocab, rows per chunk)
CE_ROWS = [
    # source: fused_linear_rows: pow2 <= 4096 * 4096 / 128256 = 128, raised to min_rows (pow2 <= 512 * 151936 /
    # 128256 = 512), under the 2 GiB budget (4186 rows of fp32 logits)
    (4096, 4096, 128256, 512),
    # source: pow2 <= 4096 * 4096 / 32000 = 512, min_rows pow2 <= 2431 = 2048
    (4096, 4096, 32000, 2048),
    # source: pow2 <= 65536 * 4096 / 128256 = 2048
    (65536, 4096, 128256, 2048),
    # source: at most n_rows
    (100, 64, 1000, 100),
    # source: _MAX_ROWS 4096 (min_rows clamped to it), then the budget: 2 GiB / (8 * 4) bytes
    (10 ** 9, 4096, 8, 4096),
]


@pytest.mark.parametrize("rows,hidden,vocab,chunk", CE_ROWS)
def test_ce_chunk_rows(rows, hidden, vocab, chunk):
    assert ce_chunk_rows(rows, hidden, vocab) == chunk


def test_ce_buffer_bytes():
    # source: _Buffers: (R, stride) fp32, stride = V rounded up to a multiple of 8
    assert (ce_buffer_bytes(512, 128256), ce_buffer_bytes(2, 1001)) == (512 * 128256 * 4, 2 * 1008 * 4)


#: (layer, n_layers, input bytes, offloaded)
GC_OFFLOADS = [
    (0, 32, 32 * 2 ** 20, True),  # source: new_size > MINIMUM_SIZE
    (31, 32, 32 * 2 ** 20, False),  # source: CURRENT_GC_INDEX == LAST_GC_INDEX after the first pass: the last layer
    (0, 32, GC_MIN_OFFLOAD_BYTES, False),  # source: strictly more than MINIMUM_SIZE (2 MiB)
]


@pytest.mark.parametrize("layer,n,nbytes,offloaded", GC_OFFLOADS)
def test_gc_offloads(layer, n, nbytes, offloaded):
    assert gc_offloads(layer, n, nbytes) is offloaded


def test_gc_buffer_bytes():
    # source: INITIAL_GPU_BUFFER_SIZE = 2 * 256 * 2048 bf16 elements, resize_ to ceil(new_size / 2)
    assert (gc_buffer_bytes(1000), gc_buffer_bytes(32 * 2 ** 20)) == (2 * 2 ** 20, 32 * 2 ** 20)


from memcalc.inputs.profiles import profile_for  # noqa: E402

#: 2 layers, one layer input 4096 x 512 bf16 = 4 MiB (above MINIMUM_SIZE)
MODEL = tiny_llama(n_layers=2, d_model=512, d_ff=1024, vocab_size=128256)


def _est(framework: str = "unsloth", seq: int = 4096):
    tr = TrainingSpec(batch=1, seq=seq, precision="bf16", checkpoint="full", lora=LoraSpec())
    return estimate(ExperimentSpec(name="t", model=MODEL, training=tr, profile=profile_for(framework)))


@pytest.fixture(scope="module")
def unsloth_est():
    return _est()


def test_layer_inputs_leave_the_gpu(unsloth_est):
    """Each layer input above 2 MiB goes to host memory except the last one's; the staging buffers (A and B, one
    layer input each) stay."""
    # source: unsloth_zoo gradient_checkpointing.py UnslothCheckpointFunction.forward, _ensure_device_buffers
    one_input = 4096 * 512 * 2  # B * T * d_model * bf16
    assert unsloth_est.components.get("unsloth checkpoint buffers") == 2 * one_input


def test_below_seq_512_nothing_is_offloaded():
    # source: unsloth/models/_utils.py apply_unsloth_gradient_checkpointing: max_seq_length < 512 -> True
    tr = TrainingSpec(batch=1, seq=256, checkpoint="full", lora=LoraSpec())
    rule = provenance(ExperimentSpec(name="t", model=MODEL, training=tr, profile=profile_for("unsloth")))
    assert "nothing offloaded" in rule["mechanisms"][0]["rule"]


def _round(n: int) -> int:
    return -(-n // 512) * 512


def test_no_logits_tensor(unsloth_est):
    """At its peak the loss holds the shifted labels, the labelled rows' indices, grad_h, lp_all, the one (R, V) fp32
    buffer and one chunk's (R, H) fp32 gradient: with 128256 columns, 4096 rows and width 512, R = 512; no (B, T, V)
    tensor."""
    # source: unsloth_zoo fused_losses/fused_linear.py _ce_impl, fused_linear_rows, _Buffers
    n, d = 4096, 512
    loss_at_peak = (_round(n * 8) * 2 + _round(n * d * 2) + _round(n * 4) + _round(ce_buffer_bytes(512, 128256))
                    + _round(512 * d * 4))
    assert unsloth_est.peak_at.startswith("final norm & head")
    assert unsloth_est.components["logits & loss"] == loss_at_peak


def test_provenance_says_read_not_traced(unsloth_est):
    doc = unsloth_est.to_dict()
    prov = doc["provenance"]
    assert prov["traced"] == ["LoRA"]  # fast_lora's Functions, tests/trace/test_unsloth_kernels.py
    assert {m["mechanism"]: m["how"] for m in prov["mechanisms"]}["loss"] == "read"
    assert {m["mechanism"] for m in prov["mechanisms"]} >= {"gradient checkpointing", "loss", "LoRA"}
    assert any("step is not traced" in a for a in unsloth_est.estimate.assumptions)


#: (CLI args, exit code, the one-line message)
CLI_ROWS = [
    (["validate", "--framework", "unsloth", "--model", "llama-3.2-1b", "--lora"], 2, UNTRACED),
    # source: Unsloth compiles its own modules (unsloth_zoo compiler.py) and offloads through its checkpoint
    (["estimate", "--model", "llama-3.2-1b", "--framework", "unsloth", "--lora", "--compile"], 2,
     "--framework unsloth models Unsloth's eager kernels"),
]


@pytest.mark.parametrize("args,code,message", CLI_ROWS)
def test_cli(args, code, message):
    one_line_error(CliRunner().invoke(app, args), code, message)



def test_the_default_output_says_what_is_read(unsloth_est):
    """Issue 27: the terminal output without --verbose (not only its assumptions and --json) says Unsloth's step is
    not traced and names the numbers read from source."""
    from memcalc.render.report import report_items

    # source: memcalc/core/unsloth.py PROVENANCE (the gradient checkpointing and loss rows are 'read')
    lines = [x for x in report_items(unsloth_est.estimate, unsloth_est.resolved, [], verbose=False)
             if isinstance(x, str)]
    text = " ".join(lines)
    assert "step is not traced" in text and "read from source: gradient checkpointing, loss" in text, text

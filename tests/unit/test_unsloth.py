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
from memcalc.core.unsloth import (GC_MIN_OFFLOAD_BYTES, UNTRACED, ce_chunk_rows, ce_chunks, gc_buffer_bytes,
                                  gc_offloads, provenance)

GIB = 2 ** 30

#: (rows, vocab, fixed bytes, chunks)
CE_CHUNKS = [
    # source: get_chunk_size: exact = rows * V * 16 / 2**30 / target <= 1 -> one chunk (4096 x 32000 x 16 = 1.95 GiB)
    (4096, 32000, 0, 1),
    # source: exact = 4096 * 128256 * 16 / 2**30 / 4 = 1.96 -> ceil(1.96 / 4) * 4 = 4 chunks
    (4096, 128256, 0, 4),
    # source: _get_chunk_multiplier: fixed_gb 3.5 < 4 leaves a 0.5 GiB target: exact 15.7 -> 16 chunks
    (4096, 128256, int(3.5 * GIB), 16),
    # source: fixed_gb 5 >= target 4: "keep the full budget instead"
    (4096, 128256, 5 * GIB, 4),
    # source: get_chunk_size: min(n_chunks, bsz*qlen)
    (2, 2 ** 40, 0, 2),
]


@pytest.mark.parametrize("rows,vocab,fixed,chunks", CE_CHUNKS)
def test_ce_chunks(rows, vocab, fixed, chunks):
    assert ce_chunks(rows, vocab, fixed) == chunks


def test_ce_chunk_rows():
    # source: torch.chunk (CHUNK_ALIGN_ROWS 0): ceil(rows / chunks) rows in the first chunks
    assert (ce_chunk_rows(4096, 4), ce_chunk_rows(4097, 4), ce_chunk_rows(5, 1)) == (1024, 1025, 5)


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
    """At the head the loss holds the shifted labels, grad_inputs and one chunk's 14 bytes per logit: with 128256
    columns and 4096 rows, get_chunk_size gives 4 chunks of 1024 rows; no (B, T, V) tensor."""
    # source: unsloth_zoo fused_losses/cross_entropy_loss.py UnslothFusedLoss.forward, get_chunk_size
    assert unsloth_est.peak_at.startswith("final norm & head")
    assert unsloth_est.components["logits & loss"] == (_round(4096 * 8) + _round(4096 * 512 * 2)
                                                       + _round(1024 * 128256 * 14))


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
]


@pytest.mark.parametrize("args,code,message", CLI_ROWS)
def test_cli(args, code, message):
    one_line_error(CliRunner().invoke(app, args), code, message)

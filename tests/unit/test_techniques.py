"""Issue 14's techniques without torch: the CLI's errors, the registry's paged records, and what the
estimate reports (activation offloading's host memory, paged optimizer state, LoRA on the head, DoRA).

The estimate-vs-trace checks of the same techniques are in ``tests/trace/test_techniques_trace.py`` (slow).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.optimizers import BNB_BLOCK, BNB_PAGED_MIN_NUMEL, OPTIMIZERS
from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, TrainingSpec
from memcalc.core.kernels import pinned_bytes
from memcalc.engine.optimizers import PAGED, state_bytes
from memcalc.engine.params import count_params
from memcalc.engine.offload import ActivationOffload
from memcalc.engine.sim import Node, Param, Sim, T
from memcalc.estimate.peak import estimate
from memcalc.render.report import technique_lines

SMALL = ["--model", "gpt2", "--seq", "128"]
TINY = ModelSpec(name="tiny", n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=1000, max_seq_len=64)
#: an embedding of 1000 x 128 = 128,000 elements: above bitsandbytes' paging threshold (1e5)
BIG_VOCAB = TINY.model_copy(update={"d_model": 128, "d_ff": 256})


def run(args: list[str]):
    return CliRunner().invoke(app, args)


# (args, exit code, message)
ERRORS = [
    # source: torchtune recipes raise for optimizer_in_bwd with gradient_accumulation_steps > 1
    (["estimate", *SMALL, "--fused-optimizer", "--grad-accum", "4"], 2,
     "Gradient accumulation is not supported with optimizer in bwd"),
    # source: one whole-model graph is one autograd node (AOTAutograd's CompiledFunction): its saved set
    # would be offloaded and brought back all at once, which memcalc does not model; a stated refusal
    (["estimate", *SMALL, "--compile", "--activation-offload"], 2,
     "activation offloading under --compile-scope model is not modelled"),
    # source: memcalc's offload model covers per-layer regions only (engine/offload.py); a stated refusal
    (["estimate", *SMALL, "--checkpoint", "sqrt", "--activation-offload"], 2,
     "activation offloading with --checkpoint sqrt is not modelled yet"),
    (["estimate", *SMALL, "--checkpoint", "selective", "--activation-offload"], 2,
     "activation offloading with --checkpoint selective is not modelled yet"),
    # source: peft/tuners/lora/layer.py ParamWrapper refuses use_dora=True
    (["estimate", "--model", "qwen3-30b-a3b", "--lora", "--lora-targets", "experts", "--dora"], 2,
     "PEFT's ParamWrapper (target_parameters) refuses use_dora=True"),
    # source: the registry's names are the CLI's choices
    (["estimate", *SMALL, "--optimizer", "adamx"], 2, "paged-adamw, paged-adamw-8bit"),
    # source: a target name outside LORA_TARGETS and its aliases
    (["estimate", *SMALL, "--lora", "--lora-targets", "q,heads"], 2, "unknown --lora-targets heads"),
]


@pytest.mark.parametrize("args,code,message", ERRORS)
def test_technique_errors_are_one_line_exit_2(args, code, message):
    r = run(args)
    assert r.exit_code == code, r.output
    assert message in r.output
    assert "Traceback" not in r.output


def _json(args: list[str]) -> dict:
    r = run(["estimate", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def _est(training: dict, model: ModelSpec = None):
    return estimate(ExperimentSpec(model=model or TINY, training=TrainingSpec(**training)), timeline=False, replay=False)


def test_activation_offload_reports_integer_host_bytes():
    d = _json([*SMALL, "--lora", "--activation-offload"])
    assert isinstance(d["host_activation_bytes"], int) and d["host_activation_bytes"] > 0
    assert d["host_activation_bytes"] >= d["host_activation_raw_bytes"]  # power-of-two host blocks
    assert d["offloaded_tensors"] > 0


def test_activation_offload_moves_saved_tensors_off_the_gpu():
    tr = dict(batch=4, seq=64, precision="bf16", lora=LoraSpec(rank=8))
    base, off = _est(tr), _est({**tr, "activation_offload": True})
    assert "host_activation_bytes" not in base.extra
    assert off.extra["host_activation_bytes"] > 0
    assert off.extra["max_activation_bytes"] < base.extra["max_activation_bytes"]
    assert any("pinned for offloaded activations" in line for line in technique_lines(off))


def test_a_checkpoint_recomputes_on_its_reloaded_inputs():
    """torch.utils.checkpoint's recompute runs on the inputs the offload hook unpacks (GPU copies):
    a region input freed in forward comes back as the reloaded block, and an op of the recompute
    that keeps it (an fp32 RMSNorm's pow saves ``x.to(fp32)``, which is ``x``; a LayerNorm saves
    its input) keeps the reload alive after the backward stash lets go of it."""
    sim = Sim()
    off = ActivationOffload()
    sim.set_offload(off)
    x = sim.alloc(4096, "activations", "activations", numel=1024)
    off.active = True
    node = Node("checkpoint layer 0", [], [], [], [], on_backward=lambda s, n: None)
    node.saved, node.offloaded = off.pack(sim, [x])
    off.active = False
    off.after_node(sim)  # the forward stash is drained
    sim.unref(x)  # the model code lets go of the input
    assert not x.alive and sim.total == 0
    off.unpack(sim, node)  # before the recompute
    assert x.alive and x.category == "reloaded activations" and sim.total == x.nbytes == 4096
    sim.ref(x)  # an op of the recompute saves it
    off.end_backward(sim)
    assert x.alive and sim.total == 4096
    sim.unref(x)
    assert not x.alive and sim.total == 0


@pytest.mark.parametrize("norm,precision,checkpoint", [
    ("rmsnorm", "fp32", "full"),  # source: the fp32 RMSNorm's x.to(fp32) is x, which pow saves
    ("rmsnorm", "fp32", "every-k"),  # (every 2nd layer: the other runs eagerly)
    ("rmsnorm", "amp-bf16", "selective-op"),
    ("layernorm", "bf16", "full"),  # source: native_layer_norm saves its input
])
def test_checkpointed_offload_recompute_keeps_its_reloaded_input(norm, precision, checkpoint):
    m = TINY.model_copy(update={"norm": norm})
    tr = dict(batch=2, seq=64, precision=precision, checkpoint=checkpoint)
    base, off = _est(tr, m), _est({**tr, "activation_offload": True}, m)
    assert off.extra["host_activation_bytes"] > 0
    assert off.extra["max_activation_bytes"] <= base.extra["max_activation_bytes"]


@pytest.mark.slow  # 288 estimates (about 35 s)
def test_tp_checkpoint_offload_combinations_estimate_or_refuse_in_one_line():
    """Every combination of --tp, --checkpoint, --activation-offload, --sequence-parallel, --zero
    and precision estimates or is a one-line error (exit 2), never an internal exception."""
    import itertools

    for tp, ck, off, sp, zero, prec in itertools.product(
            [1, 2], ["none", "full", "every-2", "sqrt", "selective", "selective-op"], [False, True], [False, True],
            [0, 2, 3], ["fp32", "bf16"]):
        args = ["estimate", "--model", "tinyllama-1.1b", "--seq", "128", "--precision", prec, "--checkpoint", ck,
                "--tp", str(tp), "--gpus", str(2 * tp), "--zero", str(zero)]
        args += ["--activation-offload"] * off + ["--sequence-parallel"] * sp
        r = run(args)
        assert r.exit_code in (0, 2), (args, r.exception)
        if r.exit_code == 2:
            assert r.stderr.startswith("memcalc: error: ") and r.stderr.count("\n") == 1, (args, r.stderr)


@pytest.mark.parametrize("n,pinned", [
    (1024, 1024),  # source: CachingHostAllocator rounds up to a power of two (PowerOf2Ceil)
    (1025, 2048),
    (3 * 2**20, 4 * 2**20),
])
def test_pinned_blocks_are_powers_of_two(n, pinned):
    assert pinned_bytes(n) == pinned


def test_paged_records():
    for name in ("paged-adamw", "paged-adamw-8bit"):
        rec = OPTIMIZERS[name]
        assert rec.paged and "bitsandbytes" in rec.source and rec.moments == 2
    assert not OPTIMIZERS["adamw-8bit"].paged


def _param(n: int) -> Param:
    return Param("w", T(2 * n, "weights", "weights", numel=n, itemsize_bits=16), True, 2 * n, 0, n)


# (optimizer, elements, paged bytes, bytes on the device) -- bitsandbytes/optim/optimizer.py
PAGED_ROWS = [
    ("paged-adamw", 4096 * 4096, 2 * 4 * 4096 * 4096, 0),  # source: fp32 state1/state2 via get_paged (>= 1e5)
    ("paged-adamw", 50_000, 0, 2 * 4 * 50_000),  # source: get_state_buffer: numel < 1e5 -> zeros_like
    ("paged-adamw-8bit", 4096 * 4096, 2 * 4096 * 4096, 2 * 4 * (4096 * 4096 // BNB_BLOCK)),  # source: absmax never paged
    ("paged-adamw-8bit", 2048, 0, 2 * 4 * 2048),  # source: below min_8bit_size 4096: fp32 state, not paged
]


@pytest.mark.parametrize("name,n,paged,device", PAGED_ROWS)
def test_paged_state_split(name, n, paged, device):
    tr = TrainingSpec(precision="bf16", optimizer=name)
    st = state_bytes(_param(n), 4096, tr)
    assert sum(b for c, b in st if c == PAGED) == paged
    assert sum(b for c, b in st if c != PAGED) == device
    assert n >= BNB_PAGED_MIN_NUMEL or paged == 0


def test_paged_state_is_outside_the_peak():
    eight = _est(dict(batch=1, seq=64, precision="bf16", optimizer="adamw-8bit"), BIG_VOCAB)
    paged = _est(dict(batch=1, seq=64, precision="bf16", optimizer="paged-adamw-8bit"), BIG_VOCAB)
    assert isinstance(paged.extra["paged_optimizer_bytes"], int) and paged.extra["paged_optimizer_bytes"] > 0
    assert paged.peak_bytes < eight.peak_bytes
    assert "paged_optimizer_bytes" not in eight.extra
    assert any("cudaMallocManaged" in a for a in paged.assumptions)
    assert any("unified memory" in line for line in technique_lines(paged))




@pytest.mark.parametrize("tie", [False, True])
def test_head_target_parameters(tie):
    # source: PEFT lm_head adapter A: r x d, B: vocab x r, also with tied embeddings (no ensure_weight_tying)
    m = TINY.model_copy(update={"tie_embeddings": tie})
    base = count_params(m, LoraSpec(rank=8, targets=("q", "v"))).trainable
    head = count_params(m, LoraSpec(rank=8, targets=("q", "v", "head"))).trainable
    assert head - base == 8 * 64 + 1000 * 8


def test_head_target_aliases_and_flag():
    assert LoraSpec(targets=("q_proj", "lm_head")).targets == ("q", "head")
    d = _json([*SMALL, "--lora", "--lora-targets", "qkv,head"])
    assert d["inputs"]["training"]["lora"]["targets"] == ["qkv", "head"]


def test_dora_magnitude_vectors():
    # source: PEFT DoraLinearLayer.weight: one magnitude per output row of each target
    lora = LoraSpec(rank=8, targets=("q", "v"))
    plain = count_params(TINY, lora).trainable
    dora = count_params(TINY, lora.model_copy(update={"dora": True})).trainable
    assert dora - plain == TINY.n_layers * (TINY.q_dim + TINY.kv_dim)


def test_dora_costs_memory():
    exp = ExperimentSpec(model=TINY, training=TrainingSpec(batch=2, seq=64, precision="bf16", lora=LoraSpec(rank=8)))
    dexp = exp.model_copy(update={"training": exp.training.model_copy(
        update={"lora": exp.training.lora.model_copy(update={"dora": True})})})
    assert estimate(dexp, timeline=False).peak_bytes > estimate(exp, timeline=False).peak_bytes


def test_fits_says_when_paged_state_pages_out():
    from types import SimpleNamespace

    from memcalc.render.report import fits_rows

    est = _est(dict(batch=1, seq=64, precision="bf16", optimizer="paged-adamw"), BIG_VOCAB)
    paged = est.extra["paged_optimizer_bytes"]
    need = fits_rows(est, [SimpleNamespace(name="any", capacity_bytes=1)])[0]["device_total_bytes"]  # this card kind's
    roomy = SimpleNamespace(name="roomy", capacity_bytes=need + paged)
    tight = SimpleNamespace(name="tight", capacity_bytes=need + paged - 1)
    rows = fits_rows(est, [roomy, tight])
    assert [r["fits"] for r in rows] == [True, True]  # the paged state is not part of the required bytes
    assert [r["paged_state_resident"] for r in rows] == [True, False]

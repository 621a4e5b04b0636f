"""``memcalc validate --framework hf``: the real transformers + PEFT step traced on meta.

Small models (1-2 layers, widths of 64-128), seconds each.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch.nn.functional as F  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from memcalc.cli import app  # noqa: E402
from memcalc.core.errors import UserError  # noqa: E402
from memcalc.core.kernels import choose_attention_kernel  # noqa: E402
from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, TrainingSpec  # noqa: E402
from memcalc.engine.params import count_params  # noqa: E402
from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.inputs.profiles import get_profile  # noqa: E402
from memcalc.validate.hf_kernels import HFKernels  # noqa: E402
from memcalc.validate.hf_model import FAMILIES, build_hf_model, choose_family, param_counts, peft_targets  # noqa: E402
from memcalc.validate.hf_runner import measure_hf  # noqa: E402

PROFILE = get_profile("hf-torch-2.8-cuda")
_LLAMA = dict(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256, max_seq_len=256)
_PLAIN = dict(mlp="plain", activation="gelu_tanh", norm="layernorm", qkv_bias=True, o_bias=True, mlp_bias=True)

# one tiny ModelSpec per family; source: each family's modeling_*.py (transformers 5.23), as in hf_model.py
TINY = {
    "llama": ModelSpec(name="tiny-llama", **_LLAMA),
    "mistral": ModelSpec(name="tiny-mistral", **_LLAMA),
    "qwen2": ModelSpec(name="tiny-qwen2", **_LLAMA, qkv_bias=True),
    "gpt2": ModelSpec(name="tiny-gpt2", n_layers=1, d_model=64, n_heads=4, d_ff=256, vocab_size=256, max_seq_len=128,
                      positions="learned", tie_embeddings=True, attn_dropout=0.1, resid_dropout=0.1,
                      embd_dropout=0.1, fused_qkv=True, **_PLAIN),
    "phi": ModelSpec(name="tiny-phi", n_layers=1, d_model=64, n_heads=4, d_ff=256, vocab_size=256, max_seq_len=128,
                     block="parallel", rotary_pct=0.5, lm_head_bias=True, **_PLAIN),
}


def exp_of(m: ModelSpec, **tr) -> ExperimentSpec:
    base = dict(batch=1, seq=32)
    base.update(tr)
    return ExperimentSpec(name="t", model=m, training=TrainingSpec(**base), profile=PROFILE)


def test_every_family_has_a_tiny_model():
    assert set(TINY) == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_family_chosen_and_full_param_count(model_type):
    # source: memcalc.engine.params.count_params is the estimator's count; tolerance: exact
    m = TINY[model_type]
    assert choose_family(m).model_type == model_type
    model, _ = build_hf_model(m, None, torch.bfloat16)
    assert param_counts(model) == (count_params(m).total, count_params(m).total)


@pytest.mark.parametrize("preset,model_type", [
    ("tinyllama-1.1b", "llama"),  # source: data/models/tinyllama-1.1b.yaml (HF TinyLlama config.json)
    ("mistral-7b", "mistral"),  # source: data/models/mistral-7b.yaml
    ("qwen2.5-7b", "qwen2"),  # source: data/models/qwen2.5-7b.yaml
    ("gpt2", "gpt2"),  # source: data/models/gpt2.yaml
    ("phi-1.5", "phi"),  # source: data/models/phi-1.5.yaml
])
def test_presets_round_trip(preset, model_type):
    """ModelSpec -> HF config -> from_config: the parameter count of the preset's full shape (at 2
    layers: the same per-layer tensors) equals count_params; tolerance: exact."""
    m = load_preset(preset).model_copy(update={"n_layers": 2})
    model, fam = build_hf_model(m, None, torch.bfloat16)
    assert fam.model_type == model_type
    assert param_counts(model)[0] == count_params(m).total


@pytest.mark.parametrize("model_type,targets", [
    ("llama", ("q", "v")),  # source: peft LoraLayer.update_layer: A (r, in), B (out, r)
    ("llama", ("q", "k", "v", "o", "gate", "up", "down")),
    ("mistral", ("q", "v")),
    ("qwen2", ("q", "k", "v", "o")),
    ("phi", ("q", "v", "o", "up", "down")),  # phi: dense = o, fc1 = up, fc2 = down
    ("gpt2", ("o", "up", "down")),  # gpt2: attn.c_proj = o, c_fc = up, mlp.c_proj = down
])
def test_peft_trainable_count(model_type, targets):
    # tolerance: exact (separate projections: one adapter pair per memcalc target)
    m = TINY[model_type]
    lora = LoraSpec(rank=4, targets=targets)
    model, _ = build_hf_model(m, lora, torch.bfloat16)
    total, trainable = param_counts(model)
    want = count_params(m, lora)
    assert (total, trainable) == (want.total, want.trainable)


def test_gpt2_fused_qkv_adapter_is_one():
    """GPT-2's c_attn is one (d, 3d) Conv1D: PEFT puts one A (r, d) and one B (3d, r) on it, as
    memcalc's fused_qkv target ``qkv`` counts (r * d + 3d * r per layer)."""
    m, r = TINY["gpt2"], 4
    lora = LoraSpec(rank=r, targets=("qkv",))
    model, _ = build_hf_model(m, lora, torch.bfloat16)
    assert param_counts(model)[1] == count_params(m, lora).trainable == (r * m.d_model + 3 * m.d_model * r) * m.n_layers
    assert peft_targets(FAMILIES["gpt2"], lora) == ["c_attn"]


def test_inexpressible_model_and_targets_are_one_line_errors():
    with pytest.raises(UserError, match="none of the Hugging Face families.*supported: llama"):
        choose_family(load_preset("deep-one-1.6b"))
    with pytest.raises(UserError, match="gpt2 has no LoRA target q, v"):
        peft_targets(FAMILIES["gpt2"], LoraSpec(targets=("q", "v")))


# -- the routed kernel ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,kv_heads,mask,enable_gqa", [
    (torch.bfloat16, 2, False, True),  # source: sdp_utils.cpp flash: 16-bit, no mask, GQA native
    (torch.bfloat16, 4, False, False),  # flash
    (torch.float32, 4, False, False),  # memory-efficient (flash needs 16-bit)
    (torch.float32, 2, False, True),  # mem-efficient has no grouped-query support: math
    (torch.bfloat16, 4, True, False),  # any mask: memory-efficient
    (torch.bfloat16, 2, True, True),  # mask and GQA: math
])
def test_sdpa_routed_to_the_kernel_memcalc_names(dtype, kv_heads, mask, enable_gqa):
    B, H, T, D = 1, 4, 16, 16
    q = torch.empty((B, H, T, D), device="meta", dtype=dtype, requires_grad=True)
    k = torch.empty((B, kv_heads, T, D), device="meta", dtype=dtype, requires_grad=True)
    am = torch.empty((B, 1, T, T), device="meta", dtype=torch.bool) if mask else None
    mode = HFKernels(PROFILE)
    with mode:
        out = F.scaled_dot_product_attention(q, k, k, attn_mask=am, is_causal=not mask, enable_gqa=enable_gqa)
    want = choose_attention_kernel("auto", dtype != torch.float32, mask, enable_gqa and kv_heads != H)
    assert mode.calls == [(want, dtype, enable_gqa and kv_heads != H, mask)]
    assert out.shape == (B, H, T, D)
    out.sum().backward()
    assert k.grad.shape == k.shape


@pytest.mark.parametrize("model_type,precision,kernel,gqa", [
    ("llama", "bf16", "flash", True),  # transformers passes grouped K/V un-expanded (use_gqa_in_sdpa)
    ("llama", "fp32", "math", True),  # fp32 + enable_gqa: no memory-efficient kernel
    ("llama", "amp-bf16", "flash", True),  # autocast casts q, k, v to bf16
    ("gpt2", "fp32", "efficient", False),  # no GQA, fp32
    ("gpt2", "bf16", "flash", False),
    ("phi", "amp-bf16", "flash", False),
])
def test_hf_model_calls_the_expected_kernel(model_type, precision, kernel, gqa):
    seen: list = []
    meas = measure_hf(exp_of(TINY[model_type], precision=precision), "meta", kernels_seen=seen)
    assert meas.status == "ok", meas.reason
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    assert seen and set(seen) == {(kernel, dtype, gqa, False)}


# -- traces ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", sorted(TINY))
@pytest.mark.parametrize("setup", [  # plain bf16 and fp32 run in test_hf_model_calls_the_expected_kernel
    dict(precision="amp-bf16", checkpoint="full"),
    dict(precision="bf16", lora=LoraSpec(rank=4, targets=("o", "up"), dropout=0.05), checkpoint="full"),
])
def test_each_family_traces(model_type, setup):
    meas = measure_hf(exp_of(TINY[model_type], **setup), "meta")
    assert meas.status == "ok", meas.reason
    assert meas.framework == "hf" and meas.transformers_version
    assert (meas.peft_version is not None) == ("lora" in setup)
    assert isinstance(meas.measured_bytes, int) and meas.measured_bytes >= meas.params * 2


def test_reentrant_checkpointing_traces():
    """Both checkpoint implementations run (reentrant needs the embedding output to require grad,
    which activation_checkpointing_enable arranges) and keep less than no checkpointing."""
    m = TINY["llama"].model_copy(update={"n_layers": 2})
    lora = LoraSpec(rank=4, targets=("q", "v"))
    none = measure_hf(exp_of(m, precision="bf16", seq=128, lora=lora), "meta")
    e = exp_of(m, precision="bf16", seq=128, checkpoint="full", lora=lora)
    a = measure_hf(e, "meta")
    b = measure_hf(exp_of(m, precision="bf16", seq=128, checkpoint="full", checkpoint_reentrant=True, lora=lora),
                   "meta")
    assert none.status == a.status == b.status == "ok"
    assert a.measured_bytes < none.measured_bytes and b.measured_bytes < none.measured_bytes


#: the estimate of a reentrant-checkpointed step against the HF trace (relative)
REENTRANT_TOL = 0.005


@pytest.mark.parametrize("adapter,checkpoint", [
    # source: torch 2.13 utils/checkpoint.py CheckpointFunction.backward (nested autograd.backward holding the
    # recomputed outputs and their gradient; memcalc.engine.checkpoint reentrant)
    ("lora", "full"),
    ("lora", "every-k"),
    ("none", "full"),
    # source: peft 0.21 prepare_model_for_kbit_training: the checkpointing hf --qlora gets by default
    # (its last layer's region held one fp32 hidden state more than the estimate until autograd's out-of-place
    # sum into a gradient something else holds, InputBuffer::accumulate, was followed: sim_backward, 69e75a9)
    ("qlora", "full"),
    ("qlora", "every-k"),
])
def test_reentrant_estimate_matches_trace(adapter, checkpoint):
    """The estimate of torch's reentrant checkpoint (recomputed whole, its output and gradient held through
    the nested backward) against transformers' activation_checkpointing_enable(use_reentrant=True)."""
    from memcalc.estimate.peak import estimate

    m = TINY["llama"].model_copy(update={"n_layers": 2})
    lora = {"none": None, "lora": LoraSpec(rank=8, targets=("q", "k", "v", "o")),
            "qlora": LoraSpec(rank=8, qlora=True, targets=("q", "k", "v", "o"))}[adapter]
    e = exp_of(m, precision="bf16", seq=128, batch=4, checkpoint=checkpoint, checkpoint_every=2,
               checkpoint_reentrant=True, lora=lora)
    traced = measure_hf(e, "meta")
    assert traced.status == "ok", traced.reason
    assert estimate(e, timeline=False).peak_bytes == pytest.approx(traced.measured_bytes, rel=REENTRANT_TOL)


def test_checkpointing_saves_memory():
    """every-K is activation_checkpointing_enable(every_n_layers=K): layer 0 of 2 checkpointed, so
    it keeps more than full and less than none."""
    m = TINY["llama"].model_copy(update={"n_layers": 2})

    def peak(**kw):
        return measure_hf(exp_of(m, precision="bf16", seq=128, batch=2, **kw), "meta").measured_bytes

    none, every2, full = peak(), peak(checkpoint="every-k", checkpoint_every=2), peak(checkpoint="full")
    assert full < every2 < none


@pytest.mark.parametrize("setup", [
    dict(precision="fp32"),  # source: meta-trace-pitfalls.md: CPU and meta peaks agree where kernels agree
    dict(precision="fp32", lora=LoraSpec(rank=4, targets=("q", "v"))),
    dict(precision="fp32", checkpoint="full"),
])
def test_cpu_and_meta_peaks_agree_on_the_math_path(setup):
    """fp32 with grouped K/V routes to the math kernel on every device: the same ops run on CPU
    (real tensors) and meta, so the traced peaks are identical but for AdamW's ``step`` counters,
    0-d CPU tensors (one per trainable tensor, created in the first step) that the CPU run counts
    and a meta (or CUDA) trace does not; tolerance: exactly those 512-byte blocks."""
    e = exp_of(TINY["llama"], **setup)
    seen: list = []
    meta = measure_hf(e, "meta", kernels_seen=seen)
    cpu = measure_hf(e, "cpu")
    assert {c[0] for c in seen} == {"math"}
    model, _ = build_hf_model(e.model, e.training.lora, torch.float32)
    counters = 512 * sum(1 for p in model.parameters() if p.requires_grad)
    assert cpu.measured_bytes == meta.measured_bytes + counters
    assert cpu.first_step_bytes >= meta.first_step_bytes


@pytest.mark.parametrize("setup,why", [
    (dict(checkpoint="sqrt"), "no Hugging Face equivalent"),
    (dict(compile=True), "torch.compile needs CUDA"),
])
def test_skipped_with_reason(setup, why):
    meas = measure_hf(exp_of(TINY["llama"], **setup), "meta")
    assert meas.status == "skipped" and why in meas.reason


# -- the command line -------------------------------------------------------------------------------------
def run(args):
    return CliRunner().invoke(app, args)


def test_cli_framework_hf_json():
    r = run(["validate", "--framework", "hf", "--model", "tinyllama-1.1b", "--bf16", "--lora", "--seq", "128",
             "--scale-layers", "1", "--device", "meta", "--json"])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(r.stdout)
    assert rec["framework"] == "hf" and rec["status"] == "ok"
    assert rec["transformers_version"] and rec["peft_version"]
    assert isinstance(rec["measured_bytes"], int) and isinstance(rec["predicted_bytes"], int)


def test_cli_plain_records_name_the_framework():
    r = run(["validate", "--framework", "plain", "--model", "tinyllama-1.1b", "--bf16", "--seq", "64",
             "--scale-layers", "1", "--device", "meta", "--json"])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(r.stdout)
    assert rec["framework"] == "plain" and rec["transformers_version"] is None and rec["peft_version"] is None


# (args, exit code, message)
BAD = [
    (["validate", "--framework", "keras", "--model", "gpt2", "--device", "meta"], 2,
     "unknown --framework 'keras'; valid: plain, hf, torchtune, litgpt, trl, unsloth; aliases: transformers"),
    (["validate", "--framework", "hf", "--config", "control", "--device", "meta"], 2,
     "none of the Hugging Face families"),
    (["validate", "--framework", "hf", "--model", "gpt2", "--lora", "--lora-targets", "q,v", "--device", "meta"], 2,
     "q, k, v are one fused projection: target qkv"),
    # source: validate/command.py REENTRANT_TRACED (the replica's checkpoint is non-reentrant)
    (["validate", "--reentrant", "--checkpoint", "full", "--framework", "plain", "--model", "gpt2", "--device",
      "meta"], 2, "is traced by --framework hf or trl on one GPU; plain's checkpointing is non-reentrant"),
    # source: memcalc/core/training_spec.py TrainingSpec._check (reentrant needs checkpointed layers)
    (["validate", "--reentrant", "--framework", "hf", "--model", "gpt2", "--device", "meta"], 2,
     "reentrant checkpointing applies to checkpointed layers"),
    # source: validate/hf_runner.py CONV1D_FAMILIES (hf_qlora.load_4bit reads nn.Linear weights only)
    (["validate", "--framework", "hf", "--model", "gpt2", "--bf16", "--qlora", "--lora-targets", "qkv",
      "--device", "meta"], 2, "--qlora on gpt2: its projections are transformers' Conv1D"),
    (["validate", "--framework", "trl", "--model", "gpt2", "--bf16", "--qlora", "--lora-targets", "qkv",
      "--device", "meta"], 2, "--qlora on gpt2: its projections are transformers' Conv1D"),
]


@pytest.mark.parametrize("args,code,message", BAD)
def test_cli_bad_input_one_line_exit_2(args, code, message):
    r = run(args)
    assert r.exit_code == code, r.output
    assert message in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.output


def _saved(fn):
    """(shape, dtype) of every tensor autograd saves while ``fn`` runs."""
    out = []

    def pack(t):
        out.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return out


def test_flash_keeps_grouped_kv_unexpanded():
    """FA2 takes K/V with fewer heads natively (flash_api.cpp ``mha_fwd``: num_heads_k divides
    num_heads): what is saved is the un-expanded K and V, not ``repeat_kv`` copies."""
    B, H, kvH, T, D = 1, 8, 2, 16, 16
    q = torch.empty((B, H, T, D), device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty((B, kvH, T, D), device="meta", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty((B, kvH, T, D), device="meta", dtype=torch.bfloat16, requires_grad=True)
    with HFKernels(PROFILE) as mode:
        saved = _saved(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert mode.calls[0][0] == "flash"
    shapes = [s for s, _ in saved]
    assert shapes.count((B, kvH, T, D)) == 2 and shapes.count((B, H, T, D)) == 2  # k, v; q, out
    assert (B, H, T) in shapes  # the logsumexp


def test_dropout_saves_a_bool_mask():
    # source: aten/src/ATen/native/cuda/Dropout.cu: native_dropout saves a bool mask (1 byte/element)
    x = torch.empty((4, 64), device="meta", dtype=torch.float32, requires_grad=True)
    with HFKernels(PROFILE):
        saved = _saved(lambda: F.dropout(x, 0.05, training=True))
    assert saved == [((4, 64), torch.bool)]


def test_grid_covers_the_families_and_setups():
    from memcalc.validate.hf_grid import grid, hf_estimator_spec

    items = grid()
    assert len(items) >= 40
    assert {choose_family(e.model).model_type for _, e in items} == set(FAMILIES)
    assert {e.training.precision for _, e in items} == {"fp32", "bf16", "amp-bf16"}
    assert {e.training.checkpoint for _, e in items} == {"none", "full"}
    assert {e.training.lora.dropout for _, e in items if e.training.lora} == {0.0, 0.05}
    assert all(hf_estimator_spec(e).profile.logits_fp32 for _, e in items)


def test_packed_sequence_detection_is_answered_on_meta():
    """masking_utils.find_packed_sequence_indices calls ``bool()`` on a meta tensor (it cannot); inside
    hf_patches it answers what unpacked data answers (None), and is restored after."""
    from transformers import masking_utils

    from memcalc.validate.hf_kernels import hf_patches

    pos = torch.arange(8, device="meta")[None]
    original = masking_utils.find_packed_sequence_indices
    with pytest.raises(Exception):
        original(pos)
    with hf_patches(torch.nn.Module(), HFKernels(PROFILE)):
        assert masking_utils.find_packed_sequence_indices(pos) is None
        real = torch.arange(8)[None]  # real tensors still go to transformers' own function
        assert masking_utils.find_packed_sequence_indices(real) is None
        assert masking_utils.find_packed_sequence_indices(torch.tensor([[0, 1, 0, 1]])) is not None
    assert masking_utils.find_packed_sequence_indices is original


def test_math_kernel_dropout_saves_a_bool_mask():
    """The math kernel's ``at::dropout`` is ``native_dropout`` on CUDA: its (B,H,T,T) mask is bool."""
    B, H, kvH, T, D = 1, 4, 2, 16, 16
    q = torch.empty((B, H, T, D), device="meta", dtype=torch.float32, requires_grad=True)
    k = torch.empty((B, kvH, T, D), device="meta", dtype=torch.float32, requires_grad=True)
    with HFKernels(PROFILE) as mode:
        saved = _saved(lambda: F.scaled_dot_product_attention(q, k, k, dropout_p=0.1, is_causal=True,
                                                              enable_gqa=True))
    assert mode.calls[0][0] == "math"
    assert ((B, H, T, T), torch.bool) in saved


def test_the_cli_accepts_exactly_the_frameworks_the_validator_traces():
    # memcalc/core/choices.py TRACED_FRAMEWORKS (the CLI's check, before torch loads) is the validator's
    # own list: plain, hf and validate/trainers/ TRAINERS
    from memcalc.core.choices import TRACED_FRAMEWORKS
    from memcalc.validate.command import FRAMEWORKS

    assert TRACED_FRAMEWORKS == FRAMEWORKS

"""Frameworks in the estimator: ``--framework {hf, torchtune, litgpt, plain}``, ``--torch``,
``--lora-dtype``, the defaults and their reasons, and the framework rules in the engine (LoRA
adapter dtype and input casts, grouped-query SDPA, transformers' gelu_new chain)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from conftest import one_line_error
from memcalc.core.dtypes import DType
from memcalc.core.spec import ExperimentSpec, KernelProfile, LoraSpec, ModelSpec, TrainingSpec
from memcalc.engine.ops import Ops
from memcalc.engine.params import count_params
from memcalc.engine.sim import Sim
from memcalc.engine.timeline import weights_and_state_bytes
from memcalc.estimate.peak import estimate
from memcalc.inputs.profiles import PROFILES, VARIANTS, compose, get_profile, profile_for
from memcalc.inputs.resolve import Options, resolve


def run(args: list[str]):
    return CliRunner().invoke(app, args)


def doc_of(args: list[str]) -> dict:
    r = run([*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# -- the CLI ----------------------------------------------------------------------------------

BAD_INPUT = [
    # (args, exit code, message on stderr)
    (["estimate", "--model", "gpt2", "--framework", "jax"], 2, "unknown --framework 'jax'; valid: plain, hf, torchtune, litgpt"),
    (["estimate", "--model", "gpt2", "--torch", "3.0"], 2, "unknown --torch '3.0'; valid: 2.1 to 2.13"),
    (["estimate", "--model", "gpt2", "--torch", "2.0"], 2, "unknown --torch '2.0'; valid: 2.1 to 2.13"),
    (["estimate", "--model", "gpt2", "--torch", "latest"], 2, "unknown --torch 'latest'"),
    (["estimate", "--model", "gpt2", "--lora-dtype", "fp16"], 2, "'fp16' is not one of 'fp32', 'model'"),
    (["plan", "--model", "gpt2", "--framework", "deepspeed"], 2, "unknown --framework 'deepspeed'; valid: "),
    (["plan", "--model", "gpt2", "--torch", "1.13"], 2, "unknown --torch '1.13'"),
]


@pytest.mark.parametrize("args,code,message", BAD_INPUT)
def test_bad_input_is_one_line_exit_2(args, code, message):
    r = run(args)
    one_line_error(r, code, message)


#: (args, framework, torch, profile name, origin of the framework)
PROFILE_ROWS = [
    (["--config", "control"], "plain", "2.8", "torch-2.8-cuda", "config"),  # source: the reference build
    (["--model", "gpt2"], "hf", "2.8", "hf-torch-2.8-cuda", "default"),  # source: a preset is an HF model
    (["--params", "1e8"], "hf", "2.8", "hf-torch-2.8-cuda", "default"),  # source: most users run HF + PEFT
    (["--model", "gpt2", "--framework", "plain"], "plain", "2.8", "torch-2.8-cuda", "flag"),
    (["--model", "gpt2", "--framework", "torchtune", "--torch", "2.9"], "torchtune", "2.9",
     "torchtune-torch-2.9-cuda", "flag"),
    # --framework replaces the framework of --profile, keeping its PyTorch version
    (["--model", "gpt2", "--profile", "torch-2.9-cuda", "--framework", "hf"], "hf", "2.9", "hf-torch-2.9-cuda", "flag"),
    # --torch replaces the version of the config's profile, keeping its framework
    (["--config", "control", "--torch", "2.9"], "plain", "2.9", "torch-2.9-cuda", "config"),
    (["--model", "gpt2", "--profile", "hf-torch-2.8-cuda"], "hf", "2.8", "hf-torch-2.8-cuda", "flag"),
]


def options(args: list[str]) -> Options:
    """The estimate command's options for ``args`` (flags as the CLI passes them; no estimate run)."""
    kw: dict = {}
    it = iter(args)
    for a in it:
        key = a.lstrip("-").replace("-", "_")
        kw[key] = True if key in ("lora", "qlora", "bf16") else next(it)
    for k in ("batch", "seq"):
        if k in kw:
            kw[k] = int(kw[k])
    return Options(**kw)


@pytest.mark.parametrize("args,framework,torch,name,origin", PROFILE_ROWS)
def test_framework_and_torch_compose(args, framework, torch, name, origin):
    res = resolve(options(args))
    p = res.exp.profile
    assert (p.framework, p.torch_version, p.name) == (framework, torch, name)
    assert res.origin["framework"] == origin


def test_cli_profile_and_framework_compose():
    d = doc_of(["estimate", "--model", "gpt2", "--seq", "64", "--profile", "torch-2.9-cuda", "--framework", "hf"])
    assert d["inputs"]["profile"] == profile_for("hf", "2.9").model_dump(mode="json")  # (JSON: tuples as lists)


def test_reference_configs_keep_plain_and_their_published_peak():
    res = resolve(options(["--config", "control"]))
    assert res.exp.profile == get_profile("torch-2.8-cuda")
    assert res.exp.published_peak_bytes is not None  # the setup is still the reference one


@pytest.mark.slow  # an 8B model at batch 4 x 4096
def test_issue_example_defaults_to_bf16_and_says_why():
    # source: issue 11's done-criterion
    args = ["estimate", "--model", "llama-3.1-8b", "--qlora", "--checkpoint", "full", "--batch", "4", "--seq", "4096",
            "--gpu", "rtx-4090"]
    d = doc_of(args)
    tr, o, why = d["inputs"]["training"], d["inputs"]["origin"], d["inputs"]["reasons"]
    assert tr["precision"] == "bf16" and o["precision"] == "default" and "QLoRA computes in bf16" in why["precision"]
    assert d["inputs"]["profile"]["framework"] == "hf" and "preset" in why["framework"]
    assert d["inputs"]["adapter_dtype"] == "fp32" and "autocast_adapter_dtype" in why["lora_dtype"]
    r = run([*args, "--verbose"])  # (issue 29: the inputs with their reasons are --verbose's)
    text = " ".join(r.stdout.split())
    assert "bf16 (default: QLoRA: a bf16 base" in text, text
    assert "hf (default: a preset is a Hugging Face model" in text, text


#: a small model, so the quick lane stays quick
TINY = ["--params", "2e7", "--seq", "64"]

#: (args, precision, reason fragment); source: inputs.resolve's module docstring
PRECISION_ROWS = [
    (["--lora"], "bf16", "LoRA: a bf16 base"),
    (["--qlora"], "bf16", "QLoRA computes in bf16"),
    ([], "fp32", "Hugging Face Trainer runs without --bf16"),
]


@pytest.mark.parametrize("args,precision,why", PRECISION_ROWS)
def test_precision_default_and_reason(args, precision, why):
    res = resolve(options([*TINY, *args]))
    assert res.exp.training.precision == precision
    assert why in res.reasons["precision"]


def test_given_precision_has_no_reason():
    res = resolve(options([*TINY, "--lora", "--precision", "fp16"]))
    assert res.exp.training.precision == "fp16" and "precision" not in res.reasons


#: (args, adapter dtype); source: profiles.FRAMEWORKS lora_dtype and the PEFT / torchtune / litgpt code cited there
LORA_DTYPE_ROWS = [
    (["--framework", "hf"], "fp32"),
    (["--framework", "plain"], "bf16"),
    (["--framework", "torchtune"], "bf16"),
    (["--framework", "litgpt"], "bf16"),
    (["--framework", "hf", "--lora-dtype", "model"], "bf16"),
    (["--framework", "plain", "--lora-dtype", "fp32"], "fp32"),
]


@pytest.mark.parametrize("args,adapters", LORA_DTYPE_ROWS)
def test_lora_dtype_follows_the_framework(args, adapters):
    res = resolve(options([*TINY, "--lora", *args]))
    assert res.exp.adapter_dtype.value == adapters
    assert res.origin["lora_dtype"] == ("flag" if "--lora-dtype" in args else "default")


def test_json_and_text_show_the_defaults_and_why():
    d = doc_of(["estimate", *TINY, "--qlora"])
    why = d["inputs"]["reasons"]
    assert d["inputs"]["training"]["precision"] == "bf16" and "QLoRA computes in bf16" in why["precision"]
    assert d["inputs"]["adapter_dtype"] == "fp32" and "autocast_adapter_dtype" in why["lora_dtype"]
    assert d["inputs"]["origin"]["framework"] == "default" and "--params" in why["framework"]
    text = " ".join(run(["estimate", *TINY, "--qlora", "--verbose"]).stdout.split())
    assert "bf16 (default: QLoRA: a bf16 base" in text and "hf (default: --params" in text, text


def test_help_states_the_defaults():
    text = " ".join(run(["estimate", "--help"]).stdout.split())
    for phrase in ("Default: plain for a --config", "hf for --model and --params", "default 2.8",
                   "Default: bf16 with --lora/--qlora", "hf: fp32", "--framework/--torch replace that part of it"):
        assert phrase in text, phrase


# -- the profiles -------------------------------------------------------------------------------

#: (framework, torch, field, value)
RULES = [
    ("hf", "2.8", "rmsnorm", "composite-legacy"),  # source: transformers LlamaRMSNorm, weight * h.to(input_dtype)
    ("hf", "2.9", "rmsnorm", "composite-legacy"),  # source: the same module on any PyTorch (not nn.RMSNorm)
    ("hf", "2.8", "logits_fp32", True),  # source: transformers ForCausalLMLoss, logits.float()
    ("hf", "2.8", "shift_copy", False),  # source: ForCausalLMLoss shifts the labels (pad + [..., 1:])
    ("hf", "2.8", "lora_dtype", "fp32"),  # source: peft cast_adapter_dtype, autocast_adapter_dtype=True
    ("hf", "2.8", "lora_input_cast", True),  # source: peft lora.Linear.forward, x.to(lora_A.weight.dtype)
    ("hf", "2.8", "sdpa_gqa", True),  # source: transformers sdpa_attention_forward, use_gqa_in_sdpa
    ("hf", "2.4", "sdpa_gqa", False),  # source: enable_gqa exists from PyTorch 2.5
    ("hf", "2.8", "gelu_new", "chain"),  # source: transformers NewGELUActivation (pointwise ops)
    ("plain", "2.8", "rmsnorm", "composite"),  # source: aten rms_norm_symint 2.6-2.8
    ("plain", "2.9", "rmsnorm", "fused"),  # source: _fused_rms_norm from 2.9
    ("plain", "2.1", "mean_saves_input", True),  # source: mean backward kept its input in 2.1
    ("torchtune", "2.8", "rmsnorm", "composite"),  # source: torchtune 0.6.1 RMSNorm, F.rms_norm(x.float()) (traced)
    ("torchtune", "2.8", "cross_entropy", "chunked"),  # source: torchtune CEWithChunkedOutputLoss
    ("torchtune", "2.8", "shift_copy", False),  # source: the recipes shift the labels (hstack)
    ("torchtune", "2.8", "sdpa_gqa", False),  # source: torchtune MultiHeadAttention expand + reshape
    ("litgpt", "2.8", "rmsnorm", "composite"),  # source: litgpt RMSNorm, (x_normed * weight.float()).to(dtype)
    ("litgpt", "2.9", "rmsnorm", "composite"),  # source: litgpt's own module on any PyTorch
    ("litgpt", "2.8", "sdpa_gqa", False),  # source: litgpt CausalSelfAttention repeat_interleave
    ("litgpt", "2.8", "lora_dtype", "model"),  # source: litgpt LoRALinear, Fabric bf16-true
]


@pytest.mark.parametrize("framework,torch,field,value", RULES)
def test_framework_rule(framework, torch, field, value):
    assert getattr(profile_for(framework, torch), field) == value


def test_named_profiles_are_their_pairs():
    for name, p in PROFILES.items():  # a variant: the pair with a framework version's fields (VARIANTS)
        want = profile_for(p.framework, p.torch_version)
        assert p == (want.model_copy(update={"name": name, **VARIANTS[name]}) if name in VARIANTS else want), name
    assert PROFILES["torch-2.8-cuda"] == KernelProfile()  # the spec's default is the reference build


def test_compose_keeps_fields_that_are_not_rules():
    base = KernelProfile(attention="math", loss_chunks=3, allocator_round_bytes=1024)
    p = compose(base, framework="hf")
    assert (p.attention, p.loss_chunks, p.allocator_round_bytes) == ("math", 3, 1024)
    assert p.framework == "hf" and p.logits_fp32 and p.name == "hf-torch-2.8-cuda"
    assert compose(base) is base


# (--framework, --torch over --profile litgpt-2023.10-torch-2.1-cuda, the name, norm_upcast)
VARIANT_COMPOSE = [
    # source: the variant's own pair: lit-gpt before 6178c7cc on PyTorch 2.1 (lit_gpt/rmsnorm.py, no x.float())
    ("litgpt", "2.1", "litgpt-2023.10-torch-2.1-cuda", False),
    # source: the same lit-gpt code on another PyTorch: its RMSNorm still has no upcast, the label keeps it
    (None, "2.8", "litgpt-2023.10-torch-2.8-cuda", False),
    # source: transformers' LlamaRMSNorm upcasts (hidden_states.to(torch.float32)): not lit-gpt's code
    ("hf", None, "hf-torch-2.1-cuda", True),
]


@pytest.mark.parametrize("framework,torch,name,upcast", VARIANT_COMPOSE)
def test_compose_a_variant_says_what_runs(framework, torch, name, upcast):
    p = compose(get_profile("litgpt-2023.10-torch-2.1-cuda"), framework, torch)
    assert (p.name, p.norm_upcast) == (name, upcast)


# -- the engine rules -----------------------------------------------------------------------------

def _ops(profile: KernelProfile, autocast=None) -> tuple[Sim, Ops]:
    sim = Sim(round_bytes=1)
    return sim, Ops(sim, profile, autocast)


def _saved(sim: Sim) -> int:
    """Bytes of the distinct tensors that the recorded nodes save for backward."""
    seen = {id(t): t.nbytes for n in sim.nodes for t in n.saved}
    return sum(seen.values())


N = 4096
#: (gelu_new mode, autocast, x dtype, saved bytes per element of x)
GELU_ROWS = [
    ("fused", None, DType.bf16, 2),  # source: gelu_backward(grad, self): the input only
    ("chain", None, DType.bf16, 8),  # source: pow saves x, tanh its result, the last mul both operands: 4 x 2 bytes
    ("chain", None, DType.fp32, 16),  # source: the same four tensors in fp32
    ("chain", DType.bf16, DType.bf16, 4 + 4 + 2 + 4),  # source: autocast runs pow in fp32: x copy, tanh, 1+tanh fp32
]


@pytest.mark.parametrize("mode,autocast,dt,per_elem", GELU_ROWS)
def test_gelu_new_saves(mode, autocast, dt, per_elem):
    sim, o = _ops(KernelProfile(gelu_new=mode), autocast)
    x = o.new(N, dt)
    x.requires_grad = True
    y = o.activation(x, "gelu_new")
    assert _saved(sim) == per_elem * N
    o.drop(y)


B, H, HKV, T, D = 2, 8, 2, 128, 64


def _attn(kernel: str, n_rep: int) -> tuple[int, list[int]]:
    sim, o = _ops(KernelProfile())
    q = o.new(B * H * T * D, DType.bf16)
    k = o.new(B * H * T * D // n_rep, DType.bf16)
    v = o.new(B * H * T * D // n_rep, DType.bf16)
    for t in (q, k, v):
        t.requires_grad = True
    out = o.sdpa(q, k, v, B, H, T, D, None, 0, 0.0, kernel, n_rep=n_rep)
    node = sim.nodes[-1]
    o.drop(out)
    return _saved(sim), node.temps


def test_flash_with_grouped_kv_saves_them_unexpanded():
    # source: FA2 mha_fwd saves q, k, v, out, lse with num_heads_k < num_heads
    n_q = B * H * T * D
    saved, temps = _attn("flash", H // HKV)
    assert saved == 2 * (n_q + 2 * n_q // (H // HKV) + n_q) + 4 * B * H * T
    # source: FA2 mha_bwd allocates dk_expanded and dv_expanded (B, T, H, D) for grouped K/V
    assert temps[-2:] == [2 * n_q, 2 * n_q]


def test_math_with_grouped_kv_saves_expanded_copies():
    # source: attention.cpp _scaled_dot_product_attention_math: repeat_interleave of k and v under enable_gqa
    grouped, _ = _attn("math", H // HKV)
    expanded, _ = _attn("math", 1)
    assert grouped == expanded


def _lora_exp(framework: str, **lora) -> ExperimentSpec:
    m = ModelSpec(name="tiny", n_layers=2, d_model=256, n_heads=8, n_kv_heads=2, d_ff=512, vocab_size=512,
                  max_seq_len=512)
    return ExperimentSpec(model=m, training=TrainingSpec(batch=2, seq=256, precision="bf16", lora=LoraSpec(**lora)),
                          profile=profile_for(framework))


def test_fp32_adapters_weights_and_adam_state():
    # source: PEFT fp32 adapters: 4 bytes of weight + 8 of AdamW state per adapter parameter, vs 2 + 4 in bf16
    n = count_params(_lora_exp("hf").model, LoraSpec()).lora
    assert weights_and_state_bytes(_lora_exp("hf")) - weights_and_state_bytes(_lora_exp("plain")) == (12 - 6) * n
    d = estimate(_lora_exp("hf"), timeline=False, replay=False).bytes_per_param
    assert (d["weights"], d["gradients"], d["optimizer_state"]) == (4, 4, 8)


def test_each_target_casts_its_input():
    # source: peft lora.Linear.forward: every target casts x to fp32 and lora_A saves that copy;
    # a bf16 adapter saves the (shared) bf16 input instead. The hf profile with --lora-dtype model
    # keeps everything but the adapter dtype the same.
    rows, d = 2 * 256, 256
    hf32 = estimate(_lora_exp("hf", targets=("q", "k", "v")), timeline=False, replay=False)
    hf16 = estimate(_lora_exp("hf", targets=("q", "k", "v"), dtype="model"), timeline=False, replay=False)
    more = hf32.extra["max_activation_bytes"] - hf16.extra["max_activation_bytes"]
    # per layer: three fp32 copies of the norm output saved instead of the one bf16 output (which
    # nothing else saves: the frozen base keeps no input), and each lora_A output (rows x r) in fp32
    r = LoraSpec().rank
    assert more == 2 * (3 * rows * d * 4 - rows * d * 2 + 3 * rows * r * (4 - 2))


def test_dropout_saves_its_output_not_the_copy():
    # source: peft lora.Linear.forward lora_A(dropout(x)): the cast copy dies, dropout's output
    # (fp32, the same size) is saved instead, plus its bool mask -- in layer 1 only: layer 0's input
    # needs no gradient (the embedding is frozen), so autograd records no dropout there and the
    # mask dies at once
    base = estimate(_lora_exp("hf", targets=("q",)), timeline=False, replay=False).components
    drop = estimate(_lora_exp("hf", targets=("q",), dropout=0.1), timeline=False, replay=False).components
    assert drop["saved activations"] == base["saved activations"]
    assert drop["dropout masks"] == 2 * 256 * 256 * 1 and "dropout masks" not in base


def test_qlora_targets_cast_their_input_too():
    # source: peft/tuners/lora/bnb.py Linear4bit.forward: outside autocast x is cast to the adapters'
    # dtype (saved by lora_A) as in lora.Linear; the base output is cloned and the branch's output
    # cast back before the add (transients only), so the saved difference is the same as LoRA's
    # (without prepare_model_for_kbit_training's fp32 casts, as TRL >= 0.20's SFTTrainer runs it: with
    # them the stream is fp32 already and the cast is no copy)
    rows, d, r = 2 * 256, 256, LoraSpec().rank
    q32 = estimate(_no_kbit_cast(_lora_exp("hf", targets=("q", "k", "v"), qlora=True)), timeline=False, replay=False)
    q16 = estimate(_no_kbit_cast(_lora_exp("hf", targets=("q", "k", "v"), qlora=True, dtype="model")), timeline=False,
                   replay=False)
    more = q32.extra["max_activation_bytes"] - q16.extra["max_activation_bytes"]
    assert more == 2 * (3 * rows * d * 4 - rows * d * 2 + 3 * rows * r * (4 - 2))


def _no_kbit_cast(exp: ExperimentSpec) -> ExperimentSpec:
    return exp.model_copy(update={"profile": exp.profile.model_copy(update={"qlora_fp32_cast": False})})


def test_kbit_cast_makes_every_16_bit_parameter_fp32():
    # source: peft/utils/other.py prepare_model_for_kbit_training: ``param.data = param.data.to(torch.float32)``
    # for every fp16/bf16 parameter that is not a bitsandbytes Params4bit: the embedding, the norms and the
    # untied head (2 more bytes each); the NF4 base and the fp32 adapters are unchanged
    exp = _lora_exp("hf", qlora=True)
    m = exp.model
    frozen = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2) + m.d_model * (2 * m.n_layers + 1)
    cast = estimate(exp, timeline=False, replay=False).components
    plain = estimate(_no_kbit_cast(exp), timeline=False, replay=False).components
    assert cast["frozen base weights"] - plain["frozen base weights"] == 2 * frozen
    assert cast["frozen base weights (NF4)"] == plain["frozen base weights (NF4)"]

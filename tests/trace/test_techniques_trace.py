"""Issue 14's techniques, estimate against the meta trace of the same step.

Each row builds one experiment; ``memcalc.estimate.peak`` simulates it and the validator traces it
on ``meta``: the plain replica (``validate/``: torchtune's OffloadActivations as saved-tensor hooks,
the paged-optimizer stand-in, the head adapter, PEFT's DoRA code) or the real transformers + PEFT
step (``--framework hf``: ``LoraConfig(target_modules=[..., "lm_head"], use_dora=True)``). Small
shapes: presets cut to 2 layers.
"""

from __future__ import annotations

import pytest

# needs torch (the validator): left out of the quick lane, run by the full suite
pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

from memcalc.core.spec import ExperimentSpec, TrainingSpec  # noqa: E402
from memcalc.estimate.peak import estimate  # noqa: E402
from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.inputs.profiles import profile_for  # noqa: E402
from memcalc.validate.hf_runner import measure_hf  # noqa: E402
from memcalc.validate.runner import measure  # noqa: E402

TOLERANCE_PCT = 3.0  # the project's estimate-vs-trace tolerance (tests/trace/test_estimator_vs_trace.py)
DORA_TOLERANCE_PCT = 2.0  # issue 14: DoRA within 2% of the HF validator
HOST_TOLERANCE_PCT = 2.0  # pinned host bytes: RoPE tables are not packed (hf/trl/torchtune pass them as keywords)
ALL = ("q", "k", "v", "o", "gate", "up", "down")

# (preset, layers, training, framework) -- a # source: per row names what it exercises
GRID = [
    # source: torchtune OffloadActivations, full fine-tuning (peak: optimizer step)
    ("tinyllama-1.1b", 2, dict(batch=2, seq=512, precision="bf16", activation_offload=True), "plain"),
    # source: OffloadActivations + LoRA: frozen weight views offloaded and reloaded in backward
    ("tinyllama-1.1b", 2, dict(batch=2, seq=512, precision="bf16", lora=dict(rank=16), activation_offload=True), "plain"),
    # source: OffloadActivations + checkpointing: the region inputs (_NoopSaveInputs) are what is offloaded
    ("llama-3.1-8b", 2, dict(batch=1, seq=1024, precision="bf16", lora=dict(rank=8, targets=ALL), checkpoint="full",
                             activation_offload=True), "plain"),
    # source: OffloadActivations + checkpointing in fp32: the recompute's RMSNorm saves the reloaded input itself
    ("tinyllama-1.1b", 2, dict(batch=2, seq=512, checkpoint="full", activation_offload=True), "plain"),
    # source: OffloadActivations + checkpointing, LayerNorm: native_layer_norm saves the reloaded input
    ("gpt2", 2, dict(batch=2, seq=512, precision="bf16", checkpoint="full", activation_offload=True), "plain"),
    # source: OffloadActivations, fp32 GPT-2 (tied head kept on the GPU by the NoOpManager)
    ("gpt2", 2, dict(batch=2, seq=512, activation_offload=True), "plain"),
    # source: OffloadActivations + QLoRA under AMP
    ("mistral-7b", 2, dict(batch=2, seq=512, precision="amp-bf16", lora=dict(rank=16, qlora=True),
                           activation_offload=True), "plain"),
    # source: bitsandbytes PagedAdamW8bit: large moments in unified memory (not counted)
    ("tinyllama-1.1b", 2, dict(batch=2, seq=512, precision="bf16", optimizer="paged-adamw-8bit"), "plain"),
    # source: bitsandbytes PagedAdamW (32-bit state)
    ("tinyllama-1.1b", 2, dict(batch=1, seq=256, precision="bf16", optimizer="paged-adamw"), "plain"),
    # source: LoRA on the output head (lm_head), untied
    ("tinyllama-1.1b", 2, dict(batch=2, seq=512, precision="bf16", lora=dict(rank=16, targets=("q", "v", "head"))), "plain"),
    # source: LoRA on a tied head under AMP
    ("gpt2", 2, dict(batch=2, seq=512, precision="amp-bf16", lora=dict(rank=8, targets=("qkv", "head"))), "plain"),
    # source: PEFT DoraLinearLayer.forward, every projection (peak: a layer's DoRA temporaries)
    ("llama-3.1-8b", 2, dict(batch=1, seq=256, precision="bf16", lora=dict(rank=8, dora=True, targets=ALL)), "plain"),
    # source: DoRA with dropout: PEFT recomputes the base output on the dropped input
    ("tinyllama-1.1b", 2, dict(batch=2, seq=512, precision="bf16", lora=dict(rank=16, dora=True, targets=ALL,
                                                                              dropout=0.05)), "plain"),
    # source: QLoRA + DoRA: dequantize_module_weight, then the copy; checkpointed
    ("llama-3.1-8b", 2, dict(batch=1, seq=256, precision="bf16", lora=dict(rank=8, dora=True, targets=ALL, qlora=True),
                             checkpoint="full"), "plain"),
    # source: the real PEFT use_dora=True step (fp32 adapters over bf16, input casts)
    ("tinyllama-1.1b", 2, dict(batch=2, seq=512, precision="bf16", lora=dict(rank=16, dora=True, targets=ALL)), "hf"),
    # source: PEFT DoRA with dropout, every projection, Llama 3.1 shapes
    ("llama-3.1-8b", 2, dict(batch=1, seq=512, precision="bf16", lora=dict(rank=16, dora=True, targets=ALL,
                                                                            dropout=0.05)), "hf"),
    # source: PEFT target_modules with lm_head, and OffloadActivations closed at lm_head (torchtune's NoOpManager)
    ("tinyllama-1.1b", 2, dict(batch=2, seq=512, precision="bf16", lora=dict(rank=16, targets=("q", "v", "head")),
                               activation_offload=True), "hf"),
]


def _exp(preset: str, layers: int, tr: dict, framework: str) -> ExperimentSpec:
    m = load_preset(preset).model_copy(update={"n_layers": layers})
    prof = profile_for(framework) if framework == "hf" else None
    return ExperimentSpec(name=preset, model=m, training=TrainingSpec(**tr), **({"profile": prof} if prof else {}))


def _id(row) -> str:
    preset, layers, tr, fw = row
    lora = tr.get("lora", {})
    bits = [f"{k}={v}" for k, v in tr.items() if k != "lora"]
    bits += [f"lora-{k}={v}" for k, v in lora.items() if k != "targets"] + (["head"] if "head" in lora.get("targets", ()) else [])
    return f"{fw}-{preset}-" + "-".join(bits)


@pytest.mark.parametrize("preset,layers,tr,framework", [pytest.param(*r, id=_id(r)) for r in GRID])
def test_technique_matches_meta_trace(preset, layers, tr, framework):
    exp = _exp(preset, layers, tr, framework)
    est = estimate(exp, timeline=False)
    meas = (measure_hf if framework == "hf" else measure)(exp, "meta")
    assert meas.status == "ok", meas.reason
    gap = 100 * (est.peak_bytes - meas.measured_bytes) / meas.measured_bytes
    host = est.extra.get("host_activation_bytes")
    tol = DORA_TOLERANCE_PCT if tr.get("lora", {}).get("dora") else TOLERANCE_PCT
    assert abs(gap) <= tol, (f"estimate {est.peak_bytes:,} B ({est.peak_phase}) vs trace {meas.measured_bytes:,} B "
                             f"({meas.peak_phase}): {gap:+.2f}%")
    if tr.get("activation_offload"):
        assert host and meas.host_activation_bytes
        hgap = 100 * (host - meas.host_activation_bytes) / meas.host_activation_bytes
        assert abs(hgap) <= HOST_TOLERANCE_PCT, f"host bytes {host:,} vs traced {meas.host_activation_bytes:,}: {hgap:+.2f}%"



#: --framework hf offloading + LoRA + checkpointing on a narrow shape, where each mechanism below is > 0.8% of the
#: peak (a full-width row hides them under the weights): the last step's input leaf and its .grad (1.55%) and the
#: forward stash's window without RoPE ids (0.81%); the trace and the estimate agree to -0.03%
HELD_LEAF_TOLERANCE_PCT = 0.5


@pytest.mark.parametrize("targets", [("q", "v")])  # source: enable_input_require_grads' leaf (PEFT + checkpointing)
def test_hf_offload_keeps_the_last_unpacking_node(targets):
    """torchtune's ``OffloadActivations`` (the hf path's twin, validate/offload.py) keeps its last unpacking node
    across steps, so the previous step's input leaf and ``.grad`` are alive in the next backward
    (memcalc.engine.offload ``keep_graph``), and a checkpointed HF layer packs its hidden states alone (RoPE
    tables are a keyword: ``rope_region_inputs``): the host bytes carry no tables."""
    from memcalc.core.spec import LoraSpec
    from memcalc.validate.record import target_spec

    m = load_preset("tinyllama-1.1b").model_copy(update={"n_layers": 2, "d_model": 128, "n_heads": 4, "n_kv_heads": 2,
                                                         "d_ff": 256, "vocab_size": 2048, "name": "tinyllama-tiny"})
    tr = TrainingSpec(batch=2, seq=128, precision="bf16", checkpoint="full", activation_offload=True,
                      lora=LoraSpec(rank=8, alpha=16, targets=targets, dropout=0.0))
    exp = ExperimentSpec(name="held-leaf", model=m, training=tr, profile=profile_for("hf"))
    est = estimate(target_spec(exp, None, "hf"), timeline=False)
    meas = measure_hf(exp, "meta")
    assert meas.status == "ok", meas.reason
    gap = 100 * (est.peak_bytes - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= HELD_LEAF_TOLERANCE_PCT, (
        f"estimate {est.peak_bytes:,} B vs trace {meas.measured_bytes:,} B: {gap:+.2f}%")
    assert est.extra.get("host_activation_bytes") == meas.host_activation_bytes


# (preset, LoRA) -- trainable parameters counted by memcalc and by PEFT 0.21 on the real model
COUNT_ROWS = [
    ("qwen3-0.6b", dict(rank=8, targets=("q", "v", "head"))),  # source: tied embeddings: PEFT adapts lm_head alone
    # source: DoraLinearLayer.weight per target, on an untied lm_head too
    ("tinyllama-1.1b", dict(rank=4, targets=("q", "down", "head"), dora=True)),
]


@pytest.mark.parametrize("preset,lora", COUNT_ROWS)
def test_head_and_dora_parameters_match_peft(preset, lora):
    from memcalc.core.spec import LoraSpec
    from memcalc.engine.params import count_params
    from memcalc.validate.hf_model import build_hf_model, param_counts

    m = load_preset(preset).model_copy(update={"n_layers": 2})
    spec = LoraSpec(**lora)
    model, _ = build_hf_model(m, spec, torch.bfloat16, "meta")
    total, trainable = param_counts(model)
    counts = count_params(m, spec)
    assert (counts.total, counts.trainable) == (total, trainable)

"""A Hugging Face family added from its adapter alone (memcalc.inputs.hf_families, one module per
model_type), built and traced by the validator from the same adapter (slow; the estimate's side is
``tests/unit/test_family_adapter.py``)."""

from __future__ import annotations

import pytest

from memcalc.inputs import hf_families
from memcalc.inputs.hf_config import from_hf_config
from memcalc.inputs.hf_families import LLAMA_LORA, Family

#: Ministral (transformers' MinistralConfig / modeling_ministral.py: Mistral's layout, its defaults) as
#: a family memcalc's builtins lack: the mistral adapter's reader under another model_type
TINY_MINISTRAL = {"model_type": "ministral", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                  "max_position_embeddings": 2048, "sliding_window": 4096, "rms_norm_eps": 1e-5}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_a_family_from_an_adapter_alone_is_traced(lora: bool, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from memcalc.core.spec import ExperimentSpec, LoraSpec, TrainingSpec
    from memcalc.engine.params import count_params
    from memcalc.inputs.hf_families import mistral
    from memcalc.inputs.profiles import get_profile
    from memcalc.validate import hf_presets
    from memcalc.validate.hf_grid import HF_ESTIMATOR_PROFILE, estimate_hf
    from memcalc.validate.hf_model import build_hf_model, choose_family, param_counts
    from memcalc.validate.hf_runner import measure_hf

    if hf_families.get("ministral") is not None:
        pytest.skip("ministral is a builtin family now: tests/trace/test_hf_families_trace.py covers it")
    fam = Family("ministral", mistral.read, defaults=mistral.FAMILY.defaults, lora=LLAMA_LORA)
    hf_families.register(fam)
    try:
        m = from_hf_config(dict(TINY_MINISTRAL), "tiny-ministral", strict=True)
        # the validator finds the model's config.json as it finds a shipped one's (data/hf_configs)
        shipped = hf_presets._hf_config_presets()
        monkeypatch.setattr(hf_presets, "_hf_config_presets",
                            lambda: (*shipped, ("tiny-ministral", m, dict(TINY_MINISTRAL))))
        assert choose_family(m).model_type == "ministral"
        spec = LoraSpec(rank=16, alpha=32, targets=tuple(m.lora_targets)) if lora else None
        model, _ = build_hf_model(m, spec, torch.bfloat16)
        counted = count_params(m, spec)
        assert param_counts(model) == (counted.total, counted.trainable if spec is not None else counted.total)
        del model
        exp = ExperimentSpec(name="tiny-ministral", model=m, training=TrainingSpec(batch=1, seq=256, precision="bf16",
                                                                                   lora=spec),
                             profile=get_profile(HF_ESTIMATOR_PROFILE))
        meas = measure_hf(exp, "meta")
        assert meas.status == "ok", meas.reason
        pred, _phase = estimate_hf(exp)
        # tolerance: issue 12's 3%, as tests/trace/test_hf_families_trace.py
        gap = (pred - meas.measured_bytes) / meas.measured_bytes * 100
        assert abs(gap) <= 3.0, f"estimate {pred} vs traced {meas.measured_bytes} ({gap:+.2f}%)"
    finally:
        hf_families.unregister(fam)

"""Shared helpers: small model specs that estimate in milliseconds."""

from __future__ import annotations

import pytest

from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec

_WHOLE_FILE_SLOW = "\npytestmark = pytest.mark.slow"


def pytest_ignore_collect(collection_path, config):
    """The quick lane (``-m "not slow"``) does not even import a test file marked slow as a whole
    (``pytestmark = pytest.mark.slow``): those are the validator's files, and importing them
    imports torch (several seconds) for tests that would be deselected anyway."""
    if (config.getoption("markexpr") or "").replace(" ", "") != "notslow" or collection_path.suffix != ".py":
        return None
    try:
        text = collection_path.read_text()
    except OSError:
        return None
    return True if _WHOLE_FILE_SLOW in text else None


def tiny_llama(**kw) -> ModelSpec:
    base = dict(name="tiny-llama", n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, d_ff=688,
                vocab_size=1000, max_seq_len=4096)
    base.update(kw)
    return ModelSpec(**base)


def experiment(model: ModelSpec | None = None, **training) -> ExperimentSpec:
    return ExperimentSpec(name="test", model=model or tiny_llama(), training=TrainingSpec(**training))


@pytest.fixture
def tiny():
    return tiny_llama()


def small_config(name: str, layers: int, **training) -> ExperimentSpec:
    """A shipped reference config with fewer layers (and training overrides)."""
    from memcalc.inputs.configs import load_config

    exp = load_config(name)
    return exp.model_copy(update={"model": exp.model.model_copy(update={"n_layers": layers}),
                                  "training": exp.training.model_copy(update=training)})


def preset_exp(model: str, layers: int, budget: float, **kw) -> ExperimentSpec:
    """A preset under torch.compile at ``budget``, batch 2 x seq 256, with fewer layers."""
    from memcalc.inputs.resolve import Options, resolve

    exp = resolve(Options(model=model, batch=2, seq=256, memory_budget=budget, **kw)).exp
    return exp.model_copy(update={"model": exp.model.model_copy(update={"n_layers": layers})})

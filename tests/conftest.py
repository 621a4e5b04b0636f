"""Shared helpers: small model specs that estimate in milliseconds."""

from __future__ import annotations

import pytest

from memcalc.spec import ExperimentSpec, ModelSpec, TrainingSpec


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

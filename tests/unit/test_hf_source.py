"""The config.json a ModelSpec was read from travels with it (``ModelSpec.hf_source``), so the HF validator
traces that exact file (``validate/hf_model.py`` ``source_family``); the keys issue 27 made the reader
read: ``use_cache`` and the families' own norm code (``norm_impl``)."""

from __future__ import annotations

import pytest

from memcalc.inputs.data_files import load_named
from memcalc.inputs.hf_config import from_hf_config

# (config stem, edit of the file, field, expected value); source: each family's modeling_*.py norm class
# (transformers 5.24) and its configuration class's ``use_cache: bool = True``
READ = [
    ("openai-community--gpt2", {}, "use_cache", True),
    ("openai-community--gpt2", {"use_cache": False}, "use_cache", False),
    ("meta-llama--Llama-3.2-1B", {}, "norm_impl", "framework"),  # LlamaRMSNorm: the profile's
    ("allenai--OLMo-2-1124-7B", {}, "norm_impl", "weight-fp32"),  # Olmo2RMSNorm
    ("google--gemma-2b", {}, "norm_impl", "weight-fp32"),  # GemmaRMSNorm
    ("google--gemma-2-2b", {}, "norm_impl", "weight-fp32"),  # Gemma2RMSNorm
    ("openai--gpt-oss-20b", {}, "norm_impl", "weight-fp32"),  # GptOssRMSNorm
    ("CohereForAI--aya-23-8B", {}, "norm_impl", "layernorm-ops"),  # CohereLayerNorm
]


@pytest.mark.parametrize("stem,edit,field,expected", READ, ids=[f"{r[0]}-{r[2]}-{r[3]}" for r in READ])
def test_reader_reads(stem: str, edit: dict, field: str, expected) -> None:
    assert getattr(from_hf_config({**load_named("hf_configs", stem), **edit}, stem), field) == expected


def test_source_is_the_file_read_at_any_depth() -> None:
    raw = {**load_named("hf_configs", "openai-community--gpt2"), "use_cache": False}
    m = from_hf_config(raw, "mine", where="mine/config.json")
    assert m.hf_source is not None and m.hf_source.config == raw and m.hf_source.where == "mine/config.json"
    cut = m.model_copy(update={"n_layers": 2, "name": "cut"})
    assert cut.hf_source is not None and cut.hf_source.config["use_cache"] is False
    assert m.model_copy(update={"d_ff": m.d_ff + 64}).hf_source is None  # no longer that file's model
    assert from_hf_config(load_named("hf_configs", "openai-community--gpt2"), "x").model_copy(
        update={"use_cache": False, "name": "mine"}) == m  # provenance is not identity

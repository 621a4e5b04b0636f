"""The GPU catalog: integer byte capacities with their sources, names, aliases and errors."""

from __future__ import annotations

import re

import pytest

from memcalc.core.errors import UserError
from memcalc.inputs.gpus import GPU, get_gpu, gpu_names, list_gpus
from memcalc.core.units import GiB, KiB, MiB

REQUIRED = ["t4", "l4", "a10g", "rtx-3090", "rtx-4090", "rtx-5090", "a100-40gb", "a100-80gb", "h100-80gb", "h200",
            "b200", "mi300x"]

# (slug, device total in MiB as nvidia-smi / rocminfo reports it)
DEVICE_MIB = [
    ("t4", 15_360), ("l4", 23_034), ("a10g", 23_028), ("rtx-3090", 24_576), ("rtx-4090", 24_564),
    ("rtx-5090", 32_607), ("a100-40gb", 40_960), ("a100-80gb", 81_920), ("h100-80gb", 81_559),
    ("h200", 143_771), ("b200", 183_359), ("mi300x", 196_592), ("l40s", 46_068),
    # source: nvidia-smi tables cited in data/gpus.yaml's header (issue 16's 16 GB and 48 GB cards)
    ("v100-16gb", 16_160), ("v100-32gb", 32_480), ("rtx-4080", 16_376), ("rtx-4060-ti-16gb", 16_380),
    ("a40", 46_068), ("l40", 46_068), ("rtx-a6000", 49_140), ("rtx-6000-ada", 49_140), ("h100-nvl", 95_830),
]


def test_required_gpus_present():
    assert set(REQUIRED) <= set(gpu_names())


@pytest.mark.parametrize("name,mib", DEVICE_MIB)
def test_capacity_is_the_device_total(name, mib):
    g = get_gpu(name)
    assert isinstance(g.capacity_bytes, int)
    assert g.capacity_bytes == mib * MiB


def test_rtx_4090_bytes():
    assert get_gpu("rtx-4090").capacity_bytes == 25_757_220_864


@pytest.mark.parametrize("g", list_gpus(), ids=lambda g: g.name)
def test_source_states_the_reported_figure(g):
    m = re.search(r"(\d+) (MiB|KiB)", g.capacity_source)
    assert m, g.capacity_source
    unit = {"MiB": MiB, "KiB": KiB}[m.group(2)]
    assert int(m.group(1)) * unit == g.capacity_bytes
    assert ("nvidia-smi" in g.capacity_source) == (g.vendor == "nvidia")


@pytest.mark.parametrize("g", list_gpus(), ids=lambda g: g.name)
def test_device_total_is_just_below_the_marketed_figure(g):
    marketed = g.marketed_capacity * (GiB if g.marketed_unit == "GiB" else 10**9)
    assert 0.9 * marketed <= g.capacity_bytes <= marketed


def test_sorted_by_capacity():
    caps = [g.capacity_bytes for g in list_gpus()]
    assert caps == sorted(caps)


def test_precision_support():
    assert not get_gpu("t4").bf16 and not get_gpu("t4").fp8
    assert get_gpu("rtx-3090").bf16 and not get_gpu("rtx-3090").fp8
    assert get_gpu("a100-80gb").bf16 and not get_gpu("a100-80gb").fp8
    assert all(get_gpu(n).fp8 for n in ("rtx-4090", "l4", "h100-80gb", "h200", "b200", "rtx-5090", "mi300x"))


@pytest.mark.parametrize("query,name", [
    ("rtx-4090", "rtx-4090"), ("RTX-4090", "rtx-4090"), ("4090", "rtx-4090"), ("rtx4090", "rtx-4090"),
    ("RTX 4090", "rtx-4090"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("h100", "h100-80gb"),
    ("H100 80GB", "h100-80gb"), ("NVIDIA H200", "h200"), ("AMD Instinct MI300X", "mi300x"), ("Tesla T4", "t4"),
    ("a10", "a10g"), ("A100-80GB", "a100-80gb"), ("a100 40gb", "a100-40gb"), ("rtx50", "rtx-5090"),
])
def test_get_gpu_names_and_aliases(query, name):
    assert get_gpu(query).name == name


def test_unknown_lists_valid_and_suggests():
    with pytest.raises(UserError) as e:
        get_gpu("rtx-4070")
    msg = str(e.value)
    assert "'rtx-4070'" in msg and "did you mean" in msg and "\n" not in msg
    assert all(n in msg for n in REQUIRED)


def test_ambiguous_prefix():
    with pytest.raises(UserError, match="ambiguous: a100-40gb, a100-80gb"):
        get_gpu("a100")


def test_short_prefix_does_not_resolve():
    with pytest.raises(UserError):
        get_gpu("b")


def test_aliases_unique():
    seen = {}
    for g in list_gpus():
        for label in (g.name, *g.aliases):
            assert label.lower() not in seen, (label, seen.get(label.lower()))
            seen[label.lower()] = g.name


def test_gpu_model_is_frozen_and_strict():
    g = get_gpu("t4")
    with pytest.raises(Exception):
        g.capacity_bytes = 1  # type: ignore[misc]
    with pytest.raises(Exception):
        GPU(**{**g.model_dump(), "memory": 1})
    with pytest.raises(Exception):
        GPU(**{**g.model_dump(), "name": "Bad Name"})
    for f in GPU.model_fields.values():
        assert f.description


def test_model_dump_is_json_friendly():
    d = get_gpu("h100-80gb").model_dump()
    assert d["capacity_bytes"] == 85_520_809_984 and d["display_name"] == "NVIDIA H100 80GB"


# source: memcalc.inputs.gpus.capacity_gpu keeps the value as typed in GPU.given_as;
# memcalc.plan.remedies.gpu_word gives it back to --gpu (a capacity card's slug is no --gpu value)
GPU_WORDS = [
    ("23.99GiB", "23-99gib", "23.99GiB"),
    (" 24 GB ", "24gb", "24 GB"),
    ("h100", "h100-80gb", "h100-80gb"),  # a catalog card: its slug
    ("3-5gb", "3-5gb", "3-5gb"),  # a capacity card's own name (the key --json gives it) is a --gpu value too
]


@pytest.mark.parametrize("given,name,word", GPU_WORDS)
def test_gpu_word_is_the_value_given(given, name, word):
    from memcalc.plan.remedies import gpu_word

    g = get_gpu(given)
    assert g.name == name and gpu_word(g) == word
    assert get_gpu(word).capacity_bytes == get_gpu(name).capacity_bytes == g.capacity_bytes

"""The GPU side of a step (memcalc.core.gpu_side): workspaces, CUDA context, NCCL, and the three peaks.

Torch-free. Each row's expected bytes are read from the source the module cites, computed by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.gpu_side import device_memory, gpu_side, overhead_bytes
from memcalc.core.units import KiB, MiB

TINY = str(Path(__file__).parent.parent / "fixtures" / "tiny-rope.yaml")  # 2 layers, no biases

H200 = "data/reference/measured/protocol-cuda-nvidia-h200-20261128-070544.json"
#: source: H200, case cuda-context: NVML used after mem_get_info made the context, less before
HOPPER_CONTEXT = 548_995_072
#: source: unsloth-zoo PR #1053, RTX 6000 Ada, torch 2.10+cu130: 426 MiB in nvidia-smi
ADA_CONTEXT = 426 * MiB
#: source: H200, every eager step case: device used at the step's end less max_memory_reserved, 747.5625 MiB,
#: less the context 523.5625 MiB
STEP_LOADED = 224 * MiB

# (vendor, architecture, gpus, biased-forward threads, workspace bytes allocated, their segments, NCCL bytes,
#  context, step's loads)
SIDES = [
    # source: CublasHandlePool.cpp parseChosenWorkspaceSize ":4096:2:16:8" = 8,519,680 B, two handles; the first,
    # under 10 MiB, takes a 20 MiB segment (CUDACachingAllocator.cpp kLargeBuffer), the second its free rest;
    # no measurement on Ampere: the H200's context and loads stand in
    ("nvidia", "Ampere", 1, 0, 2 * 8_519_680, 20 * MiB, 0, HOPPER_CONTEXT, STEP_LOADED),
    # source: the same, 32 MiB on sm90 (PR #89027): a 32 MiB request is its own 32 MiB segment; H200 measured
    ("nvidia", "Hopper", 1, 0, 2 * 32 * MiB, 2 * 32 * MiB, 0, HOPPER_CONTEXT, STEP_LOADED),
    # source: H200 case cublas-workspace: a biased linear's step adds ONE 1 MiB cuBLASLt workspace (the forward's
    # addmm; backward runs plain mm): small pool, one 2 MiB segment; Ada's own context (PR #1053)
    ("nvidia", "Ada Lovelace", 1, 1, 2 * 8_519_680 + 1024 * KiB, 20 * MiB + 2 * MiB, 0, ADA_CONTEXT, STEP_LOADED),
    # source: with checkpointing the recomputed forward runs addmm on the autograd thread too: a second
    # cuBLASLt handle and workspace (thread_local handle pool); both 1 MiB in one 2 MiB small-pool segment
    ("nvidia", "Hopper", 1, 2, 2 * 32 * MiB + 2 * 1024 * KiB, 2 * 32 * MiB + 2 * MiB, 0, HOPPER_CONTEXT, STEP_LOADED),
    # source: NCCL src/init.cc LL 524,288 + LL128 4,915,200 + Simple 4,194,304 B per channel, 2 channels
    ("nvidia", "Ampere", 8, 0, 2 * 8_519_680, 20 * MiB, 2 * (524_288 + 4_915_200 + 4_194_304), HOPPER_CONTEXT,
     STEP_LOADED),
    # source: the ROCm branch: 128 MiB hipBLAS workspace on gfx94x (CDNA 3), two handles; no ROCm measurement
    ("amd", "CDNA 3", 1, 0, 2 * 128 * MiB, 2 * 128 * MiB, 0, HOPPER_CONTEXT, STEP_LOADED),
    # source: a card given by its capacity: the CUDA defaults outside Hopper, the H200's context and loads
    ("any", "unspecified", 1, 0, 2 * 8_519_680, 20 * MiB, 0, HOPPER_CONTEXT, STEP_LOADED),
]


@pytest.mark.parametrize("vendor,arch,gpus,biased,ws,segs,nccl,ctx,loaded", SIDES)
def test_gpu_side_parts(vendor, arch, gpus, biased, ws, segs, nccl, ctx, loaded):
    side = gpu_side(vendor, arch, "card", gpus, biased)
    assert (side.workspace_bytes, side.workspace_segment_bytes, side.nccl_bytes) == (ws, segs, nccl)
    assert (side.cuda_context_bytes, side.step_loaded_bytes) == (ctx, loaded)
    assert overhead_bytes(side) == segs + ctx + loaded + nccl
    # an architecture with no measurement of its own says which figure stands in
    assert any("stands in" in s for s in side.sources) == (arch not in ("Hopper",))


def test_compiled_step_loads_64_kib_more():
    # source: H200, the 5 compiled cases: device used less reserved 747.625 MiB against the eager 747.5625 MiB
    assert gpu_side("nvidia", "Hopper", "H200", compiled=True).step_loaded_bytes == STEP_LOADED + 64 * KiB


# (step allocated, step reserved or None): the three peaks follow from them on one card
PEAKS = [
    (10 * 2**30, 11 * 2**30),  # source: a replay with 1 GiB of segments not in use
    (10 * 2**30, None),  # source: no replay: reserved taken as allocated
]


@pytest.mark.parametrize("alloc,reserved", PEAKS)
def test_device_memory_adds_up(alloc, reserved):
    side = gpu_side("nvidia", "Hopper", "H100", 4, False)
    d = device_memory(alloc, reserved, side)
    assert d.allocated_peak_bytes == alloc + side.workspace_bytes
    assert d.reserved_peak_bytes == (reserved or alloc) + side.workspace_segment_bytes
    assert d.device_total_bytes == (d.reserved_peak_bytes + side.cuda_context_bytes + side.step_loaded_bytes
                                    + side.nccl_bytes)
    assert sum(d.parts.values()) == d.device_total_bytes
    assert d.parts["allocator_overhead_bytes"] == d.reserved_peak_bytes - d.allocated_peak_bytes >= 0


def test_estimate_json_reports_three_peaks_and_parts():
    """--json: integer byte fields for the three peaks; the parts sum to the device total; each card's
    row has its own device total and fits compares it with the card."""
    r = CliRunner().invoke(app, ["estimate", "--model", TINY, "--batch", "1", "--seq", "64", "--gpu", "h100",
                                 "--gpu", "a100-80gb", "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    for k in ("allocated_peak_bytes", "reserved_peak_bytes", "device_total_bytes"):
        assert isinstance(doc[k], int)
    assert doc["peak_bytes"] <= doc["allocated_peak_bytes"] <= doc["reserved_peak_bytes"] < doc["device_total_bytes"]
    assert sum(doc["device_parts"].values()) == doc["device_total_bytes"] == doc["required_bytes"]
    h100, a100 = doc["gpus"]
    # source: the workspaces: 2 x 32 MiB segments on Hopper, one shared 20 MiB elsewhere (no biases: no cuBLASLt)
    assert h100["device_total_bytes"] - a100["device_total_bytes"] == 2 * 32 * MiB - 20 * MiB
    for g in doc["gpus"]:
        assert g["fits"] == (g["device_total_bytes"] <= g["capacity_bytes"])
        assert g["headroom_bytes"] == g["capacity_bytes"] - g["device_total_bytes"]


def test_warm_replay_starts_the_second_step_from_the_setup():
    """The steady replay runs the step twice; what the first run leaves alive (a tensor allocated in the
    step, freed only in the next one) is released before the second, as the timeline's steady step starts
    from the setup's tensors alone (it once stayed allocated and doubled: +1.07 GB on litgpt-gemma-2b-lora)."""
    from memcalc.estimate.peak import replay_allocator

    # source: setup 100 MiB; the step allocates 50 MiB (kept past its end) and 30 MiB (freed): 180 MiB at its peak
    events = [(1, 100 * MiB), (2, 50 * MiB), (3, 30 * MiB), (3, 0)]
    assert replay_allocator(events, 1, warm=False)[0] == replay_allocator(events, 1, warm=True)[0] == 180 * MiB


# (allocator capacity, runs): a 20 MiB tensor kept, a 20 MiB one freed (its segment cached), then 24 MiB: 64 MiB
# reserved unconstrained; releasing the cached 20 MiB segment (release_cached_blocks) leaves 44 MiB
CAPACITY_ROWS = [
    (64 * MiB, True),  # source: the unconstrained reserved peak
    (44 * MiB, True),  # source: fits once the cached segment is released
    (44 * MiB - 1, False),  # source: one byte short even then: torch's OutOfMemoryError
]


@pytest.mark.parametrize("capacity,runs", CAPACITY_ROWS)
def test_replay_with_a_capacity_releases_the_cache_first(capacity, runs):
    from memcalc.estimate.peak import replay_allocator

    events = [(1, 20 * MiB), (2, 20 * MiB), (2, 0), (3, 24 * MiB)]
    assert replay_allocator(events, 0, warm=False)[1] == 64 * MiB
    assert (replay_allocator(events, 0, warm=False, capacity=capacity)[0] >= 0) is runs


def test_fits_after_cache_release_only_for_cards_asked():
    """A card the device total exceeds gets fits_after_cache_release (a capacity-limited replay) when
    at most AFTER_RELEASE_CARDS cards are asked; the catalog's rows do not (it would take a replay each)."""
    import memcalc.api
    from memcalc.render.report import AFTER_RELEASE_CARDS, fits_rows

    est = memcalc.api.estimate(model=TINY, seq=64, gpu="1GiB").estimate
    card = {"vendor": "any", "architecture": "unspecified", "display_name": "card"}
    from types import SimpleNamespace

    short = SimpleNamespace(name="short", capacity_bytes=est.device_total_bytes - 1, **card)
    row = fits_rows(est, [short])[0]
    assert row["fits"] is False and isinstance(row["fits_after_cache_release"], bool)
    many = fits_rows(est, [short] * (AFTER_RELEASE_CARDS + 1))
    assert all("fits_after_cache_release" not in r for r in many)


# (args, the precision estimated, text in the output): data/gpus.yaml: T4 and V100 have no bf16 (bf16: false)
NO_BF16_ROWS = [
    # source: data/gpus.yaml t4 bf16 false: LoRA's bf16 default becomes fp16, the reason says why
    (["--lora", "--gpu", "t4"], "fp16", "NVIDIA T4 has no bf16: fp16, the same bytes"),
    # source: one card of the two has bf16: the default stays
    (["--lora", "--gpu", "t4", "--gpu", "h100"], "bf16", "LoRA: a bf16 base"),
    # source: a bf16 the user gave stays, with a note
    (["--lora", "--bf16", "--gpu", "v100-16gb"], "bf16", "has no bf16: --precision bf16 as given; fp16 is what runs"),
    # source: no --gpu: the default stays
    (["--lora"], "bf16", "LoRA: a bf16 base"),
]


@pytest.mark.slow  # four CLI estimates (about 1 s)
@pytest.mark.parametrize("args,precision,text", NO_BF16_ROWS)
def test_a_card_without_bf16_runs_fp16(args, precision, text):
    r = CliRunner().invoke(app, ["estimate", "--model", TINY, "--seq", "64", *args, "--json"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["inputs"]["training"]["precision"] == precision
    assert text in r.stdout


@pytest.mark.slow  # two CLI estimates
def test_the_fp16_estimate_is_the_bf16_one_to_the_byte():
    # source: fp16 and bf16 are both 2 bytes (memcalc.core.dtypes): the card's fp16 changes no number
    docs = [json.loads(CliRunner().invoke(app, ["estimate", "--model", TINY, "--seq", "64", "--lora", "--precision", p,
                                                "--gpu", "t4", "--json"]).stdout) for p in ("bf16", "fp16")]
    assert docs[0]["device_total_bytes"] == docs[1]["device_total_bytes"]


def test_plan_commands_on_a_card_without_bf16_say_fp16():
    from types import SimpleNamespace

    from memcalc.plan.rows import half_command

    cmd = "memcalc estimate --model m --precision bf16 --master-weights --gpu t4"
    # source: data/gpus.yaml t4 bf16 false, h100 true
    assert half_command(cmd, SimpleNamespace(bf16=False)) == cmd.replace("bf16", "fp16", 1)
    assert half_command(cmd, SimpleNamespace(bf16=True)) == cmd


#: (args, exit code, text): the catalog's summary without --gpu judges a card without bf16 by the fp16 step it runs
#: as (memcalc.inputs.trainer_defaults.half_on, the rule --gpu follows), and says so
CATALOG_NO_BF16_ROWS = [
    # source: data/gpus.yaml t4 bf16 false, the smallest card: LoRA's bf16 default runs there as fp16
    (["--lora"], 0, "smallest t4 (in fp16: no bf16): needs"),
    # source: an fp32 step runs as given on every card
    (["--lora", "--precision", "fp32"], 0, "smallest t4: needs"),
]


@pytest.mark.slow  # two CLI estimates over the catalog (about 1 s)
@pytest.mark.parametrize("args,code,text", CATALOG_NO_BF16_ROWS)
def test_the_catalog_summary_says_a_card_runs_fp16(args, code, text):
    r = CliRunner().invoke(app, ["estimate", "--model", TINY, "--seq", "64", *args])
    assert r.exit_code == code, r.stderr
    assert text in " ".join(r.stdout.split())


def test_half_on_is_the_one_rule():
    from types import SimpleNamespace

    from memcalc.inputs.trainer_defaults import half_on

    t4, h100 = SimpleNamespace(bf16=False), SimpleNamespace(bf16=True)
    # source: data/gpus.yaml (t4 bf16 false); NO_BF16: bf16 -> fp16, amp-bf16 -> amp-fp16
    assert [half_on(t4, p) for p in ("bf16", "amp-bf16", "fp32", "fp16")] == ["fp16", "amp-fp16", None, None]
    assert half_on(h100, "bf16") is None and half_on(SimpleNamespace(), "bf16") is None  # a capacity card: bf16

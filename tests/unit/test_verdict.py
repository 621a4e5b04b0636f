"""Issue 29, "answer first": ``memcalc estimate`` opens with the verdict (fits or not on each card
asked, the headroom, the peak and its phase) and, where it does not fit, the smallest changes that
do, each with the ``memcalc estimate`` command that shows it (memcalc/render/verdict.py,
memcalc/plan/remedies.py); the same changes are ``to_make_it_fit`` in ``--json`` and the API."""

from __future__ import annotations

import io
import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcalc.cli import app

#: the answer is within this many lines of output ...
FIRST_LINES = 5
#: ... at this terminal width
COLUMNS = "80"


def run(args: list[str]):
    return CliRunner().invoke(app, args, prog_name="memcalc", env={"COLUMNS": COLUMNS})


def first_lines(r) -> list[str]:
    assert r.exit_code == 0, r.output
    return r.stdout.splitlines()[:FIRST_LINES]


# (args, exit code, texts the first FIRST_LINES lines hold, in order)
QUESTIONS = [
    # source: issue 29, "will Llama-3.1-8B QLoRA fit my 4090 at 4096 tokens?": yes, as PEFT runs it (its k-bit
    # preparation checkpoints every layer by default: memcalc/inputs/trainer_defaults.py)
    (["estimate", "--model", "llama-3.1-8b", "--qlora", "--seq", "4096", "--gpu", "rtx-4090"], 0,
     ["Fits rtx-4090? yes: needs", "GiB to spare", "Peak", "in backward", "checkpointing full (reentrant)"]),
    # source: the README's first question: bf16 LoRA does not fit; a shorter sequence or QLoRA does
    (["estimate", "--model", "llama-3.1-8b", "--lora", "--seq", "4096", "--gpu", "rtx-4090"], 0,
     ["Fits rtx-4090? no: needs", "GiB short", "Peak", "in backward", "To make it fit rtx-4090",
      "--seq 512:", "to spare", "memcalc estimate --model llama-3.1-8b --lora --seq 512 --gpu rtx-4090"]),
    # source: issue 29, "how many H100s to fully fine-tune Qwen3-8B?" (the full fine-tune's own answer first)
    (["estimate", "--model", "qwen3-8b", "--gpu", "h100-80gb"], 0,
     ["Fits h100-80gb? no", "Peak", "To make it fit h100-80gb", "--gpus 8 --zero 3:",
      "memcalc estimate --model qwen3-8b --gpus 8 --zero 3 --gpu h100-80gb"]),
    # source: issue 29, "which GPU for LoRA on a 14B model?" (the catalog: how many fit, the smallest that does)
    (["estimate", "--model", "qwen3-14b", "--lora"], 0,
     ["Fits 6 of 22 GPUs; smallest h100-80gb: needs", "Does not fit rtx-a6000", "Peak"]),
]


@pytest.mark.slow  # three 8-14B estimates and their searches (about 2 s)
@pytest.mark.parametrize("args,code,texts", QUESTIONS, ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_the_answer_comes_first(args, code, texts):
    r = run(args)
    assert r.exit_code == code, r.output
    head = "\n".join(first_lines(r))
    at = 0
    for t in texts:
        i = head.find(t, at)
        assert i >= 0, f"{t!r} not in the first {FIRST_LINES} lines (after position {at}):\n{head}"
        at = i


# a small model on a card it does not fit (checkpointing makes it fit); the card as `memcalc gpus` names it (the
# key of --json), and as the user gave it (what the text says: a capacity as typed, memcalc.plan.remedies.gpu_word)
TINY = ["estimate", "--model", "gpt2", "--seq", "1024", "--batch", "4", "--gpu", "6GiB"]
CARD = "6gib"
WORD = "6GiB"


@pytest.mark.slow  # CLI runs with the search (about 0.3 s); the quick lane has the API row
def test_a_change_listed_is_its_command_s_answer():
    # the command printed for a change gives that change's bytes and fits the card (quick lane: gpt2)
    doc = json.loads(run([*TINY, "--json"]).stdout)
    assert not doc["gpus"][0]["fits"]
    fixes = doc["to_make_it_fit"][CARD]
    assert fixes and fixes[0]["flags"] == "--checkpoint full"
    for fix in fixes[:2]:
        assert fix["command"].startswith("memcalc estimate ")
        got = json.loads(run([*shlex.split(fix["command"])[1:], "--json"]).stdout)
        assert got["gpus"][0]["device_total_bytes"] == fix["device_total_bytes"]
        assert got["peak_bytes"] == fix["peak_bytes"]
        assert got["gpus"][0]["fits"] and got["gpus"][0]["headroom_bytes"] == fix["headroom_bytes"]
        assert got["to_make_it_fit"] == {}


@pytest.mark.slow  # CLI runs with the search (about 0.3 s); the quick lane has the API row
def test_text_opens_with_the_verdict_and_the_changes():
    lines = first_lines(run(TINY))
    assert lines[0].startswith(f"Fits {WORD}? no: needs ") and lines[0].endswith(" short")
    assert lines[1].startswith("Peak ") and lines[2].startswith(f"To make it fit {WORD} ")
    assert lines[3].startswith("  --checkpoint full: ") and lines[4].startswith("    memcalc estimate --model gpt2")


@pytest.mark.slow  # CLI runs with the search (about 0.3 s); the quick lane has the API row
def test_inputs_and_assumptions_are_verbose_s():
    plain, verbose = run(TINY).stdout, run([*TINY, "--verbose"]).stdout
    assert "assumption:" not in plain and "Inputs: gpt2" not in plain and "Setup: gpt2" in plain
    assert "assumption:" in verbose and "Inputs: gpt2" in verbose


def test_api_gives_the_same_changes():
    import memcalc

    # (a smaller step than TINY's, for the quick lane: gpt2 at batch 5 x 256 needs more than 4 GiB; batch 4
    # fits since the foreach step's temporaries are one request per tensor, cached blocks reused)
    r = memcalc.estimate(model="gpt2", seq=256, batch=5, gpu="4GiB")
    card = "4gib"
    fixes = r.to_make_it_fit[card]
    assert [f.flags for f in fixes] == ["--checkpoint full"]  # the smallest change alone (remedies.SHOWN)
    assert [f.as_json() for f in fixes] == r.to_dict()["to_make_it_fit"][card]
    assert all(f.headroom_bytes == 4 * 2**30 - f.device_total_bytes >= 0 for f in fixes)
    assert memcalc.estimate(model="gpt2", seq=128, gpu="6GiB").to_make_it_fit is None
    from rich.console import Console

    from memcalc.render.report import print_items
    from memcalc.render.verdict import verdict_items

    con = Console(width=int(COLUMNS), record=True, file=io.StringIO())
    print_items(verdict_items(r.estimate, list(r.cards), True, r.to_make_it_fit), con)
    lines = con.export_text().splitlines()
    # the text names the card as it was given (4GiB), --json by its slug (4gib), which --gpu takes back too
    assert lines[0].startswith("Fits 4GiB? no: needs ")
    # after the peak line (and a note)
    at = lines.index("To make it fit 4GiB (the smallest change; `memcalc plan` lists others):")
    assert lines[at - 1].startswith("Peak ") or lines[at - 2].startswith("Peak ")
    assert lines[at + 1].startswith(f"  {fixes[0].flags}: ") and lines[at + 2] == "    " + fixes[0].command


def test_one_vocabulary_for_the_kinds_of_memory():
    # the table's rows are the kinds (KIND_NAMES: the API's breakdown keys, spaced, as the chart and the
    # HTML legend name them), each split into the components it holds
    import memcalc
    from memcalc.engine.result import KIND_NAMES, KINDS
    from memcalc.render.chart import KIND_NAMES as CHART_NAMES
    from memcalc.render.report import peak_rows

    r = memcalc.estimate(model="gpt2", seq=128, lora=True, gpu="6GiB")
    assert CHART_NAMES is KIND_NAMES and list(r.breakdown) == list(KINDS)
    doc = r.to_dict()
    assert {k: sum(v.values()) for k, v in doc["breakdown"].items()} == {k: v for k, v in r.breakdown.items() if v}
    per_component: dict[str, int] = {}
    for parts in doc["breakdown"].values():
        for name, b in parts.items():
            per_component[name] = per_component.get(name, 0) + b
    assert per_component == r.components
    kinds = [(name, b) for name, part, b in peak_rows(r.estimate) if not part]
    assert kinds == [(KIND_NAMES[k], v) for k, v in r.breakdown.items() if v]


@pytest.mark.slow  # an 8B estimate, its search and the batch search (about 2 s)
def test_max_batch_0_points_at_what_makes_batch_1_fit():
    # source: issue 29, "--max-batch without checkpointing prints '0': it should say what would make batch 1 fit"
    r = run(["estimate", "--model", "llama-3.1-8b", "--qlora", "--checkpoint", "none", "--seq", "4096", "--gpu",
             "rtx-4090", "--max-batch"])
    head = " ".join(r.stdout.split("Setup:")[0].split())  # the answer block, before the details
    assert "To make it fit rtx-4090" in head and "--checkpoint full --gpu rtx-4090" in head
    assert head.endswith("max batch at seq 4096 on NVIDIA GeForce RTX 4090 (23.988 GiB): 0 (batch 1 does not fit; "
                         "see 'To make it fit' above)"), head


def test_the_screen_stops_where_the_verdict_says_no():
    """"To make it fit" screens each change with ``estimate(stop_above=largest_peak_within(card))``
    (memcalc/plan/remedies.py ``_first_fit``): the simulation stops once its running total passes the
    limit, the allocator replay once what it reserves does (the device total is the reserved peak plus
    the card's overhead). So it must raise PeakAbove exactly where the verdict (``fits_rows``) says no:
    here one byte either side of the device total, the simulated peak fitting both (the replay decides)."""
    from types import SimpleNamespace

    import memcalc
    from memcalc.engine.observers import PeakAbove
    from memcalc.estimate.peak import card_side, estimate, largest_peak_within
    from memcalc.render.report import fits_rows

    tiny = str(Path(__file__).parent.parent / "fixtures" / "tiny-rope.yaml")  # 2 layers
    r = memcalc.estimate(model=tiny, seq=64, gpu="1GiB", timeline=False)
    exp, est = r.spec, r.estimate
    for capacity, fits in ((est.device_total_bytes, True), (est.device_total_bytes - 1, False)):
        card = SimpleNamespace(name="card", capacity_bytes=capacity, vendor="any", architecture="unspecified",
                               display_name="card")
        assert fits_rows(est, [card])[0]["fits"] is fits
        limit = largest_peak_within(capacity, card_side(exp, card))
        assert est.peak_bytes < limit  # the simulation passes: the replay's reserved bytes decide
        if fits:
            screened = estimate(exp, timeline=False, replay=True, flops=False, stop_above=limit)
            assert fits_rows(screened, [card])[0]["device_total_bytes"] == capacity
        else:
            with pytest.raises(PeakAbove):
                estimate(exp, timeline=False, replay=True, flops=False, stop_above=limit)


# (a setup's options, cut short where) -- source: memcalc/engine/timeline.py _simulate and engine/pipeline.py
# RankStep.run let a step that raises PeakAbove go as a whole step goes (Sim.abandon_graph)
CUT_SHORT = [
    ({}, 0.5),  # source: one step, stopped in its forward
    ({}, 0.99),  # source: stopped near its peak
    ({"pp": 2, "batch": 2}, 0.5),  # source: pipeline parallelism, the micro-batches' graphs in flight
]


@pytest.mark.parametrize("options,at", CUT_SHORT)
def test_a_step_cut_short_leaves_no_cyclic_garbage(options, at):
    """"To make it fit" stops a dozen steps part-way; each must be freed by reference counting, as a whole
    step is, not left (graph, observers, allocation events) to the cyclic garbage collector, which would
    traverse it again and again (about a tenth of a no-fit estimate's time)."""
    import gc

    import memcalc
    from memcalc.engine.observers import PeakAbove
    from memcalc.estimate.peak import estimate

    tiny = str(Path(__file__).parent.parent / "fixtures" / "tiny-rope.yaml")
    exp = memcalc.estimate(model=tiny, seq=64, timeline=False, **options).spec
    peak = estimate(exp, timeline=False, replay=False, flops=False).peak_bytes
    gc.collect(0)  # (the youngest generation: where everything made while the collector is off stays)
    gc.disable()
    try:
        with pytest.raises(PeakAbove):
            estimate(exp, timeline=False, replay=True, flops=False, stop_above=int(peak * at))
        assert gc.collect(0) == 0
    finally:
        gc.enable()

"""``memcalc plan --gpu`` rows (memcalc.plan.rows): ``--lora`` / ``--qlora`` / ``--full`` keep that kind of run,
fused-step rows that show their unfused twin's numbers are left out, and every row carries the
``memcalc estimate`` command that gives its numbers (checked here: a few rows' commands run through the CLI
reproduce the row's bytes exactly). Torch-free."""

from __future__ import annotations

import functools
import json
import shlex

import pytest
from typer.testing import CliRunner

from conftest import one_line_error

import memcalc.api
from memcalc.cli import app
from memcalc.plan.options import Technique
from memcalc.plan.rows import dedup
from memcalc.plan.search import OptionResult


@functools.cache
def _plan(*flags: str) -> dict:
    r = CliRunner().invoke(app, ["plan", "--model", "tinyllama-1.1b", "--gpu", "rtx-4090", "--seq", "512", *flags,
                                 "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.slow  # one plan search (about 2.5 s, torch-free)
def test_filter_keeps_that_kind():
    rows = _plan("--lora", "--qlora")["options"]
    assert rows and {o["adapters"] for o in rows} == {"lora", "qlora"}


def test_filters_combine():
    assert memcalc.api.plan  # (the API takes the same keywords: lora=, qlora=, full=)
    from memcalc.plan.rows import adapter_kinds

    assert adapter_kinds(True, False, True, "rtx-4090") == ("none", "qlora")
    assert adapter_kinds(False, False, False, "rtx-4090") is None


@pytest.mark.slow  # the same plan search, and 3 estimates
def test_every_row_has_its_command_and_it_gives_the_row():
    # source: the row's TrainingSpec is Technique.training(1, seq); the command names each of its fields
    rows = _plan("--lora", "--qlora")["options"]
    assert all(o["command"] for o in rows)
    for o in (rows[0], rows[len(rows) // 2], rows[-1]):
        args = shlex.split(o["command"])
        assert args[:2] == ["memcalc", "estimate"] and f"--{o['adapters']}" in args
        r = CliRunner().invoke(app, [*args[1:], "--json"])
        assert r.exit_code == 0, r.output
        est = json.loads(r.stdout)
        # the peak, the device total (the estimate's allocator replay) and the verdict exactly
        assert est["peak_bytes"] == o["peak_bytes"], o["command"]
        assert est["required_bytes"] == o["required_bytes"], o["command"]
        assert est["gpus"][0]["fits"] is o["fits"] is True, o["command"]


@pytest.mark.slow  # a plan search on llama-3.1-8b (LoRA rows only, about 3 s) and an estimate per row
def test_plan_rows_fit_by_the_estimates_verdict():
    # source: `memcalc estimate --model llama-3.1-8b --seq 4096 --lora --checkpoint full --gpu rtx-4090` says
    # "needs 24.47 GiB of its 23.99 GiB, 490 MiB short" (its allocator replay: 1.8 GiB of segments not in use
    # at the peak), so plan must not list that option as fitting; every row listed reproduces through its command
    r = CliRunner().invoke(app, ["plan", "--model", "llama-3.1-8b", "--seq", "4096", "--gpu", "rtx-4090", "--lora",
                                 "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["options"]
    assert rows and not any(o["checkpoint"] == "full" and not o["fused_optimizer"] for o in rows), rows
    for o in rows:
        est = json.loads(CliRunner().invoke(app, [*shlex.split(o["command"])[1:], "--json"]).stdout)
        assert (est["peak_bytes"], est["required_bytes"], est["gpus"][0]["fits"]) == (
            o["peak_bytes"], o["required_bytes"], True), o["command"]


def _row(t: Technique, peak: int) -> OptionResult:
    return OptionResult(t, peak, peak + 2**29, True, 4, 4096, 1.0, True)


def test_dedup_drops_a_fused_twin_with_the_same_numbers():
    plain = Technique("lora", "16", "adamw", "full", False)
    fused = Technique("lora", "16", "adamw", "full", True)
    same = [_row(fused, 10 * 2**30 + 1000), _row(plain, 10 * 2**30)]  # 1000 B apart: the same row at 0.01 GiB
    assert [o.technique for o in dedup(same)] == [plain]
    apart = [_row(fused, 9 * 2**30), _row(plain, 10 * 2**30)]  # the fused step saves a GiB: both stay
    assert len(dedup(apart)) == 2


#: (args, exit code, message)
CLI_ERRORS = [
    (["plan", "--model", "gpt2", "--lora"], 2, "plan --lora restricts the plan for one GPU"),
    (["plan", "--model", "gpt2", "--full"], 2, "give --gpu too"),
]


@pytest.mark.parametrize("args,code,message", CLI_ERRORS)
def test_cli_errors(args, code, message):
    one_line_error(CliRunner().invoke(app, args), code, message)


# --------------------------------------------------------------------------- plan --model M (no --gpu)
#: (setup, layout, checkpointing): each kind of command the multi-GPU plan prints
CLUSTER_ROWS = [
    ("full", {"dp": 2, "tp": 1}, "full"),  # ZeRO-3 alone (source: plan/cluster.py cluster_setups)
    ("full", {"dp": 1, "tp": 2}, "none"),  # dp x tp with sequence parallelism (source: plan/layouts.py parallel)
    ("full", {"dp": 1, "tp": 1, "cp": 2}, "full"),  # context parallelism (source: plan/layouts.py parallel)
    ("qlora", {"dp": 2, "tp": 1}, "full"),  # --checkpoint given: estimate's own QLoRA default is reentrant
]


@pytest.mark.parametrize("setup,layout,ck", CLUSTER_ROWS)
def test_cluster_command_is_the_setup(setup, layout, ck):
    # the command's estimate has the plan's step to the byte: the allocated peak of the same spec
    from memcalc.inputs.infer import infer_params
    from memcalc.inputs.profiles import plan_model_profile
    from memcalc.plan.cluster import SHARDING, cluster_setups
    from memcalc.plan.layouts import parallel
    from memcalc.plan.rows import cluster_command
    from memcalc.plan.simulations import estimated_peak

    m, prof, _ = plan_model_profile(infer_params("20M")[0], None, None, None, None, None, None, None)
    exp = parallel(cluster_setups(m, 32, prof)[setup][ck], layout["tp"], layout.get("cp", 1), gpus=layout["dp"])
    cmd = cluster_command(setup, layout, ck, 32, "h100-80gb", SHARDING, ["--params", "20M"])
    args = shlex.split(cmd)
    assert args[:2] == ["memcalc", "estimate"] and args[args.index("--checkpoint") + 1] == ck
    r = CliRunner().invoke(app, [*args[1:], "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["peak_bytes"] == estimated_peak(exp), cmd


@pytest.mark.slow  # a multi-GPU plan search on one card (about 1.5 s)
def test_cluster_plan_rows_agree_with_their_commands():
    # source: issue 29 ("plan and the estimate command it prints agree to the byte"): a 300M model on a 4 GB card
    # needs 2 GPUs for a full fine-tune (tp 2) and one for LoRA / QLoRA (3 GB before the device total counted what
    # the step loads into the CUDA context, issue 28)
    r = CliRunner().invoke(app, ["plan", "--params", "300M", "--seq", "512", "--json"])
    assert r.exit_code == 0, r.output
    from memcalc.inputs.gpus import get_gpu
    from memcalc.inputs.infer import infer_params
    from memcalc.inputs.profiles import plan_model_profile
    from memcalc.plan.cluster import plan_cluster
    from memcalc.plan.rows import cluster_commands

    m, prof, _ = plan_model_profile(infer_params("300M")[0], None, None, None, None, None, None, None)
    cp = plan_cluster(m, 512, prof, gpus=[get_gpu("4GB")])
    cluster_commands(cp, {"params": "300M"})
    row = cp.rows[0]
    assert row.min_gpus == {"full": 2, "lora": 1, "qlora": 1}
    for s in ("full", "lora", "qlora"):
        got = CliRunner().invoke(app, [*shlex.split(str(row.commands[s]))[1:], "--json"])
        assert got.exit_code == 0, got.output
        assert json.loads(got.stdout)["peak_bytes"] == row.peak_bytes[s], row.commands[s]
    doc = json.loads(r.stdout)["gpus"]
    assert all(g["command_qlora"] and "--qlora" in g["command_qlora"] and g["min_gpus_qlora"] for g in doc)

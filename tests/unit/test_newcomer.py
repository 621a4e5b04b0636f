"""What a newcomer trips on (issue 16): sharding flags in the inputs table and why they change
nothing alone, host memory under --offload-optimizer, --check's exit code, --seq past a RoPE
model's context, list tables whole in 80 columns, "wrote FILE" after --html."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from memcalc.cli import _check_fits, app


def run(args: list[str], **env):
    return CliRunner().invoke(app, args, prog_name="memcalc", env=env or None)


SPEC = str(Path(__file__).parent.parent / "fixtures" / "tiny-rope.yaml")  # 2 layers, RoPE, max_seq_len 512
TINY = ["--model", SPEC, "--seq", "256"]

# (flags, text in the inputs table's sharding row, note that says why nothing changes or None)
SHARDING = [
    (["--zero", "2"], "ZeRO-2 over 1 (default) GPU", "zero 2 has no effect with one GPU"),
    (["--gpus", "8"], "no ZeRO (default) over 8 GPUs", "gpus 8 has no effect without ZeRO"),
    (["--zero", "3", "--gpus", "4"], "ZeRO-3 over 4 GPUs", None),
    (["--offload-optimizer"], "over 1 (default) GPU, optimizer state on the CPU", None),
    # FSDP2 over the flattened dp x cp ranks (torchtitan's dp_shard_cp), not "over 1 GPU"
    (["--zero", "3", "--cp", "2", "--bf16"], "ZeRO-3 over 1 (default) data-parallel x cp 2 = 2 ranks", None),
]


@pytest.mark.parametrize("flags,row,note", SHARDING, ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_sharding_flags_are_shown_and_explained(flags, row, note):
    r = run(["estimate", *TINY, *flags, "--verbose"], COLUMNS="200")  # (the inputs table is --verbose's)
    assert r.exit_code == 0, r.output
    assert row in r.stdout
    if note:
        assert note in r.stdout


@pytest.mark.slow  # the quick lane stays under 30 s; CI runs it
def test_offload_reports_host_memory():
    # source: AdamW fp32 state = 8 bytes/param (exp_avg, exp_avg_sq), on the CPU under offload
    doc = json.loads(run(["estimate", *TINY, "--offload-optimizer", "--json"]).stdout)
    assert doc["host_optimizer_bytes"] == pytest.approx(8 * doc["trainable_params"], abs=1)
    sharded = json.loads(run(["estimate", *TINY, "--offload-optimizer", "--zero", "1", "--gpus", "4", "--json"]).stdout)
    assert sharded["host_optimizer_bytes"] == -(-doc["host_optimizer_bytes"] // 4)
    assert "host_optimizer_bytes" not in json.loads(run(["estimate", *TINY, "--json"]).stdout)
    assert "host memory: " in run(["estimate", *TINY, "--offload-optimizer"], COLUMNS="200").stdout


@pytest.mark.parametrize("gpu,code", [("h100", 0), ("0.2GiB", 3)])  # source: the tiny model needs ~0.5 GiB (CUDA context alone 426 MiB)
def test_check_exits_3_when_a_card_is_too_small(gpu, code):
    r = run(["estimate", *TINY, "--gpu", gpu, "--check", "--json"])
    assert r.exit_code == code, r.output
    json.loads(r.stdout)  # the JSON document is still printed
    assert ("memcalc: warning: does not fit" in r.stderr) is (code == 3)


def test_check_needs_a_gpu():
    r = run(["estimate", *TINY, "--check"])
    assert r.exit_code == 2 and "--check compares the estimate with a card: give --gpu" in r.stderr


def test_check_counts_the_device_total():
    """--check compares each card's device total (reserved + CUDA context + NCCL): one byte short fails."""
    import memcalc.api

    est = memcalc.api.estimate(model=SPEC, seq=256, gpu="1GiB").estimate
    need = est.device_total_bytes  # source: the one --gpu's own device total
    card = SimpleNamespace(name="card", vendor="any", architecture="unspecified", display_name="card",
                           capacity_bytes=need)
    assert _check_fits(est, [card]) == 0
    assert _check_fits(est, [SimpleNamespace(**{**vars(card), "capacity_bytes": need - 1})]) == 3


def test_seq_past_a_rope_context_warns_learned_refuses():
    r = run(["estimate", "--model", SPEC, "--seq", "1024", "--json"])  # source: the fixture's max_seq_len 512
    assert r.exit_code == 0
    assert any("beyond tiny-rope's max_seq_len 512 (rope" in n for n in json.loads(r.stdout)["notes"])
    r = run(["estimate", "--model", "gpt2", "--seq", "2048", "--batch", "1"])
    assert r.exit_code == 2 and "learned position table (1024)" in r.stderr


@pytest.mark.parametrize("cmd", [["profiles"], ["models"], ["gpus"], ["configs"]])
def test_list_tables_fit_80_columns(cmd):
    r = run(cmd, COLUMNS="80")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert max(len(x) for x in lines) <= 80
    assert not any("\u2026" in x for x in lines[3:]), r.stdout  # nothing cut with an ellipsis


def test_html_says_where_it_wrote(tmp_path):
    out = tmp_path / "r.html"
    r = run(["estimate", *TINY, "--html", str(out), "--json"])
    assert r.exit_code == 0
    json.loads(r.stdout)
    assert r.stderr.startswith(f"memcalc: wrote {out} (") and out.exists()

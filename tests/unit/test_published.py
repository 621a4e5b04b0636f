"""Published GPU runs of the trainers memcalc models, as tests (issues 27 and 28).

Each row of ``data/reference/published.yaml`` is a number a trainer's maintainers published (the
source, the commit, the metric and the unit as published; README.md beside it says how rows were
pinned) and the ``memcalc estimate`` call a careful user would type for it. A row with every input
known is held to its issue's line (``published_rows.pass_line``: issue 27 within
``TOLERANCE_PCT``; issue 28 never more than ``MAX_LOW_PCT`` low, QLoRA within
``QLORA_TOLERANCE_PCT``). Rows memcalc misses today are strict xfails naming the mechanism, so they
flip when the mechanism lands. ``python tests/published_report.py`` prints the table and the
signed mean error.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from published_rows import (
    METRIC_KEY,
    METRICS,
    REQUIRED,
    UNIT_BYTES,
    known,
    load,
    pass_line,
    rows,
    run,
)

# --- what memcalc misses today, by mechanism (never a loosened tolerance) ---------------------
_TT_COMPILED_OFFLOAD = (
    "high (QLoRA +9.0%; the LoRA row, +4.8%, passes by 0.2 points), not identified. The peak is the first "
    "compiled chunk's backward: weights, "
    "AdamW state, every chunk's bf16 logits, one chunk's gradient and the offloading stash (the final norm's fp32"
    " input, the last layer's input). Ruled out: inductor writing that gradient into the saved logits (a forward "
    "input, never a donated buffer; test_compile_scope.py "
    "test_compiled_chunk_backward_allocates_beside_saved_logits) and any other PyTorch 2.13 mechanism at the head"
    " (torchtune 0.6.1's step with inductor on CPU, compiled layers and loss, checkpointing, offloading through "
    "validate's twin, 8 chunks, matches the estimate there to 0.01 of a chunk; docs/torchtune.md). The published "
    "values sit below weights + state + 9 logits chunks (LoRA 8.75, QLoRA 4.86 GiB); outside PyTorch 2.13, "
    "unpinned: torchtune before #1877 (2024-11-18) offloaded on one stream under torch '2.5.0' (a string compare;"
    " no forward stash, -0.14 GiB). The rows name their card (--gpu a100-80gb: an A100's 2 x 8.1 MiB of cuBLAS "
    "workspaces, not an H100's 64 MiB)")
XFAIL = {
    "torchtune-flags-qlora": _TT_COMPILED_OFFLOAD,
}

_HEX40 = re.compile(r"[0-9a-f]{40}")


def test_rows_are_pinned():
    """Every row names its source at a commit, the metric and unit as published, and its inputs."""
    doc = load()
    notes = doc["notes"]
    ids = [r["id"] for r in doc["rows"]]
    assert len(ids) == len(set(ids)), "row ids must be unique"
    assert set(XFAIL) <= set(ids), f"XFAIL names rows that do not exist: {set(XFAIL) - set(ids)}"
    for r in doc["rows"]:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"{r.get('id')}: missing {missing}"
        assert _HEX40.fullmatch(r["commit"]), f"{r['id']}: commit must be 40 hex digits"
        assert r["commit"] in r["source"] and r["repo"] in r["source"], f"{r['id']}: source must link the commit"
        assert r["unit"] in UNIT_BYTES, f"{r['id']}: unit {r['unit']!r} not in {sorted(UNIT_BYTES)}"
        assert r["metric"] in METRICS, f"{r['id']}: metric {r['metric']!r} not in {METRICS}"
        assert r["issue"] in (27, 28) and isinstance(r["qlora"], bool)
        assert float(r["value"]) > 0 and str(r["value"]).rstrip("0").rstrip(".") in r["quote"].replace(" GB", ""), (
            f"{r['id']}: the value must appear in the quote")
        assert set(r["assumptions"]) <= set(notes), f"{r['id']}: unknown note in {r['assumptions']}"
        assert isinstance(r.get("unknown", []), list)
        if r["id"] in XFAIL:
            assert known(r), f"{r['id']}: an xfail row must have every input known (else it is printed only)"


def test_data_file_is_packaged():
    """The data file ships in a non-editable install (package data of memcalc.data)."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8"))
    globs = pyproject["tool"]["setuptools"]["package-data"]["memcalc.data"]
    assert {"reference/*.yaml", "reference/*.md", "reference/models/*.json"} <= set(globs)


# (issue, qlora, error %, passes): the lines the issues set (issue 27: "within 5% where every input
# is known"; issue 28: "no row ... more than 10% low; QLoRA rows within 5%")
PASS_LINES = [
    (27, False, -4.9, True), (27, False, 5.1, False), (27, False, -5.1, False),
    (28, False, -9.9, True), (28, False, 30.0, True), (28, False, -10.1, False),
    (28, True, 4.9, True), (28, True, -5.1, False), (28, True, 5.1, False),
]


@pytest.mark.parametrize("issue,qlora,err,ok", PASS_LINES)
def test_pass_lines(issue, qlora, err, ok):
    assert pass_line({"issue": issue, "qlora": qlora}, err)[0] is ok


def _params():
    out = []
    for r in rows():
        if not known(r):
            continue
        marks = [pytest.mark.slow]
        if r["id"] in XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[r["id"]]))
        out.append(pytest.param(r, id=r["id"], marks=marks))
    return out


@pytest.mark.parametrize("row", _params())
def test_published_row(row):
    res = run(row)
    assert res.error is None, f"{row['id']}: {res.error}"
    ok, line = pass_line(row, res.error_pct)
    assert ok, (f"{row['id']}: estimate {res.estimate_bytes:,} B ({METRIC_KEY[row['metric']]}) vs published "
                f"{row['value']} {row['unit']} {row['metric']}: {res.error_pct:+.1f}%, the line is {line}")


@pytest.mark.slow  # estimates every row, the unknown ones too
def test_print_published_table(capsys):
    """Prints every row (run with -s), the unknown ones too, and the summary; each row with
    arguments gets an estimate or the CLI's one-line refusal."""
    from published_report import main

    assert main([]) == 0
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    for r in rows():
        assert r["id"] in out
        if r["args"]:
            res = run(r)
            assert (res.estimate_bytes is None) == (res.error is not None)
            assert res.error is None or "\n" not in res.error

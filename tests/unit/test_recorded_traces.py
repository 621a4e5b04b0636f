"""The estimate against the validator's recorded peaks, in the quick lane (issue 26).

``tests/traces/recorded.json`` holds, per row of ``tests/traces/rows.py``, the peak the validator
traced (memcalc's PyTorch replica, the real transformers + PEFT step, one rank of FSDP2 / FSDP1,
tensor parallelism or DeepSpeed, on meta or fake tensors) with the inputs it was traced for and
the tolerance of the slow test the row comes from; since issue 27 also the trainers' own steps
(torchtune, LitGPT, TRL: validate/trainers/). Each row here estimates the same inputs through
``memcalc.estimate`` and compares: the estimator is checked against the validator on every run,
without torch. ``python tests/traces/record.py`` records the peaks again;
``tests/trace/test_recorded_traces_live.py`` (slow) checks the recording equals a live trace.
"""

from __future__ import annotations

import json
import os

import pytest
from traces.rows import ROWS, TOLERANCES, cli_of, spec_of, tolerance_constant

import memcalc

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "traces", "recorded.json")
with open(PATH, encoding="utf-8") as _f:
    RECORDED: list[dict] = json.load(_f)["rows"]
VALIDATORS = {"replica", "hf", "fsdp", "tp", "ep", "deepspeed", "torchtune", "litgpt", "trl"}


def test_every_row_is_recorded_as_defined():
    """issue 26: at least 30 rows (here 40 or more), every validator; the recording is of the rows as
    ``rows.py`` defines them now (a changed row must be recorded again)."""
    assert len(RECORDED) >= 40
    assert [r["name"] for r in RECORDED] == [r["name"] for r in ROWS]
    assert {r["validator"] for r in RECORDED} == VALIDATORS
    for rec, row in zip(RECORDED, ROWS, strict=True):
        pct, path, const = TOLERANCES[row["tolerance"]]
        assert (rec["validator"], rec["inputs"], rec["scale_layers"], rec["model"], rec["cli"]) == (
            row["validator"], row["inputs"], row["scale_layers"], row["model"], cli_of(row)), rec["name"]
        assert (rec["tolerance_pct"], rec["tolerance_source"]) == (pct, f"{path} {const}"), rec["name"]
        assert isinstance(rec["traced_peak_bytes"], int) and rec["traced_peak_bytes"] > 0, rec["name"]
        assert rec["versions"]["torch"], rec["name"]


def _peft(inputs: dict) -> str:
    return ("qlora" if inputs.get("qlora") else "dora" if inputs.get("dora") else "lora" if inputs.get("lora")
            else "full")


def test_rows_span_the_setups():
    """The rows cover what issue 26 asks: the reference configs, every checkpointing policy, full
    fine-tuning and LoRA / QLoRA / DoRA (the HF step too), the families, FSDP2 / FSDP1 at ZeRO-2 and 3,
    tensor parallelism and DeepSpeed ZeRO-2 and 3."""
    ins = [r["inputs"] for r in RECORDED]
    assert {i["config"] for i in ins if "config" in i} >= {"control", "checkpoint", "bfloat16"}
    assert {i.get("checkpoint", "none") for i in ins} >= {"none", "full", "sqrt", "selective", "every-2",
                                                           "selective-op"}
    assert {_peft(i) for i in ins} == {"full", "lora", "qlora", "dora"}
    assert {_peft(r["inputs"]) for r in RECORDED if r["validator"] == "hf"} >= {"full", "lora", "dora"}
    assert {i["model"] for i in ins if "model" in i} >= {
        "gpt2", "tinyllama-1.1b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "qwen3-0.6b", "gemma-2-9b",
        "gemma-3-1b", "phi-4", "mixtral-8x7b", "deepseek-v3", "gpt-oss-20b"}
    sharded = {(i.get("sharding", "fsdp2"), i["zero"]) for r, i in zip(RECORDED, ins, strict=True)
               if r["validator"] in ("fsdp", "deepspeed")}
    assert sharded >= {("fsdp2", 2), ("fsdp2", 3), ("fsdp1", 2), ("fsdp1", 3)}
    assert {i["zero"] for r, i in zip(RECORDED, ins, strict=True) if r["validator"] == "deepspeed"} == {2, 3}
    assert {i["tp"] for i in ins if "tp" in i} >= {2, 4}
    for trainer in ("torchtune", "litgpt", "trl"):  # issue 27: the trainers' own steps, full and LoRA at least
        assert {_peft(r["inputs"]) for r in RECORDED if r["validator"] == trainer} >= {"full", "lora"}, trainer
    assert {_peft(r["inputs"]) for r in RECORDED if r["validator"] in ("torchtune", "trl")} >= {"qlora"}


@pytest.mark.parametrize("key", sorted(TOLERANCES))
def test_tolerance_is_the_slow_tests_constant(key):
    """Each tolerance is the value of the constant it names in its slow test (read from the source)."""
    assert tolerance_constant(key) == TOLERANCES[key][0]


@pytest.mark.parametrize("rec", RECORDED, ids=[r["name"] for r in RECORDED])
def test_estimate_matches_recorded_trace(rec):
    est = memcalc.estimate(spec=spec_of(rec))
    traced = rec["traced_peak_bytes"]
    gap = 100 * (est.peak_bytes - traced) / traced
    assert abs(gap) <= rec["tolerance_pct"], (
        f"{rec['name']}: estimate {est.peak_bytes:,} B ({est.phase}) vs recorded trace {traced:,} B "
        f"({rec['traced_phase']}): {gap:+.2f}%, tolerance {rec['tolerance_pct']}% ({rec['tolerance_source']})")

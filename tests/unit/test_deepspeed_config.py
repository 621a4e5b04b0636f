"""``--deepspeed ds_config.json`` (torch-free): the reader, "auto" values as Hugging Face fills them,
conflicts with other flags, bad files. The traced grid is tests/trace/test_deepspeed.py (slow)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.inputs.deepspeed_config import read_deepspeed
from memcalc.inputs.resolve import Options, resolve

FIX = "tests/fixtures/deepspeed"
ZERO2, ZERO3 = f"{FIX}/ds_config_zero2.json", f"{FIX}/ds_config_zero3.json"


def _write(tmp_path, doc, name="ds.json") -> str:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(p)


def test_published_zero2_config():
    # source: transformers tests/deepspeed/ds_config_zero2.json (SOURCES.md): stage 2, 2e8 buckets, overlap,
    # optimizer offload to cpu; fp16/bf16 "auto" leave the precision to the flags
    ds = read_deepspeed(ZERO2, hidden_size=2048)
    assert ds.stage == 2
    assert ds.spec == {"stage": 2, "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000,
                       "overlap_comm": True, "contiguous_gradients": True, "offload_param": False}
    assert ds.training == {"offload_optimizer": True}
    assert any("zero_optimization.reduce_scatter" in n and "optimizer" in n for n in ds.notes)


def test_published_zero3_config_auto_values():
    # source: transformers/integrations/deepspeed.py trainer_config_finalize: reduce_bucket_size = h*h,
    # stage3_prefetch_bucket_size = int(0.9*h*h), stage3_param_persistence_threshold = 10*h
    h = 4096
    ds = read_deepspeed(ZERO3, hidden_size=h)
    assert ds.spec["reduce_bucket_size"] == h * h
    assert ds.spec["prefetch_bucket_size"] == int(0.9 * h * h)
    assert ds.spec["param_persistence_threshold"] == 10 * h
    assert ds.spec["max_live_parameters"] == 10**9 and ds.spec["offload_param"] is True
    assert any("auto" in n for n in ds.notes)


def test_resolve_sets_sharding_stage_and_master_weights():
    res = resolve(Options(model="tinyllama-1.1b", deepspeed=ZERO2, gpus=4, bf16=True, seq=256))
    tr = res.exp.training
    assert (tr.sharding, tr.zero, tr.precision, tr.master_weights) == ("deepspeed", 2, "bf16", True)
    assert tr.deepspeed.reduce_bucket_size == 200_000_000 and tr.offload_optimizer
    assert res.origin["zero"] == "config"


def test_config_precision_and_batch(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                             "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4})
    tr = resolve(Options(model="gpt2", deepspeed=path, gpus=2)).exp.training
    assert (tr.precision, tr.master_weights, tr.batch, tr.grad_accum, tr.zero) == ("bf16", True, 2, 4, 3)


def test_bucket_size_changes_the_estimate(tmp_path):
    from memcalc.estimate.peak import estimate

    small = _write(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 10**7}, "bf16": {"enabled": True}}, "a.json")
    big = _write(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 10**8}, "bf16": {"enabled": True}}, "b.json")
    a = estimate(resolve(Options(model="gpt2", deepspeed=small, gpus=4, seq=256)).exp, timeline=False)
    b = estimate(resolve(Options(model="gpt2", deepspeed=big, gpus=4, seq=256)).exp, timeline=False)
    # the bucket is reduce_bucket_size elements of bf16 (stage_1_and_2.py setup_buckets): 1.8e8 bytes more; the
    # small bucket reduces more often (its flatten copies are alive at its backward peak), so the gap is smaller
    assert b.phases["backward"] - a.phases["backward"] >= 10**8
    assert b.peak_bytes > a.peak_bytes


BAD = [
    # (config document or None for a missing file, extra args, exit code, message)
    (None, [], 2, "no such file"),
    ("{not json", [], 2, "not valid JSON"),
    ("[1, 2]", [], 2, "a DeepSpeed config is a JSON object"),
    # issue 32: --deepspeed skipped the bounds the other readers have (50 MiB accepted, deep nesting a RecursionError)
    ('{"pad": "' + "x" * 2**21 + '"}', [], 2, "is larger than 1 MiB"),
    ("[" * 100_000 + "]" * 100_000, [], 2, "nests too deep to be a DeepSpeed config"),
    ('{"a": ' + "[" * 70 + "]" * 70 + "}", [], 2, "nests deeper than 64 levels"),
    # a number of more digits than Python converts (4,300): a ValueError json raised through the reader
    ('{"zero_optimization": {"stage": 2, "overlap_comm": ' + "9" * 5000 + "}}", [], 2,
     "not valid JSON (Exceeds the limit"),
    # a 4,000-digit value is not echoed whole (the slow fuzz found it)
    ('{"zero_optimization": {"stage": 2, "overlap_comm": ' + "9" * 4000 + "}}", [], 2,
     "overlap_comm must be true or false, got " + "9" * 56 + "...\n"),
    ({"zero_optimization": {"stage": 1}}, [], 2, "zero_optimization.stage must be 2 or 3"),
    ({"bf16": {"enabled": True}}, [], 2, "needs zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, [], 2, "reduce_bucket_size must be a whole number"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, [], 2, "reduce_bucket_size must be at least 1"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "auto"}}, [], 2, "Hugging Face fills only"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": 1}}, [], 2, "overlap_comm must be true or false"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}, [], 2, "must be none, cpu or nvme"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, [], 2, "both true"),
    ({"zero_optimization": {"stage": 3}}, ["--zero", "2"], 2, "--zero 2 conflicts with --deepspeed"),
    ({"zero_optimization": {"stage": 3}}, ["--sharding", "fsdp2"], 2, "--sharding fsdp2 conflicts"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, ["--precision", "fp16"], 2,
     "--precision fp16 conflicts with --deepspeed"),
    ({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}, ["--batch", "2"], 2,
     "--batch 2 conflicts with --deepspeed"),
    ({"zero_optimization": {"stage": 2}}, ["--fused-optimizer"], 2, "drop --fused-optimizer"),
]


@pytest.mark.parametrize("doc,args,code,msg", BAD)
def test_bad_configs(tmp_path, doc, args, code, msg):
    path = str(tmp_path / "missing.json") if doc is None else _write(tmp_path, doc)
    r = CliRunner().invoke(app, ["estimate", "--model", "gpt2", "--gpus", "4", "--seq", "128", "--deepspeed", path, *args])
    assert r.exit_code == code, r.output
    assert msg in r.output
    assert "Traceback" not in r.output


GOOD = [
    # (args, text in the output)
    (["--deepspeed", ZERO2, "--bf16"], "DeepSpeed config keys ignored"),
    (["--deepspeed", ZERO3, "--bf16"], "auto"),
    (["--deepspeed", ZERO2, "--bf16", "--zero", "2"], "ZeRO-2"),
]


@pytest.mark.slow  # the quick lane stays under 30 s; CI runs it
@pytest.mark.parametrize("args,text", GOOD)
def test_good_configs(args, text):
    r = CliRunner().invoke(app, ["estimate", "--model", "gpt2", "--gpus", "4", "--seq", "128", *args])
    assert r.exit_code == 0, r.output
    assert text in r.output


def test_unknown_zero_keys_are_listed(tmp_path):
    path = _write(tmp_path, {"zero_optimization": {"stage": 2, "frobnicate": 3}})
    r = CliRunner().invoke(app, ["estimate", "--model", "gpt2", "--gpus", "4", "--seq", "128", "--deepspeed", path])
    assert r.exit_code == 0, r.output
    assert "zero_optimization.frobnicate" in r.output


AUTO = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
#: a user experiment config that names no precision (the shipped ones all name theirs)
NO_PRECISION = "model: gpt2\ntraining: {batch: 1, seq: 128}\n"

AUTO_PRECISION = [
    # (extra args, precision, text of the note)
    # source: transformers integrations/deepspeed.py trainer_config_process fill_match("bf16.enabled", args.bf16 ...)
    # with TrainingArguments.bf16 = False, and deepspeed runtime/config_utils.py DeepSpeedConfigModel dropping "auto"
    # to DeepSpeedBF16Config.enabled = False: fp32 either way
    ([], "fp32", 'bf16.enabled and fp16.enabled "auto" resolved to false'),
    # source: fill_match with args.bf16 = True (--bf16 is TrainingArguments.bf16)
    (["--bf16"], "bf16", "here --bf16: bf16.enabled=true, fp16.enabled=false"),
    # source: fill_match with args.fp16 = True
    (["--precision", "fp16"], "fp16", "here --precision fp16: bf16.enabled=false, fp16.enabled=true"),
    # source: bf16.enabled false casts nothing (deepspeed runtime/engine.py _configure_distributed_model): the
    # base as loaded, LoRA's bf16 default (memcalc.inputs.resolve _setup_defaults)
    (["--lora"], "bf16", "the base stays as loaded: LoRA's default, a bf16 base"),
]


@pytest.mark.parametrize("args,precision,note", AUTO_PRECISION)
def test_auto_precision_says_what_it_resolved_to(tmp_path, args, precision, note):
    path = _write(tmp_path, AUTO)
    r = CliRunner().invoke(app, ["estimate", "--model", "gpt2", "--gpus", "2", "--seq", "64", "--json",
                                 "--deepspeed", path, *args])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["inputs"]["training"]["precision"] == precision
    assert any(note in n for n in doc["inferred"]), doc["inferred"]


def test_auto_precision_takes_the_config_experiments():
    # source: the --config experiment stands for the TrainingArguments fill_match reads (bfloat16 names bf16)
    res = resolve(Options(config="bfloat16", deepspeed=f"{FIX}/ds_config_zero2.json", gpus=2))
    assert (res.exp.training.precision, res.exp.training.master_weights) == ("bf16", True)
    assert any("here --config bfloat16: bf16.enabled=true" in n for n in res.notes)


NAMES_FP32 = "model: gpt2\ntraining: {batch: 1, seq: 128, precision: fp32}\n"

CONFIG_LORA = [
    # (config file text, extra args, exit code, precision, note or None)
    # source: memcalc.inputs.resolve _setup_defaults: LoRA without a precision is a bf16 base, as with --model
    (NO_PRECISION, ["--lora"], 0, "bf16", "names no precision: LoRA's default, a bf16 base"),
    # source: a config naming fp32 keeps it, and says so
    (NAMES_FP32, ["--lora"], 0, "fp32", "names precision fp32: kept under LoRA"),
    # source: a flag over the config: no note
    (NAMES_FP32, ["--lora", "--bf16"], 0, "bf16", None),
    # source: no LoRA: the config's own setup (TrainingSpec's fp32 default), no note
    (NO_PRECISION, [], 0, "fp32", None),
]


@pytest.mark.parametrize("text,args,code,precision,note", CONFIG_LORA)
def test_config_with_lora_precision(tmp_path, text, args, code, precision, note):
    cfg = _write(tmp_path, text, "exp.yaml")
    r = CliRunner().invoke(app, ["estimate", "--config", cfg, "--seq", "64", "--json", *args])
    assert r.exit_code == code, r.output
    doc = json.loads(r.stdout)
    assert doc["inputs"]["training"]["precision"] == precision
    found = [n for n in doc["inferred"] if "precision" in n and "--config" in n]
    assert (note is None and not found) or any(note in n for n in found), doc["inferred"]


def test_shipped_config_names_its_precision():
    # source: data/configs/control.yaml names precision fp32: kept under --lora, and said
    res = resolve(Options(config="control", lora=True))
    assert res.exp.training.precision == "fp32"
    assert any("--config control names precision fp32: kept under LoRA" in n for n in res.notes)

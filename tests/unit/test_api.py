"""The Python API (memcalc.api) against the CLI: the same inputs give the same documents and the same
one-line errors; `import memcalc` stays cheap and torch-free."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import memcalc
from memcalc.cli import app
from memcalc.inputs.resolve import Options

ROOT = Path(__file__).resolve().parents[2]


def cli_json(args: list[str]) -> dict:
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def cli_error(args: list[str]) -> str:
    """The message of the CLI's one error line (after ``memcalc: error: ``)."""
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("memcalc: error: ")]
    assert len(lines) == 1, r.output
    return lines[0][len("memcalc: error: "):]


_SLOW = pytest.mark.slow  # full-size models or searches: seconds each, twice (API and CLI)

# (API keyword arguments, the same setup as `memcalc estimate` flags)
SAME_AS_CLI = [
    # source: issue 14's done-criterion
    pytest.param(dict(model="llama-3.1-8b", precision="bf16", lora=True),
                 ["--model", "llama-3.1-8b", "--precision", "bf16", "--lora"], marks=_SLOW),
    # source: docs/usage.md Python API (a small model, checkpointing, two GPUs by name and capacity)
    (dict(model="gpt2", batch=2, seq=512, checkpoint="full", gpu=["rtx-4090", "24GB"]),
     ["--model", "gpt2", "--batch", "2", "--seq", "512", "--checkpoint", "full", "--gpu", "rtx-4090", "--gpu", "24GB"]),
    # source: --params inference with QLoRA on every projection
    pytest.param(dict(params="1.5b", qlora=True, lora_targets="all", gpu="rtx-4090"),
                 ["--params", "1.5b", "--qlora", "--lora-targets", "all", "--gpu", "rtx-4090"], marks=_SLOW),
    # source: a shipped reference config (its published peak is kept)
    pytest.param(dict(config="control"), ["--config", "control"], marks=_SLOW),
    # source: ZeRO-3 over 4 GPUs with an 8-bit optimizer and a framework profile
    (dict(model="gpt2", seq=256, zero=3, gpus=4, optimizer="adamw-8bit", framework="torchtune", gpu="t4"),
     ["--model", "gpt2", "--seq", "256", "--zero", "3", "--gpus", "4", "--optimizer", "adamw-8bit",
      "--framework", "torchtune", "--gpu", "t4"]),
    # source: estimate --max-batch (the limits join the document)
    pytest.param(dict(model="gpt2", seq=256, gpu="rtx-4090", max_batch=True),
                 ["--model", "gpt2", "--seq", "256", "--gpu", "rtx-4090", "--max-batch"], marks=_SLOW),
]


@pytest.mark.parametrize("kwargs,args", SAME_AS_CLI, ids=lambda x: None if isinstance(x, list) else ",".join(x))
def test_estimate_to_dict_equals_cli_json(kwargs, args):
    r = memcalc.estimate(**kwargs)
    doc = cli_json(["estimate", *args])
    assert r.to_dict() == doc
    assert isinstance(r.peak_bytes, int) and r.peak_bytes == doc["peak_bytes"]
    assert r.phase == doc["peak_phase"]
    assert r.breakdown == doc["components_by_kind"] and sum(r.breakdown.values()) == r.peak_bytes
    assert r.fits == {g["name"]: g["fits"] for g in doc["gpus"]}
    assert r.required_bytes == doc["required_bytes"]


# (API keyword arguments, `memcalc estimate` flags): both refuse the input with the same line
SAME_ERROR = [
    (dict(model="llama-9"), ["--model", "llama-9"]),  # source: tests/unit/test_cli.py BAD_INPUT (unknown preset)
    (dict(model="gpt2", batch=0), ["--model", "gpt2", "--batch", "0"]),
    (dict(model="gpt2", checkpoint="every-x"), ["--model", "gpt2", "--checkpoint", "every-x"]),
    (dict(model="gpt2", zero=4), ["--model", "gpt2", "--zero", "4"]),
    (dict(model="gpt2", seq=4096), ["--model", "gpt2", "--seq", "4096"]),
    (dict(model="gpt2", fused_optimizer=True, grad_accum=4),  # a pydantic cross-field error, one line
     ["--model", "gpt2", "--fused-optimizer", "--grad-accum", "4"]),
    (dict(model="gpt2", gpu="gtx-480"), ["--model", "gpt2", "--gpu", "gtx-480"]),
    (dict(), []),  # no model
    (dict(model="gpt2", params="7e9"), ["--model", "gpt2", "--params", "7e9"]),
    (dict(model="gpt2", lora=True, lora_targets="q,z"), ["--model", "gpt2", "--lora", "--lora-targets", "q,z"]),
]


@pytest.mark.parametrize("kwargs,args", SAME_ERROR, ids=lambda x: None if isinstance(x, list) else ",".join(x) or "none")
def test_bad_input_raises_user_error_with_the_cli_message(kwargs, args):
    with pytest.raises(memcalc.UserError) as e:
        memcalc.estimate(**kwargs)
    assert str(e.value) == cli_error(["estimate", *args])
    assert isinstance(e.value, ValueError)


# (API keyword arguments, the message): choices the CLI leaves to its option parser
CHOICE_ERRORS = [
    (dict(model="gpt2", precision="fp8"), "unknown --precision 'fp8'; valid: fp32, bf16, fp16, amp-bf16, amp-fp16"),
    (dict(model="gpt2", optimizer="adamax"), "unknown --optimizer 'adamax'; valid: adamw, adam, sgd"),
    (dict(model="gpt2", framework="jax"), "unknown --framework 'jax'; valid: plain, hf, torchtune, litgpt"),
    (dict(model="gpt2", loss="half"), "unknown --loss 'half'; valid: full, chunked"),
]


@pytest.mark.parametrize("kwargs,message", CHOICE_ERRORS)
def test_bad_choice_lists_the_valid_ones(kwargs, message):
    with pytest.raises(memcalc.UserError, match="^" + message.replace("(", r"\(")):
        memcalc.estimate(**kwargs)


def test_unknown_argument_is_a_type_error_listing_the_options():
    with pytest.raises(TypeError, match="unknown argument modle; valid: .*model"):
        memcalc.estimate(modle="gpt2")


def test_every_option_is_accepted_by_name():
    # a field added to Options (a new flag) is an API keyword at once: forwarded, not listed here
    for f in dataclasses.fields(Options):
        memcalc.options_from(**{f.name: f.default})


def test_spec_gives_the_same_estimate_as_its_options():
    from memcalc.inputs.resolve import resolve

    exp = resolve(Options(model="gpt2", batch=2, seq=256, lora=True)).exp
    by_spec = memcalc.estimate(spec=exp)
    assert by_spec.peak_bytes == memcalc.estimate(model="gpt2", batch=2, seq=256, lora=True).peak_bytes
    assert by_spec.spec == exp
    with pytest.raises(memcalc.UserError, match="not both"):
        memcalc.estimate(spec=exp, batch=4)


def test_a_hugging_face_config_dict_is_a_model():
    # source: data/hf_configs/EleutherAI--pythia-160m.json, given as a dict and as a file
    path = ROOT / "data" / "hf_configs" / "EleutherAI--pythia-160m.json"
    cfg = json.loads(path.read_text())
    r = memcalc.estimate(model=dict(cfg, _name_or_path="EleutherAI/pythia-160m"), seq=128, lora=True)
    assert r.peak_bytes == memcalc.estimate(model=str(path), seq=128, lora=True).peak_bytes
    assert r.to_dict()["inputs"]["model_source"] == {"kind": "hf-config", "value": "pythia-160m"}


def test_stages_stay_modules_and_are_callable():
    import memcalc.estimate.peak as peak
    import memcalc.plan.search  # noqa: F401

    assert memcalc.estimate.peak is peak  # the stage package is still the package
    assert memcalc.estimate(model="gpt2", seq=128).peak_bytes > 0


# (fresh interpreter code, what it must print last): `import memcalc` is cheap and torch-free
IMPORT_PROBE = ("import sys; sys.modules['torch'] = None; import memcalc; "
                "print(sorted(m for m in ('numpy', 'rich', 'click', 'typer', 'torch', 'pydantic') "
                "if sys.modules.get(m)))")


def test_import_memcalc_loads_no_heavy_module():
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.slow  # a fresh interpreter that estimates an 8B model (about 1 s)
def test_done_criterion_runs_without_torch():
    # source: issue 14 "Done when": the exact one-liner, with torch made unimportable
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "import memcalc; print(memcalc.estimate(model='llama-3.1-8b', precision='bf16', lora=True).peak_bytes)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().isdigit()
    assert int(out.stdout) == memcalc.estimate(model="llama-3.1-8b", precision="bf16", lora=True).peak_bytes


def test_measure_is_reachable_without_torch_until_called():
    code = ("import sys; sys.modules['torch'] = None; import memcalc, memcalc.integrations.transformers as t\n"
            "try:\n    memcalc.measure(model='gpt2')\nexcept memcalc.UserError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("measure() needs torch")


@pytest.mark.slow  # the plan for every catalog GPU (seconds)
def test_cluster_plan_to_dict_equals_cli_json():
    # source: memcalc plan without --gpu
    assert memcalc.plan(model="gpt2", seq=512).to_dict() == cli_json(["plan", "--model", "gpt2", "--seq", "512"])


@pytest.mark.slow  # a plan search for one GPU (seconds)
def test_gpu_plan_to_dict_equals_cli_json():
    # source: `memcalc plan --model gpt2 --gpu 1.5GB --seq 256 --json` (the same search; the full-size
    # search is the plan-llama8b-4090 snapshot in tests/unit/test_snapshots.py); 1.5 GB since the device total
    # counts what the step loads into the CUDA context (issue 28: on 1 GB nothing fits)
    p = memcalc.plan(model="gpt2", gpu="1.5GB", seq=256)
    assert p.to_dict() == cli_json(["plan", "--model", "gpt2", "--gpu", "1.5GB", "--seq", "256"])
    assert p.fitting and all(o["fits"] for o in p.fitting)


def test_plan_bad_input_raises_user_error():
    with pytest.raises(memcalc.UserError, match="--all lists the combinations"):
        memcalc.plan(model="gpt2", all=True)
    with pytest.raises(memcalc.UserError, match="plan needs a model"):
        memcalc.plan()


# (TrainingArguments / SFTConfig fields, weights dtype, PEFT config, 4-bit base, the memcalc options they mean)
HF_RUNS = [
    # source: transformers 5.24 training_args.py defaults (batch 8; optim adamw_torch_fused from torch 2.8, L806-811:
    # fused=True in trainer_optimizer.py _get_adamw_torch; fp32 weights, no autocast)
    ({}, "float32", None, False, dict(batch=8, grad_accum=1, precision="fp32", optimizer="adamw", optimizer_impl="fused")),
    # source: bf16=True autocasts; over fp32 weights that is memcalc's amp-bf16
    ({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "bf16": True, "optim": "adamw_torch_fused"},
     "float32", None, False, dict(batch=4, grad_accum=2, precision="amp-bf16", optimizer="adamw", optimizer_impl="fused")),
    # source: a model loaded in bfloat16 trains in bf16 whatever the autocast flag; the deprecated alias still counts
    ({"per_device_train_batch_size": 1, "bf16": True, "gradient_checkpointing": True, "optim": "adafactor"},
     "bfloat16", None, False, dict(batch=1, grad_accum=1, precision="bf16", checkpoint="full", optimizer="adafactor")),
    # source: transformers 5.23 activation_checkpointing_kwargs (every_n_layers, offload)
    ({"per_device_train_batch_size": 2, "activation_checkpointing": True,
      "activation_checkpointing_kwargs": {"every_n_layers": 2, "offload": True}, "optim": "adamw_8bit", "max_length": 1024},
     "bfloat16", None, False, dict(batch=2, grad_accum=1, seq=1024, precision="bf16", checkpoint="every-2",
                                   activation_offload=True, optimizer="adamw-8bit",
                                   framework="trl")),  # max_length: a TRL SFTConfig
    # source: a PEFT LoraConfig.to_dict() over a bitsandbytes 4-bit base (QLoRA), target_modules a set, DoRA;
    # paged_adamw_8bit: bitsandbytes AdamW(optim_bits=8, is_paged=True) = PagedAdamW8bit (transformers 5.24
    # trainer_optimizer.py _get_bitsandbytes_optimizer); q_proj/v_proj are memcalc's q/v (the --recipe reader's names)
    ({"per_device_train_batch_size": 2, "bf16": True, "optim": "paged_adamw_8bit"}, "bfloat16",
     {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": {"v_proj", "q_proj"},
      "use_dora": True}, True,
     dict(batch=2, grad_accum=1, precision="bf16", optimizer="paged-adamw-8bit", lora=True, lora_rank=16,
          lora_alpha=32.0, lora_dropout=0.05, lora_targets="q,v", dora=True, qlora=True,
          no_double_quant=True)),  # double quantization not given: BitsAndBytesConfig's default False
    # source: PEFT's "all-linear" shortcut is memcalc's `all`; lora_alpha absent: PEFT LoraConfig's default 8
    ({"per_device_train_batch_size": 1, "optim": "rmsprop"}, "float32", {"r": 8, "target_modules": "all-linear"}, False,
     dict(batch=1, grad_accum=1, precision="fp32", lora=True, lora_rank=8, lora_alpha=8.0, lora_targets="all")),
]


# (the live model's bnb_4bit_use_double_quant, LoraSpec.double_quant, a note says the default was taken)
LIVE_DOUBLE_QUANT = [
    # source: transformers 5.24 utils/quantization_config.py BitsAndBytesConfig(bnb_4bit_use_double_quant=False)
    (None, False, True),
    # source: the live config says so (validate/callback.py _double_quant reads model.config.quantization_config)
    (True, True, False),
    (False, False, False),
]


@pytest.mark.parametrize("given,double_quant,noted", LIVE_DOUBLE_QUANT)
def test_live_4bit_double_quant(given, double_quant, noted):
    from memcalc.integrations.transformers import options_from_hf

    opts, notes = options_from_hf({"bf16": True}, "bfloat16", {"r": 8, "target_modules": ["q_proj"]}, True, given)
    assert opts.get("no_double_quant", False) is not double_quant
    memcalc.options_from(**opts)  # every key is an estimate keyword
    assert any("bnb_4bit_use_double_quant" in n for n in notes) is noted


@pytest.mark.parametrize("args,dtype,peft,four_bit,expected", HF_RUNS)
def test_hf_training_arguments_map_to_memcalc_options(args, dtype, peft, four_bit, expected):
    from memcalc.integrations.transformers import options_from_hf

    opts, notes = options_from_hf(args, dtype, peft, four_bit)
    assert opts == expected
    memcalc.options_from(**opts)  # every key is an estimate keyword
    if args.get("optim") == "rmsprop":
        assert any(args["optim"] in n for n in notes)  # not modelled: said so


def test_the_callback_module_is_torch_free_until_used():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import memcalc.integrations.transformers as t\n"
            "try:\n    t.MemcalcCallback\nexcept memcalc.UserError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", "import memcalc\n" + code], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MemcalcCallback needs torch and transformers")


@pytest.mark.slow  # estimates an 8B model twice (the package's and the module's examples)
@pytest.mark.parametrize("module", ["memcalc", "memcalc.api", "memcalc.integrations.transformers",
                                    "memcalc.inputs.recipes.hf"])
def test_docstring_examples(module):
    import doctest
    import importlib

    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_a_config_dict_is_named_in_errors_not_its_temporary_file():
    # source: memcalc/inputs/hf_config.py _Reader (a missing required key)
    with pytest.raises(memcalc.UserError) as e:
        memcalc.estimate(model={"model_type": "llama", "hidden_size": 64, "_name_or_path": "org/tiny"})
    assert str(e.value) == "Hugging Face config <tiny config dict> (model_type llama) lacks 'num_attention_heads'"


def test_every_package_is_installed():
    # pyproject lists packages explicitly: a subpackage missing there is missing from a wheel install
    # (memcalc.integrations, and memcalc.inputs.hf_families before it was added: `--model` of a config failed)
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "memcalc").rglob("__init__.py")}
    assert found - listed == set()


RECIPE = str(ROOT / "tests" / "fixtures" / "recipes" / "litgpt_llama-3.2-1B_lora.yaml")


def test_estimate_recipe_to_dict_equals_cli_json():
    # source: issue 26 ("memcalc.estimate(recipe=...).to_dict() lacks the recipe key --json prints")
    doc = memcalc.estimate(recipe=[RECIPE], gpu="rtx-4090").to_dict()
    assert doc["recipe"]["mapping"]
    assert doc == cli_json(["estimate", "--recipe", RECIPE, "--gpu", "rtx-4090"])


def test_plan_takes_a_recipe(monkeypatch):
    # source: issue 26 ("memcalc.plan(recipe=...) is a TypeError"): the recipe's model, sequence length
    # and framework reach the search, as for `memcalc plan --recipe` (tests/unit/test_recipes.py)
    import memcalc.plan.search as search

    got = []

    class Stop(Exception):
        pass

    def spy(model, gpu, seq, prof, **kw):
        got.append((model.name, seq, prof.framework))
        raise Stop

    monkeypatch.setattr(search, "plan_gpu", spy)
    with pytest.raises(Stop):
        memcalc.plan(recipe=RECIPE, gpu="rtx-4090")
    assert got == [("llama-3.2-1b", 512, "litgpt")]


@pytest.mark.slow  # a plan search for one GPU (seconds)
def test_plan_recipe_to_dict_equals_cli_json():
    p = memcalc.plan(recipe=[RECIPE], gpu="8GB")
    assert p.to_dict()["recipe"] == p.recipe
    assert p.to_dict() == cli_json(["plan", "--recipe", RECIPE, "--gpu", "8GB"])


def test_listings_are_the_cli_json():
    # source: memcalc models / configs / gpus / profiles --json (the CLI renders the API's rows)
    for rows, command in ((memcalc.api.list_models(), "models"), (memcalc.api.list_configs(), "configs"),
                          (memcalc.api.list_gpus(), "gpus"), (memcalc.api.list_profiles(), "profiles")):
        assert json.loads(json.dumps(rows)) == cli_json([command])

"""``--recipe FILE``: real published recipes (tests/fixtures/recipes/SOURCES.md) give the same setup as
the same run written with flags; detection; the ignored-keys line; bad values; flags over the recipe.

"The same estimate" is checked through the resolved ExperimentSpec (model, training, kernel profile):
the estimate is a pure function of it, and comparing specs keeps this file well under a second
(`test_fixture_estimates_match_flags` runs the full estimates too, in the slow lane).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import _Stop, resolved

from memcalc.cli import app
from memcalc.inputs.recipes import load_recipe
from memcalc.inputs.recipes.detect import detect
from memcalc.inputs.resolve import Options

FIX = Path(__file__).parent.parent / "fixtures" / "recipes"
TT_LORA = str(FIX / "torchtune_llama3_1_8B_lora_single_device.yaml")
TT_QLORA = str(FIX / "torchtune_llama3_1_8B_qlora_single_device.yaml")
TT_FULL = str(FIX / "torchtune_llama3_1_8B_full_single_device.yaml")
TRL_QLORA = str(FIX / "trl_zephyr-7b-beta_sft_config_qlora.yaml")
TRL_FULL = str(FIX / "trl_zephyr-7b-beta_sft_config_full.yaml")
AX_LORA = str(FIX / "axolotl_llama-3_lora-1b.yml")
AX_QLORA = str(FIX / "axolotl_mistral_qlora.yml")
LITGPT = str(FIX / "litgpt_llama-3.2-1B_lora.yaml")


# (fixture, the same setup written with flags); each row: # source: where the recipe's values come from
SAME_AS_FLAGS = [
    # source: torchtune lora_finetune_single_device + LoRA builder lora_llama3_1_8b; loss LinearCrossEntropyLoss -> chunked (noted)
    pytest.param(TT_LORA, "--model llama-3.1-8b --framework torchtune --lora --lora-rank 8 --lora-alpha 16 "
                 "--lora-targets q,v,o,gate,up,down --batch 2 --grad-accum 8 --checkpoint full --optimizer adamw "
                 "--optimizer-impl fused --precision bf16 --loss chunked", id="torchtune-8B-lora"),
    # source: torchtune qlora_llama3_1_8b (quantize_base=True: NF4), CEWithChunkedOutputLoss
    pytest.param(TT_QLORA, "--model llama-3.1-8b --framework torchtune --qlora --lora-rank 8 --lora-alpha 16 "
                 "--lora-targets q,v,k,o,gate,up,down --batch 2 --grad-accum 16 --checkpoint full "
                 "--optimizer-impl fused --precision bf16 --loss chunked", id="torchtune-8B-qlora"),
    # source: torchtune full_finetune_single_device: PagedAdamW8bit stepped in backward (optimizer_in_bwd)
    pytest.param(TT_FULL, "--model llama-3.1-8b --framework torchtune --batch 2 --grad-accum 1 --checkpoint full "
                 "--optimizer paged-adamw-8bit --fused-optimizer --precision bf16 --loss chunked",
                 id="torchtune-8B-full"),
    # source: alignment-handbook zephyr SFT QLoRA: TRL ModelConfig (load_in_4bit, lora_*) + SFTConfig; optim default adamw_torch_fused
    # use_bnb_nested_quant omitted: TRL's default False (fp32 absmax: --no-double-quant)
    pytest.param(TRL_QLORA, "--model mistral-7b --framework trl --qlora --no-double-quant --lora-rank 16 "
                 "--lora-alpha 16 --lora-dropout 0.05 --lora-targets q,k,v,o,gate,up,down --batch 4 --grad-accum 2 "
                 "--seq 2048 --checkpoint full --precision bf16 --optimizer adamw --optimizer-impl fused",
                 id="trl-zephyr-qlora"),
    # source: alignment-handbook zephyr SFT full: torch_dtype bfloat16 + bf16 -> pure bf16 (its ZeRO-3 lives in the accelerate config, not here)
    pytest.param(TRL_FULL, "--model mistral-7b --framework trl --batch 32 --grad-accum 2 --seq 2048 --checkpoint full "
                 "--precision bf16 --optimizer adamw --optimizer-impl fused", id="trl-zephyr-full"),
    # source: axolotl examples/llama-3/lora-1b.yml: NousResearch/Llama-3.2-1B = meta-llama/Llama-3.2-1B; adamw_8bit = bnb AdamW8bit
    pytest.param(AX_LORA, "--model llama-3.2-1b --framework hf --lora --lora-rank 16 --lora-alpha 32 "
                 "--lora-dropout 0.05 --lora-targets gate,down,up,q,v,k,o --batch 2 --grad-accum 2 --seq 2048 "
                 "--checkpoint full --precision bf16 --optimizer adamw-8bit", id="axolotl-llama-1b-lora"),
    # source: axolotl examples/mistral/qlora.yml: lora_target_linear -> every linear layer but the head
    pytest.param(AX_QLORA, "--model mistral-7b --framework hf --qlora --lora-rank 32 --lora-alpha 16 "
                 "--lora-dropout 0.05 --lora-targets all --batch 2 --grad-accum 4 --seq 8192 --checkpoint full "
                 "--precision bf16 --optimizer adamw-8bit", id="axolotl-mistral-qlora"),
    # source: litgpt config_hub/finetune/llama-3.2-1B/lora.yaml: global 8 / (1 device) / micro 1 = 8 accumulation steps
    pytest.param(LITGPT, "--model llama-3.2-1b --framework litgpt --lora --lora-rank 32 --lora-alpha 16 "
                 "--lora-dropout 0.05 --lora-targets q,v --batch 1 --grad-accum 8 --seq 512 --precision bf16 "
                 "--optimizer adamw", id="litgpt-llama-1b-lora"),
]


# (file name, recipe text, LoraSpec.double_quant): an omitted double-quantization key means what the library builds
DOUBLE_QUANT = [
    # source: trl 1.16 trl/trainer/model_config.py ModelConfig.use_bnb_nested_quant default False -> trainer/utils.py
    # get_quantization_config(bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant)
    ("sft.yaml", "model_name_or_path: mistralai/Mistral-7B-v0.1\nuse_peft: true\nload_in_4bit: true\n", False),
    # source: the same, the key given
    ("sft.yaml", "model_name_or_path: mistralai/Mistral-7B-v0.1\nuse_peft: true\nload_in_4bit: true\n"
     "use_bnb_nested_quant: true\n", True),
    # source: axolotl src/axolotl/loaders/model.py ModelLoader._set_quantization_config: bnb_4bit_use_double_quant True
    ("ax.yml", "base_model: mistralai/Mistral-7B-v0.1\nadapter: qlora\nload_in_4bit: true\n", True),
    # source: the same: bnb_config.update(cfg.bnb_config_kwargs)
    ("ax.yml", "base_model: mistralai/Mistral-7B-v0.1\nadapter: qlora\nload_in_4bit: true\nbnb_config_kwargs:\n"
     "  bnb_4bit_use_double_quant: false\n", False),
    # source: litgpt/args + lightning/fabric/plugins/precision/bitsandbytes.py: bnb.nf4 is compress_statistics=False
    ("lit.yaml", "checkpoint_dir: checkpoints/meta-llama/Llama-3.2-1B\nlora_r: 8\nquantize: bnb.nf4\n", False),
    # source: the same: bnb.nf4-dq is _NF4DQLinear, compress_statistics=True
    ("lit.yaml", "checkpoint_dir: checkpoints/meta-llama/Llama-3.2-1B\nlora_r: 8\nquantize: bnb.nf4-dq\n", True),
]


@pytest.mark.parametrize("name,text,double_quant", DOUBLE_QUANT)
def test_recipe_double_quant_default(name, text, double_quant, tmp_path, monkeypatch):
    p = tmp_path / name
    p.write_text(text)
    res = resolved(["--recipe", str(p)], monkeypatch)
    assert res.exp.training.lora.qlora and res.exp.training.lora.double_quant is double_quant


@pytest.mark.parametrize("fixture,flags", SAME_AS_FLAGS)
def test_fixture_same_setup_as_flags(fixture, flags, monkeypatch):
    by_recipe = resolved(["--recipe", fixture], monkeypatch)
    by_flags = resolved(flags.split(), monkeypatch)
    assert by_recipe.exp == by_flags.exp
    assert by_recipe.recipe is not None and by_recipe.recipe["mapping"]


@pytest.mark.slow
@pytest.mark.parametrize("fixture,flags", SAME_AS_FLAGS)
def test_fixture_estimates_match_flags(fixture, flags):
    """The full estimate of each fixture equals that of its flags, byte for byte (tolerance: none)."""
    def peak(args):
        r = CliRunner().invoke(app, ["estimate", *args, "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["peak_bytes"]

    assert peak(["--recipe", fixture]) == peak(flags.split())


# (fixture, kind): source: the SOURCES.md repository of each fixture
DETECT = [
    (TT_LORA, "torchtune"), (TT_QLORA, "torchtune"), (TT_FULL, "torchtune"), (TRL_QLORA, "hf"), (TRL_FULL, "hf"),
    (AX_LORA, "axolotl"), (AX_QLORA, "axolotl"), (LITGPT, "litgpt"),
]


@pytest.mark.parametrize("fixture,kind", DETECT)
def test_detect(fixture, kind):
    import yaml

    assert detect(yaml.safe_load(Path(fixture).read_text()), Path(fixture).name) == kind


def test_ignored_line_names_the_keys():
    rec = load_recipe([TT_LORA])
    line = rec.lines()[0]
    assert line.startswith("recipe torchtune_llama3_1_8B_lora_single_device.yaml (torchtune): ignored")
    for key in ("output_dir", "checkpointer", "profiler", "metric_logger", "optimizer.lr", "lr_scheduler"):
        assert key in rec.ignored
    assert "batch_size" not in rec.ignored and not rec.unread  # every key is either read or ignored


def test_unread_keys_are_stated(tmp_path):
    p = tmp_path / "sft.yaml"
    p.write_text("model_name_or_path: Qwen/Qwen2.5-7B\nper_device_train_batch_size: 2\nmystery_memory_knob: 3\n")
    rec = load_recipe([str(p)])
    assert rec.unread == ["mystery_memory_knob"]
    assert any("not read" in line and "mystery_memory_knob" in line for line in rec.lines())


def test_flag_overrides_recipe(monkeypatch):
    res = resolved(["--recipe", TT_LORA, "--batch", "4", "--precision", "fp32", "--lora-rank", "32"], monkeypatch)
    tr = res.exp.training
    assert (tr.batch, tr.precision, tr.lora.rank, tr.lora.alpha, tr.grad_accum) == (4, "fp32", 32, 16.0, 8)
    assert res.origin["batch"] == "flag" and res.origin["precision"] == "flag"
    assert res.origin["grad_accum"] == "recipe torchtune_llama3_1_8B_lora_single_device.yaml:gradient_accumulation_steps"
    assert res.origin["model"] == "recipe torchtune_llama3_1_8B_lora_single_device.yaml:model._component_"


def test_model_flag_overrides_recipe_model(monkeypatch):
    res = resolved(["--recipe", AX_LORA, "--model", "llama-3.2-3b"], monkeypatch)
    assert res.exp.model.name == "llama-3.2-3b" and res.origin["model"] == "flag"


def test_inputs_table_shows_recipe_origin():
    from memcalc.inputs.resolve import resolve
    from memcalc.render.report import _mark

    res = resolve(Options(recipe=[LITGPT]))
    assert "recipe litgpt_llama-3.2-1B_lora.yaml:train.global_batch_size" in _mark(res.origin, "grad_accum")


def test_adapter_config_with_hf_recipe(tmp_path, monkeypatch):
    """A TrainingArguments JSON plus a PEFT adapter_config.json (written here, not published files)."""
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"model_name_or_path": "meta-llama/Llama-3.2-1B", "per_device_train_batch_size": 2,
                                "bf16": True, "gradient_checkpointing": True, "optim": "adamw_torch",
                                "output_dir": "out", "learning_rate": 2e-4}))
    adapter = tmp_path / "adapter_config.json"
    adapter.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.1,
                                   "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM",
                                   "base_model_name_or_path": "meta-llama/Llama-3.2-1B"}))
    for extra in (["--recipe", str(adapter)], ["--adapter-config", str(adapter)]):
        res = resolved(["--recipe", str(args), *extra, "--seq", "256"], monkeypatch)
        lo = res.exp.training.lora
        assert (lo.rank, lo.alpha, lo.dropout, lo.targets) == (4, 8.0, 0.1, ("q", "v"))
        assert res.exp.training.optimizer_impl == "foreach" and res.exp.training.batch == 2
        assert res.recipe["kind"] == "hf+peft"


@pytest.mark.parametrize("source", [
    ["--model", "llama-3.2-1b"],  # source: issue 32 (a documented use ended in KeyError: 'framework')
    ["--params", "7e9"],  # source: docs/usage.md recipe table: a PEFT adapter_config.json via --adapter-config
    ["--config", "control"],  # source: the same README row
])
def test_adapter_config_without_recipe(tmp_path, monkeypatch, source):
    """``--adapter-config`` with a model source and no training recipe: the adapter's LoRA, framework hf
    read from it, and only its unread keys called ignored."""
    adapter = tmp_path / "adapter_config.json"
    adapter.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                   "task_type": "CAUSAL_LM"}))
    res = resolved([*source, "--adapter-config", str(adapter)], monkeypatch)
    lo = res.exp.training.lora
    assert (lo.rank, lo.alpha, lo.targets) == (4, 8.0, ("q", "v"))
    assert res.exp.profile.framework == "hf" and res.recipe["ignored"] == ["task_type"]


def test_embedded_peft_config(tmp_path, monkeypatch):
    p = tmp_path / "sft.json"
    p.write_text(json.dumps({"model_name_or_path": "Qwen/Qwen2.5-7B", "max_length": 512, "packing": True,
                             "peft_config": {"peft_type": "LORA", "r": 8, "target_modules": "all-linear"}}))
    res = resolved(["--recipe", str(p)], monkeypatch)
    assert res.exp.model.name == "qwen2.5-7b" and res.exp.training.batch == 8  # TrainingArguments' default
    assert res.exp.training.lora.targets == res.exp.model.lora_targets and res.exp.training.seq == 512
    assert any("packing" in n for n in res.notes)


def test_json_has_recipe_mapping(tmp_path):
    p = tmp_path / "sft.yaml"
    p.write_text("model_name_or_path: openai-community/gpt2\nper_device_train_batch_size: 1\nmax_length: 64\n"
                 "output_dir: out\n")
    r = CliRunner().invoke(app, ["estimate", "--recipe", str(p), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["recipe"]["kind"] == "hf" and doc["recipe"]["ignored"] == ["output_dir"]
    rows = {m["option"]: m for m in doc["recipe"]["mapping"]}
    assert rows["seq"] == {"key": "sft.yaml:max_length", "value": 64, "option": "seq", "to": 64}
    assert doc["inputs"]["origin"]["seq"] == "recipe sft.yaml:max_length"


def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


TT_HEAD = ("model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n  lora_attn_modules: ['q_proj']\n"
           "  lora_rank: 8\n  lora_alpha: 16\n")

# (file name, recipe text, exit code, message): source: the valid values are each reader's tables
BAD = [
    ("tt.yaml", TT_HEAD + "dtype: fp16\n", 2, "tt.yaml:dtype: unknown value 'fp16'; valid: bf16, fp32"),
    ("tt.yaml", "model:\n  _component_: torchtune.models.gemma.lora_gemma_2b\n", 2,
     "no memcalc preset for torchtune's gemma_2b; known: llama2_7b"),
    ("tt.yaml", TT_HEAD + "optimizer:\n  _component_: torch.optim.RMSprop\n", 2,
     "tt.yaml:optimizer._component_: unknown value 'torch.optim.RMSprop'; valid: torch.optim.AdamW"),
    ("tt.yaml", TT_HEAD + "optimizer_in_bwd: True\ngradient_accumulation_steps: 4\n", 2,
     "optimizer_in_bwd with gradient_accumulation_steps 4: torchtune refuses it"),
    ("tt.yaml", TT_HEAD + "loss:\n  _component_: my.Loss\n", 2, "valid: torchtune.modules.loss.CEWithChunkedOutputLoss"),
    ("tt.yaml", TT_HEAD + "batch_size: -2\n", 2, "tt.yaml:batch_size: expected a positive integer, got -2"),
    ("tt.yaml", TT_HEAD.replace("['q_proj']", "['q_proj', 'gate']"), 2, "unknown value 'gate'; valid: q_proj"),
    ("sft.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\noptim: adamw_weird\n", 2,
     "sft.yaml:optim: unknown value 'adamw_weird'; valid: adamw_torch, adamw_torch_fused"),
    ("sft.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nuse_peft: true\nload_in_8bit: true\n", 2,
     "load_in_8bit: an 8-bit (LLM.int8) base is not modelled"),
    ("sft.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nfsdp: full_shard offload\n", 2, "FSDP offload is not modelled"),
    ("sft.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nbf16: true\nfp16: true\n", 2, "bf16 and fp16 are both set"),
    ("sft.json", '{"model_name_or_path": "Qwen/Qwen2.5-7B", "peft_config": {"r": 8, "target_modules": ".*proj"}}', 2,
     "a regular expression (.*proj) is not supported"),
    ("ax.yml", "base_model: mistralai/Mistral-7B-v0.1\nadapter: ia3\n", 2, "ax.yml:adapter: unknown value 'ia3'; valid: lora, qlora"),
    ("ax.yml", "base_model: mistralai/Mistral-7B-v0.1\nadapter: qlora\n", 2, "qlora needs load_in_4bit: true"),
    ("ax.yml", "base_model: mistralai/Mistral-7B-v0.1\ngradient_checkpointing: sometimes\n", 2,
     "ax.yml:gradient_checkpointing: expected true or false, got 'sometimes'"),
    ("lit.yaml", "checkpoint_dir: checkpoints/meta-llama/Llama-3.2-1B\nprecision: 8-true\n", 2,
     "lit.yaml:precision: unknown value '8-true'; valid: bf16-true, bf16-mixed"),
    ("lit.yaml", "checkpoint_dir: checkpoints/meta-llama/Llama-3.2-1B\nlora_r: 8\nquantize: bnb.fp4\n", 2,
     "valid: bnb.nf4, bnb.nf4-dq"),
    ("lit.yaml", "checkpoint_dir: checkpoints/meta-llama/Llama-3.2-1B\ndevices: 2\ntrain:\n  global_batch_size: 2\n"
     "  micro_batch_size: 2\n", 2, "per device 2 // 2 = 1, less than train.micro_batch_size 2"),
    ("ds.json", '{"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}', 2,
     "is a DeepSpeed config, not a training recipe"),
    # issue 32: a list was taken silently
    ("sft.yaml", 'model_name_or_path: Qwen/Qwen2.5-7B\nattn_implementation: ["eager"]\n', 2,
     "sft.yaml:attn_implementation: expected an attention implementation name such as sdpa"),
    # issue 32: a string that isdigit() but int() refuses
    ("sft.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nper_device_train_batch_size: \"²\"\n", 2,
     "sft.yaml:per_device_train_batch_size: expected a positive integer, got '²'"),
    ("what.yaml", "hello: world\n", 2, "cannot tell what kind of recipe what.yaml is"),
    ("list.yaml", "- 1\n- 2\n", 2, "a recipe is a YAML/JSON mapping"),
    ("bad.yaml", "model: [unclosed\n", 2, "malformed"),
]


@pytest.mark.parametrize("name,text,code,message", BAD)
def test_bad_recipe(tmp_path, name, text, code, message):
    r = CliRunner().invoke(app, ["estimate", "--recipe", _write(tmp_path, name, text)])
    assert r.exit_code == code, r.output
    assert message in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output


@pytest.mark.slow  # the quick lane stays under 30 s; CI runs it
def test_deepspeed_key_reads_the_config(tmp_path):
    # source: HF TrainingArguments.deepspeed names a DeepSpeed JSON; transformers' ds_config_zero3.json fixture
    ds = Path(__file__).parent.parent / "fixtures" / "deepspeed" / "ds_config_zero3.json"
    p = _write(tmp_path, "sft.yaml", f"model_name_or_path: Qwen/Qwen2.5-7B\nbf16: true\ndeepspeed: {ds}\n")
    r = CliRunner().invoke(app, ["estimate", "--recipe", p, "--gpus", "8", "--json"])
    assert r.exit_code == 0, r.output
    tr = json.loads(r.output)["inputs"]["training"]
    assert (tr["sharding"], tr["zero"], tr["gpus"]) == ("deepspeed", 3, 8)


# (args, exit code, message)
CLI_ROWS = [
    (["estimate", "--recipe", "/nonexistent/recipe.yaml"], 2, "--recipe /nonexistent/recipe.yaml: no such file"),
    (["estimate", "--recipe", str(FIX)], 2, "a directory"),
    (["estimate", "--recipe", TT_LORA, "--recipe", AX_LORA], 2, "give one training recipe"),
    (["estimate", "--recipe", TT_LORA, "--adapter-config", AX_LORA], 2, "not a PEFT adapter config"),
]


@pytest.mark.parametrize("args,code,message", CLI_ROWS)
def test_cli_rows(args, code, message):
    r = CliRunner().invoke(app, args)
    assert r.exit_code == code, r.output
    assert message in " ".join(r.output.split())


def test_fsdp_maps_to_zero_and_sharding(tmp_path, monkeypatch):
    p = _write(tmp_path, "sft.yaml", "model_name_or_path: Qwen/Qwen2.5-7B\nfsdp: full_shard auto_wrap\n"
               "fsdp_config:\n  fsdp_version: 2\n  reshard_after_forward: false\n  transformer_layer_cls_to_wrap: X\n")
    res = resolved(["--recipe", p, "--gpus", "8"], monkeypatch)
    tr = res.exp.training
    assert (tr.zero, tr.sharding, tr.gpus) == (2, "fsdp2", 8)
    assert res.recipe["unread"] == ["fsdp_config.transformer_layer_cls_to_wrap"]


def test_torchtune_distributed_and_offload(tmp_path, monkeypatch):
    p = _write(tmp_path, "tt.yaml", TT_HEAD + "enable_activation_offloading: True\nfsdp_cpu_offload: False\n"
               "dataset:\n  packed: True\n  max_seq_len: 1024\n")
    res = resolved(["--recipe", p], monkeypatch)
    tr = res.exp.training
    assert (tr.zero, tr.sharding, tr.activation_offload, tr.seq) == (3, "fsdp2", True, 1024)
    assert any("packed" in n for n in res.notes)


def test_lora_on_head_and_paged_optimizer(tmp_path, monkeypatch):
    """apply_lora_to_output -> the head target; bitsandbytes PagedAdamW -> paged-adamw (techniques branch names)."""
    p = _write(tmp_path, "tt.yaml", TT_HEAD + "  apply_lora_to_output: True\noptimizer:\n"
               "  _component_: bitsandbytes.optim.PagedAdamW\n")
    tr = resolved(["--recipe", p], monkeypatch).exp.training
    assert "head" in tr.lora.targets and tr.optimizer == "paged-adamw"


def test_litgpt_model_name_and_devices(tmp_path, monkeypatch):
    """model_name (older LitGPT configs) and devices 4: FSDP over 4 GPUs, every block checkpointed."""
    p = _write(tmp_path, "lit.yaml", "model_name: Llama-3.2-1B\ndevices: 4\nprecision: bf16-mixed\n"
               "train:\n  global_batch_size: 32\n  micro_batch_size: 2\n  max_seq_length: 256\n")
    tr = resolved(["--recipe", p], monkeypatch).exp.training
    # source: litgpt/finetune/full.py FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    assert (tr.gpus, tr.zero, tr.sharding, tr.checkpoint, tr.grad_accum, tr.precision) == (
        4, 3, "fsdp1", "full", 4, "amp-bf16")


def test_plan_takes_model_seq_framework_from_recipe(monkeypatch):
    """plan --recipe: the recipe's model, sequence length and framework reach the search (not run here)."""
    import memcalc.plan.search as search

    got = []

    def spy(model, gpu, seq, prof, **kw):
        got.append((model.name, seq, prof.framework))
        raise _Stop

    monkeypatch.setattr(search, "plan_gpu", spy)
    CliRunner().invoke(app, ["plan", "--recipe", LITGPT, "--gpu", "rtx-4090"])
    assert got == [("llama-3.2-1b", 512, "litgpt")]


def test_litgpt_recipe_head_is_untied(monkeypatch):
    """A LitGPT config-hub file on a model Hugging Face ties (Llama 3.2 1B, tie_word_embeddings true): LitGPT
    0.5.13 builds its own lm_head whatever the checkpoint (litgpt/model.py GPT.__init__ ``self.lm_head =
    nn.Linear(...)``; the finetune scripts refuse train.tie_embeddings, litgpt/finetune/lora.py validate_args)."""
    from memcalc.inputs.presets import load_preset

    assert load_preset("llama-3.2-1b").tie_embeddings
    res = resolved(["--recipe", LITGPT], monkeypatch)
    assert res.exp.profile.framework == "litgpt" and not res.exp.model.tie_embeddings
    assert any("builds its own lm_head" in n for n in res.notes)

"""One reader of Hugging Face ``TrainingArguments``: a recipe file (``--recipe``) and the Trainer
callback's mapping of the live arguments (``options_from_hf``) give the same options and the same
number for every ``optim`` name; every external optimizer name is an alias on the optimizer
registry, each with its source. Torch-free (the quick lane)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

import memcalc
from memcalc.core.optimizers import ALIAS_KINDS, OPTIMIZERS, alias_table
from memcalc.inputs.recipes import load_recipe
from memcalc.inputs.recipes.hf import options_from_hf

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30

#: the setup of the issue's 29.9 / 74.8 GiB case: Llama 3.1 8B loaded in bf16, bf16 autocast, every layer checkpointed
ARGS = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "max_length": 2048, "bf16": True,
        "gradient_checkpointing": True}
MODEL = {"model_name_or_path": "meta-llama/Llama-3.1-8B", "torch_dtype": "bfloat16"}


def both_ways(tmp_path: Path, optim: str, hub_id: str = "meta-llama/Llama-3.1-8B"):
    """(the recipe's options, the callback's options) for ARGS with this ``optim``, and the recipe file."""
    f = tmp_path / "args.json"
    f.write_text(json.dumps({**ARGS, **MODEL, "model_name_or_path": hub_id, "optim": optim}))
    rec = load_recipe([str(f)])
    from_file = {k: v for k, v in rec.values.items() if k != "model" and (k != "framework" or v == "trl")}
    live, notes = options_from_hf({**ARGS, "optim": optim}, model_dtype="bfloat16")  # the callback: args.to_dict()
    assert not any("not modelled" in n for n in notes), notes
    return from_file, live, str(f)


@pytest.mark.parametrize("optim", list(alias_table("hf")))
def test_every_optim_name_gives_one_setup_both_ways(tmp_path, optim):
    # source: the recipe reader and the callback share memcalc/inputs/recipes/hf.py read(); the estimate is a pure
    # function of its options, so the same options are the same number (computed for every name in the slow lane,
    # pinned below for the issue's case)
    from_file, live, _ = both_ways(tmp_path, optim)
    assert from_file == live
    assert live["optimizer"] == alias_table("hf")[optim][0]


@pytest.mark.slow  # two estimates per optim name (seconds in all)
@pytest.mark.parametrize("optim", list(alias_table("hf")))
def test_every_optim_name_gives_one_number_both_ways(tmp_path, optim):
    _, live, f = both_ways(tmp_path, optim, "meta-llama/Llama-3.2-1B")
    assert memcalc.estimate(recipe=[f]).peak_bytes == memcalc.estimate(model="llama-3.2-1b", **live).peak_bytes


# (optim, GiB both ways): source: `memcalc estimate --recipe args.json` on ARGS + MODEL. Before the one reader the
# callback gave 74.788 GiB for paged_adamw_32bit (bf16 AdamW moments on the GPU: its table said adamw) and 45.155
# for paged_adamw_8bit (adamw-8bit): bitsandbytes' paged state is cudaMallocManaged memory, outside
# max_memory_allocated (bitsandbytes optimizer.py Optimizer8bit.get_state_buffer)
# ARGS' max_length makes them a TRL SFTConfig (--framework trl): its collator's attention mask (+16 KiB) is an input
# (the RoPE cos/sin as transformers makes them, (1, T, 128) bf16: rules.rope_tables_bytes; 1 MiB under the former
# two (B, T, 128) fp32 tables)
PINNED = [("paged_adamw_32bit", 32174604800), ("paged_adamw_8bit", 32424011264), ("adamw_torch", 80302612480)]


@pytest.mark.parametrize("optim,peak", PINNED)
def test_the_issue_case_gives_one_number(tmp_path, optim, peak):
    from_file, live, f = both_ways(tmp_path, optim)
    assert from_file == live
    assert memcalc.estimate(recipe=[f]).peak_bytes == memcalc.estimate(model="llama-3.1-8b", **live).peak_bytes == peak


@pytest.mark.parametrize("optim_args,optimizer",
                         [("momentum=0.9, nesterov=True", "sgd-momentum"), ("momentum=0", "sgd"), (None, "sgd")])
def test_sgd_momentum_from_optim_args(tmp_path, optim_args, optimizer):
    # source: transformers 5.24 trainer_optimizer.py _get_sgd: optim_args' momentum (parsed by _parse_optim_args,
    # "a=1,b=2") goes to torch.optim.SGD, which then keeps a momentum buffer per parameter (memcalc's sgd-momentum)
    args = {**ARGS, "optim": "sgd", "optim_args": optim_args}
    f = tmp_path / "args.json"
    f.write_text(json.dumps({**MODEL, **args}))
    live, _ = options_from_hf(args, "bfloat16")
    assert load_recipe([str(f)]).values["optimizer"] == live["optimizer"] == optimizer


def test_a_live_arguments_dict_reads_as_its_file():
    # source: transformers 5.24 TrainingArguments.to_dict(): every field, the unset ones None or False, enums as
    # values; gradient_checkpointing mirrors activation_checkpointing (training_args.py __post_init__)
    live = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "optim": "adamw_torch", "bf16": False,
            "fp16": False, "activation_checkpointing": True, "gradient_checkpointing": True,
            "activation_checkpointing_kwargs": {"every_n_layers": 3},
            "gradient_checkpointing_kwargs": {"every_n_layers": 3},
            "torch_compile": False, "use_liger_kernel": False, "deepspeed": None, "fsdp": None, "fsdp_config": None,
            "output_dir": "out", "learning_rate": 5e-5, "optim_args": None}
    opts, notes = options_from_hf(live, "float32")
    assert opts == dict(batch=4, grad_accum=2, precision="fp32", checkpoint="every-3", optimizer="adamw",
                        optimizer_impl="foreach")
    assert notes == []
    opts, notes = options_from_hf({**live, "fsdp": ["full_shard"], "use_liger_kernel": True}, "float32")
    assert any("fsdp is not read" in n for n in notes)  # noted, never raised
    assert opts["kernels"] == "liger"  # Trainer.train applies Liger: the estimate follows (memcalc.core.liger)


# (kind, external name, memcalc optimizer, optimizer_impl): every alias on the registry, one row each
ALIASES = [
    # source: transformers 5.24 training_args.py OptimizerNames.ADAMW_TORCH; trainer_optimizer.py _get_adamw_torch
    # (no foreach/fused argument: CUDA's default, foreach)
    ("hf", "adamw_torch", "adamw", "foreach"),
    # source: trainer_optimizer.py _get_adamw_torch: optimizer_kwargs fused=True for ADAMW_TORCH_FUSED
    ("hf", "adamw_torch_fused", "adamw", "fused"),
    # source: transformers 4.x OptimizerNames.ADAMW_HF: transformers.optimization.AdamW, a per-parameter loop
    # (not in 5.24)
    ("hf", "adamw_hf", "adamw", "for-loop"),
    # source: trainer_optimizer.py _get_sgd: torch.optim.SGD, momentum only from optim_args
    ("hf", "sgd", "sgd", None),
    # source: trainer_optimizer.py _get_adafactor: transformers.optimization.Adafactor(scale_parameter=False,
    # relative_step=False)
    ("hf", "adafactor", "adafactor", None),
    # source: _get_bitsandbytes_optimizer: bitsandbytes Lion(optim_bits=32) (memcalc models lion-pytorch's one buffer)
    ("hf", "lion_32bit", "lion", None),
    # source: _get_bitsandbytes_optimizer: "adam" in the name -> bitsandbytes AdamW, optim_bits 8, is_paged False
    ("hf", "adamw_bnb_8bit", "adamw-8bit", None),
    # source: training_args.py ADAMW_8BIT = "adamw_8bit"  # just an alias for adamw_bnb_8bit
    ("hf", "adamw_8bit", "adamw-8bit", None),
    # source: trainer_optimizer.py _get_torchao_optimizer: torchao AdamW8bit (block_size 256)
    ("hf", "adamw_torch_8bit", "adamw-8bit-torchao", None),
    # source: trainer_optimizer.py _get_torchao_optimizer: torchao AdamW4bit (block_size 256 from optim_args' default)
    ("hf", "adamw_torch_4bit", "adamw-4bit-torchao", None),
    # source: trainer_optimizer.py _get_galore_optimizer: galore_torch.GaLoreAdamW over optim_target_modules
    ("hf", "galore_adamw", "galore-adamw", None),
    # source: _get_bitsandbytes_optimizer: AdamW, optim_bits 32 (no "8bit"), is_paged True = PagedAdamW
    ("hf", "paged_adamw_32bit", "paged-adamw", None),
    # source: _get_bitsandbytes_optimizer: AdamW, optim_bits 8, is_paged True = PagedAdamW8bit
    ("hf", "paged_adamw_8bit", "paged-adamw-8bit", None),
    # source: torchtune recipes' optimizer._component_ / LitGPT class_path: the class itself
    ("class", "torch.optim.AdamW", "adamw", None),
    # source: torch/optim/adam.py Adam
    ("class", "torch.optim.Adam", "adam", None),
    # source: torch/optim/sgd.py SGD (momentum 0 by default; torchtune's reader reads optimizer.momentum)
    ("class", "torch.optim.SGD", "sgd", None),
    # source: bitsandbytes/optim/adamw.py AdamW8bit (optim_bits=8)
    ("class", "bitsandbytes.optim.AdamW8bit", "adamw-8bit", None),
    # source: galore_torch 1.0 __init__.py GaLoreAdamW (galore_torch/adamw.py AdamW)
    ("class", "galore_torch.GaLoreAdamW", "galore-adamw", None),
    # source: torchao 0.14.1 torchao/optim/adam.py AdamW8bit (torchtune's low-memory recipes)
    ("class", "torchao.optim.AdamW8bit", "adamw-8bit-torchao", None),
    # source: torchao's former path of the same class (torchao.prototype.low_bit_optim)
    ("class", "torchao.prototype.low_bit_optim.AdamW8bit", "adamw-8bit-torchao", None),
    # source: torchao/optim/adam.py AdamW4bit
    ("class", "torchao.optim.AdamW4bit", "adamw-4bit-torchao", None),
    # source: torchao's former path of the same class
    ("class", "torchao.prototype.low_bit_optim.AdamW4bit", "adamw-4bit-torchao", None),
    # source: torchao/optim/adam.py AdamWFp8
    ("class", "torchao.optim.AdamWFp8", "adamw-fp8-torchao", None),
    # source: torchao's former path of the same class
    ("class", "torchao.prototype.low_bit_optim.AdamWFp8", "adamw-fp8-torchao", None),
    # source: bitsandbytes/optim/adamw.py PagedAdamW (optim_bits=32, is_paged=True)
    ("class", "bitsandbytes.optim.PagedAdamW", "paged-adamw", None),
    # source: bitsandbytes/optim/adamw.py PagedAdamW32bit (the same class with optim_bits fixed at 32)
    ("class", "bitsandbytes.optim.PagedAdamW32bit", "paged-adamw", None),
    # source: bitsandbytes/optim/adamw.py PagedAdamW8bit (optim_bits=8, is_paged=True)
    ("class", "bitsandbytes.optim.PagedAdamW8bit", "paged-adamw-8bit", None),
    # source: LitGPT litgpt/utils.py instantiate_torch_optimizer: a bare name is getattr(torch.optim, name)
    ("litgpt", "AdamW", "adamw", None),
    # source: as above, torch.optim.Adam
    ("litgpt", "Adam", "adam", None),
    # source: as above, torch.optim.SGD
    ("litgpt", "SGD", "sgd", None),
]


@pytest.mark.parametrize("kind,name,optimizer,impl", ALIASES)
def test_alias_registry_row(kind, name, optimizer, impl):
    opt, alias = alias_table(kind)[name]
    assert (opt, alias.impl) == (optimizer, impl)
    assert alias.source and alias in OPTIMIZERS[opt].aliases
    assert impl is None or impl in OPTIMIZERS[opt].impls


def test_the_table_lists_every_alias():
    on_registry = {(a.kind, a.name) for r in OPTIMIZERS.values() for a in r.aliases}
    assert on_registry == {(k, n) for k, n, _, _ in ALIASES}
    assert {a.kind for r in OPTIMIZERS.values() for a in r.aliases} == set(ALIAS_KINDS)


def test_no_names_outside_the_registry():
    # the four separate tables (recipes/common.py, integrations/transformers.py, torchtune.py, litgpt.py) are gone:
    # no module but the registry spells an external optimizer name in a mapping
    names = {n for k in ALIAS_KINDS for n in alias_table(k)} - {"sgd", "adafactor"}
    readers = [ROOT / "memcalc" / d for d in ("inputs", "integrations", "cli")]
    for path in [p for d in readers for p in d.rglob("*.py")] + [ROOT / "memcalc" / "api.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                assert not keys & names, (path, keys & names)


def test_callback_does_not_import_the_integration():
    # the cycle memcalc.integrations.transformers <-> memcalc.validate.callback: the callback reads the arguments
    # with the recipe reader, the integration imports the callback (lazily)
    tree = ast.parse((ROOT / "validate" / "callback.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m.startswith("memcalc.integrations") for m in imported), imported

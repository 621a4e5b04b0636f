"""What the commands share: the choice enums (from the registries and the spec's vocabularies),
the options several commands take, and the helpers that turn them into
:class:`memcalc.inputs.resolve.Options`.

Pydantic-free: the choices come from :mod:`memcalc.core.choices` and
:mod:`memcalc.core.optimizers`, not from the spec models.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

import typer

from memcalc.core.choices import FRAMEWORKS, LORA_DTYPES, LOSSES
from memcalc.core.errors import UserError
from memcalc.core.optimizers import IMPLS, OPTIMIZER_NAMES, OPTIMIZERS


class PrecisionOpt(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    amp_bf16 = "amp-bf16"
    amp_fp16 = "amp-fp16"


#: --optimizer choices and --optimizer-impl choices: the registry's (memcalc.core.optimizers)
OptimizerOpt = Enum("OptimizerOpt", {n.replace("-", "_"): n for n in OPTIMIZER_NAMES}, type=str)  # type: ignore[misc]
ImplOpt = Enum("ImplOpt", {n.replace("-", "_"): n for n in IMPLS}, type=str)  # type: ignore[misc]


#: --loss choices: the profile's cross_entropy values (memcalc.core.spec.LOSSES)
LossOpt = Enum("LossOpt", {n: n for n in LOSSES}, type=str)  # type: ignore[misc]
#: --framework and --lora-dtype choices: the spec's (memcalc.core.spec.FRAMEWORKS, LORA_DTYPES)
FrameworkOpt = Enum("FrameworkOpt", {n: n for n in FRAMEWORKS}, type=str)  # type: ignore[misc]
LoraDtypeOpt = Enum("LoraDtypeOpt", {n: n for n in LORA_DTYPES}, type=str)  # type: ignore[misc]


# -- shared options -------------------------------------------------------------------
MODEL = typer.Option(None, "--model", "-m", help="Preset name (see `memcalc models`), a Hugging Face id ORG/NAME (a preset with that id, else config.json from the local Hugging Face cache, else fetched from the Hub unless HF_HUB_OFFLINE=1), or a path to a Hugging Face config.json or a model spec YAML/JSON.")
PARAMS = typer.Option(None, "--params", help="Infer a Llama-style decoder with about this many parameters (7e9, 7B, 350M), or a mixture of experts as TOTAL-A<ACTIVE> (30B-A3B: top-8 routing, balanced).")
CONFIG = typer.Option(None, "--config", "-c", help="A reference config name (see `memcalc configs`) or an experiment YAML/JSON; flags override it.")
BATCH = typer.Option(None, "--batch", "-b", help="Micro-batch size (default 1).")
SEQ = typer.Option(None, "--seq", "-s", help="Sequence length (default 2048, or the model's maximum if smaller).")
ACCUM = typer.Option(None, "--grad-accum", help="Gradient-accumulation micro-steps (default 1).")
PRECISION = typer.Option(None, "--precision", help="fp32 | bf16 | fp16 (pure 16-bit) | amp-bf16 | amp-fp16 (autocast over fp32 weights). Default: bf16 with --lora/--qlora (a bf16 base; QLoRA computes in bf16), else fp32 (what Hugging Face Trainer runs without --bf16), or the --config's.")
BF16 = typer.Option(False, "--bf16", help="Short for --precision bf16: weights, grads and optimizer state all bf16.")
MASTER = typer.Option(False, "--master-weights", help="16-bit weights and grads + fp32 master weights and moments (16 bytes/param with Adam).")
OPTIMIZER = typer.Option(None, "--optimizer", help="Optimizer (default adamw): " + "; ".join(
    f"{r.name} = {r.help}" for r in OPTIMIZERS.values()) + ".")
IMPL = typer.Option(None, "--optimizer-impl", help="Optimizer implementation (default foreach, CUDA's default): " + "; ".join(
    f"{r.name}: {', '.join(r.impls)}" for r in OPTIMIZERS.values() if r.impls != IMPLS) + "; the others: all.")
CHECKPOINT = typer.Option(None, "--checkpoint", help="none | full | every-K (e.g. every-2) | sqrt | selective | selective-op (torchtitan).")
FUSED = typer.Option(False, "--fused-optimizer", help="Step the optimizer in post-accumulate-grad hooks during backward.")
COMPILE = typer.Option(False, "--compile", help="torch.compile the model.")
BUDGET = typer.Option(None, "--memory-budget", help="torch.compile activation_memory_budget in [0, 1] (implies --compile).")
LORA = typer.Option(False, "--lora", help="LoRA adapters on a frozen base (default rank 16, alpha 32, targets q,k,v,o).")
LORA_RANK = typer.Option(None, "--lora-rank", help="LoRA rank.")
LORA_ALPHA = typer.Option(None, "--lora-alpha", help="LoRA alpha.")
LORA_TARGETS = typer.Option(None, "--lora-targets", help="Comma-separated from q,k,v,o,gate,up,down (or PEFT's q_proj, ..., down_proj); qkv / gate_up on fused projections (c_attn, qkv_proj, query_key_value, gate_up_proj), q_a,q_b,kv_a,kv_b on MLA, experts on MoE; or all (every projection the model has). Default: the attention projections.")
LORA_DROPOUT = typer.Option(None, "--lora-dropout", help="Dropout on the adapter input.")
QLORA = typer.Option(False, "--qlora", help="QLoRA: LoRA over a 4-bit NF4 frozen base.")
LORA_DTYPE = typer.Option(None, "--lora-dtype", help="LoRA adapter dtype (weights, grads, optimizer state): fp32, or model (the base's). Default: the framework's (hf: fp32, PEFT's autocast_adapter_dtype=True; plain, torchtune, litgpt: model).")
PROFILE = typer.Option(None, "--profile", help="Kernel profile by name (see `memcalc profiles`): a (framework, PyTorch version) pair; --framework/--torch replace that part of it. Default: the --config's profile (torch-2.8-cuda, plain, for the reference configs), else hf-torch-2.8-cuda.")
FRAMEWORK = typer.Option(None, "--framework", help="Whose layer code runs the model: hf (transformers 5.x + PEFT), torchtune, litgpt, or plain (memcalc's own PyTorch replica). Default: plain for a --config (the reference configs), hf for --model and --params (most users run transformers + PEFT). Replaces the framework of --profile/--config's profile.")
TORCH = typer.Option(None, "--torch", help="PyTorch version whose kernels run (major.minor, 2.1 to 2.13; default 2.8, or the profile's). Replaces the version of --profile/--config's profile.")
LOSS = typer.Option(None, "--loss", help="Cross-entropy: full, or chunked (the logits rows in --loss-chunks pieces, each upcast to fp32 on its own, as torchtune's CEWithChunkedOutputLoss); overrides the profile.")
LOSS_CHUNKS = typer.Option(None, "--loss-chunks", help="Chunks of --loss chunked (default 8); overrides the profile.")
JSON = typer.Option(False, "--json", help="Print only JSON (integer bytes).")
ZERO = typer.Option(None, "--zero", help="ZeRO stage 0-3 (1: optimizer state, 2: + gradients, 3: + weights sharded over --gpus).")
GPUS = typer.Option(None, "--gpus", help="Data-parallel GPUs that ZeRO shards over (default 1).")
OFFLOAD = typer.Option(False, "--offload-optimizer", help="Keep optimizer state and its step on the CPU.")
SHARDING = typer.Option(None, "--sharding", help="How --zero runs over --gpus: fsdp2 (default; fully_shard per layer and root, --zero 3 reshards after forward, --zero 2 does not), fsdp1, or deepspeed.")
DEEPSPEED = typer.Option(None, "--deepspeed", help="A DeepSpeed config (ds_config.json): sharding deepspeed with its ZeRO stage (2 or 3), buckets, prefetch limits, bf16/fp16, micro-batch and accumulation; \"auto\" values as Hugging Face fills them.")
TP = typer.Option(None, "--tp", help="Tensor-parallel degree (Megatron-style column/row parallel linears); GPUs in all = --gpus x --tp.")
SEQ_PARALLEL = typer.Option(False, "--sequence-parallel", help="With --tp: norms and dropout on sequence shards.")
ACT_OFFLOAD = typer.Option(False, "--activation-offload", help="Saved activations go to host memory in forward and come back for backward (torchtune's OffloadActivations); the host memory is reported.")
RECIPE = typer.Option(None, "--recipe", help="A training setup file: a torchtune recipe YAML, Hugging Face TrainingArguments / TRL SFTConfig (JSON or YAML), an axolotl YAML or a LitGPT config; repeat it to add a PEFT adapter_config.json. Its memory-relevant keys set the inputs (origin: recipe FILE:KEY); flags override them; keys that do not affect memory are listed as ignored.")
ADAPTER_CONFIG = typer.Option(None, "--adapter-config", help="A PEFT adapter_config.json (LoraConfig) for a Hugging Face / TRL or axolotl --recipe, or on its own with --model.")
DORA = typer.Option(False, "--dora", help="DoRA (PEFT use_dora=True): LoRA plus a trainable magnitude vector per target (implies --lora).")


def _check_output(path: Optional[str], flag: str) -> None:
    """An output file that cannot be written is a one-line error before any work starts:
    an empty path, a directory, a missing or unwritable folder, an unwritable file."""
    import os
    from pathlib import Path

    if path is None:
        return
    if not path.strip():
        raise UserError(f"cannot write {flag} {path!r}: an empty path; give a file path")
    p = Path(path).expanduser()
    try:
        p = Path(os.path.realpath(p))  # a symlink is written through: check its target
        if p.is_dir():
            raise UserError(f"cannot write {flag} {path}: it is a directory; give a file path")
        parent = p.parent
        if not parent.is_dir():
            raise UserError(f"cannot write {flag} {path}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise UserError(f"cannot write {flag} {path}: permission denied")
    except OSError as e:  # a name the OS refuses (too long)
        raise UserError(f"cannot write {flag} {path[:200]}: {e.strerror or e}") from None


def _options(**kw: Any):
    from memcalc.inputs.resolve import Options

    for k in ("precision", "optimizer", "optimizer_impl", "loss", "framework", "lora_dtype"):
        if kw.get(k) is not None:
            kw[k] = kw[k].value
    return Options(**kw)

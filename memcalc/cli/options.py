"""What the commands share: the choices (from the registries and the spec's vocabularies), the
click options several commands take, and the helpers that turn them into
:class:`memcalc.inputs.resolve.Options`.

Pydantic-free: the choices come from :mod:`memcalc.core.choices` and
:mod:`memcalc.core.optimizers`, not from the spec models.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import click

from memcalc.core.choices import FRAMEWORKS, LORA_DTYPES, LOSSES, PRECISIONS
from memcalc.core.errors import UserError
from memcalc.core.optimizers import IMPLS, OPTIMIZER_NAMES, OPTIMIZERS


# -- shared options -------------------------------------------------------------------
MODEL = click.option("--model", "-m", help="Preset name (see `memcalc models`), a Hugging Face id ORG/NAME (a preset with that id, else config.json from the local Hugging Face cache, else fetched from the Hub unless HF_HUB_OFFLINE=1), or a path to a Hugging Face config.json or a model spec YAML/JSON.")
PARAMS = click.option("--params", help="Infer a Llama-style decoder with about this many parameters (7e9, 7B, 350M), or a mixture of experts as TOTAL-A<ACTIVE> (30B-A3B: top-8 routing, balanced).")
CONFIG = click.option("--config", "-c", help="A reference config name (see `memcalc configs`) or an experiment YAML/JSON; flags override it.")
BATCH = click.option("--batch", "-b", type=int, help="Micro-batch size (default 1).")
SEQ = click.option("--seq", "-s", type=int, help="Sequence length (default 2048, or the model's maximum if smaller).")
ACCUM = click.option("--grad-accum", type=int, help="Gradient-accumulation micro-steps (default 1).")
PRECISION = click.option("--precision", type=click.Choice(PRECISIONS), help="fp32 | bf16 | fp16 (pure 16-bit) | amp-bf16 | amp-fp16 (autocast over fp32 weights). Default: bf16 with --lora/--qlora (a bf16 base; QLoRA computes in bf16), else fp32 (what Hugging Face Trainer runs without --bf16), or the --config's.")
BF16 = click.option("--bf16", is_flag=True, help="Short for --precision bf16: weights, grads and optimizer state all bf16.")
MASTER = click.option("--master-weights", is_flag=True, help="16-bit weights and grads + fp32 master weights and moments (16 bytes/param with Adam).")
OPTIMIZER = click.option("--optimizer", type=click.Choice(OPTIMIZER_NAMES), help="Optimizer (default adamw): " + "; ".join(
    f"{r.name} = {r.help}" for r in OPTIMIZERS.values()) + ".")
IMPL = click.option("--optimizer-impl", type=click.Choice(IMPLS), help="Optimizer implementation (default foreach, CUDA's default): " + "; ".join(
    f"{r.name}: {', '.join(r.impls)}" for r in OPTIMIZERS.values() if r.impls != IMPLS) + "; the others: all.")
CHECKPOINT = click.option("--checkpoint", help="none | full | every-K (e.g. every-2) | sqrt | selective | selective-op (torchtitan).")
FUSED = click.option("--fused-optimizer", is_flag=True, help="Step the optimizer in post-accumulate-grad hooks during backward.")
COMPILE = click.option("--compile", is_flag=True, help="torch.compile the model.")
BUDGET = click.option("--memory-budget", type=float, help="torch.compile activation_memory_budget in [0, 1] (implies --compile).")
LORA = click.option("--lora", is_flag=True, help="LoRA adapters on a frozen base (default rank 16, alpha 32, targets q,k,v,o).")
LORA_RANK = click.option("--lora-rank", type=int, help="LoRA rank.")
LORA_ALPHA = click.option("--lora-alpha", type=float, help="LoRA alpha.")
LORA_TARGETS = click.option("--lora-targets", help="Comma-separated from q,k,v,o,gate,up,down (or PEFT's q_proj, ..., down_proj); qkv / gate_up on fused projections (c_attn, qkv_proj, query_key_value, gate_up_proj), q_a,q_b,kv_a,kv_b on MLA, experts on MoE; or all (every projection the model has). Default: the attention projections.")
LORA_DROPOUT = click.option("--lora-dropout", type=float, help="Dropout on the adapter input.")
QLORA = click.option("--qlora", is_flag=True, help="QLoRA: LoRA over a 4-bit NF4 frozen base.")
LORA_DTYPE = click.option("--lora-dtype", type=click.Choice(LORA_DTYPES), help="LoRA adapter dtype (weights, grads, optimizer state): fp32, or model (the base's). Default: the framework's (hf: fp32, PEFT's autocast_adapter_dtype=True; plain, torchtune, litgpt: model).")
PROFILE = click.option("--profile", help="Kernel profile by name (see `memcalc profiles`): a (framework, PyTorch version) pair; --framework/--torch replace that part of it. Default: the --config's profile (torch-2.8-cuda, plain, for the reference configs), else hf-torch-2.8-cuda.")
FRAMEWORK = click.option("--framework", type=click.Choice(FRAMEWORKS), help="Whose layer code runs the model: hf (transformers 5.x + PEFT), torchtune, litgpt, or plain (memcalc's own PyTorch replica). Default: plain for a --config (the reference configs), hf for --model and --params (most users run transformers + PEFT). Replaces the framework of --profile/--config's profile.")
TORCH = click.option("--torch", help="PyTorch version whose kernels run (major.minor, 2.1 to 2.13; default 2.8, or the profile's). Replaces the version of --profile/--config's profile.")
LOSS = click.option("--loss", type=click.Choice(LOSSES), help="Cross-entropy: full, or chunked (the logits rows in --loss-chunks pieces, each upcast to fp32 on its own, as torchtune's CEWithChunkedOutputLoss); overrides the profile.")
LOSS_CHUNKS = click.option("--loss-chunks", type=int, help="Chunks of --loss chunked (default 8); overrides the profile.")
JSON = click.option("--json", "as_json", is_flag=True, help="Print only JSON (integer bytes).")
ZERO = click.option("--zero", type=int, help="ZeRO stage 0-3 (1: optimizer state, 2: + gradients, 3: + weights sharded over --gpus).")
GPUS = click.option("--gpus", type=int, help="Data-parallel GPUs that ZeRO shards over (default 1).")
OFFLOAD = click.option("--offload-optimizer", is_flag=True, help="Keep optimizer state and its step on the CPU.")
SHARDING = click.option("--sharding", help="How --zero runs over --gpus: fsdp2 (default; fully_shard per layer and root, --zero 3 reshards after forward, --zero 2 does not), fsdp1, or deepspeed.")
DEEPSPEED = click.option("--deepspeed", help="A DeepSpeed config (ds_config.json): sharding deepspeed with its ZeRO stage (2 or 3), buckets, prefetch limits, bf16/fp16, micro-batch and accumulation; \"auto\" values as Hugging Face fills them.")
TP = click.option("--tp", type=int, help="Tensor-parallel degree (Megatron-style column/row parallel linears); GPUs in all = --gpus x --tp.")
SEQ_PARALLEL = click.option("--sequence-parallel", is_flag=True, help="With --tp: norms and dropout on sequence shards.")
ACT_OFFLOAD = click.option("--activation-offload", is_flag=True, help="Saved activations go to host memory in forward and come back for backward (torchtune's OffloadActivations); the host memory is reported.")
RECIPE = click.option("--recipe", multiple=True, help="A training setup file: a torchtune recipe YAML, Hugging Face TrainingArguments / TRL SFTConfig (JSON or YAML), an axolotl YAML or a LitGPT config; repeat it to add a PEFT adapter_config.json. Its memory-relevant keys set the inputs (origin: recipe FILE:KEY); flags override them; keys that do not affect memory are listed as ignored.")
ADAPTER_CONFIG = click.option("--adapter-config", help="A PEFT adapter_config.json (LoraConfig) for a Hugging Face / TRL or axolotl --recipe, or on its own with --model.")
DORA = click.option("--dora", is_flag=True, help="DoRA (PEFT use_dora=True): LoRA plus a trainable magnitude vector per target (implies --lora).")


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


def with_options(*options: Callable) -> Callable:
    """Apply click option decorators so that ``--help`` lists them in the order given (a stack of
    decorators applies bottom-up, and click lists the last applied first)."""
    def apply(f: Callable) -> Callable:
        for option in reversed(options):
            f = option(f)
        return f
    return apply


def _options(**kw: Any):
    """The parsed options as :class:`~memcalc.inputs.resolve.Options`; a repeatable option given no
    times (click's empty tuple) is None, "not given", as for every other option."""
    from memcalc.inputs.resolve import Options

    if "recipe" in kw:
        kw["recipe"] = list(kw["recipe"] or ()) or None
    return Options(**kw)

"""The ``memcalc`` command line.

Every bad input ends as one line on stderr and exit code 2: typer/click usage
errors, :class:`~memcalc.core.errors.UserError`, and pydantic validation errors.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any, List, Optional

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from memcalc.core.errors import UserError
from memcalc.core.optimizers import IMPLS, OPTIMIZER_NAMES, OPTIMIZERS
from memcalc.core.spec import FRAMEWORKS, LORA_DTYPES, LOSSES, MAX_LAYERS
from memcalc.core.units import gib


class _Group(TyperGroup):
    """Runs commands without click's standalone error printing; errors become one line + exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # type: ignore[override]
        try:
            rv = super().main(args=args, prog_name=prog_name or "memcalc", complete_var=complete_var,
                              standalone_mode=False, **extra)
        except UserError as e:
            _err(str(e))
            sys.exit(2)
        except ValidationError as e:
            from memcalc.inputs.pydantic_errors import pydantic_error_line

            _err(pydantic_error_line(e, "input"))
            sys.exit(2)
        except Exception as e:  # click's (or typer's vendored click's) Exit / Abort / usage errors
            name = type(e).__name__
            if name == "NoArgsIsHelpError":  # a bare `memcalc`: the help screen as is (click >= 8.2: stderr, exit 2)
                sys.stderr.write(e.format_message().rstrip("\n") + "\n")  # type: ignore[attr-defined]
                sys.exit(2)
            if name == "Exit":
                sys.exit(getattr(e, "exit_code", 0))
            if name == "Abort":
                _err("aborted")
                sys.exit(130)
            if hasattr(e, "format_message"):  # ClickException: no such option, bad choice, bad number
                _err(" ".join(e.format_message().split()))
                sys.exit(2)
            raise
        if isinstance(rv, int) and rv:
            sys.exit(rv)
        sys.exit(0)


#: list tables: a header rule, no edges, padding shared between neighbours (whole names in 80 columns)
def _compact() -> dict[str, Any]:
    from rich import box

    return {"box": box.SIMPLE_HEAD, "show_edge": False, "collapse_padding": True}


def _err(msg: str) -> None:
    sys.stderr.write(f"memcalc: error: {msg}\n")


app = typer.Typer(
    cls=_Group,
    help="memcalc: how much GPU memory a training step takes, from its timeline, and proof by measuring.",
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from memcalc import __version__

        typer.echo(f"memcalc {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """memcalc: how much GPU memory a training step takes, from its timeline, and proof by measuring."""


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


@app.command()
def estimate(
    model: Optional[str] = MODEL, params: Optional[str] = PARAMS, config: Optional[str] = CONFIG,
    batch: Optional[int] = BATCH, seq: Optional[int] = SEQ, grad_accum: Optional[int] = ACCUM,
    precision: Optional[PrecisionOpt] = PRECISION, bf16: bool = BF16, master_weights: bool = MASTER,
    optimizer: Optional[OptimizerOpt] = OPTIMIZER, optimizer_impl: Optional[ImplOpt] = IMPL,
    checkpoint: Optional[str] = CHECKPOINT, fused_optimizer: bool = FUSED, compile: bool = COMPILE,
    memory_budget: Optional[float] = BUDGET, lora: bool = LORA, lora_rank: Optional[int] = LORA_RANK,
    lora_alpha: Optional[float] = LORA_ALPHA, lora_targets: Optional[str] = LORA_TARGETS,
    lora_dropout: Optional[float] = LORA_DROPOUT, qlora: bool = QLORA, lora_dtype: Optional[LoraDtypeOpt] = LORA_DTYPE,
    profile: Optional[str] = PROFILE, framework: Optional[FrameworkOpt] = FRAMEWORK, torch: Optional[str] = TORCH,
    zero: Optional[int] = ZERO, gpus: Optional[int] = GPUS, offload_optimizer: bool = OFFLOAD,
    sharding: Optional[str] = SHARDING, tp: Optional[int] = TP, sequence_parallel: bool = SEQ_PARALLEL,
    activation_offload: bool = ACT_OFFLOAD, dora: bool = DORA, deepspeed: Optional[str] = DEEPSPEED,
    loss: Optional[LossOpt] = LOSS, loss_chunks: Optional[int] = LOSS_CHUNKS,
    recipe: Optional[List[str]] = RECIPE, adapter_config: Optional[str] = ADAPTER_CONFIG,
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", help="Only these GPUs in the fits table (repeatable; see `memcalc gpus`), or a capacity: 48GiB (2**30 bytes each), 24GB (10**9)."),
    as_json: bool = JSON,
    timeline: bool = typer.Option(False, "--timeline", help="Also draw memory across the step (after the tables; ignored with --json)."),
    html: Optional[str] = typer.Option(None, "--html", help="Also write a self-contained HTML report to this file."),
    max_batch: bool = typer.Option(False, "--max-batch", help="Also find the largest batch (at --seq) that fits the one --gpu (exact: binary search over estimates)."),
    max_seq: bool = typer.Option(False, "--max-seq", help="Also find the longest sequence (at --batch) that fits the one --gpu, up to the model's maximum."),
    check: bool = typer.Option(False, "--check", help="With --gpu: exit 3, with a warning on stderr, when the step needs more memory than a --gpu card has (or the caching allocator's replayed reserved peak exceeds it)."),
) -> None:
    """Predict the peak memory of one training step, the phase that sets it, and where it fits.

    Examples:

      memcalc estimate --params 7e9 --bf16 --lora

      memcalc estimate --model llama-3.1-8b --batch 2 --seq 4096 --qlora --checkpoint full --gpu rtx-4090

      memcalc estimate --model llama-3.1-8b --qlora --checkpoint full --gpu rtx-4090 --max-batch --max-seq

      memcalc estimate --model llama-3.1-8b --lora --framework torchtune --torch 2.9

      memcalc estimate --config control --json

      memcalc estimate --recipe 8B_lora_single_device.yaml --gpu rtx-4090
    """
    from memcalc.estimate.peak import estimate as run_estimate
    from memcalc.inputs.gpus import get_gpu, list_gpus
    from memcalc.inputs.resolve import resolve
    from memcalc.render.report import dumps, render, to_json

    _check_output(html, "--html")
    if check and not gpu:
        raise UserError("--check compares the estimate with a card: give --gpu (e.g. --gpu rtx-4090 or --gpu 24GB)")
    res = resolve(_options(
        model=model, params=params, config=config, batch=batch, seq=seq, grad_accum=grad_accum,
        precision=precision, bf16=bf16, master_weights=master_weights, optimizer=optimizer,
        optimizer_impl=optimizer_impl, checkpoint=checkpoint, fused_optimizer=fused_optimizer,
        compile=compile, memory_budget=memory_budget, lora=lora, lora_rank=lora_rank, lora_alpha=lora_alpha,
        lora_targets=lora_targets, lora_dropout=lora_dropout, qlora=qlora, lora_dtype=lora_dtype, profile=profile,
        framework=framework, torch=torch,
        zero=zero, gpus=gpus, offload_optimizer=offload_optimizer, loss=loss, loss_chunks=loss_chunks,
        sharding=sharding, tp=tp, sequence_parallel=sequence_parallel, activation_offload=activation_offload, dora=dora,
        recipe=recipe or None, adapter_config=adapter_config,
        deepspeed=deepspeed,
    ))
    cards = [get_gpu(g) for g in gpu] if gpu else list_gpus()
    limits = None
    if max_batch or max_seq:
        from memcalc.plan.limits import check_one_gpu, estimate_limits

        limit_gpu = check_one_gpu(gpu, "--max-batch" if max_batch else "--max-seq")
    est = run_estimate(res.exp)
    if max_batch or max_seq:
        limits = estimate_limits(res.exp, limit_gpu, max_batch, max_seq)
    if html is not None:
        from memcalc.render.html import estimate_html, write_report

        write_report(html, estimate_html(est, res, cards))
    if as_json:
        doc = to_json(est, res, cards)
        if res.recipe is not None:
            doc["recipe"] = res.recipe
        if limits:
            doc.update({k: limits[k] for k in ("max_batch", "max_seq") if k in limits}, limits=limits)
        typer.echo(dumps(doc))
    else:
        render(est, res, cards)
        if limits:
            from memcalc.render.plan_report import render_limits

            render_limits(limits, limit_gpu, res.exp.model)
        if timeline:
            from rich.console import Console

            from memcalc.render.chart import timeline_chart

            con = Console()
            con.print(timeline_chart(est, cards[0].capacity_bytes if len(cards) == 1 else None, width=min(con.width, 120)))
    if check:
        return _check_fits(est, cards)


def _check_fits(est: Any, cards: list) -> int:
    """``estimate --check``: 3 (and one warning line per card) when a card is too small, else 0."""
    from memcalc.core.units import fmt_bytes

    reserved = est.extra.get("reserved_peak_bytes")
    short = []
    for g in cards:
        if est.required_bytes > g.capacity_bytes:
            short.append(f"{g.name}: needs {fmt_bytes(est.required_bytes)} (peak + CUDA context + allocator slack), "
                         f"has {fmt_bytes(g.capacity_bytes)}")
        elif reserved is not None and reserved > g.capacity_bytes:
            short.append(f"{g.name}: the caching allocator's replayed reserved peak {fmt_bytes(reserved)} "
                         f"exceeds its {fmt_bytes(g.capacity_bytes)}")
    for line in short:
        sys.stderr.write(f"memcalc: warning: does not fit {line}\n")
    return 3 if short else 0


@app.command()
def plan(
    model: Optional[str] = MODEL, params: Optional[str] = PARAMS,
    gpu: Optional[str] = typer.Option(None, "--gpu", help="Plan for this GPU (see `memcalc gpus`, or a capacity such as 48GiB or 24GB): every technique combination that fits it. Without --gpu: for every catalog GPU, how many a full fine-tune and a LoRA run need."),
    seq: Optional[int] = typer.Option(None, "--seq", "-s", help="Sequence length (default 2048, or the model's maximum if smaller)."),
    profile: Optional[str] = PROFILE, framework: Optional[FrameworkOpt] = FRAMEWORK, torch: Optional[str] = TORCH,
    loss: Optional[LossOpt] = LOSS, loss_chunks: Optional[int] = LOSS_CHUNKS,
    recipe: Optional[List[str]] = RECIPE, adapter_config: Optional[str] = ADAPTER_CONFIG,
    show_all: bool = typer.Option(False, "--all", help="With --gpu: also list the combinations that do not fit."),
    compile_: bool = typer.Option(False, "--compile", help="With --gpu: also try torch.compile at activation memory budgets 1.0, 0.5 and 0.1 (full fine-tune, LoRA, QLoRA; direct estimates, slower)."),
    as_json: bool = JSON,
) -> None:
    """Which GPU, how many, and with which memory techniques (precision, optimizer, checkpointing, LoRA/QLoRA, fused step).

    Examples:

      memcalc plan --model llama-3.1-8b --gpu rtx-4090

      memcalc plan --model llama-3.1-8b --gpu rtx-4090 --seq 4096 --all --json

      memcalc plan --model tinyllama-1.1b --gpu rtx-4090 --compile

      memcalc plan --model llama-3.1-70b
    """
    from memcalc.inputs.gpus import get_gpu
    from memcalc.inputs.profiles import plan_profile
    from memcalc.plan.cluster import plan_cluster
    from memcalc.plan.options import plan_model
    from memcalc.plan.search import plan_gpu
    from memcalc.render.plan_report import cluster_plan_json, gpu_plan_json, render_cluster_plan, render_gpu_plan
    from memcalc.render.report import dumps

    rec = None
    if recipe or adapter_config:  # the recipe's model, sequence, framework and loss; plan searches the rest
        from memcalc.inputs.recipes import load_recipe

        rec = load_recipe(recipe or [], adapter_config)
        v = rec.values
        if model is None and params is None:
            model = v.get("model")
        seq = seq if seq is not None else v.get("seq")
        if profile is None and framework is None and "framework" in v:
            framework = FrameworkOpt(v["framework"])
        if loss is None and loss_chunks is None and "loss" in v:
            loss, loss_chunks = LossOpt(v["loss"]), v.get("loss_chunks")
    m, notes = plan_model(model, params)
    if rec is not None:
        notes[:0] = rec.lines() + ["recipe: plan takes the model, sequence length, framework and loss from it and "
                                   "searches the rest (batch, precision, optimizer, checkpointing, LoRA/QLoRA); "
                                   "`memcalc estimate --recipe` gives the recipe's own setup"]
    # the same default as estimate's for --model/--params: Hugging Face transformers + PEFT
    prof, note = plan_profile(profile, framework.value if framework else None, torch,
                              loss.value if loss else None, loss_chunks)
    notes.append(note)
    if gpu is None:
        if show_all:
            raise UserError("--all lists the combinations that do not fit one GPU; give --gpu too")
        if compile_:
            raise UserError("--compile adds torch.compile options to the plan for one GPU; give --gpu too")
        cp = plan_cluster(m, seq, prof)
        cp.notes[:0] = notes
        if as_json:
            typer.echo(dumps({**cluster_plan_json(cp), **({"recipe": rec.as_json()} if rec else {})}))
        else:
            render_cluster_plan(cp)
        return
    options = None
    if compile_:
        from memcalc.plan.options import compile_techniques, techniques

        options = techniques() + compile_techniques()
    gp = plan_gpu(m, get_gpu(gpu), seq, prof, include_all=show_all, options=options)
    gp.notes[:0] = notes
    if as_json:
        typer.echo(dumps({**gpu_plan_json(gp), **({"recipe": rec.as_json()} if rec else {})}))
    else:
        render_gpu_plan(gp)


@app.command()
def models(as_json: bool = JSON) -> None:
    """List the model presets with their Hugging Face ids, shapes and parameter counts.

    `--model ORG/NAME` with a listed Hugging Face id picks that preset.
    """
    from rich.console import Console
    from rich.table import Table

    from memcalc.inputs.presets import list_presets, preset_summary
    from memcalc.render.report import dumps

    rows = [preset_summary(name) for name in list_presets()]
    if as_json:
        typer.echo(dumps(rows))
        return
    t = Table(title="Model presets (--json adds d_ff, vocabulary, max sequence, exact counts)", **_compact())
    for col in ("name", "params", "layers", "d_model", "heads/kv"):
        t.add_column(col, justify="left" if col == "name" else "right", no_wrap=True)
    t.add_column("Hugging Face id (--model ORG/NAME)", overflow="fold")
    for r in rows:
        t.add_row(r["name"], f"{r['params'] / 1e9:,.2f}B", str(r["n_layers"]), str(r["d_model"]),
                  f"{r['n_heads']}/{r['n_kv_heads']}", r["hf_id"] or "-")
    Console().print(t)


@app.command()
def configs(as_json: bool = JSON) -> None:
    """List the shipped reference configs and their published peaks."""
    from rich.console import Console
    from rich.table import Table

    from memcalc.inputs.configs import list_configs, load_config
    from memcalc.render.report import dumps

    rows = []
    for name in list_configs():
        e = load_config(name)
        tr = e.training
        rows.append({"name": name, "description": e.description, "precision": tr.precision,
                     "checkpoint": tr.checkpoint, "fused_optimizer": tr.fused_optimizer, "compile": tr.compile,
                     "memory_budget": tr.memory_budget, "published_peak_bytes": e.published_peak_bytes})
    if as_json:
        typer.echo(dumps(rows))
        return
    t = Table(title="Reference configs (Deep One 1.6B, batch 4 x 768, Adafactor, RTX 4090, PyTorch 2.8)", **_compact())
    for col in ("name", "precision", "checkpoint", "fused", "compile", "published GiB"):
        t.add_column(col, no_wrap=col != "published GiB")
    for r in rows:
        comp = "-" if not r["compile"] else ("yes" if r["memory_budget"] is None else f"budget {r['memory_budget']}")
        t.add_row(r["name"], r["precision"], r["checkpoint"], "yes" if r["fused_optimizer"] else "-", comp,
                  f"{gib(r['published_peak_bytes']):.3f}")
    Console().print(t)


@app.command()
def gpus(as_json: bool = JSON) -> None:
    """List the GPU catalog (capacities in bytes; GiB = 2**30)."""
    from rich.console import Console
    from rich.table import Table

    from memcalc.inputs.gpus import list_gpus
    from memcalc.render.report import dumps

    gs = list_gpus()
    if as_json:
        typer.echo(dumps([g.model_dump() for g in gs]))
        return
    t = Table(title="GPU catalog", **_compact())
    for col in ("name", "GPU", "memory GiB", "bytes"):
        t.add_column(col, justify="left" if col in ("name", "GPU") else "right", no_wrap=col != "GPU")
    for g in gs:
        t.add_row(g.name, getattr(g, "display_name", g.name), f"{gib(g.capacity_bytes):.2f}", f"{g.capacity_bytes:,}")
    Console().print(t)


@app.command()
def profiles(as_json: bool = JSON) -> None:
    """List the kernel profiles (what each PyTorch version and framework saves)."""
    from rich.console import Console
    from rich.table import Table

    from memcalc.inputs.profiles import PROFILES
    from memcalc.render.report import dumps

    if as_json:
        typer.echo(dumps([p.model_dump() for p in PROFILES.values()]))
        return
    t = Table(title="Kernel profiles (--framework/--torch build any pair; --json: every field)", **_compact())
    for col in ("name", "RMSNorm", "loss", "LoRA", "K/V"):
        t.add_column(col, no_wrap=True)
    for p in PROFILES.values():
        loss = ("chunked" if p.cross_entropy == "chunked" else "full") + (" fp32" if p.logits_fp32 else "")
        lora = p.lora_dtype + ("+cast" if p.lora_input_cast else "")
        t.add_row(p.name, p.rmsnorm, loss, lora, "grouped" if p.sdpa_gqa else "copies")
    Console().print(t)


@app.command()
def validate(
    config: Optional[List[str]] = typer.Option(None, "--config", "-c", help="Reference config name or file (repeatable)."),
    all_configs: bool = typer.Option(False, "--all", help="Every shipped reference config."),
    model: Optional[str] = MODEL, params: Optional[str] = PARAMS,
    batch: Optional[int] = BATCH, seq: Optional[int] = SEQ, grad_accum: Optional[int] = ACCUM,
    precision: Optional[PrecisionOpt] = PRECISION, bf16: bool = BF16, master_weights: bool = MASTER,
    optimizer: Optional[OptimizerOpt] = OPTIMIZER, optimizer_impl: Optional[ImplOpt] = IMPL,
    checkpoint: Optional[str] = CHECKPOINT, fused_optimizer: bool = FUSED, compile: bool = COMPILE,
    memory_budget: Optional[float] = BUDGET, lora: bool = LORA, lora_rank: Optional[int] = LORA_RANK,
    lora_alpha: Optional[float] = LORA_ALPHA, lora_targets: Optional[str] = LORA_TARGETS,
    lora_dropout: Optional[float] = LORA_DROPOUT, qlora: bool = QLORA, profile: Optional[str] = PROFILE,
    loss: Optional[LossOpt] = LOSS, loss_chunks: Optional[int] = LOSS_CHUNKS,
    recipe: Optional[List[str]] = RECIPE, adapter_config: Optional[str] = ADAPTER_CONFIG,
    deepspeed: Optional[str] = DEEPSPEED,
    tp: Optional[int] = TP, sequence_parallel: bool = SEQ_PARALLEL,
    device: Optional[str] = typer.Option(None, "--device", help="cuda | meta | cpu (default: cuda when available, else meta)."),
    scale_layers: Optional[int] = typer.Option(None, "--scale-layers", help="Trace with only this many layers (quick runs)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write records to this JSON file as each one finishes."),
    snapshot: Optional[str] = typer.Option(None, "--snapshot", help="CUDA only: write a memory snapshot (memory_viz) here."),
    as_json: bool = JSON,
    activation_offload: bool = ACT_OFFLOAD, dora: bool = DORA,
    html: Optional[str] = typer.Option(None, "--html", help="Also write a self-contained HTML report (predicted vs measured) to this file."),
    framework: Optional[FrameworkOpt] = typer.Option(
        None, "--framework",
        help="Whose step is traced, and whose rules the estimate beside it uses: plain (memcalc's PyTorch replica "
             "of the model) or hf (the real transformers + PEFT step: AutoModelForCausalLM.from_config, "
             "get_peft_model, only kernel dispatch patched). Default: as for estimate, plain for a --config, "
             "hf for --model and --params."),
    reentrant: bool = typer.Option(
        False, "--reentrant",
        help="With --framework hf and --checkpoint: use_reentrant=True (HF Trainer's default is False)."),
    gpus: Optional[int] = typer.Option(
        None, "--gpus",
        help="Trace one rank of N GPUs (with --zero 2|3): the sharded step runs in one process on PyTorch's fake "
             "process group, fake tensors (--device meta or cpu; nothing is allocated); memcalc's replica unless "
             "--framework hf (FSDP2 only)."),
    zero: Optional[int] = typer.Option(
        None, "--zero", help="With --gpus: 3 reshards parameters after forward (FSDP2 reshard_after_forward=True, "
                             "FSDP1 FULL_SHARD), 2 keeps them until backward (False, SHARD_GRAD_OP)."),
    sharding: Optional[str] = typer.Option(
        None, "--sharding", help="With --gpus: fsdp2 (default; fully_shard per layer and root), fsdp1 "
                                 "(FullyShardedDataParallel, one unit per layer) or deepspeed (ZeRO-2/3 with "
                                 "DeepSpeed's defaults, or the buckets of --deepspeed)."),
    rank: Optional[int] = typer.Option(None, "--rank", help="With --gpus: which rank to trace (default 0)."),
) -> None:
    """Run the real training step (CUDA) or trace it on the meta device, and compare with the estimate.

    Examples:

      memcalc validate --config fused --device meta

      memcalc validate --all --device meta --output results.json

      memcalc validate --model llama-2-7b --batch 2 --seq 1024 --bf16 --checkpoint full --device meta --scale-layers 4

      memcalc validate --framework hf --model mistral-7b --bf16 --lora --device meta --scale-layers 2

      memcalc validate --model tinyllama-1.1b --deepspeed ds_config.json --gpus 8 --seq 512 --scale-layers 2

      memcalc validate --framework plain --model llama-2-7b --bf16 --master-weights --gpus 8 --zero 3 --scale-layers 2

      memcalc validate --model llama-3.1-8b --bf16 --tp 4 --sequence-parallel --device meta --scale-layers 2
    """
    from memcalc.inputs.configs import list_configs
    from memcalc.inputs.resolve import resolve

    if device is not None and device not in ("cuda", "meta", "cpu"):
        raise UserError(f"unknown --device {device!r}; valid: cuda, meta, cpu")
    if framework is not None and framework.value not in ("plain", "hf"):
        raise UserError(f"--framework {framework.value}: validate traces plain (memcalc's replica) or hf "
                        "(transformers + PEFT); estimate models torchtune and litgpt from their sources")
    if scale_layers is not None and scale_layers <= 0:
        raise UserError(f"--scale-layers must be positive, got {scale_layers}")
    if scale_layers is not None and scale_layers > MAX_LAYERS:
        raise UserError(f"--scale-layers {scale_layers:,} is more than {MAX_LAYERS:,}, the most layers a model may have")
    for path, flag in ((output, "--output"), (html, "--html"), (snapshot, "--snapshot")):
        _check_output(path, flag)
    _check_sharded_flags(gpus, zero, sharding, rank)
    if gpus is not None and gpus > 1:
        if device == "cuda":
            raise UserError(f"--gpus {gpus} --device cuda: validate runs one process and cannot measure {gpus} ranks "
                            "on CUDA; trace one rank with --device meta")
        if framework is None:  # the sharded trace builds the replica unless --framework hf (FSDP2 only) is given
            framework = FrameworkOpt("plain")
    from memcalc.validate.interrupt import StopRequested, stoppable, stopped  # torch-free

    with stoppable():  # importing torch takes seconds: a signal then stops cleanly too
        try:
            from memcalc.validate.command import run_validate
        except ImportError as e:  # torch missing
            raise UserError(f"validate needs torch: pip install 'memcalc[validate]' ({e})") from None
        except StopRequested as e:
            stopped(e)
            sys.stderr.write(f"memcalc validate: stopped by {e} before any config ran\n")
            sys.stdout.write("[]\n" if as_json else "")
            raise SystemExit(e.exit_code) from None
    names = list(config or [])
    if all_configs:
        names += [n for n in list_configs() if n not in names]
    common = dict(
        activation_offload=activation_offload, dora=dora,
        model=model, params=params, batch=batch, seq=seq, grad_accum=grad_accum, precision=precision, bf16=bf16,
        master_weights=master_weights, optimizer=optimizer, optimizer_impl=optimizer_impl, checkpoint=checkpoint,
        fused_optimizer=fused_optimizer, compile=compile, memory_budget=memory_budget, lora=lora,
        lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets, lora_dropout=lora_dropout,
        qlora=qlora, profile=profile, loss=loss, loss_chunks=loss_chunks, framework=framework,
        recipe=recipe or None, adapter_config=adapter_config,
        zero=zero, gpus=gpus, sharding=sharding, deepspeed=deepspeed,
    )
    common.update(tp=tp, sequence_parallel=sequence_parallel)  # traced on the fake process group (validate/sharded/tp.py)
    items: list = []
    if names:
        for n in names:
            try:
                items.append((n, resolve(_options(config=n, **common)).exp))
            except UserError as e:  # one of several configs: its record says why, the others still run
                if len(names) == 1:
                    raise
                items.append((n, e))
    else:
        items.append((None, resolve(_options(**common)).exp))
    items = [(n or e.name, e) for n, e in items]
    traced = {e.profile.framework for _, e in items if not isinstance(e, UserError)} or {"plain"}
    if not traced <= {"plain", "hf"} or len(traced) > 1:
        raise UserError(f"validate traces one framework per run, plain or hf; these experiments use "
                        f"{', '.join(sorted(traced))}: pass --framework plain or --framework hf")
    if "hf" in traced and any(not isinstance(e, UserError) and e.training.tp > 1 for _, e in items):
        raise UserError("--tp traces memcalc's replica under torchtitan's plan: pass --framework plain")
    records = run_validate(items, device, as_json, output, scale_layers, snapshot, framework=traced.pop(),
                           reentrant=reentrant, rank=rank or 0)
    if html is not None:
        from memcalc.estimate.peak import estimate as run_estimate
        from memcalc.render.html import validate_html, write_report

        # the estimates' timelines are of the full model: left out when tracing fewer layers
        ests = {n: run_estimate(e) for n, e in items if not isinstance(e, Exception)} if scale_layers is None else None
        write_report(html, validate_html(list(records or []), ests))


def _check_sharded_flags(gpus: Optional[int], zero: Optional[int], sharding: Optional[str],
                         rank: Optional[int]) -> None:
    """validate's sharded flags go together: --gpus N (N >= 2) with --zero 2 or 3."""
    from memcalc.core.spec import SHARDINGS

    if sharding is not None and sharding not in SHARDINGS:
        raise UserError(f"unknown --sharding {sharding!r}; valid: {', '.join(SHARDINGS)}")
    if sharding == "deepspeed":
        raise UserError("--sharding deepspeed: validate traces fsdp2 and fsdp1 here; DeepSpeed ZeRO needs the "
                        "DeepSpeed tracer (issue 13), not in this build")
    if gpus is None or gpus == 1:
        given = [f"{f} {v}" for f, v in (("--zero", zero or None), ("--sharding", sharding), ("--rank", rank))
                 if v is not None]
        if given:
            raise UserError(f"{' '.join(given)} needs --gpus N (N >= 2): validate traces one rank of a sharded step; "
                            "add it, with --zero 2 or 3")
        return
    if gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus}")
    if zero not in (2, 3):
        raise UserError(f"--gpus {gpus} needs --zero 2 or 3 for validate (got {'none' if zero is None else zero}): "
                        "it traces one rank of an FSDP step; data parallel without sharding is one GPU's step")
    if rank is not None and not 0 <= rank < gpus:
        raise UserError(f"--rank {rank} is not a rank of --gpus {gpus} (valid: 0..{gpus - 1})")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

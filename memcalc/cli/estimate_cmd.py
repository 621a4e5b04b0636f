"""``memcalc estimate``: the peak of one training step, its phase, and the GPUs it fits.

Loads what it prints: ``--json`` never imports rich, and the tables import it only to render.
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional

import typer

from memcalc.cli.group import app
from memcalc.cli.options import (ACCUM, ACT_OFFLOAD, ADAPTER_CONFIG, BATCH, BF16, BUDGET, CHECKPOINT, COMPILE, CONFIG,
                                 DEEPSPEED, DORA, FRAMEWORK, FUSED, GPUS, IMPL, JSON, LORA, LORA_ALPHA, LORA_DROPOUT,
                                 LORA_DTYPE, LORA_RANK, LORA_TARGETS, LOSS, LOSS_CHUNKS, MASTER, MODEL, OFFLOAD,
                                 OPTIMIZER, PARAMS, PRECISION, PROFILE, QLORA, RECIPE, SEQ, SEQ_PARALLEL, SHARDING, TORCH,
                                 TP, ZERO, FrameworkOpt, ImplOpt, LoraDtypeOpt, LossOpt, OptimizerOpt, PrecisionOpt,
                                 _check_output, _options)
from memcalc.core.errors import UserError


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
        from memcalc.render.report import dumps, to_json

        doc = to_json(est, res, cards)
        if res.recipe is not None:
            doc["recipe"] = res.recipe
        if limits:
            doc.update({k: limits[k] for k in ("max_batch", "max_seq") if k in limits}, limits=limits)
        typer.echo(dumps(doc))
    else:
        from memcalc.render.report import render

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


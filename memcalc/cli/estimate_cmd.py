"""``memcalc estimate``: the peak of one training step, its phase, and the GPUs it fits.

Loads what it prints: ``--json`` never imports rich, and the tables import it only to render.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import click

from memcalc.cli.group import app
from memcalc.cli.options import (ACCUM, ACT_OFFLOAD, ADAPTER_CONFIG, BATCH, BF16, BUDGET, CHECKPOINT, COMPILE, CONFIG,
                                 DEEPSPEED, DORA, FRAMEWORK, FUSED, GPUS, IMPL, JSON, LORA, LORA_ALPHA, LORA_DROPOUT,
                                 LORA_DTYPE, LORA_RANK, LORA_TARGETS, LOSS, LOSS_CHUNKS, MASTER, MODEL, OFFLOAD,
                                 OPTIMIZER, PARAMS, PRECISION, PROFILE, QLORA, RECIPE, SEQ, SEQ_PARALLEL, SHARDING, TORCH,
                                 TP, ZERO, _check_output, _options, with_options)
from memcalc.core.errors import UserError


@app.command()
@with_options(
    MODEL, PARAMS, CONFIG, BATCH, SEQ, ACCUM, PRECISION, BF16, MASTER, OPTIMIZER, IMPL, CHECKPOINT, FUSED, COMPILE,
    BUDGET, LORA, LORA_RANK, LORA_ALPHA, LORA_TARGETS, LORA_DROPOUT, QLORA, LORA_DTYPE, PROFILE, FRAMEWORK, TORCH,
    ZERO, GPUS, OFFLOAD, SHARDING, TP, SEQ_PARALLEL, ACT_OFFLOAD, DORA, DEEPSPEED, LOSS, LOSS_CHUNKS, RECIPE,
    ADAPTER_CONFIG,
    click.option("--gpu", multiple=True, help="Only these GPUs in the fits table (repeatable; see `memcalc gpus`), or a capacity: 48GiB (2**30 bytes each), 24GB (10**9)."),
    JSON,
    click.option("--timeline", is_flag=True, help="Also draw memory across the step (after the tables; ignored with --json)."),
    click.option("--html", help="Also write a self-contained HTML report to this file."),
    click.option("--max-batch", is_flag=True, help="Also find the largest batch (at --seq) that fits the one --gpu (exact: binary search over estimates)."),
    click.option("--max-seq", is_flag=True, help="Also find the longest sequence (at --batch) that fits the one --gpu, up to the model's maximum."),
    click.option("--check", is_flag=True, help="With --gpu: exit 3, with a warning on stderr, when the step needs more memory than a --gpu card has (or the caching allocator's replayed reserved peak exceeds it)."),
)
def estimate(gpu: tuple[str, ...], as_json: bool, timeline: bool, html: Optional[str], max_batch: bool, max_seq: bool,
             check: bool, **inputs: Any) -> Optional[int]:
    """Predict the peak memory of one training step, the phase that sets it, and where it fits.

    Examples:

    \b
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
    res = resolve(_options(**inputs))  # every other option is an input of the experiment
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
        click.echo(dumps(doc))
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


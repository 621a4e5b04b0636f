"""``memcalc plan``: which GPU, how many, and with which memory techniques."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from memcalc.cli.group import app
from memcalc.cli.options import (AdapterConfig, Framework, Json, Kernels, Loss, LossChunks, LossTokens, Model, Params,
                                 Profile, Recipe, Seq, Torch)


#: The variables that size the BLAS and OpenMP thread pools numpy starts with.
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _one_blas_thread() -> None:
    """One BLAS thread for the plan (unless the user set the variables, or numpy is loaded already):
    its matrices are a few rows by a few thousand, while an idle BLAS thread pool spins on the CPUs
    the plan's worker processes simulate on (about 0.5 s of CPU and 0.1-0.2 s of wall time on a
    2-core machine, benchmarks/bench_speed.py)."""
    import os
    import sys

    if "numpy" not in sys.modules:
        for var in BLAS_THREAD_VARS:
            os.environ.setdefault(var, "1")


@app.command()
def plan(
    model: Model = None, params: Params = None,
    gpu: Annotated[Optional[str], typer.Option(
        "--gpu", help="Plan for this GPU (see `memcalc gpus`, or a capacity such as 48GiB or 24GB): every "
                      "technique combination that fits it. Without --gpu: for every catalog GPU, how many a full "
                      "fine-tune and a LoRA run need.")] = None,
    seq: Seq = None, profile: Profile = None, framework: Framework = None, torch: Torch = None, loss: Loss = None,
    loss_chunks: LossChunks = None, loss_tokens: LossTokens = None, kernels: Kernels = None, recipe: Recipe = None,
    adapter_config: AdapterConfig = None,
    show_all: Annotated[bool, typer.Option(
        "--all", help="With --gpu: also list the combinations that do not fit.")] = False,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="With --gpu: also try torch.compile at activation memory budgets 1.0, 0.5 and 0.1 (full "
                          "fine-tune, LoRA, QLoRA; direct estimates, slower).")] = False,
    lora: Annotated[bool, typer.Option("--lora", help="With --gpu: only LoRA runs (combine with --qlora/--full for "
                                                      "several kinds).")] = False,
    qlora: Annotated[bool, typer.Option("--qlora", help="With --gpu: only QLoRA runs.")] = False,
    full: Annotated[bool, typer.Option("--full", help="With --gpu: only full fine-tunes.")] = False,
    as_json: Json = False,
) -> None:
    """Which GPU, how many, and with which memory techniques (precision, optimizer, checkpointing, LoRA/QLoRA, fused step).

    Examples:

    \b
      memcalc plan --model llama-3.1-8b --gpu rtx-4090
      memcalc plan --model llama-3.1-8b --gpu rtx-4090 --seq 4096 --all --json
      memcalc plan --model tinyllama-1.1b --gpu rtx-4090 --compile
      memcalc plan --model llama-3.1-8b --gpu rtx-4090 --qlora --seq 4k
      memcalc plan --model llama-3.1-70b
    """
    _one_blas_thread()
    import memcalc.api

    p = memcalc.api.plan(model, params, gpu=gpu, seq=seq, profile=profile, framework=framework, torch=torch, loss=loss,
                         loss_chunks=loss_chunks, loss_tokens=loss_tokens, all=show_all, compile=compile_,
                         recipe=recipe or None,
                         adapter_config=adapter_config, kernels=kernels, lora=lora, qlora=qlora, full=full)
    if as_json:
        from memcalc.render.report import dumps

        typer.echo(dumps(p.document()))
    elif p.gpu_plan:
        from memcalc.render.plan_report import render_gpu_plan

        render_gpu_plan(p.raw)
    else:
        from memcalc.render.plan_report import render_cluster_plan

        render_cluster_plan(p.raw)

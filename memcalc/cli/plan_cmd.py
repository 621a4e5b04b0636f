"""``memcalc plan``: which GPU, how many, and with which memory techniques."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from memcalc.cli.group import app
from memcalc.cli.options import (AdapterConfig, Framework, Json, Loss, LossChunks, Model, Params, Profile, Recipe, Seq,
                                 Torch)


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
    loss_chunks: LossChunks = None, recipe: Recipe = None, adapter_config: AdapterConfig = None,
    show_all: Annotated[bool, typer.Option(
        "--all", help="With --gpu: also list the combinations that do not fit.")] = False,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="With --gpu: also try torch.compile at activation memory budgets 1.0, 0.5 and 0.1 (full "
                          "fine-tune, LoRA, QLoRA; direct estimates, slower).")] = False,
    as_json: Json = False,
) -> None:
    """Which GPU, how many, and with which memory techniques (precision, optimizer, checkpointing, LoRA/QLoRA, fused step).

    Examples:

    \b
      memcalc plan --model llama-3.1-8b --gpu rtx-4090
      memcalc plan --model llama-3.1-8b --gpu rtx-4090 --seq 4096 --all --json
      memcalc plan --model tinyllama-1.1b --gpu rtx-4090 --compile
      memcalc plan --model llama-3.1-70b
    """
    _one_blas_thread()
    from memcalc.inputs.gpus import get_gpu
    from memcalc.inputs.profiles import plan_profile
    from memcalc.plan.cluster import plan_cluster
    from memcalc.plan.options import check_one_gpu_flags, plan_model
    from memcalc.plan.search import plan_gpu
    from memcalc.render.plan_report import cluster_plan_json, gpu_plan_json, render_cluster_plan, render_gpu_plan
    from memcalc.render.report import dumps

    rec = None
    if recipe or adapter_config:  # the recipe's model, sequence, framework and loss; plan searches the rest
        from memcalc.inputs.recipes import load_recipe

        rec = load_recipe(list(recipe or ()), adapter_config)
        v = rec.values
        if model is None and params is None:
            model = v.get("model")
        seq = seq if seq is not None else v.get("seq")
        if profile is None and framework is None and "framework" in v:
            framework = v["framework"]
        if loss is None and loss_chunks is None and "loss" in v:
            loss, loss_chunks = v["loss"], v.get("loss_chunks")
    m, notes = plan_model(model, params)
    if rec is not None:
        notes[:0] = rec.lines() + ["recipe: plan takes the model, sequence length, framework and loss from it and "
                                   "searches the rest (batch, precision, optimizer, checkpointing, LoRA/QLoRA); "
                                   "`memcalc estimate --recipe` gives the recipe's own setup"]
    # the same default as estimate's for --model/--params: Hugging Face transformers + PEFT
    prof, note = plan_profile(profile, framework, torch, loss, loss_chunks)
    notes.append(note)
    check_one_gpu_flags(gpu, show_all, compile_)
    if gpu is None:
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

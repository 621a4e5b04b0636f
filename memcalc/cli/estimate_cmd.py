"""``memcalc estimate``: the peak of one training step, its phase, and the GPUs it fits.

Loads what it prints: ``--json`` never imports rich, and the tables import it only to render.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Optional

import typer

from memcalc.cli.group import app
from memcalc.cli.options import (Reentrant, GaloreRank, Quant, ActivationOffload, AdapterConfig, Batch, Bf16,
                                 Checkpoint, Compile,
                                 CompileScope, Config, Deepspeed,
                                 BnbSavesInput,
                                 Dora, Framework, FusedOptimizer, Gpus, GradAccum, Json, Kernels, Lora, LoraAlpha,
                                 ModulesToSave,
                                 LoraDropout,
                                 LoraDtype, LoraRank, LoraTargets, Loss, LossChunks, LossTokens, MasterWeights,
                                 MemoryBudget, Model,
                                 OffloadOptimizer, Optimizer, OptimizerImpl, Params, Precision, Profile, Qlora, Recipe,
                                 Seq, Ep, EpCapacityFactor, Cp, CpMethod, SequenceParallel, Sharding, Torch, Tp, Zero,
                                 _check_output, Force,
                                 Pp, PpSchedule, PpStagesPerRank, PpFirstLess, PpLastLess,
                                 Microbatches, FirstSeq, NoDoubleQuant,
                                 inputs_of)
from memcalc.core.errors import UserError


@app.command()
def estimate(
    model: Model = None, params: Params = None, config: Config = None, batch: Batch = None, seq: Seq = None,
    grad_accum: GradAccum = None, precision: Precision = None, bf16: Bf16 = False,
    master_weights: MasterWeights = False,
    optimizer: Optimizer = None, optimizer_impl: OptimizerImpl = None,
    galore_rank: GaloreRank = None, checkpoint: Checkpoint = None, reentrant: Reentrant = False,
    fused_optimizer: FusedOptimizer = False, compile: Compile = False, memory_budget: MemoryBudget = None,
    compile_scope: CompileScope = None,
    lora: Lora = False, lora_rank: LoraRank = None, lora_alpha: LoraAlpha = None, lora_targets: LoraTargets = None,
    lora_dropout: LoraDropout = None, qlora: Qlora = False,
    quant: Quant = None, lora_dtype: LoraDtype = None, profile: Profile = None,
    framework: Framework = None, torch: Torch = None, zero: Zero = None, gpus: Gpus = None,
    offload_optimizer: OffloadOptimizer = False, sharding: Sharding = None, tp: Tp = None,
    ep: Ep = None, ep_capacity_factor: EpCapacityFactor = None,
    cp: Cp = None, cp_method: CpMethod = None,
    sequence_parallel: SequenceParallel = False, activation_offload: ActivationOffload = False, dora: Dora = False,
    pp: Pp = None, pp_schedule: PpSchedule = None, microbatches: Microbatches = None,
    pp_stages_per_rank: PpStagesPerRank = None, pp_first_stage_less_layers: PpFirstLess = None,
    pp_last_stage_less_layers: PpLastLess = None,
    first_seq: FirstSeq = None,
    modules_to_save: ModulesToSave = None,
    bnb_saves_input: BnbSavesInput = False,
    no_double_quant: NoDoubleQuant = False,
    deepspeed: Deepspeed = None, loss: Loss = None, loss_chunks: LossChunks = None, loss_tokens: LossTokens = None,
    kernels: Kernels = None,
    recipe: Recipe = None,
    adapter_config: AdapterConfig = None,
    gpu: Annotated[Optional[list[str]], typer.Option(
        "--gpu", metavar="<str>", help="Only these GPUs in the fits table (repeatable; see `memcalc gpus`), or a "
                                       "capacity: 48GiB (2**30 bytes each), 24GB (10**9).")] = None,
    as_json: Json = False,
    timeline: Annotated[bool, typer.Option(
        "--timeline", help="Also draw memory across the step (after the tables; ignored with --json).")] = False,
    html: Annotated[Optional[str], typer.Option(
        "--html", help="Also write a self-contained HTML report to this file.")] = None,
    snapshot: Annotated[Optional[str], typer.Option(
        "--snapshot", metavar="FILE.pickle",
        help="Also write the predicted step as a PyTorch CUDA memory snapshot (what "
             "torch.cuda.memory._dump_snapshot writes: open it at pytorch.org/memory_viz, or hold it against "
             "a real run's), each allocation labelled with memcalc's kind, layer and name.")] = None,
    force: Force = False,
    max_batch: Annotated[bool, typer.Option(
        "--max-batch", help="Also find the largest batch (at --seq) that fits the one --gpu (exact: binary search "
                            "over estimates).")] = False,
    max_seq: Annotated[bool, typer.Option(
        "--max-seq", help="Also find the longest sequence (at --batch) that fits the one --gpu, up to the model's "
                          "maximum.")] = False,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Also print every input with where it came from (flag, config, default and why), "
                                "and the assumptions (all of it is always in --json).")] = False,
    check: Annotated[bool, typer.Option(
        "--check", help="With --gpu: exit 3, with a warning on stderr, when the step needs more memory than a "
                        "--gpu card has (or the caching allocator's replayed reserved peak exceeds it).")] = False,
) -> Optional[int]:
    """Predict the peak memory of one training step, the phase that sets it, and where it fits.

    Examples:

    \b
      memcalc estimate --params 7e9 --bf16 --lora
      memcalc estimate --model llama-3.1-8b --batch 2 --seq 4096 --qlora --checkpoint full --gpu rtx-4090
      memcalc estimate --model llama-3.1-8b --qlora --checkpoint full --gpu rtx-4090 --max-batch --max-seq
      memcalc estimate --model llama-3.1-8b --lora --framework torchtune --torch 2.9
      memcalc estimate --config control --json
      memcalc estimate --recipe examples/torchtune_llama3_1_8B_lora_single_device.yaml --gpu rtx-4090
    """
    inputs = inputs_of(locals(), _OWN)  # every other option is an input of the experiment
    import memcalc.api

    _check_output(html, "--html", force)
    _check_output(snapshot, "--snapshot", force)
    if check and not gpu:
        raise UserError("--check compares the estimate with a card: give --gpu (e.g. --gpu rtx-4090 or --gpu 24GB)")
    # the timeline is recorded only for what draws it (--timeline, --html): the tables and --json do not show it
    r = memcalc.api.estimate(gpu=gpu or None, max_batch=max_batch, max_seq=max_seq,
                             timeline=(timeline and not as_json) or html is not None, **inputs)
    cards = list(r.cards)
    if html is not None:
        from memcalc.render.html import estimate_html, write_report

        write_report(html, estimate_html(r.estimate, r.resolved, cards, bool(gpu), r.to_make_it_fit))
    written = None
    if snapshot is not None:
        from memcalc.snapshot.export import write_estimate_snapshot

        written = write_estimate_snapshot(r.estimate, snapshot)
    if as_json:
        from memcalc.render.report import dumps

        doc = r.document()
        if written is not None:
            doc["snapshot"] = written
        typer.echo(dumps(doc))
    else:
        _render(r, timeline, verbose, asked=bool(gpu))
        if written is not None:
            typer.echo(f"Snapshot: {snapshot} ({written['trace_entries']:,} allocator events of the {written['step']} "
                       "step; open it at https://pytorch.org/memory_viz)")
    if check:
        return _check_fits(r.estimate, cards)
    return None


def _render(r: Any, timeline: bool, verbose: bool, asked: bool) -> None:
    """The verdict first (and what would make it fit, and the limits asked for), then the tables (and
    with ``timeline`` the chart) of an estimate."""
    from memcalc.render.report import print_items, report_items
    from memcalc.render.verdict import verdict_items

    cards = list(r.cards)
    items = verdict_items(r.estimate, cards, asked, r.to_make_it_fit)
    if r.limits:
        from memcalc.render.plan_report import limits_lines

        items += limits_lines(r.limits, cards[0], r.resolved.exp.model)  # (the limits are for the one --gpu)
    print_items(items + report_items(r.estimate, r.resolved, cards, verbose))
    if timeline:
        from rich.console import Console

        from memcalc.render.chart import timeline_chart

        con = Console()
        con.print(timeline_chart(r.estimate, cards[0].capacity_bytes if len(cards) == 1 else None,
                                 width=min(con.width, 120)))


#: estimate's own options; the others are the experiment's inputs
_OWN = ("gpu", "as_json", "timeline", "html", "snapshot", "force", "max_batch", "max_seq", "check", "verbose")


def _check_fits(est: Any, cards: list) -> int:
    """``estimate --check``: 3 (and one warning line per card) when a card is too small, else 0."""
    from memcalc.core.units import fmt_bytes
    from memcalc.render.report import fits_rows

    short = []
    for row in fits_rows(est, cards):
        if not row["fits"]:
            short.append(f"{row['name']}: needs {fmt_bytes(row['device_total_bytes'])} (the device total: reserved + "
                         f"CUDA context + NCCL), has {fmt_bytes(row['capacity_bytes'])}")
    for line in short:
        sys.stderr.write(f"memcalc: warning: does not fit {line}\n")
    return 3 if short else 0


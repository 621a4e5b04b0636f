"""``memcalc plan`` and ``estimate --max-batch/--max-seq`` for people: tables and notes, and the
``--json`` documents of the plans (:mod:`memcalc.plan`).

Each report is a list of rich tables and lines of rich markup (``gpu_plan_items``,
``cluster_plan_items``, ``limits_lines``), printed like the estimate's report
(:func:`memcalc.render.report.print_items`), on ``console`` when one is given. rich is imported
only inside the functions.
"""

from __future__ import annotations

from typing import Any, Optional

from memcalc.core.pipeline import layers_text
from memcalc.core.spec import ModelSpec
from memcalc.core.units import fmt_bytes, fmt_count, gib
from memcalc.plan.cluster import GPU_CAP, SETUPS, ClusterPlan
from memcalc.plan.cost import COST_MODEL_LINES
from memcalc.plan.limits import BATCH_CAP
from memcalc.plan.options import LORA_RANK, techniques
from memcalc.plan.search import GpuPlan
from memcalc.render.report import left_table, print_items


def limits_lines(lim: dict[str, Any], gpu: Any, model: ModelSpec) -> list[str]:
    """``estimate --max-batch/--max-seq``'s lines of markup."""
    out = []
    name = getattr(gpu, "display_name", gpu.name)
    cap = fmt_bytes(lim["capacity_bytes"])
    if "max_batch" in lim:
        b = lim["max_batch"]
        if b == 0:
            out.append(f"[bold]max batch[/bold] at seq {lim['max_batch_seq']} on {name} ({cap}): [red]0[/red] "
                       "(batch 1 does not fit; see 'To make it fit' above)")
        else:
            nxt = lim["next_batch_required_bytes"]
            why = f"; batch {b + 1} needs {fmt_bytes(nxt)}" if nxt is not None else f" (the search stops at {BATCH_CAP:,})"
            out.append(f"[bold]max batch[/bold] at seq {lim['max_batch_seq']} on {name} ({cap}): [green]{b:,}[/green] "
                       f"(needs {fmt_bytes(lim['max_batch_required_bytes'])}{why})")
    if "max_seq" in lim:
        t = lim["max_seq"]
        if t == 0:
            out.append(f"[bold]max seq[/bold] at batch {lim['max_seq_batch']} on {name} ({cap}): [red]0[/red] "
                       "(not even 2 tokens fit)")
        else:
            nxt = lim["next_seq_required_bytes"]
            why = (f"; seq {t + 1} needs {fmt_bytes(nxt)}" if nxt is not None
                   else f"; {model.name}'s maximum sequence length")
            out.append(f"[bold]max seq[/bold] at batch {lim['max_seq_batch']} on {name} ({cap}): [green]{t:,}[/green] "
                       f"(needs {fmt_bytes(lim['max_seq_required_bytes'])}{why})")
    return out


def render_limits(lim: dict[str, Any], gpu: Any, model: ModelSpec, console=None) -> None:
    print_items(limits_lines(lim, gpu, model), console)


def gpu_plan_json(p: GpuPlan) -> dict[str, Any]:
    g = p.gpu
    return {
        "model": p.model.name,
        "gpu": {"name": g.name, "display_name": getattr(g, "display_name", g.name), "capacity_bytes": g.capacity_bytes},
        "seq": p.seq,
        "options": [o.as_dict(p.half) for o in p.options],
        "fitting": len(p.fitting),
        "evaluated_configurations": p.evaluated,
        "required_bytes_means": "the device total without an allocator replay: peak + the cuBLAS workspaces' "
                                "segments + CUDA context + NCCL (memcalc.core.gpu_side)",
        "cost_model": list(COST_MODEL_LINES),
        "notes": p.notes,
    }


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{gib(n):,.2f}"


def render_gpu_plan(p: GpuPlan, console=None) -> None:
    print_items(gpu_plan_items(p), console)


def gpu_plan_items(p: GpuPlan) -> list[Any]:
    """The one-GPU plan in order: its table (a caption under it), then lines of markup."""
    g = p.gpu
    n_all = p.considered or len(techniques())
    title = (f"{p.model.name} on {getattr(g, 'display_name', g.name)} ({fmt_bytes(g.capacity_bytes)}): "
             f"{len(p.fitting)} of {n_all} technique combinations fit at batch 1 x seq {p.seq}")
    t = left_table(title,
                   caption=f"peak, needs: GiB at batch 1 x seq {p.seq}; max batch at seq {p.seq}; max seq at batch 1; "
                           "cost: relative step time per token at the max batch (lower is better)",
                   caption_justify="left")
    for col in ("#", "option", "peak", "needs", "max batch", "max seq", "cost"):
        t.add_column(col, justify="left" if col == "option" else "right", no_wrap=col != "option")
    for k, o in enumerate(p.options, 1):
        style = None if o.fits else "dim"
        ms = f"{o.max_seq:,}" + (" (max)" if o.max_seq == p.model.max_seq_len else "")
        mb = f"{o.max_batch:,}" + ("+" if o.max_batch >= BATCH_CAP else "")
        t.add_row(str(k) if o.fits else "-", o.technique.label(p.half), _gib(o.peak_bytes), _gib(o.required_bytes),
                  mb if o.fits else "0", ms if o.max_seq else "0",
                  "-" if o.relative_cost is None else f"{o.relative_cost:.2f}", style=style)
    out: list[Any] = [t]
    for k, o in enumerate(p.fitting, 1):  # the estimate behind each numbered row gives its numbers
        if o.command:
            from rich.markup import escape

            out.append(f"[dim]#{k}:[/dim] {escape(o.command)}")
    if not p.fitting:
        out.append("[red]nothing fits[/red]: try a bigger GPU, fewer tokens (--seq), or `memcalc plan --model "
                   f"{p.model.name}` for a multi-GPU count")
    out.append(f"[dim]peak = allocated peak; needs = the estimate's device total: reserved (the allocator's replay) + "
               f"CUDA context + what the step loads (+ NCCL), what the row's command prints; max batch, max seq: with "
               f"reserved taken as allocated (no allocator replay per probe: the estimate there can need more); "
               f"LoRA/QLoRA: rank {LORA_RANK} on q,k,v,o; "
               f"numbers of fitting options confirmed by direct estimates (max seq capped at the model's "
               f"{p.model.max_seq_len:,})[/dim]")
    for line in COST_MODEL_LINES:
        out.append(f"[dim]cost model: {line}[/dim]")
    for n in p.notes:
        out.append(f"[yellow]note:[/yellow] {n}")
    return out


def cluster_plan_json(p: ClusterPlan) -> dict[str, Any]:
    return {"model": p.model.name, "params": p.params, "seq": p.seq, "sharding": p.sharding,
            "sharding_mechanics": p.sharding_text, "gpus": [r.as_dict() for r in p.rows], "notes": p.notes,
            "pipelines": [r.as_dict() for r in p.pipelines], "pipelines_note": p.pipelines_note,
            "experts": [r.as_dict() for r in p.experts], "experts_note": p.experts_note}


def render_cluster_plan(p: ClusterPlan, console=None) -> None:
    print_items(cluster_plan_items(p), console)


def cluster_plan_items(p: ClusterPlan) -> list[Any]:
    """The multi-GPU plan in order: its table, then lines of markup."""
    # SIMPLE_HEAD without edges or padding (its blank vertical rule is the one space between columns): twelve
    # columns fit 80 terminal columns
    from rich import box

    t = left_table(f"{p.model.name} ({fmt_count(p.params)} params): fewest GPUs at batch 1 x seq {p.seq} per GPU",
                   box=box.SIMPLE_HEAD, show_edge=False, padding=0, pad_edge=False)
    # (the next power of two of each count is in --json, min_gpus_*_pow2: thirteen columns would not fit 80)
    for col in ("GPU", "GiB", "full", "tp", "ckpt", "need", "LoRA", "ckpt", "need", "QLoRA", "ckpt", "need"):
        t.add_column(col, justify="left" if col in ("GPU", "ckpt") else "right", no_wrap=True)
    for r in p.rows:
        cells = [r.gpu.name, f"{gib(r.gpu.capacity_bytes):.1f}"]
        for s in SETUPS:
            n = r.min_gpus[s]
            cells += [f">{GPU_CAP}" if n is None else str(n)]
            if s == "full":  # the tensor-parallel degree of that count: dp = full / tp (plan/layouts.py)
                lay = r.layout.get(s)
                cells.append("-" if lay is None else f"cp{lay['cp']}" if "cp" in lay else str(lay["tp"]))
            cells += [r.checkpoint[s] or "-", "-" if r.required_bytes[s] is None else f"{gib(r.required_bytes[s]):.1f}"]
        t.add_row(*cells)
    out: list[Any] = [t, f"sharding assumed: ZeRO-3 by {p.sharding} (--sharding {p.sharding})"]
    out += _command_lines(p)
    out += [f"[dim]{n}[/dim]" for n in p.notes]
    return out + _pipeline_items(p) + _expert_items(p)


def _expert_items(p: ClusterPlan) -> list[Any]:
    """A mixture-of-experts model's expert-parallel layouts (memcalc.plan.experts): per card, the fewest GPUs
    and the per-rank peak; or why its experts cannot be sharded."""
    from rich import box
    from rich.markup import escape

    from memcalc.plan.experts import COUNTS, EP

    if p.experts_note is not None:
        return [f"[dim]expert-parallel layouts: none ({escape(p.experts_note)})[/dim]"]
    if not p.experts:
        return []
    t = left_table(f"{p.model.name}: expert parallel (ep {EP})", box=box.SIMPLE_HEAD,
                   show_edge=False, padding=0, pad_edge=False)
    for col in ("GPU", "GPUs", "ep", "peak", "need"):
        t.add_column(col, justify="left" if col == "GPU" else "right", no_wrap=True)
    for r in p.experts:
        lay = r.layout
        if lay is None:
            t.add_row(r.gpu.name, f">{COUNTS[-1]}", "-", "-", "-")
        else:
            t.add_row(r.gpu.name, str(lay.gpus), str(lay.ep), f"{gib(lay.peak_bytes):.1f}",
                      f"{gib(lay.required_bytes):.1f}")
    out: list[Any] = [t]
    row = next((r for r in p.experts if r.command), None)
    if row is not None:
        out.append(f"[dim]expert parallel ({row.gpu.name}'s row; --json has every row's command): "
                   f"{escape(str(row.command))}[/dim]")
    out.append(f"[dim]expert-parallel layouts: the full fine-tune, ZeRO-3 by FSDP2 over N GPUs, each MoE layer's "
               f"routed experts split over {EP} of them (one node) and sharded over the other N / {EP}, batch 1 x seq "
               f"{p.seq} per GPU, checkpointing full; N whole nodes, powers of two "
               f"({', '.join(map(str, COUNTS))})[/dim]")
    return out


def _pipeline_items(p: ClusterPlan) -> list[Any]:
    """The pipeline x tensor-parallel layouts (memcalc.plan.pipelines): per card, the fewest GPUs, the worst
    rank (its layers) and its peak; or why the model has none."""
    from rich import box
    from rich.markup import escape

    if p.pipelines_note is not None:
        return [f"[dim]pipeline layouts: none ({escape(p.pipelines_note)})[/dim]"]
    if not p.pipelines:
        return []
    moe = any(r.layout is not None and r.layout.ep > 1 for r in p.pipelines)
    width = "ep" if moe else "tp"
    title = "expert" if moe else "tensor"
    t = left_table(f"{p.model.name}: pipeline x {title} parallel (pp x {width} GPUs)", box=box.SIMPLE_HEAD,
                   show_edge=False, padding=0, pad_edge=False)
    for col in ("GPU", "GPUs", "pp", width, "worst rank", "peak", "need"):
        t.add_column(col, justify="left" if col in ("GPU", "worst rank") else "right", no_wrap=True)
    for r in p.pipelines:
        lay = r.layout
        if lay is None:
            t.add_row(r.gpu.name, f">{GPU_CAP}", "-", "-", "-", "-", "-")
            continue
        lo, hi = lay.layers
        t.add_row(r.gpu.name, str(lay.gpus), str(lay.pp), str(lay.ep if moe else lay.tp),
                  f"{lay.rank} ({layers_text(lo, hi)})",
                  f"{gib(lay.peak_bytes):.1f}", f"{gib(lay.required_bytes):.1f}")
    out: list[Any] = [t]
    row = next((r for r in p.pipelines if r.command), None)
    if row is not None and row.layout is not None:
        out.append(f"[dim]pipeline ({row.gpu.name}'s row; --json has every row's command): "
                   f"{escape(str(row.command))}[/dim]")
    within = ("ep within a node of 8 (each stage's routed experts split over its ep ranks, the rest of the stage "
              "replicated over them)" if moe else "tp within a node of 8")
    out.append(f"[dim]pipeline layouts: the full fine-tune as 1F1B over pp stages, pp micro-batches of 1 x seq "
               f"{p.seq}, checkpointing full; {within}, pp stages across nodes, no ZeRO (each rank holds "
               f"1/(pp x {width}) of the model states; data-parallel replicas add GPUs, not memory); the peak is the "
               "worst rank's (GiB allocated; need: the device total)[/dim]")
    return out


def _command_lines(p: ClusterPlan) -> list[str]:
    """Each column's ``memcalc estimate`` command, with the row's card, count and checkpointing as
    GPU / N / CKPT (one row's own: ``--json``'s ``command_full`` / ``command_lora`` / ``command_qlora``);
    the estimate's peak is the row's to the byte (its needs adds the allocator replay)."""
    from rich.markup import escape

    out = []
    for s, label in zip(SETUPS, ("full", "LoRA", "QLoRA"), strict=True):
        # a row without tensor or context parallelism (its command has the flags every row has)
        rows = [r for r in p.rows if r.commands.get(s)]
        row = next((r for r in rows if (r.layout[s] or {}).get("tp") == 1 and "cp" not in (r.layout[s] or {})),
                   rows[0] if rows else None)
        if row is None:
            continue
        lay, ck = row.layout[s] or {}, row.checkpoint[s]
        cmd = str(row.commands[s])
        # the first row's own command, its card / count / checkpointing named by what they stand for
        for flag, value, name in (("--gpu", row.gpu.name, "GPU"), ("--gpus", str(lay.get("dp")), "N"),
                                  ("--checkpoint", str(ck), "CKPT")):
            cmd = cmd.replace(f" {flag} {value}", f" {flag} {name}", 1)
        out.append(f"[dim]{label}:[/dim] {escape(cmd)}")
    if out:
        out.insert(0, "[dim]the estimate behind each column (GPU, N, CKPT: the row's; tensor- or context-parallel "
                      "rows add --tp T --sequence-parallel or --cp C, and --json has every row's command):[/dim]")
    return out

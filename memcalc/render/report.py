"""Rendering: rich tables and JSON for an estimate. No arithmetic beyond unit conversion.

The report is a list of rich tables and lines of rich markup (``report_items``), printed in order
by ``print_items``. rich is imported inside the functions that build or print them, never at module
level: ``estimate --json`` (``to_json``, ``dumps``) loads no rich (``tests/unit/test_lazy_imports.py``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Optional

from memcalc.core.pipeline import pipeline_line
from memcalc.engine.fsdp import sharding_mechanics
from memcalc.inputs.resolve import Resolved
from memcalc.inputs.trainer_defaults import half_on
from memcalc.core.expert_parallel import ep_line
from memcalc.core.ring_attention import cp_line, gpus_in_all, tp_line, zero_ranks_unit
from memcalc.core.gpu_side import DeviceMemory, device_memory
from memcalc.engine.result import KIND_NAMES, KINDS, Estimate
from memcalc.estimate.peak import card_side, runs_within
from memcalc.core.units import MiB, fmt_auto, fmt_bytes, fmt_count, gib

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from memcalc.core.spec import ExperimentSpec, KernelProfile, ModelSpec, TrainingSpec

ORIGIN_MARK = {"flag": "", "config": "config", "default": "default", "inferred": "inferred"}


#: ``extra`` keys of the techniques (activation offloading, paged optimizers), all integers, in --json
TECHNIQUE_KEYS = ("host_activation_bytes", "host_activation_raw_bytes", "offloaded_tensors", "paged_optimizer_bytes")


def technique_lines(est: Estimate) -> list[str]:
    """One text line per technique whose memory lies outside the GPU peak."""
    out = []
    host = est.extra.get("host_activation_bytes")
    if host is not None:
        out.append(f"host memory: {fmt_bytes(host)} pinned for offloaded activations "
                   f"({est.extra['offloaded_tensors']:,} tensors, {fmt_bytes(est.extra['host_activation_raw_bytes'])}; "
                   "--activation-offload; not in the GPU peak)")
    paged = est.extra.get("paged_optimizer_bytes")
    if paged is not None:
        out.append(f"paged optimizer state: {fmt_bytes(paged)} in CUDA unified memory (cudaMallocManaged), outside "
                   "the caching allocator: not in the GPU peak; it uses free GPU memory and pages to the host under "
                   "pressure")
    return out


def card_memory(est: Estimate, g: Any) -> DeviceMemory:
    """The step's three peaks on card ``g`` (its own workspaces, context; :mod:`memcalc.core.gpu_side`)."""
    return device_memory(est.step_allocated_bytes, est.step_reserved_bytes, card_side(est.experiment, g))


#: (id of an estimate's replays, the allocator's room) -> (those replays, whether the step runs there)
_AFTER: dict[tuple[int, int], tuple[Any, bool]] = {}
#: the capacity-limited replays run for at most this many cards (those asked for: each gets a verdict
#: line, memcalc.render.verdict.CARD_LINES); the catalog's summary does not show them
AFTER_RELEASE_CARDS = 4


def _after_release(est: Estimate, g: Any) -> Optional[bool]:
    """Whether a step whose device total exceeds card ``g`` still runs there: the allocator replay with
    the card's room for it (capacity less the CUDA context, NCCL and the workspaces' segments), cached
    segments released before a new one would not fit (:func:`memcalc.estimate.peak.runs_within`). None
    without a replay."""
    if est.step_reserved_bytes is None:
        return None
    side = card_side(est.experiment, g)
    room = g.capacity_bytes - side.outside_allocator_bytes - side.workspace_segment_bytes
    key = (id(est.replays), room)
    got = _AFTER.get(key)
    if got is None or got[0] is not est.replays:
        if len(_AFTER) > 64:
            _AFTER.clear()
        got = _AFTER[key] = (est.replays, est.step_allocated_bytes <= room and bool(runs_within(est, room)))
    return got[1]


def fits_rows(est: Estimate, gpus: list[Any]) -> list[dict[str, Any]]:
    """Per GPU: capacity, its device total, whether it fits, and the headroom (bytes, may be negative).
    A card the device total exceeds says whether the step still runs once the caching allocator has
    released its cached segments (``fits_after_cache_release``; absent without an allocator replay or
    for more than :data:`AFTER_RELEASE_CARDS` cards). A paged optimizer: whether its unified-memory state
    also stays resident in the headroom (``paged_state_resident``; else it pages to the host, slower).
    ``runs_as``: the precision the card runs the step in instead (fp16 for bf16, the same bytes: ``half_on``)."""
    paged = est.extra.get("paged_optimizer_bytes")
    out = []
    for g in gpus:
        need = card_memory(est, g).device_total_bytes
        after = _after_release(est, g) if need > g.capacity_bytes and len(gpus) <= AFTER_RELEASE_CARDS else None
        out.append({
            "name": g.name,
            "capacity_bytes": g.capacity_bytes,
            "device_total_bytes": need,
            "fits": need <= g.capacity_bytes,
            **({"fits_after_cache_release": after} if after is not None else {}),
            "headroom_bytes": g.capacity_bytes - need,
            **({"runs_as": r} if (r := half_on(g, est.experiment.training.precision)) else {}),
            **({"paged_state_resident": need + paged <= g.capacity_bytes} if paged is not None else {}),
        })
    return out


def recompute_pct(rec: dict[str, Any]) -> float:
    """The share of the forward FLOPs recomputed in backward, in percent (``extra["recompute"]``)."""
    return 100 * rec["flops"] / rec["forward_flops"] if rec["forward_flops"] else 0.0


def to_json(est: Estimate, res: Resolved, gpus: list[Any]) -> dict[str, Any]:
    """The --json document: integer bytes throughout."""
    exp = est.experiment
    return {
        "config": exp.name,
        "model": exp.model.name,
        "params": est.params,
        "trainable_params": est.trainable_params,
        "peak_bytes": est.peak_bytes,
        "peak_phase": est.peak_phase,
        "peak_at": est.peak_label,
        "peak_step": est.extra.get("peak_step"),
        "components": est.components,
        "components_by_kind": est.components_by_kind,
        "breakdown": est.by_kind,
        "phases": est.phases,
        "first_step_peak_bytes": est.first_step_peak_bytes,
        "steady_peak_bytes": est.extra.get("steady_peak_bytes"),
        "allocated_peak_bytes": est.allocated_peak_bytes,
        "reserved_peak_bytes": est.reserved_peak_bytes,
        "device_total_bytes": est.device_total_bytes,
        "device": est.device,
        "device_parts": est.device_parts,
        "load_peak_bytes": est.extra.get("load_peak_bytes"),
        "load_peak_at": est.extra.get("load_peak_label"),
        "run_peak_bytes": est.extra.get("run_peak_bytes"),
        "required_bytes": est.required_bytes,
        "cuda_context_bytes": est.cuda_context_bytes,
        "bytes_per_param": est.bytes_per_param,
        "published_peak_bytes": exp.published_peak_bytes,
        **{k: est.extra[k] for k in TECHNIQUE_KEYS if k in est.extra},
        "compiled": est.extra.get("compiled"),
        "recompute": est.extra.get("recompute"),
        **({"host_optimizer_bytes": est.extra["host_optimizer_bytes"]} if "host_optimizer_bytes" in est.extra else {}),
        **({"host_offload_bytes": est.extra["host_offload_bytes"]} if "host_offload_bytes" in est.extra else {}),
        **({"host_param_bytes": est.extra["host_param_bytes"]} if "host_param_bytes" in est.extra else {}),
        # only for a framework the validator cannot trace (unsloth): which numbers are read from source
        **({"provenance": est.extra["provenance"]} if "provenance" in est.extra else {}),
        **({"pipeline": est.extra["pipeline"]} if "pipeline" in est.extra else {}),
        "gpus": fits_rows(est, gpus),
        "inputs": {
            "model": exp.model.model_dump(),
            "training": exp.training.model_dump(),
            "profile": exp.profile.model_dump(),
            "origin": res.origin,
            # only when --model was not a preset name (keeps the preset documents as they were)
            **({"model_source": res.model_source.as_json()}
               if res.model_source is not None and res.model_source.kind != "preset" else {}),
            "reasons": res.reasons,
            "adapter_dtype": exp.adapter_dtype.value if exp.adapter_dtype is not None else None,
        },
        "inferred": res.notes,
        "assumptions": est.assumptions,
        "notes": est.notes,
    }


def escape(text: str) -> str:
    """rich's ``markup.escape``, importing rich only when ``text`` has something to escape."""
    if "[" not in text and not text.endswith("\\"):
        return text
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _mark(origin: dict[str, str], key: str) -> str:
    v = origin.get(key, "")
    m = ORIGIN_MARK.get(v, escape(v) if v.startswith("recipe ") else "")  # --recipe: "recipe FILE:KEY"
    return f" [dim]({m})[/dim]" if m else ""


def _why(res: Resolved, key: str) -> str:
    """`` (default: reason)`` for a default that depends on the setup, else the plain origin mark."""
    if res.origin.get(key) == "default" and key in res.reasons:
        return f" [dim](default: {res.reasons[key]})[/dim]"
    return _mark(res.origin, key)


def inputs_table(est: Estimate, res: Resolved) -> Table:
    exp, tr, m, p = est.experiment, est.experiment.training, est.experiment.model, est.experiment.profile
    o = res.origin
    t = left_table(f"Inputs: {exp.name}", show_header=False)
    t.add_column("input", style="bold")
    t.add_column("value", overflow="fold")  # a long path breaks across lines instead of losing its end
    prec = tr.precision + (" + fp32 master weights" if tr.master_weights else "")
    rows = [  # (input, value or None where the row does not apply)
        ("model", f"{m.name}{_mark(o, 'model')}"),
        ("model from", escape(res.model_source.describe())
         if res.model_source is not None and res.model_source.kind != "preset" else None),
        ("shape", _model_shape(m)),
        ("parameters", f"{est.params:,} ({fmt_count(est.params)}); trainable {est.trainable_params:,}"),
        ("batch x seq", f"{tr.batch}{_mark(o, 'batch')} x {tr.seq}{_mark(o, 'seq')}, "
                        f"grad accum {tr.grad_accum}{_mark(o, 'grad_accum')}"),
        ("precision", f"{prec}{_why(res, 'precision')}"),
        ("optimizer", f"{tr.optimizer} ({tr.optimizer_impl}){_mark(o, 'optimizer')}"
                      + (", fused into backward" if tr.fused_optimizer else "")),
        ("checkpointing", _checkpointing(tr, o)),
        ("sharding", _sharding(tr, o)),
        ("compile", ((f"yes, memory budget {tr.memory_budget}" if tr.memory_budget is not None else "yes")
                     + (f", each layer a graph{_why(res, 'compile_scope')}" if tr.compile_scope == "layer" else ""))
         if tr.compile else None),
        ("tensor parallel", tp_line(tr, _mark(o, "tp"), _mark(o, "sequence_parallel"))),
        ("expert parallel", ep_line(exp, _mark(o, "ep"), _mark(o, "ep_capacity_factor"))),
        ("pipeline parallel", pipeline_line(est.extra["pipeline"]) if "pipeline" in est.extra else None),
        ("context parallel", cp_line(tr, _mark(o, "cp"), _mark(o, "cp_method"))),
        ("adapters", _adapters(exp, res)),
        ("framework", f"{p.framework}{_why(res, 'framework')}, PyTorch {p.torch_version}{_why(res, 'torch_version')}"),
        ("kernel profile", _kernel_profile(p, m, o)),
        ("loss", _loss(p, o)),
    ]
    for name, value in rows:
        if value is not None:
            t.add_row(name, value)
    return t


def _model_shape(m: ModelSpec) -> str:
    """The model's shape in one line: layers, widths, heads, MLP, norm, positions; MoE and MLA."""
    shape = (f"{m.n_layers} layers x d_model {m.d_model}, {m.n_heads} heads"
             + (f" ({m.kv_heads} kv)" if m.kv_heads != m.n_heads else "")
             + f", ff {m.d_ff} ({m.mlp} {m.activation}), vocab {m.vocab_size}, {m.norm} {m.norm_placement}-norm, {m.positions}")
    if m.moe is not None:
        e = m.moe
        shape += (f"; MoE {e.n_experts} experts of {e.d_ff_expert}, top {e.top_k}"
                  + (f", {e.n_shared_experts} shared" if e.n_shared_experts else "")
                  + (f", first {e.first_dense_layers} layers dense" if e.first_dense_layers else "")
                  + f" ({e.routing} routing assumed)")
    if m.mla is not None:
        shape += f"; MLA kv rank {m.mla.kv_lora_rank}, q rank {m.mla.q_lora_rank or 'none'}"
    return shape


def _checkpointing(tr: TrainingSpec, o: dict[str, str]) -> str:
    ck = tr.checkpoint + (f" (K={tr.checkpoint_every})" if tr.checkpoint == "every-k" else "")
    return (f"{ck}{_mark(o, 'checkpoint')}"
            + (f"; saved activations offloaded to host memory{_mark(o, 'activation_offload')}"
               if tr.activation_offload else ""))


def _sharding(tr: TrainingSpec, o: dict[str, str]) -> Optional[str]:
    """ZeRO, the GPUs and the optimizer offload, where any is set (or given as a flag)."""
    flags = {k for k, v in o.items() if v == "flag"}
    if not (tr.zero or tr.gpus > 1 or tr.offload_optimizer or {"zero", "gpus", "offload_optimizer"} & flags):
        return None
    shard = f"ZeRO-{tr.zero}{_mark(o, 'zero')}" if tr.zero else f"no ZeRO{_mark(o, 'zero')}"
    how = sharding_mechanics(tr)
    return (f"{shard} over {tr.gpus}{_mark(o, 'gpus')}{zero_ranks_unit(tr)}"
            + (f" ({how}){_mark(o, 'sharding')}" if how else "")
            + (f", optimizer state on the CPU{_mark(o, 'offload_optimizer')}" if tr.offload_optimizer else ""))


def _adapters(exp: ExperimentSpec, res: Resolved) -> Optional[str]:
    lo = exp.training.lora
    if lo is None:
        return None
    adt = exp.adapter_dtype
    kind = "QLoRA (NF4 base)" if lo.qlora else f"LoRA ({lo.quant.upper()} base)" if lo.quant else "LoRA"
    return (f"{kind}{' + DoRA' if lo.dora else ''} rank {lo.rank}, "
            f"alpha {lo.alpha:g}, on {','.join(lo.targets)}"
            f"; adapters {adt.name if adt is not None else '-'}{_why(res, 'lora_dtype')}"
            + (f"; modules_to_save {','.join(lo.modules_to_save)} (trainable copies beside the frozen originals)"
               if lo.modules_to_save else ""))


def _kernel_profile(p: KernelProfile, m: ModelSpec, o: dict[str, str]) -> str:
    return (f"{p.name}{_mark(o, 'profile')}: RMSNorm {p.rmsnorm}, attention {p.attention}"
            + (" (grouped K/V un-expanded)" if p.sdpa_gqa and m.kv_heads != m.n_heads else "")
            + f", logits {'fp32' if p.logits_fp32 else 'model dtype'}"
            + (f", gelu_new {p.gelu_new}" if m.activation == "gelu_new" else "")
            + (f"; kernels {p.kernels}{_mark(o, 'kernels')}" if p.kernels != "none" else "")
            + (f" ({', '.join(p.liger_ops)})" if p.kernels == "liger" else ""))


def _loss(p: KernelProfile, o: dict[str, str]) -> Optional[str]:
    """The loss, where it is chunked or was given as a flag."""
    if not (p.cross_entropy != "full" or "cross_entropy" in o or "loss_chunks" in o):
        return None
    chunks = f" in {p.loss_chunks}{_mark(o, 'loss_chunks')} chunks" if p.cross_entropy == "chunked" else ""
    if p.cross_entropy == "trl-fused":
        chunks = f" on {p.loss_tokens:g}{_mark(o, 'loss_tokens')} of the tokens"
    return f"cross-entropy {p.cross_entropy}{_mark(o, 'cross_entropy')}{chunks}"


def peak_table(est: Estimate) -> Table:
    t = left_table(f"Alive at the peak: {fmt_bytes(est.peak_bytes)} in {est.peak_phase}, at {est.peak_label}")
    t.add_column("kind: component")
    t.add_column("GiB", justify="right")
    t.add_column("MiB", justify="right")
    t.add_column("share", justify="right")
    for name, indent, b in peak_rows(est):
        t.add_row(f"  {name}" if indent else f"[bold]{name}[/bold]", f"{gib(b):.3f}", f"{b / MiB:,.1f}",
                  f"{100 * b / est.peak_bytes:.1f}%")
    t.add_row("[bold]total (allocated peak)[/bold]", f"[bold]{gib(est.peak_bytes):.3f}[/bold]",
              f"{est.peak_bytes / MiB:,.1f}", "100.0%")
    return t


def peak_rows(est: Estimate) -> list[tuple[str, bool, int]]:
    """The peak's rows: each kind with bytes (:data:`memcalc.engine.result.KIND_NAMES`), then its
    components (indented: True) where it has more than one or one named otherwise; a step without
    the split by kind (``Estimate.by_kind`` empty) lists its components alone."""
    if not est.by_kind:
        return [(name, False, b) for name, b in est.components.items()]
    out = []
    for k in KINDS:
        parts = est.by_kind.get(k)
        if not parts:
            continue
        out.append((KIND_NAMES[k], False, sum(parts.values())))
        if len(parts) > 1 or next(iter(parts)) != KIND_NAMES[k]:
            out += [(name, True, b) for name, b in parts.items()]
    return out


def phases_table(est: Estimate) -> Table:
    t = left_table("Peak of each phase (steady-state step)")
    t.add_column("phase")
    t.add_column("GiB", justify="right")
    for name, b in est.phases.items():
        mark = " [bold red]<- peak[/bold red]" if name == est.peak_phase and est.extra.get("peak_step") == "steady state" else ""
        t.add_row(name + mark, f"{gib(b):.3f}")
    mark = " [bold red]<- peak[/bold red]" if est.extra.get("peak_step") == "first step" else ""
    t.add_row(f"first step (optimizer state created, {est.first_step_peak_phase}){mark}", f"{gib(est.first_step_peak_bytes):.3f}")
    return t


def bpp_table(est: Estimate) -> Table:
    t = left_table("Bytes per trainable parameter")
    for k in est.bytes_per_param:
        t.add_column(k.replace("_", " "), justify="right")
    t.add_column("total", justify="right")
    vals = list(est.bytes_per_param.values())
    t.add_row(*[f"{v:g}" for v in vals], f"{sum(vals):g}")
    return t


#: the device total's parts (``Estimate.device_parts``), as the report names them
PART_LABELS = {"step_allocated_bytes": "allocated peak of the step's tensors (allocator replay)",
               "workspace_bytes": "cuBLAS/cuBLASLt workspaces (allocated)",
               "allocator_overhead_bytes": "allocator overhead to reserved (segments not in use)",
               "cuda_context_bytes": "CUDA context (as created)",
               "step_loaded_bytes": "loaded by the step (kernel images, cuBLAS state; outside the allocator)",
               "nccl_bytes": "NCCL buffers"}


def device_table(est: Estimate) -> Table:
    """The device total on the estimate's card, part by part; allocated and reserved peaks."""
    t = left_table(f"On {est.device}: max_memory_allocated {fmt_bytes(est.allocated_peak_bytes)}, max_memory_reserved "
                   f"{fmt_bytes(est.reserved_peak_bytes)}, device total (nvidia-smi) {fmt_bytes(est.device_total_bytes)}")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    for k, v in est.device_parts.items():
        if v or k in ("step_allocated_bytes", "cuda_context_bytes"):
            t.add_row(PART_LABELS.get(k, k), fmt_bytes(v))
    return t


def gpu_table(est: Estimate, gpus: list[Any]) -> Table:
    t = left_table("Fits? the device total (reserved + CUDA context + the step's loads + NCCL) on each card")
    t.add_column("GPU")
    t.add_column("memory", justify="right")
    t.add_column("needs", justify="right")
    t.add_column("fits", justify="center")
    t.add_column("headroom", justify="right")
    for g, row in zip(gpus, fits_rows(est, gpus)):
        ok = row["fits"]
        paging = ok and row.get("paged_state_resident") is False  # the paged optimizer state pages to the host
        t.add_row(getattr(g, "display_name", g.name), fmt_bytes(g.capacity_bytes), fmt_bytes(row["device_total_bytes"]),
                  "[yellow]yes, state pages out[/yellow]" if paging else "[green]yes[/green]" if ok else
                  "[yellow]no; runs once the cache is released[/yellow]" if row.get("fits_after_cache_release")
                  else "[red]no[/red]",
                  ("" if ok else "-") + fmt_auto(abs(row["headroom_bytes"])))
    return t


def left_table(title: str, **kw: Any) -> Table:
    """A rich ``Table`` with its title on the left, as the reports' tables have it."""
    from rich.table import Table

    return Table(title=title, title_justify="left", **kw)


def print_items(items: list[Any], console: Optional[Console] = None) -> None:
    """Print tables and lines of rich markup in order: on ``console``, else on stdout."""
    if console is None:
        from rich.console import Console

        console = Console()
    for item in items:  # a Text that must not wrap (a command to paste) runs on past the width
        console.print(item, soft_wrap=bool(getattr(item, "no_wrap", False)))


def render(est: Estimate, res: Resolved, gpus: list[Any], console: Optional[Console] = None,
           verbose: bool = True) -> None:
    """Print the report: on ``console``, else on stdout."""
    print_items(report_items(est, res, gpus, verbose), console)


def _lora_kind(lo) -> str:
    """QLoRA, LoRA-GPTQ / LoRA-AWQ (a 4-bit base of its own format), or LoRA."""
    return "QLoRA" if lo.qlora else f"LoRA-{lo.quant.upper()}" if lo.quant else "LoRA"


def setup_line(est: Estimate, res: Resolved) -> str:
    """The setup in one line (``--verbose`` gives every input, with where it came from)."""
    exp, tr = est.experiment, est.experiment.training
    lo = tr.lora
    method = ("full fine-tune" if lo is None
              else f"{_lora_kind(lo)}{'+DoRA' if lo.dora else ''} r{lo.rank}")
    n = tr.gpus * tr.tp * tr.cp * tr.pp  # every rank of the mesh (TrainingSpec's tp, cp and pp fields)
    gpus = f", {gpus_in_all(tr).replace(' in all', '')}" + (f" ZeRO-{tr.zero}" if tr.zero else "") if n > 1 else ""
    src = res.model_source
    frm = f"; {escape(src.describe())}" if src is not None and src.kind != "preset" else ""
    master, reentrant = " + fp32 master" * tr.master_weights, " (reentrant)" * tr.checkpoint_reentrant
    return (f"[bold]Setup[/bold]: {exp.model.name} ({fmt_count(est.params)} parameters, "
            f"{fmt_count(est.trainable_params)} trainable{frm}), {method}, {tr.precision}{master}, batch {tr.batch} x "
            f"seq {tr.seq}, {tr.optimizer}, checkpointing {tr.checkpoint}{reentrant}{gpus}; {exp.profile.framework}, "
            f"PyTorch {exp.profile.torch_version}")


def report_items(est: Estimate, res: Resolved, gpus: list[Any], verbose: bool = True) -> list[Any]:
    """The report in order: rich tables and lines of rich markup; without ``verbose`` the inputs
    table and the assumptions give way to one setup line and a pointer to ``--verbose``."""
    out: list[Any] = []
    add = out.append
    add(inputs_table(est, res) if verbose else setup_line(est, res))
    for n in [*res.notes, *est.notes]:
        add(f"[yellow]note:[/yellow] {n}")
    add(peak_table(est))
    add(phases_table(est))
    for line in technique_lines(est):  # memory outside the GPU peak: pinned host, unified memory
        add(line)
    add(bpp_table(est))
    comp, rec = est.extra.get("compiled"), est.extra.get("recompute")
    if comp:
        add(f"torch.compile (memory budget {comp['memory_budget']:g}, {comp['decided_by']}): saves "
                f"{fmt_bytes(comp['saved_bytes'])} for backward (budget 1.0 saves {fmt_bytes(comp['default_saved_bytes'])}); "
                f"backward recomputes {recompute_pct(rec):.1f}% of the forward FLOPs and keeps "
                f"{fmt_bytes(comp['recomputed_in_backward_bytes'])} of the recomputed chain")
    elif rec:
        add(f"recomputation: {rec['by']} runs {recompute_pct(rec):.1f}% of the forward FLOPs again in backward")
    lora = est.experiment.training.lora
    if lora is not None and lora.qlora and est.extra.get("load_peak_bytes") is not None:
        add(f"loading: {fmt_bytes(est.extra['load_peak_bytes'])} at its peak ({est.extra['load_peak_label']}; the "
            f"base is quantized on the GPU as it loads); max_memory_allocated over the whole run, load included: "
            f"{fmt_bytes(est.extra['run_peak_bytes'])}")
    alloc = est.allocated_peak_bytes
    if est.experiment.published_peak_bytes:
        pub = est.experiment.published_peak_bytes
        line = (f"published peak: {fmt_bytes(pub)}; predicted {fmt_bytes(est.peak_bytes)} "
                f"({100 * (est.peak_bytes - pub) / pub:+.1f}%)")
        if est.step_reserved_bytes is not None:
            line += f", max_memory_allocated with the workspaces {fmt_bytes(alloc)} ({100 * (alloc - pub) / pub:+.1f}%)"
        add(line)
    host = est.extra.get("host_optimizer_bytes")
    if host is not None:
        add(f"host memory: {fmt_bytes(host)} of optimizer state (and fp32 master weights) per GPU lives on the CPU "
                "(--offload-optimizer; not in the GPU peak)")
    host = est.extra.get("host_offload_bytes")
    if host is not None:
        add(f"host memory: {fmt_bytes(host)} per GPU of parameter shards, gradient shards and optimizer state "
                "lives on the CPU (FSDP2 CPUOffloadPolicy, --offload-optimizer; not in the GPU peak)")
    host = est.extra.get("host_param_bytes")
    if host is not None:
        add(f"host memory: {fmt_bytes(host)} per GPU of pinned 16-bit parameter partitions (DeepSpeed ZeRO-3 "
            "offload_param; not in the GPU peak, copied to the GPU at each gather)")
    add(device_table(est))
    add(gpu_table(est, gpus))
    if not verbose:
        prov = est.extra.get("provenance")
        if prov is not None:  # an untraced trainer (Unsloth): which numbers are read from source, in every output
            add(f"[yellow]note:[/yellow] {escape(prov['note'])}; read from source: "
                f"{', '.join(m['mechanism'] for m in prov['mechanisms'] if m['how'] == 'read')} (--verbose: each rule)")
        add(f"[dim]every input with where it came from, and the {len(est.assumptions)} assumptions: --verbose; "
            "all of it: --json[/dim]")
        return out
    for a in est.assumptions:
        add(f"[dim]assumption: {a}[/dim]")
    return out


def dumps(doc: Any) -> str:
    return json.dumps(doc, indent=2)


__all__ = ["render", "to_json", "dumps", "KINDS"]

"""The listing commands: ``memcalc models``, ``configs``, ``gpus`` and ``profiles`` (tables, or
``--json``)."""

from __future__ import annotations

import typer

from memcalc.cli.group import app
from memcalc.cli.options import Json
from memcalc.core.units import gib


def _table(title: str):
    """A listing table: a header rule, no edges, padding shared between neighbours (whole names in
    80 columns), the title centred."""
    from rich import box
    from rich.table import Table

    return Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)


def _print(t) -> None:
    from rich.console import Console

    Console().print(t)


@app.command()
def models(as_json: Json = False) -> None:
    """List the model presets with their Hugging Face ids, shapes and parameter counts.

    `--model ORG/NAME` with a listed Hugging Face id picks that preset.
    """
    from memcalc.api import list_models
    from memcalc.render.report import dumps

    rows = list_models()
    if as_json:
        typer.echo(dumps(rows))
        return
    t = _table("Model presets (--json adds d_ff, vocabulary, max sequence, exact counts)")
    for col in ("name", "params", "layers", "d_model", "heads/kv"):
        t.add_column(col, justify="left" if col == "name" else "right", no_wrap=True)
    t.add_column("Hugging Face id (--model ORG/NAME)", overflow="fold")
    for r in rows:
        t.add_row(r["name"], f"{r['params'] / 1e9:,.2f}B", str(r["n_layers"]), str(r["d_model"]),
                  f"{r['n_heads']}/{r['n_kv_heads']}", r["hf_id"] or "-")
    _print(t)


@app.command()
def configs(as_json: Json = False) -> None:
    """List the shipped reference configs and their published peaks."""
    from memcalc.api import list_configs
    from memcalc.render.report import dumps

    rows = list_configs()
    if as_json:
        typer.echo(dumps(rows))
        return
    t = _table("Reference configs (Deep One 1.6B, batch 4 x 768, Adafactor, RTX 4090, PyTorch 2.8)")
    for col in ("name", "precision", "checkpoint", "fused", "compile", "published GiB"):
        t.add_column(col, no_wrap=col != "published GiB")
    for r in rows:
        comp = "-" if not r["compile"] else ("yes" if r["memory_budget"] is None else f"budget {r['memory_budget']}")
        t.add_row(r["name"], r["precision"], r["checkpoint"], "yes" if r["fused_optimizer"] else "-", comp,
                  f"{gib(r['published_peak_bytes']):.3f}")
    _print(t)


@app.command()
def gpus(as_json: Json = False) -> None:
    """List the GPU catalog (capacities in bytes; GiB = 2**30)."""
    from memcalc.api import list_gpus
    from memcalc.render.report import dumps

    gs = list_gpus()
    if as_json:
        typer.echo(dumps(gs))
        return
    t = _table("GPU catalog")
    for col in ("name", "GPU", "memory GiB", "bytes"):
        t.add_column(col, justify="left" if col in ("name", "GPU") else "right", no_wrap=col != "GPU")
    for g in gs:
        t.add_row(g["name"], g["display_name"], f"{gib(g['capacity_bytes']):.2f}", f"{g['capacity_bytes']:,}")
    _print(t)


@app.command()
def profiles(as_json: Json = False) -> None:
    """List the kernel profiles (what each PyTorch version and framework saves)."""
    from memcalc.api import list_profiles
    from memcalc.render.report import dumps

    rows = list_profiles()
    if as_json:
        typer.echo(dumps(rows))
        return
    t = _table("Kernel profiles (--framework/--torch build any pair; --json: every field)")
    for col in ("name", "RMSNorm", "loss", "LoRA", "K/V"):
        t.add_column(col, no_wrap=True)
    for p in rows:
        loss = ("chunked" if p["cross_entropy"] == "chunked" else "full") + (" fp32" if p["logits_fp32"] else "")
        lora = p["lora_dtype"] + ("+cast" if p["lora_input_cast"] else "")
        t.add_row(p["name"], p["rmsnorm"], loss, lora, "grouped" if p["sdpa_gqa"] else "copies")
    _print(t)


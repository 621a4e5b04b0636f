"""Behaviour snapshots: `memcalc estimate --json` and `memcalc plan --json` exactly as they
were before the package was reorganised into stages (issue 10). A test compares every case
byte for byte; `python tests/snapshots/cases.py --write` regenerates the files after a change
that is meant to move numbers (say which in the commit).

Each case: (file stem, CLI args, slow?). The 11 shipped reference configs, 14 other setups
that exercise LoRA, QLoRA, ZeRO 1/2/3, offload, compile, AMP, every checkpointing mode, every
optimizer family and the kernel profiles, and `plan --json` for two models. The quick lane
(`pytest -m "not slow"`) keeps four cases: the control config, LoRA (params-7b-bf16-lora),
ZeRO-3 (control-zero3-fused) and AMP with an 8-bit optimizer (llama7b-amp-8bit).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent

REFERENCE = ["control", "bfloat16", "checkpoint", "compile", "fused", "fused_checkpoint", "bf16_fused_chkpt",
             "memory_budget_05", "memory_budget_60", "fused_memory_budget_05", "bf16_budget_60"]

CASES: list[tuple[str, list[str], bool]] = [
    *[(f"config-{c}", ["estimate", "--config", c, "--json"], c != "control") for c in REFERENCE],
    ("params-7b-bf16-lora", ["estimate", "--params", "7e9", "--bf16", "--lora", "--json"], False),
    ("llama8b-qlora-full", ["estimate", "--model", "llama-3.1-8b", "--qlora", "--checkpoint", "full",
                            "--batch", "4", "--seq", "4096", "--gpu", "rtx-4090", "--json"], True),
    ("llama7b-amp-8bit", ["estimate", "--model", "llama-2-7b", "--precision", "amp-bf16",
                          "--optimizer", "adamw-8bit", "--seq", "1024", "--json"], False),
    ("llama70b-zero3-master", ["estimate", "--model", "llama-2-70b", "--bf16", "--master-weights", "--zero", "3",
                               "--gpus", "16", "--checkpoint", "full", "--seq", "1024", "--json"], True),
    ("mistral-zero2", ["estimate", "--model", "mistral-7b", "--bf16", "--zero", "2", "--gpus", "8",
                       "--seq", "1024", "--json"], True),
    ("qwen-zero1-offload", ["estimate", "--model", "qwen2.5-7b", "--bf16", "--zero", "1", "--gpus", "4",
                            "--offload-optimizer", "--seq", "1024", "--json"], True),
    ("llama8b-compile-budget", ["estimate", "--model", "llama-3.1-8b", "--bf16", "--memory-budget", "0.3",
                                "--seq", "1024", "--json"], True),
    ("gpt2-ampfp16-selective", ["estimate", "--model", "gpt2", "--precision", "amp-fp16", "--batch", "8",
                                "--seq", "1024", "--checkpoint", "selective", "--json"], True),
    ("phi-lora-all-lion", ["estimate", "--model", "phi-1.5", "--lora", "--lora-targets", "all", "--lora-dropout",
                           "0.05", "--precision", "bf16", "--optimizer", "lion", "--seq", "1024", "--json"], True),
    ("tinyllama-sgd-accum", ["estimate", "--model", "tinyllama-1.1b", "--optimizer", "sgd-momentum", "--grad-accum",
                             "4", "--checkpoint", "every-2", "--optimizer-impl", "for-loop", "--json"], True),
    ("gpt2xl-fused-sqrt-adafactor", ["estimate", "--model", "gpt2-xl", "--fused-optimizer", "--checkpoint", "sqrt",
                                     "--optimizer", "adafactor", "--json"], True),
    ("llama13b-compile-ckpt", ["estimate", "--model", "llama-2-13b", "--bf16", "--compile", "--checkpoint", "full",
                               "--seq", "1024", "--json"], True),
    ("gpt2-hf-profile-fused-adamw", ["estimate", "--model", "gpt2", "--profile", "hf-torch-2.8-cuda", "--batch", "4",
                                     "--seq", "512", "--optimizer-impl", "fused", "--json"], True),
    ("control-zero3-fused", ["estimate", "--config", "control", "--batch", "2", "--seq", "512", "--fused-optimizer",
                             "--zero", "3", "--gpus", "4", "--json"], False),
    ("plan-llama8b-4090", ["plan", "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--json"], True),
    ("plan-llama70b-cluster", ["plan", "--model", "llama-3.1-70b", "--json"], True),
]


def run_case(args: list[str]) -> tuple[int, str]:
    from typer.testing import CliRunner

    from memcalc.cli import app

    r = CliRunner().invoke(app, args)
    return r.exit_code, r.stdout


def path_of(stem: str) -> Path:
    return HERE / f"{stem}.json"


def main() -> None:
    only = set(sys.argv[2:])
    for stem, args, _ in CASES:
        if only and stem not in only:
            continue
        code, out = run_case(args)
        if code != 0:
            raise SystemExit(f"{stem}: exit {code}\n{out}")
        json.loads(out)  # valid JSON
        path_of(stem).write_text(out)
        print(f"wrote {path_of(stem).name}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"]:
        raise SystemExit("usage: python tests/snapshots/cases.py --write [STEM ...]")
    main()

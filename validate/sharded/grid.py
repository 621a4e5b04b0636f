"""The traced grid of sharded setups: one JSON per setup, written as each finishes.

``python -m memcalc.validate.sharded.grid OUT_DIR [--quick] [--only SUBSTRING]``

Each file ``<name>.json`` holds ``setup`` (the options, as ``memcalc estimate`` flags take them),
``trace`` (:func:`~.runner.trace_rank` with ``timeline=True``) and ``estimate`` (memcalc's
per-rank estimate of the same experiment at the traced depth, when it runs: ``predicted_bytes``,
``peak_phase``, and ``error_pct`` = (predicted - traced) / traced * 100). A file already there is
kept (a rerun finishes the rest).

``fsdp2-hf-*``: transformers' LlamaForCausalLM of the same shape (``framework="hf"``, ``hf.py``).

Shapes: ``7b`` is Llama-2-7B's layer (d 4096, 32 heads, ff 11008, vocab 32000; the ``llama-2-7b``
preset) cut to 2 (or 4) layers, batch 1 x 2048; ``small`` is d 1024, 16 heads, ff 2816,
vocab 32000, 2 layers, batch 1 x 512 (quick runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

PRECISIONS = {"fp32": {}, "bf16": {"bf16": True}, "mp": {"bf16": True, "master_weights": True}}
SHAPES = {
    "7b": dict(model="llama-2-7b"),
    "small": dict(model="llama-2-7b"),  # the preset's structure, narrowed below
}
SMALL = dict(d_model=1024, n_heads=16, n_kv_heads=16, d_ff=2816)


@dataclass(frozen=True)
class Setup:
    shape: str
    layers: int
    gpus: int
    zero: int
    precision: str
    checkpoint: str
    sharding: str = "fsdp2"
    batch: int = 1
    seq: int = 2048
    rank: int = 0
    framework: str = "plain"

    @property
    def name(self) -> str:
        return (f"{self.sharding}{'-hf' if self.framework == 'hf' else ''}-{self.shape}-L{self.layers}-g{self.gpus}-z{self.zero}-{self.precision}-"
                f"ck{self.checkpoint}-b{self.batch}s{self.seq}" + (f"-r{self.rank}" if self.rank else ""))

    def options(self) -> dict:
        return dict(SHAPES[self.shape], batch=self.batch, seq=self.seq, framework=self.framework, gpus=self.gpus,
                    zero=self.zero, sharding=self.sharding, checkpoint=self.checkpoint, **PRECISIONS[self.precision])

    def experiment(self):
        from memcalc.inputs.resolve import Options, resolve

        exp = resolve(Options(**self.options())).exp
        update = {"n_layers": self.layers}
        if self.shape == "small":
            update.update(SMALL)
        return exp.model_copy(update={"model": exp.model.model_copy(update=update)})


def grid(quick: bool = False) -> list[Setup]:
    """The setups: FSDP2 over ranks x precision x checkpointing x zero, deeper and smaller copies, FSDP1."""
    out: list[Setup] = []
    if quick:
        return [Setup("small", 2, g, z, p, "none", seq=512) for g in (2, 8) for z in (3, 2) for p in ("fp32", "mp")]
    for g in (8, 2, 4, 16):
        for p in ("fp32", "bf16", "mp"):
            for ck in ("none", "full"):
                for z in (3, 2):
                    out.append(Setup("7b", 2, g, z, p, ck))
    for p in ("fp32", "bf16", "mp"):
        for ck in ("none", "full"):
            out.append(Setup("7b", 4, 8, 3, p, ck))
    for g in (2, 16):
        for ck in ("none", "full"):
            out.append(Setup("7b", 4, g, 3, "mp", ck))
    out += [Setup("7b", 2, 8, 3, "mp", "none", rank=5), Setup("7b", 2, 8, 2, "bf16", "full", batch=2, seq=1024)]
    for z in (3, 2):
        for ck in ("none", "full"):
            out.append(Setup("7b", 2, 8, z, "mp", ck, framework="hf"))
    for g in (2, 8):
        for p in ("fp32", "mp"):
            for z in (3, 2):
                out.append(Setup("small", 2, g, z, p, "none", seq=512))
    for g in (4, 8):
        for p in ("fp32", "mp"):
            for z in (3, 2):
                out.append(Setup("7b", 2, g, z, p, "none", sharding="fsdp1"))
    return out


def run_setup(s: Setup) -> dict:
    from ..predict import predict
    from ..record import pct, target_spec
    from .runner import trace_rank

    exp = s.experiment()
    trace = trace_rank(exp, s.rank, timeline=True, framework=s.framework)
    p = predict(target_spec(exp, None, s.framework))
    est = {"predicted_bytes": p.peak_bytes, "peak_phase": p.peak_phase,
           "error_pct": pct(p.peak_bytes, trace["peak_bytes"]),
           "note": p.why or "memcalc's estimate of the same experiment (model at the traced depth) when traced"}
    return {"name": s.name, "setup": {**s.__dict__, "options": s.options()}, "trace": trace, "estimate": est}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None)
    ap.add_argument("--force", action="store_true", help="trace again setups whose file exists")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    for s in grid(a.quick):
        if a.only and a.only not in s.name:
            continue
        path = os.path.join(a.out, s.name + ".json")
        if os.path.exists(path) and not a.force:
            continue
        t0 = time.time()
        try:
            rec = run_setup(s)
        except Exception as e:  # noqa: BLE001 - one failing setup is reported; the grid goes on
            print(f"{s.name}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)
        t = rec["trace"]
        print(f"{s.name}: {t['peak_bytes']} B ({t['phase']}, {t['label']}) est {rec['estimate']['predicted_bytes']} "
              f"({rec['estimate']['error_pct']}%) {time.time() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

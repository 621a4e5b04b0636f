"""A grid of torchtune setups: torchtune's own step traced on meta (:mod:`.torchtune`) beside
``memcalc estimate --framework torchtune`` of the same spec, one row per setup.

Run ``python -m memcalc.validate.trainers.torchtune_grid`` (``--only TEXT`` to filter by name) for
the Markdown table of docs/torchtune.md; ``tests/trace/test_torchtune_grid.py`` checks every row.
The models are scaled down (1-2 layers, widths of 128-256, vocabularies of 2-4k) and keep every
mechanism: grouped-query attention, tied embeddings (llama3_2 1B/3B), an untied head (llama3_1).
"""

from __future__ import annotations

import sys
from typing import Optional

from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, TrainingSpec
from memcalc.inputs.profiles import profile_for, with_loss

from .grid import main as grid_main, run_rows, table  # noqa: F401 (table: the docs page)

#: GQA with an untied head (llama3_1 8B's shape, scaled down) and MHA with tied embeddings
#: (llama3_2 1B/3B's shape: tie_word_embeddings=True, scaled down)
MODELS = {
    "gqa": ModelSpec(name="tt-gqa", n_layers=2, d_model=256, n_heads=8, n_kv_heads=2, d_ff=512, vocab_size=2048,
                     max_seq_len=1024, tie_embeddings=False),
    "tied": ModelSpec(name="tt-tied", n_layers=1, d_model=128, n_heads=4, n_kv_heads=4, d_ff=384, vocab_size=4096,
                      max_seq_len=512, tie_embeddings=True),
}

ATTN = ("q", "v")
ALL = ("q", "k", "v", "o", "gate", "up", "down")

#: (model, tuning, loss, checkpoint, offload, optimizer in backward, precision, batch, seq);
#: tuning: full | lora (q,v) | lora-all | dora | qlora
SETUPS = (
    ("gqa", "full", "chunked", "none", False, False, "bf16", 2, 256),
    ("gqa", "full", "full", "none", False, False, "bf16", 2, 256),
    ("gqa", "full", "chunked", "full", False, False, "bf16", 2, 256),
    ("gqa", "full", "full", "full", False, False, "bf16", 2, 256),
    ("gqa", "full", "chunked", "full", True, False, "bf16", 2, 256),
    ("gqa", "full", "full", "full", True, False, "bf16", 2, 256),
    ("gqa", "full", "chunked", "none", False, True, "bf16", 2, 256),
    ("gqa", "full", "full", "none", False, True, "bf16", 2, 256),
    ("gqa", "full", "chunked", "full", True, True, "bf16", 2, 256),
    ("gqa", "full", "chunked", "none", False, False, "fp32", 1, 256),
    ("gqa", "lora", "chunked", "none", False, False, "bf16", 2, 256),
    ("gqa", "lora", "full", "none", False, False, "bf16", 2, 256),
    ("gqa", "lora", "chunked", "full", False, False, "bf16", 2, 256),
    ("gqa", "lora", "chunked", "full", True, False, "bf16", 2, 256),
    ("gqa", "lora-all", "chunked", "none", False, False, "bf16", 2, 256),
    ("gqa", "lora-all", "full", "full", False, False, "bf16", 2, 256),
    ("gqa", "dora", "chunked", "none", False, False, "bf16", 2, 256),
    ("gqa", "dora", "full", "full", False, False, "bf16", 2, 256),
    ("gqa", "qlora", "chunked", "none", False, False, "bf16", 2, 256),
    ("gqa", "qlora", "full", "none", False, False, "bf16", 2, 256),
    ("gqa", "qlora", "chunked", "full", False, False, "bf16", 2, 256),
    ("gqa", "qlora", "chunked", "full", True, False, "bf16", 2, 256),
    ("tied", "full", "chunked", "none", False, False, "bf16", 2, 256),
    ("tied", "full", "full", "none", False, False, "bf16", 2, 256),
    ("tied", "full", "chunked", "full", False, False, "bf16", 1, 512),
    ("tied", "full", "full", "full", True, False, "bf16", 1, 512),
    ("tied", "full", "chunked", "none", False, True, "bf16", 2, 256),
    ("tied", "lora", "chunked", "none", False, False, "bf16", 2, 256),
    ("tied", "lora", "full", "full", False, False, "bf16", 2, 256),
    ("tied", "lora-all", "chunked", "full", True, False, "bf16", 2, 256),
    ("tied", "dora", "chunked", "none", False, False, "bf16", 2, 256),
    ("tied", "qlora", "chunked", "none", False, False, "bf16", 2, 256),
    ("tied", "qlora", "full", "full", False, False, "bf16", 1, 512),
)
#: with ``compile: True`` (``compile_scope layer``: training.compile_model per layer, training.compile_loss),
#: the same fields; two rows, each compiles its layer and loss (about 8 s loaded): the full fine-tuning recipe's
#: unchunked loss stays eager (it drops compile_loss's return value), the LoRA recipe's is compiled whole (before
#: this rule the estimate of the gqa model's LoRA row was +21.9%: the eager loss's fp32 log-probabilities)
COMPILED_SETUPS = (
    ("tied", "full", "full", "none", False, False, "bf16", 2, 256),
    ("tied", "lora", "full", "none", False, False, "bf16", 2, 256),
)


def _lora(tuning: str) -> Optional[LoraSpec]:
    if tuning == "full":
        return None
    targets = ALL if tuning in ("lora-all", "qlora") else ATTN
    return LoraSpec(rank=8, alpha=16, targets=targets, dora=tuning == "dora", qlora=tuning == "qlora")


def grid(only: Optional[str] = None) -> list[tuple[str, ExperimentSpec]]:
    """The setups (name, spec); ``only`` keeps names containing it."""
    out = []
    for (model, tuning, loss, ck, off, fused, prec, B, T), comp in ([(s, False) for s in SETUPS]
                                                                   + [(s, True) for s in COMPILED_SETUPS]):
        m = MODELS[model]
        tr = TrainingSpec(batch=B, seq=T, precision=prec, checkpoint=ck, activation_offload=off,
                          fused_optimizer=fused, lora=_lora(tuning), compile=comp,
                          compile_scope="layer" if comp else "model")
        name = (f"{model} {tuning} {prec} loss={loss} ck={ck}{' offload' if off else ''}"
                f"{' opt-in-bwd' if fused else ''}{' compile' if comp else ''} {B}x{T}")
        if only is None or only in name:
            prof = with_loss(profile_for("torchtune"), loss)
            out.append((name, ExperimentSpec(name=name, model=m, training=tr, profile=prof)))
    return out


def run_grid(items: list[tuple[str, ExperimentSpec]], progress=None) -> list[dict]:
    """One record per setup: traced and predicted bytes, the gap in percent, the phases."""
    from ..predict import estimate
    from .torchtune import measure

    def predict(exp: ExperimentSpec) -> tuple[int, str]:
        est = estimate(exp)
        return est.peak_bytes, est.peak_phase

    return run_rows(items, measure, predict, progress)


def main(argv: Optional[list[str]] = None) -> int:
    return grid_main(__doc__, grid, run_grid, argv)


if __name__ == "__main__":
    sys.exit(main())

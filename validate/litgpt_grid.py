"""A grid of LitGPT setups: LitGPT's own step traced on meta (:mod:`.trainers.litgpt`) beside memcalc's
estimate of the same spec (``--framework litgpt``: :func:`~.record.trainer_estimator_spec`), one row per
setup.

Run ``python -m memcalc.validate.litgpt_grid`` (``--json`` for the records, ``--only phi`` to filter).
The models are scaled down (2 layers, width 256, vocabulary 4096) in three LitGPT config shapes:
Llama-like grouped-query attention (RMSNorm, ``LLaMAMLP``), phi (parallel residual with one shared
LayerNorm, ``GptNeoxMLP`` with tanh GELU, 40% rotary, biases, a head bias) and StableLM (sequential
LayerNorm blocks, ``LLaMAMLP``, 25% rotary). Sequences of 128 or less run the head in one chunk,
longer ones (not a multiple of 128) in several.
"""

from __future__ import annotations

import sys
from typing import Optional

from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, TrainingSpec
from memcalc.inputs.profiles import profile_for

from .record import trainer_estimator_spec
from .trainers.grid import main as grid_main, run_rows, table  # noqa: F401 (table: the docs page)

_SMALL = dict(n_layers=2, d_model=256, n_heads=8, vocab_size=4096, max_seq_len=1024)
#: litgpt/config.py shapes (Llama-3.2, phi-2, stablelm-3b-4e1t), scaled down
MODELS = {
    "llama": ModelSpec(name="llama-gqa", **_SMALL, n_kv_heads=2, d_ff=704),
    "phi": ModelSpec(name="phi", **_SMALL, d_ff=1024, mlp="plain", activation="gelu_tanh", norm="layernorm",
                     block="parallel", parallel_norms=1, rotary_pct=0.4, qkv_bias=True, o_bias=True, mlp_bias=True,
                     lm_head_bias=True),
    "stablelm": ModelSpec(name="stablelm", **_SMALL, d_ff=704, norm="layernorm", rotary_pct=0.25),
}

#: (model, tuning, precision, batch, seq, checkpoint); tuning: full, or the LoRA targets
SETUPS = (
    ("llama", "full", "bf16", 1, 320, "none"),
    ("llama", "full", "bf16", 4, 320, "none"),
    ("llama", "full", "fp32", 2, 320, "none"),
    ("llama", "full", "amp-bf16", 3, 128, "none"),
    ("llama", "full", "bf16", 2, 100, "full"),
    ("llama", "q,v", "bf16", 1, 320, "none"),
    ("llama", "q,v", "bf16", 4, 320, "none"),
    ("llama", "q,v", "amp-bf16", 2, 320, "none"),
    ("llama", "q,v", "fp32", 3, 128, "none"),
    ("llama", "o,gate,up,down", "bf16", 2, 320, "full"),
    ("llama", "q,k,v,o", "bf16", 2, 100, "none"),
    ("phi", "full", "bf16", 1, 320, "none"),
    ("phi", "full", "bf16", 3, 320, "none"),
    ("phi", "full", "fp32", 2, 128, "none"),
    ("phi", "full", "amp-bf16", 2, 320, "none"),
    ("phi", "o,up,down", "bf16", 1, 320, "none"),
    ("phi", "o,up,down", "bf16", 4, 320, "none"),
    ("phi", "o,up,down", "amp-bf16", 2, 100, "none"),
    ("phi", "o", "fp32", 2, 320, "none"),
    ("phi", "o,up,down", "bf16", 2, 320, "full"),
    ("phi", "q,v", "bf16", 2, 320, "none"),
    ("phi", "q,k,v,o", "amp-bf16", 3, 320, "none"),
    ("stablelm", "full", "bf16", 2, 320, "none"),
    ("stablelm", "full", "bf16", 4, 128, "none"),
    ("stablelm", "full", "amp-bf16", 1, 320, "none"),
    ("stablelm", "full", "fp32", 3, 100, "none"),
    ("stablelm", "o,gate,up,down", "bf16", 1, 320, "none"),
    ("stablelm", "o,gate,up,down", "bf16", 3, 320, "none"),
    ("stablelm", "o", "amp-bf16", 2, 320, "none"),
    ("stablelm", "o,gate,up,down", "fp32", 4, 128, "none"),
    ("stablelm", "o,gate,up,down", "bf16", 2, 100, "full"),
    ("stablelm", "q,v", "bf16", 2, 320, "none"),
    ("stablelm", "k", "fp32", 1, 100, "full"),
)


def grid(only: Optional[str] = None) -> list[tuple[str, ExperimentSpec]]:
    """The setups (name, spec); ``only`` keeps names containing it."""
    out = []
    for model, tuning, prec, B, T, ck in SETUPS:
        m = MODELS[model]
        lora = None if tuning == "full" else LoraSpec(rank=8, alpha=16, targets=tuple(tuning.split(",")))
        tr = TrainingSpec(batch=B, seq=T, precision=prec, checkpoint=ck, lora=lora)
        ck_tag = " ck" if ck != "none" else ""
        name = f"{m.name} {'full' if lora is None else 'lora ' + tuning} {prec} {B}x{T}{ck_tag}"
        if only is None or only in name:
            out.append((name, ExperimentSpec(name=name, model=m, training=tr, profile=profile_for("litgpt"))))
    return out


def estimate_litgpt(exp: ExperimentSpec) -> tuple[int, str]:
    """(peak bytes, peak phase) of memcalc's estimate of the LitGPT step of ``exp``."""
    from .predict import estimate

    est = estimate(trainer_estimator_spec(exp, "litgpt"))
    return est.peak_bytes, est.peak_phase


def run_grid(items: list[tuple[str, ExperimentSpec]], progress=None) -> list[dict]:
    """One record per setup: traced and predicted bytes, the gap in percent, the phases."""
    from .trainers.litgpt import measure

    return run_rows(items, measure, estimate_litgpt, progress)


def main(argv: Optional[list[str]] = None) -> int:
    return grid_main(__doc__, grid, run_grid, argv)


if __name__ == "__main__":
    sys.exit(main())

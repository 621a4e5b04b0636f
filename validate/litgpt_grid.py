"""A grid of LitGPT setups: LitGPT's own step traced on meta (:mod:`.trainers.litgpt`) beside memcalc's
estimate of the same spec (``--framework litgpt``: :func:`~.record.trainer_estimator_spec`), one row per
setup.

Run ``python -m memcalc.validate.litgpt_grid`` (``--json`` for the records, ``--only phi`` to filter).
The models are scaled down (2 layers, width 256, vocabulary 4096) in three LitGPT config shapes:
Llama-like grouped-query attention (RMSNorm, ``LLaMAMLP``), phi (parallel residual with one shared
LayerNorm, ``GptNeoxMLP`` with tanh GELU, 40% rotary, biases, a head bias) and StableLM (sequential
LayerNorm blocks, ``LLaMAMLP``, 25% rotary), and Mixtral's ``LLaMAMoE`` (3 or 4 experts of width 512, 2 per
token; the per-expert ``torch.where`` rows answered as ``MoESpec.routing`` balanced, one layer). Sequences of
128 or less run the head in one chunk, longer ones (not a multiple of 128) in several. QLoRA rows
(:data:`QLORA_SETUPS`) run LitGPT's model with every linear converted as ``BitsandbytesPrecision`` converts it,
to memcalc's replica of bitsandbytes' 4-bit linear (CUDA-only otherwise).
"""

from __future__ import annotations

import sys
from typing import Optional

from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, MoESpec, TrainingSpec
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
    # one kv head (Falcon-7B's multi-query): LitGPT's repeat_interleave still copies K and V
    "mqa": ModelSpec(name="llama-mqa", **_SMALL, n_kv_heads=1, d_ff=704),
    # Mixtral's LLaMAMoE (litgpt/config.py Mixtral-8x7B: 8 experts, 2 per token) with 4 experts of width 512,
    # one layer (the loop's ops are what a trace pays for)
    "moe": ModelSpec(name="moe", **{**_SMALL, "n_layers": 1}, n_kv_heads=2, d_ff=704,
                     moe=MoESpec(n_experts=4, top_k=2, d_ff_expert=512, implementation="litgpt")),
    # 3 experts: N k rows do not divide evenly (the balanced routing's remainder rows)
    "moe3": ModelSpec(name="moe3", **{**_SMALL, "n_layers": 1}, n_kv_heads=2, d_ff=704,
                      moe=MoESpec(n_experts=3, top_k=2, d_ff_expert=512, implementation="litgpt")),
}

#: (model, tuning, precision, batch, seq, checkpoint); tuning: full, or the LoRA targets
SETUPS = (
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
    ("stablelm", "o,gate,up,down", "bf16", 3, 320, "none"),
    ("stablelm", "o", "amp-bf16", 2, 320, "none"),
    ("stablelm", "o,gate,up,down", "fp32", 4, 128, "none"),
    ("stablelm", "o,gate,up,down", "bf16", 2, 100, "full"),
    ("stablelm", "q,v", "bf16", 2, 320, "none"),
    ("stablelm", "k", "fp32", 1, 100, "full"),
    # LLaMAMoE (litgpt/model.py): the per-expert loop; gate,up,down is lora_mlp (every expert and the router)
    ("moe", "full", "bf16", 2, 320, "none"),
    ("moe", "q,v", "amp-bf16", 4, 320, "none"),
    ("moe", "gate,up,down", "fp32", 2, 320, "none"),
    ("moe", "gate,up,down", "bf16", 4, 320, "full"),
    ("moe3", "q,v", "bf16", 1, 100, "none"),
)


#: QLoRA (finetune/lora.py --quantize bnb.nf4-dq: every linear 4-bit, lm_head too, trainers/litgpt.py
#: to_4bit): (model, targets, precision, batch, seq, checkpoint, grad_accum, bitsandbytes < 0.43.2 as
#: LitGPT 0.4 pinned it: its MatMul4Bit keeps the input on the ctx, alive with the graph fit's logits hold)
QLORA_SETUPS = (
    ("llama", "q,v", "bf16", 2, 320, "none", 2, True),
    ("llama", "q,v", "bf16", 2, 320, "none", 1, False),
    ("llama", "q,v,head", "bf16", 2, 320, "none", 1, True),
    ("llama", "q,v", "fp16", 2, 100, "none", 2, True),
    ("llama", "q,v", "bf16", 2, 320, "full", 2, True),
    ("phi", "q,v", "bf16", 2, 320, "none", 2, True),
    ("stablelm", "q,k,v,o,gate,up,down", "bf16", 1, 320, "none", 2, True),
    ("mqa", "q,v", "bf16", 2, 320, "none", 2, True),
    ("moe", "q,v,gate,up,down", "bf16", 4, 320, "none", 1, False),
)


#: the run's first micro-batch longer than the rest (TrainingSpec.first_seq, lit-gpt 8641822's longest sample
#: first): (model, targets, precision, batch, seq, first_seq, grad_accum, bitsandbytes < 0.43.2 or None: LoRA)
FIRST_SEQ_SETUPS = (
    ("llama", "q,v", "bf16", 1, 100, 320, 2, True),
    ("phi", "q,v", "bf16", 2, 100, 320, 2, None),
)


def grid(only: Optional[str] = None) -> list[tuple[str, ExperimentSpec]]:
    """The setups (name, spec); ``only`` keeps names containing it."""
    rows: list[tuple[str, str, str, int, int, str, int, Optional[bool]]] = [
        (model, tuning, prec, B, T, ck, 1, None) for model, tuning, prec, B, T, ck in SETUPS]
    rows += [(model, tuning, prec, B, T, ck, ga, legacy) for model, tuning, prec, B, T, ck, ga, legacy in QLORA_SETUPS]
    firsts = [None] * len(rows) + [first for *_, first, _ga, _legacy in FIRST_SEQ_SETUPS]
    rows += [(model, tuning, prec, B, T, "none", ga, legacy)
             for model, tuning, prec, B, T, _first, ga, legacy in FIRST_SEQ_SETUPS]
    out = []
    for (model, tuning, prec, B, T, ck, ga, legacy), first in zip(rows, firsts, strict=True):
        m = MODELS[model]
        qlora = legacy is not None
        lora = None if tuning == "full" else LoraSpec(rank=8, alpha=16, targets=tuple(tuning.split(",")),
                                                      qlora=qlora, bnb_saves_input=bool(legacy))
        tr = TrainingSpec(batch=B, seq=T, precision=prec, checkpoint=ck, lora=lora, grad_accum=ga, first_seq=first)
        ck_tag = " ck" if ck != "none" else ""
        kind = "full" if lora is None else (
            f"qlora{' bnb<0.43.2' if legacy else ''} " if qlora else "lora ") + tuning
        name = (f"{m.name} {kind} {prec} {B}x{T}{ck_tag}{f' ga{ga}' if ga > 1 else ''}"
                f"{f' first {first}' if first else ''}")
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
